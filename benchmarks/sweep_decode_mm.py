"""Launch configs of the generated decode GEMM, per path, on zoo formats at N = K = 8192 (H200).

    python benchmarks/sweep_decode_mm.py [--csv benchmarks/results/h200/decode_mm_sweep.csv]
                                         [--formats gptq,mxfp4,...] [--ms 1,16,2048]

Kernel time only: do_bench_cudagraph (median) of ``decode_mm_triton`` with an explicit config; the
default config for each M is marked. Informs ``select_config``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import RowWriter, check_and_time, versions, warm_up_clocks  # noqa: E402

from fusekern.kernels import decode_mm as dm  # noqa: E402
from fusekern.testing.decode_cones import decode_program  # noqa: E402
from fusekern.testing.decode_zoo import BY_NAME  # noqa: E402


def candidates(M, N, K):
    if M == 1:
        for bn, bk, w in ((64, 128, 8), (32, 256, 8), (128, 128, 8), (64, 256, 8), (32, 128, 4), (128, 64, 4)):
            tiles = triton.cdiv(N, bn)
            yield dm.Config(1, bn, bk, dm._split_k(tiles, triton.cdiv(K, bk), 132), 1, w, 3)
    elif M <= 256:
        bm = max(16, triton.next_power_of_2(M)) if M <= 64 else 64
        for bn, bk, w, st, swap in ((64, 128, 4, 2, True), (64, 128, 4, 2, False), (128, 128, 4, 2, True),
                                    (64, 64, 4, 3, True), (128, 64, 8, 3, True), (32, 128, 4, 2, True)):
            tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
            yield dm.Config(bm, bn, bk, dm._split_k(tiles, triton.cdiv(K, bk), 132), 1, w, st, SWAP_AB=swap)
    else:
        yield dm.DequantConfig()
        yield dm.DequantConfig(BLOCK_K=32, BLOCK_N=256, num_warps=8)
        yield dm.Config(128, 128, 64, 1, 8, 8, 2)
        yield dm.Config(128, 64, 64, 1, 8, 4, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--formats", default="gptq,mxfp4,fp8_block,int4_k_stack,awq")
    ap.add_argument("--ms", default="1,16,2048")
    ap.add_argument("--nk", type=int, default=8192)
    args = ap.parse_args()
    N = K = args.nk
    info = versions()
    warm_up_clocks()
    out = RowWriter(args.csv)
    for name in args.formats.split(","):
        case = BY_NAME[name]
        torch.manual_seed(0)
        ws = case.make(K, N, case.group, "cuda")
        text, leaves, _ = decode_program(case.fn, torch.randn(2, K, device="cuda", dtype=torch.bfloat16), *ws)
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = dm.decode_mm_reference(x, leaves, text).float()
            default = dm.select_config(M, N, K)
            for cfg in candidates(M, N, K):
                err, us = check_and_time(lambda: dm.decode_mm_triton(x, leaves, text, config=cfg), ref)
                row = dict(format=name, M=M, N=N, K=K, config=str(cfg), default=cfg == default,
                           us=round(us, 2) if isinstance(us, float) else us, rel_err=f"{err:.1e}", **info)
                print(name, M, cfg, row["us"], row["rel_err"], "*" if row["default"] else "", flush=True)
                out.write(row)
    out.close()


if __name__ == "__main__":
    main()
