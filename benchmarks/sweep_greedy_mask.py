"""Sweep of the greedy-with-mask kernel's launch shapes (issue 5, pattern 4: V = 128256, bf16 logits,
temperature per row, 16 banned ids per row).

    python benchmarks/sweep_greedy_mask.py [--csv OUT.csv] [--batches 32,256,512] [--warps-only]

Per batch: tokens per step (block), warps per program and programs per row (the default split, and two
and four times it). Every config's tokens must equal the reference's (masked_argmax_reference); times are
medians of ``do_bench_cudagraph`` (the kernel alone in a CUDA graph).
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from bench_common import RowWriter, versions, warm_up_clocks
from fusekern.kernels import masked_argmax as ma

V = 128256


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--batches", default="32,256,512")
    ap.add_argument("--warps-only", action="store_true", help="the default block and split, 4 and 8 warps")
    args = ap.parse_args()
    meta = versions()
    warm_up_clocks()
    out = RowWriter(args.csv)
    for B in map(int, args.batches.split(",")):
        g = torch.Generator().manual_seed(B)
        logits = (torch.randn(B, V, generator=g) * 3).to("cuda", torch.bfloat16)
        ids = torch.randint(0, V, (B, 16), generator=g).cuda()
        T = torch.full((B, 1), 0.7, device="cuda", dtype=torch.bfloat16)
        want = ma.masked_argmax_reference(logits, T, ids)
        default_split = ma.split_for(B, logits.device)
        default_warps = ma.warps_for(B, logits.device)
        best = None
        shapes = ((2048,), (4, 8), (1,)) if args.warps_only else ((2048, 4096, 8192), (4, 8), (1, 2, 4))
        for block, warps, mult in itertools.product(*shapes):
            cfg = dict(block=block, warps=warps, split=default_split * mult)
            tag = "default" if (block, warps, mult) == (2048, default_warps, 1) else ""
            try:
                got = ma.masked_argmax_triton(logits, T, ids, **cfg)
                exact = torch.equal(got, want.to(got.device))
                us = triton.testing.do_bench_cudagraph(lambda: ma.masked_argmax_triton(logits, T, ids, **cfg),
                                                       rep=100, return_mode="median") * 1e3
                err = ""
            except Exception as e:  # recorded, the sweep goes on
                exact, us, err = False, float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            out.write(dict(**meta, B=B, V=V, **cfg, tag=tag, median_us=round(us, 2), exact=exact, error=err))
            print(f"B={B:4d} {str(cfg):48s} {us:8.2f} us  {'exact' if exact else 'MISMATCH ' + err} {tag}", flush=True)
            if exact and (best is None or us < best[0]):
                best = (us, cfg)
        print(f"B={B}: best {best}", flush=True)
    out.close()


if __name__ == "__main__":
    main()
