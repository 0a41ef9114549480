"""Decode once + cuBLAS at prefill sizes: how fast can the decode write the bf16 weight, and which layout does
cuBLAS want it in? (probe, H200)

    python benchmarks/proto/dequant_sweep.py [--csv OUT.csv] [--shapes 8192x8192,...] [--m 2048]

Why: at M = 2048 the dispatcher decodes the weight once and runs cuBLAS, 1.14-1.21x the bf16 cuBLAS mm alone
(issue 4 asks 1.1x; decode_mm_shapes_2048.csv). The decode has to read the packed words and write the bf16
weight (at 8192 x 8192: 128 MiB, 31 µs at 4.3 TB/s); the fused product ran 57-86 µs over the mm alone. This
times ``packed_mm.decode_weight`` per tile config, writing ``[K, N]`` (cuBLAS then runs x @ w, "NN") or
``[N, K]`` (x @ w.t(), "TN"), and cuBLAS alone in both layouts, on the same shapes.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton.testing

sys.path.insert(0, "benchmarks")
from bench_common import RowWriter, versions, warm_up_clocks  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402
from fusekern.patterns.decode.formats import recognize  # noqa: E402
from fusekern.patterns.decode.layout import derive_layout  # noqa: E402
from fusekern.patterns.decode.program import DecodeProgram  # noqa: E402
from fusekern.testing.decode_cones import decode_program  # noqa: E402
from fusekern.testing.decode_zoo import BY_NAME  # noqa: E402

CONFIGS = [pm.PackedDequant(bk, bn, w) for bk, bn, w in
           ((64, 128, 4), (32, 128, 4), (128, 128, 4), (64, 256, 4), (64, 256, 8), (128, 256, 8), (32, 256, 4),
            (128, 64, 4), (16, 256, 4))]


def _layout(name, K, N):
    case = BY_NAME[name]
    torch.manual_seed(0)
    ws = case.make(K, N, case.group, "cpu")
    text, leaves, consts = decode_program(case.fn, torch.randn(1, K, dtype=torch.bfloat16), *ws)
    prog = DecodeProgram.from_text(text)
    lay = derive_layout(prog, recognize(prog, consts), consts)
    return prog, lay, [t.cuda() for t in leaves]


def decode_into(leaves, lay, K, N, cfg, w):
    """``decode_weight`` writing into ``w`` ([K, N] or the transpose view of an [N, K] buffer)."""
    ptrs, (kw, sqk, sqn, ssk, ssn, szk, szn), consts = pm._common(lay, leaves, K, N, False)
    grid = (triton.cdiv(K, cfg.BLOCK_K), triton.cdiv(N, cfg.BLOCK_N))
    pm.packed_decode_kernel[grid](w, *ptrs, N, K, kw, sqk, sqn, ssk, ssn, szk, szn, w.stride(0), w.stride(1),
                                  P=lay.per_word, ORDER=pm._encode(lay.order), PACK_N=lay.pack_axis == "N",
                                  BLOCK_K=cfg.BLOCK_K, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps, **consts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,14336x4096,4096x14336")
    ap.add_argument("--formats", default="gptq,fp8_channel,mxfp4")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--layouts", default="NN,TN")
    ap.add_argument("--configs", default=None, help="BLOCK_KxBLOCK_NwWARPS,... (default: CONFIGS)")
    args = ap.parse_args()
    configs = CONFIGS if not args.configs else [
        pm.PackedDequant(*(int(v) for v in c.replace("w", "x").split("x"))) for c in args.configs.split(",")]
    info = versions()
    warm_up_clocks()
    out = RowWriter(args.csv)
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3  # noqa: E731
    for N, K in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        x = torch.randn(args.m, K, device="cuda", dtype=torch.bfloat16)
        w_kn = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        w_nk = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        for lname, fn in (("NN", lambda: x @ w_kn), ("TN", lambda: x @ w_nk.t())):
            row = dict(format="cublas_bf16", N=N, K=K, M=args.m, layout=lname, config="", us=round(bench(fn), 2),
                       tb_s="", exact="", **info)
            print(row, flush=True)
            out.write(row)
        for name in args.formats.split(","):
            prog, lay, leaves = _layout(name, K, N)
            want = pm.decode_weight(leaves, lay, K, N, torch.bfloat16)  # the shipped config: the same bits expected
            for cfg in configs:
                if not pm.fits(lay, cfg):
                    continue
                for lname in args.layouts.split(","):
                    w = torch.full((K, N), float("nan"), device="cuda", dtype=torch.bfloat16) if lname == "NN" else \
                        torch.full((N, K), float("nan"), device="cuda", dtype=torch.bfloat16).t()
                    try:
                        decode_into(leaves, lay, K, N, cfg, w)
                        ok = torch.equal(w, want)
                        us = bench(lambda: decode_into(leaves, lay, K, N, cfg, w))
                    except Exception as e:  # noqa: BLE001
                        print(name, cfg, lname, "failed:", type(e).__name__, str(e)[:100], flush=True)
                        continue
                    moved = sum(t.numel() * t.element_size() for t in leaves) + 2 * K * N
                    row = dict(format=name, N=N, K=K, M=args.m, layout=lname,
                               config=f"{cfg.BLOCK_K}x{cfg.BLOCK_N}w{cfg.num_warps}", us=round(us, 2),
                               tb_s=round(moved / us / 1e6, 2), exact=ok, **info)
                    print(row, flush=True)
                    out.write(row)
    out.close()


if __name__ == "__main__":
    main()
