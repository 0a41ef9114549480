"""FP8 weight-only (per-channel scales) at 1 and 16 rows: how far the dispatcher's configs are from a streaming
read of the same bytes, and whether configs it does not offer close the gap (issue 4: 1.25x / 1.4x the floor).

    python benchmarks/proto/fp8_gemv_probe.py [--csv benchmarks/results/h200/fp8_gemv_probe.csv]

Per shape, in one run (CUDA graph, median µs, the 64 MiB weights do not stay in L2 between calls):
- ``read``: ``stream_read_kernel`` over the code bytes (grid-stride, 4 programs per SM, 8 blocks in flight);
- ``offered``: every config ``decode_mm.candidates`` gives for the shape (what the tuner picks among);
- ``extra``: GEMV tiles with 256- and 512-deep K tiles, 2-4 pipeline stages (M = 1) and more tensor-core
  tiles (M = 16), each checked against the float64 product of the program's own decode.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_common import RowWriter, check_and_time, versions, warm_up_clocks  # noqa: E402
from bench_int4_mma import floor_us, zoo_weight  # noqa: E402
from probe_int4_m1 import stream_read_kernel  # noqa: E402
from fusekern.kernels import decode_mm as dm  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402
from fusekern.patterns.decode.program import DecodeProgram  # noqa: E402

SMS = 132


def extra_configs(M, N, K):
    out = []
    if M == 1:
        for bn in (64, 128):
            for bk in (256, 512):
                for w in (4, 8):
                    for per_sm in (2, 4):
                        for st in (3, 4):
                            sk = dm._split_k(triton.cdiv(N, bn), triton.cdiv(K, bk), SMS, per_sm)
                            out.append(pm.PackedGemv(bn, bk, sk, w, st, vec_k=True))
    else:
        for bn, bk, w in ((64, 128, 4), (128, 128, 4), (128, 128, 8), (256, 64, 8), (128, 256, 8), (64, 256, 4)):
            for st in (3, 4):
                for per_sm in (1, 2):
                    sk = dm._split_k(triton.cdiv(N, bn), triton.cdiv(K, bk), SMS, per_sm)
                    out.append(pm.PackedDot(16, bn, bk, sk, w, st))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,14336x4096,4096x14336")
    ap.add_argument("--ms", default="1,16")
    args = ap.parse_args()
    info = versions()
    warm_up_clocks()
    out = RowWriter(args.csv)
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        text, leaves, lay = zoo_weight("fp8_channel", N, K)
        w_ref = DecodeProgram.from_text(text).evaluate(leaves).double()
        q = leaves[lay.code].view(torch.int32).reshape(-1)
        sink = torch.empty(4 * SMS * 512, dtype=torch.int32, device="cuda")
        read = triton.testing.do_bench_cudagraph(
            lambda: stream_read_kernel[(4 * SMS,)](q, sink, q.numel(), BLOCK=512, UNROLL=8, num_warps=4),
            rep=100, return_mode="median") * 1e3
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = (x.double() @ w_ref).float()
            floor = floor_us(leaves, N, K, M)
            out.write(dict(shape=shape, M=M, kind="read", config="stream_read_kernel 4/SM", us=round(read, 2),
                           floor_us=round(floor, 2), x_floor=round(read / floor, 3), rel_err="", **info))
            offered = [c for c in dm.candidates(M, N, K, layout=lay.to_text(), x_dtype=torch.bfloat16)
                       if "Dequant" not in type(c).__name__]  # (decode + cuBLAS: 5x slower at these M)
            best = {}
            for kind, cfgs in (("offered", offered), ("extra", [c for c in extra_configs(M, N, K) if c not in offered
                                                                and pm.fits(lay, c)])):
                for cfg in cfgs:
                    err, us = check_and_time(
                        lambda: dm.decode_mm_triton(x, leaves, text, config=cfg, layout=lay.to_text()), ref, rep=50)
                    ok = isinstance(us, float) and err <= 2e-2
                    if isinstance(us, float) and not ok:
                        print(f"MISMATCH {shape} M={M} {cfg}: rel err {err:.1e}", flush=True)
                    out.write(dict(shape=shape, M=M, kind=kind, config=str(cfg),
                                   us=round(us, 2) if isinstance(us, float) else us, floor_us=round(floor, 2),
                                   x_floor=round(us / floor, 3) if isinstance(us, float) else "",
                                   rel_err=f"{err:.1e}", **info))
                    if ok and (kind not in best or us < best[kind][0]):
                        best[kind] = (us, cfg)
            print(f"{shape} M={M} floor {floor:.1f} read {read:.1f} ({read / floor:.2f}x) | "
                  + " | ".join(f"{k} {u:.1f} ({u / floor:.2f}x) {c}" for k, (u, c) in best.items()), flush=True)
    out.close()


if __name__ == "__main__":
    main()
