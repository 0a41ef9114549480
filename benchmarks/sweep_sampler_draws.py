"""The sampler's step 1 on 4 and 8 warps over several random draws of the logits (issue 5's setting).

    python benchmarks/sweep_sampler_draws.py [--csv OUT.csv] [--bs 8,1] [--draws 6]

Why: the benchmark's B = 8 time moved between 12.6 and 26 us from run to run. It depends on the draw:
where a chunk's first threshold guess holds more tokens than its slots (bf16 ties near the top), step 1
narrows it by a binary search over the chunk's tokens, and that search is what a slow draw pays for
(``chunks_overflowed`` counts the chunks still over their slots after it: their rows take step 2's slow
path). Each draw is timed whole and step 1 alone (``do_bench_cudagraph``, median), on both CTA sizes.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

from bench_common import RowWriter, versions, warm_up_clocks
from fusekern.kernels import sampler as S

V, T, K, P = 128256, 0.8, 50, 0.9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--bs", default="8,1")
    ap.add_argument("--draws", type=int, default=6)
    args = ap.parse_args()
    warm_up_clocks()
    meta = versions()
    out = RowWriter(args.csv)
    seed = torch.tensor([7], device="cuda")
    for B in map(int, args.bs.split(",")):
        for draw in range(args.draws):
            torch.manual_seed(100 + draw)
            logits = torch.randn(B, V, device="cuda", dtype=torch.bfloat16) * 3
            for warps in (4, 8):
                knobs = dict(warps=warps, sub=min(S.sub_block(warps), 2048))
                _, cnt, cand = S.sample_triton(logits, T, K, P, seed=seed, step1_only=True, **knobs)
                over = int((cnt > cand.shape[-1]).sum())
                whole = triton.testing.do_bench_cudagraph(
                    lambda: S.sample_triton(logits, T, K, P, seed=seed, **knobs), rep=50, return_mode="median") * 1e3
                step1 = triton.testing.do_bench_cudagraph(
                    lambda: S.sample_triton(logits, T, K, P, seed=seed, step1_only=True, **knobs), rep=50,
                    return_mode="median") * 1e3
                out.write(dict(**meta, B=B, V=V, logits_seed=100 + draw, chunk_warps=warps,
                               sampler_us=round(whole, 2), step1_us=round(step1, 2), chunks_overflowed=over))
                print(f"B={B} draw {draw} warps {warps}: {whole:6.2f} us (step 1 {step1:6.2f}), "
                      f"{over} chunks overflowed", flush=True)
    out.close()


if __name__ == "__main__":
    main()
