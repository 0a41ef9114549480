"""Sweep launch configs of the W8A16 kernels on the GPU present; prints the best per shape.

    python benchmarks/sweep_w8a16_linear.py [--csv PATH]

Used to set the heuristics in fusekern/kernels/w8a16_linear.py. Every config is checked against the
reference before it is timed; a wrong config is reported and never chosen.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
import triton.testing

from bench_common import floor_bandwidth, versions, warm_up_clocks, write_csv
from fusekern.kernels import w8a16_linear as k
from fusekern.testing import rel_err


def candidates(M):
    if M <= 16:
        if M == 1:
            for bn, bk, ns, sk in itertools.product((8, 16, 32), (512, 1024), (2, 4), (1, 2, 4)):
                yield k.GemvConfig(bn, bk, 4, ns, SPLIT_K=sk)
        for bn, bk, ns, sk in itertools.product((32, 64), (128, 256), (4, 5), (1, 2, 4)):
            yield k.GemvConfig(bn, bk, 4, ns, USE_DOT=True, SPLIT_K=sk)
        for bm, bn, bk, ns in itertools.product((16,), (64, 128), (256,), (3, 4)):
            yield k.GemmConfig(bm, bn, bk, 8, 4, ns)
    else:
        for (bm, bn, bk, nw, ns), swap in itertools.product([
            (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
            (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (64, 256, 64, 4, 4), (128, 256, 128, 8, 3),
            (128, 128, 64, 4, 5), (64, 128, 64, 4, 4),
        ], (False, True)):
            yield k.GemmConfig(bm, bn, bk, 8, nw, ns, SWAP_AB=swap)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="1x8192x8192,16x8192x8192,2048x8192x8192,1x4096x14336,16x14336x4096")
    args = ap.parse_args()
    dev = "cuda"
    rows = []
    warm_up_clocks(dev)
    info = versions()  # (the GPU, versions, git sha and floor bandwidth on every row)
    for shape in args.shapes.split(","):
        M, N, K = map(int, shape.split("x"))
        torch.manual_seed(0)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randint(-128, 128, (N, K), device=dev, dtype=torch.int8)
        s = torch.rand(N, device=dev) * 0.01 + 1e-3
        ref = k.w8a16_linear_reference(x, w, s, None, torch.float32)
        floor_us = (N * K + 2 * M * K + 2 * M * N) / floor_bandwidth() * 1e6
        best = None
        for cfg in candidates(M):
            try:
                out = k.w8a16_linear_triton(x, w, s, None, torch.bfloat16, config=cfg)
                torch.cuda.synchronize()
            except Exception as e:  # a config that does not compile (e.g. too much smem)
                print(f"{shape} {cfg} failed: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                continue
            err = rel_err(out, ref)
            if not err < 1e-2:
                print(f"{shape} {cfg} WRONG rel_err={err}")
                continue
            us = triton.testing.do_bench(
                lambda: k.w8a16_linear_triton(x, w, s, None, torch.bfloat16, config=cfg),
                warmup=10, rep=50, return_mode="median") * 1e3
            rows.append(dict(shape=shape, config=str(cfg), us=round(us, 2), floor_us=round(floor_us, 2), rel_err=err,
                             **info))
            if best is None or us < best[0]:
                best = (us, cfg)
        wb = w.to(torch.bfloat16)
        cublas_us = triton.testing.do_bench(lambda: x @ wb.t(), warmup=10, rep=50, return_mode="median") * 1e3
        print(f"BEST {shape}: {best[0]:.1f} us (floor {floor_us:.1f}, bf16 cuBLAS {cublas_us:.1f}) {best[1]}", flush=True)
        top = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["us"])[:5]
        for r in top:
            print(f"   {r['us']:8.1f} {r['config']}")
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
