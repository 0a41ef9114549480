"""Sweep the fused sampler's chunk size and warps on the GPU, after checking it against its reference.

    python benchmarks/sweep_sampler.py [--csv benchmarks/results/h200/sampler_sweep.csv] [--quick]

Correctness: injected noise, every filter combination, bf16 and fp32, V = 128256, tokens compared
exactly with the float64 reference. Timing: the kernel alone in a CUDA graph (do_bench_cudagraph,
median), top-k 50 + top-p 0.9 + temperature 0.8, bf16 logits, for each (B, block, warps).
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from bench_common import versions, warm_up_clocks, write_csv
from fusekern.kernels import sampler as S

V = 128256
CONFIGS = {
    "top-k 50 + top-p 0.9": dict(top_k=50, top_p=0.9),
    "top-k 50": dict(top_k=50),
    "top-p 0.9": dict(top_p=0.9),
    "min-p 0.1": dict(min_p=0.1),
    "temperature only": dict(),
    "top-k 50 + top-p 0.9 + min-p 0.05": dict(top_k=50, top_p=0.9, min_p=0.05),
    "top-k 1000": dict(top_k=1000),
}


def check(B, dtype, params, scale=3.0):
    logits = (torch.randn(B, V, device="cuda") * scale).to(dtype)
    q = torch.empty(B, V, device="cuda").exponential_(1)
    out = torch.full((B,), -7, dtype=torch.int64, device="cuda")
    S.sample_triton(logits, 0.8, seed=torch.tensor([3], device="cuda"), noise=q, out=out, **params)
    ref = S.sample_reference(logits, 0.8, q=q, **params)
    return int((out.cpu() != ref).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    for (name, params), dtype, B in itertools.product(CONFIGS.items(), (torch.bfloat16, torch.float32), (1, 7, 256)):
        wrong = check(B, dtype, params)
        print(f"check {name:36s} {str(dtype):15s} B={B:3d}: {'ok' if wrong == 0 else f'{wrong} WRONG'}", flush=True)
    warm_up_clocks()
    meta = versions()
    rows = []
    seed = torch.tensor([1], device="cuda")
    for B in (1, 8, 32, 256, 512):
        logits = torch.randn(B, V, device="cuda", dtype=torch.bfloat16) * 3
        for name, params in CONFIGS.items():
            if args.quick and name not in ("top-k 50 + top-p 0.9", "top-k 50"):
                continue
            sweep = [(None, None)]
            if name == "top-k 50 + top-p 0.9":
                sweep += list(itertools.product((1024, 2048, 4096, 8192, 16384), (4, 8, 16)))
            for block, warps in sweep:
                fn = lambda: S.sample_triton(logits, 0.8, seed=seed, block=block, warps=warps, **params)
                try:
                    fn()
                    us = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
                except Exception as e:
                    print(f"B={B} {name} block={block} warps={warps}: {type(e).__name__} {str(e)[:100]}")
                    continue
                rows.append(dict(**meta, B=B, V=V, config=name, block=block or S.chunk_block(B, V),
                                 warps=warps or S.chunk_warps(block or S.chunk_block(B, V)),
                                 default=block is None, median_us=round(us, 2)))
                print(f"B={B:4d} {name:36s} block={rows[-1]['block']:6d} warps={rows[-1]['warps']:2d} "
                      f"{'*' if block is None else ' '} {us:8.2f} us", flush=True)
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
