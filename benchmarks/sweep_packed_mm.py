"""Launch configs of the hand-tuned packed kernels on zoo formats (H200): which tile wins where.

    python benchmarks/sweep_packed_mm.py [--csv benchmarks/results/h200/packed_mm_sweep.csv]
                                         [--formats gptq,mxfp4,...] [--ms 1,16,2048] [--nk 8192]

Kernel time only: do_bench_cudagraph (median) of ``decode_mm_triton`` with an explicit config, each
checked against the program's own decode (torch, fp64 matmul). The floor is the bytes that must move
(packed leaves, activations, output) over 4.3 TB/s. Informs ``decode_mm._packed_candidates``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import RowWriter, check_and_time, floor_bandwidth, versions, warm_up_clocks  # noqa: E402

from fusekern.kernels import decode_mm as dm  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402
from fusekern.patterns.decode.formats import recognize  # noqa: E402
from fusekern.patterns.decode.layout import derive_layout  # noqa: E402
from fusekern.patterns.decode.program import DecodeProgram  # noqa: E402
from fusekern.testing.decode_cones import decode_program  # noqa: E402
from fusekern.testing.decode_zoo import BY_NAME  # noqa: E402

BW = floor_bandwidth()  # bytes/s (bench_common: per GPU)


def gemv_configs(M, N, K, lay):
    """The GEMV grid: column tile x warps x split (benchmarks/results/h200/gemv_sweep.csv; its rows
    with v3d=True are the previous kernel and prefetch=True a variant that did not help, both gone)."""
    out = []
    for bk in (128, 256) if lay.group_k >= 256 else (128,):
        for bn, w in ((32, 4), (64, 4), (64, 8), (128, 8)):
            for sk in (1, 2, 4, 8, 16):
                out.append(pm.PackedGemv(bn, bk, sk, w))
                if lay.bits == 8:
                    out.append(pm.PackedGemv(bn, bk, sk, w, vec_k=True))
    return out


def configs(M, N, K, lay, gemv2=False):
    out = []
    if M <= 4 and gemv2:
        out += gemv_configs(M, N, K, lay)
    elif M <= 4:
        for bn, bk, w in ((64, 256, 4), (128, 128, 4), (32, 512, 4), (128, 256, 8), (256, 128, 8), (64, 512, 8),
                          (32, 256, 2), (64, 128, 2), (128, 512, 8), (256, 256, 8), (64, 64, 4), (32, 128, 4),
                          (128, 64, 8), (256, 32, 8), (512, 128, 8), (256, 128, 4), (512, 64, 8), (512, 128, 4)):
            for per_sm in (1, 2, 4):
                sk = dm._split_k(triton.cdiv(N, bn), triton.cdiv(K, bk), 132, per_sm)
                out.append(pm.PackedGemv(bn, bk, sk, w))
    if 1 < M <= 64:
        bm = max(16, triton.next_power_of_2(M))
        for bn, bk, w, st in ((64, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3), (64, 256, 4, 2),
                              (32, 128, 4, 3)):
            for per_sm in (1, 2, 4):
                sk = dm._split_k(triton.cdiv(N, bn) * triton.cdiv(M, bm), triton.cdiv(K, bk), 132, per_sm)
                out.append(pm.PackedDot(bm, bn, bk, sk, w, st))
    if not gemv2:
        out += [pm.PackedDequant(), pm.PackedDequant(32, 256, 8), pm.PackedDequant(128, 128, 8)]
    seen, res = set(), []
    for c in out:
        if c not in seen and pm.fits(lay, c):
            seen.add(c)
            res.append(c)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--formats", default="gptq,int4_k_stack,awq,mxfp4,nvfp4,fp8_channel,int8_channel")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--nk", type=int, default=8192)
    ap.add_argument("--gemv2", action="store_true", help="the GEMV grid (tile, warps, split) instead of the tile sweep")
    args = ap.parse_args()
    N = K = args.nk
    info = versions()
    warm_up_clocks()
    out = RowWriter(args.csv)
    for name in args.formats.split(","):
        case = BY_NAME[name]
        torch.manual_seed(0)
        ws = case.make(K, N, case.group, "cuda")
        text, leaves, consts = decode_program(case.fn, torch.randn(2, K, device="cuda", dtype=torch.bfloat16), *ws)
        prog = DecodeProgram.from_text(text)
        lay = derive_layout(prog, recognize(prog, {i: v.cpu() for i, v in consts.items()}),
                            {i: v.cpu() for i, v in consts.items()})
        if lay is None:
            print(name, "no layout")
            continue
        w_ref = prog.evaluate(leaves).double()
        leaf_bytes = sum(t.numel() * t.element_size() for t in leaves)
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = (x.double() @ w_ref).float()
            floor = (leaf_bytes + 2 * M * (K + N)) / BW * 1e6
            best = None
            for cfg in configs(M, N, K, lay, args.gemv2):
                err, us = check_and_time(
                    lambda: dm.decode_mm_triton(x, leaves, text, config=cfg, layout=lay.to_text()), ref, rep=30)
                ok = isinstance(us, float)
                row = dict(format=name, M=M, N=N, K=K, config=str(cfg), us=round(us, 2) if ok else us,
                           floor_us=round(floor, 2), x_floor=round(us / floor, 2) if ok else "",
                           rel_err=f"{err:.1e}", **info)
                if ok and err > 2e-2:
                    print(f"MISMATCH {name} M={M} {cfg}: rel err {err:.1e}", flush=True)
                if ok and err <= 2e-2 and (best is None or us < best[0]):
                    best = (us, cfg)
                out.write(row)
            print(f"{name} M={M}: best {best[0]:.1f} us ({best[0] / floor:.2f}x floor {floor:.1f}) {best[1]}", flush=True)
    out.close()


if __name__ == "__main__":
    main()
