"""Greedy decoding with banned tokens (issue 5, pattern 4) on the GPU: eager, stock torch.compile (with
and without CUDA graphs), fusekern, and the kernel alone, V = 128256, bf16 logits, 16 banned ids per row.

    python benchmarks/bench_greedy_mask.py [--csv benchmarks/results/h200/greedy_mask.csv] [--batches 1,32,256]

Medians of ``triton.testing.do_bench`` (and ``do_bench_cudagraph`` for the graph columns); every variant's
tokens are checked against eager's (they must be equal). The floor reads the logits once at the floor bandwidth.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import RowWriter, floor_bandwidth, versions, warm_up_clocks  # noqa: E402

import fusekern  # noqa: E402,F401
from fusekern.kernels import masked_argmax as ma  # noqa: E402

V = 128256


def greedy_banned(logits, ids, T):
    return (logits / T).scatter(-1, ids, float("-inf")).argmax(dim=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--autotune", action="store_true", help="also stock torch.compile with mode=\"max-autotune-no-cudagraphs\"")
    args = ap.parse_args()
    info = versions()
    warm_up_clocks()
    out = RowWriter(args.csv)
    for B in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(B, V, device="cuda", dtype=torch.bfloat16) * 3
        ids = torch.randint(0, V, (B, 16), device="cuda")
        T = torch.full((B, 1), 0.7, device="cuda", dtype=torch.bfloat16)
        want = greedy_banned(logits, ids, T)
        variants = {
            "eager": greedy_banned,
            "stock": torch.compile(greedy_banned),
            "fusekern": torch.compile(greedy_banned, backend="fusekern"),
            "kernel": lambda lg, i, t: ma.masked_argmax_triton(lg, t, i),
        }
        if args.autotune:
            variants["stock_autotune"] = torch.compile(greedy_banned, mode="max-autotune-no-cudagraphs")
        floor = B * V * 2 / floor_bandwidth() * 1e6
        for name, fn in variants.items():
            got = fn(logits, ids, T)
            ok = torch.equal(got.reshape(-1), want.reshape(-1))
            us = triton.testing.do_bench(lambda: fn(logits, ids, T), return_mode="median") * 1e3
            us_cg = triton.testing.do_bench_cudagraph(lambda: fn(logits, ids, T), return_mode="median") * 1e3
            print(f"B={B:4d} {name:9s} {us:8.1f} us  cudagraph {us_cg:8.1f} us  floor {floor:.2f}  equal={ok}", flush=True)
            out.write(dict(B=B, V=V, variant=name, median_us=round(us, 2), cudagraph_us=round(us_cg, 2),
                           floor_us=round(floor, 3), tokens_equal=ok, **info))
    out.close()


if __name__ == "__main__":
    main()
