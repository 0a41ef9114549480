"""Where the fused decode step's GPU time goes: torch.profiler over the demo's decoder layers (B = 1),
compiled with backend="fusekern", and the config the decode GEMM's tuner chose per shape.

    python benchmarks/profile_e2e_decode.py [--batch 1] [--backend fusekern] [--rows 18]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_e2e_decode import layers_fn  # noqa: E402

import fusekern  # noqa: E402,F401
from fusekern.demo import LLAMA3_8B_SHAPED, PROMPT_LEN, Decoder  # noqa: E402
from fusekern.kernels import decode_mm as dm  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--backend", default="fusekern")
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args()
    cfg = LLAMA3_8B_SHAPED
    torch.manual_seed(0)
    model = Decoder(cfg, "w4a16", args.batch, "cuda").eval()
    f = torch.compile(layers_fn(model), backend=args.backend)
    pos = torch.tensor([PROMPT_LEN], device="cuda")
    x = torch.randn(args.batch, 1, cfg.dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            f(x, pos)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                f(x, pos)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    for (text, layout, bucket, batch, dev), c in dm._tuned.items():
        prog = dm.DecodeProgram.from_text(text)
        print(f"tuned K={prog.K} N={prog.N} M<={bucket} layout={'yes' if layout else 'no'}: {c}")


if __name__ == "__main__":
    main()
