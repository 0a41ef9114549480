"""Host time of one fused sampler call per way it is called: the launcher's path (checks, heuristics, the
seed's draw and two JIT launches, every call), the op's CUDA function (replays the first call's draw and
launches, ``fusekern/kernels/layout_replay.py``), through the dispatcher (``torch.ops.fusekern.sample``),
and the whole compiled Hugging Face chain, fusekern's and stock inductor's. Back-to-back calls, wall time per
call (host-bound at small batches: the GPU queue never drains).

    python benchmarks/profile_sampler_host.py [--batch 1] [--calls 2000] [--csv out.csv] [--ways a,b]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import RowWriter, per_call_us, versions  # noqa: E402

import fusekern  # noqa: E402,F401  (registers the backend)
from fusekern.kernels import sampler as S  # noqa: E402
from fusekern.testing.sampling_chains import hf_sample  # noqa: E402

V, T, K, P = 128256, 0.8, 50, 0.9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--ways", default=None, help="comma-separated subset of the ways (default: all; the two "
                    "compiled graphs cost a compile each)")
    args = ap.parse_args()
    logits = 3 * torch.randn(args.batch, V, device="cuda", dtype=torch.bfloat16)
    chain = lambda x: hf_sample(x, T, K, P)  # noqa: E731
    op_args = (logits, None, T, None, K, None, P, None, 0.0, None)
    ways = {
        "launcher_path": lambda: (lambda x: S.sample_triton(x, T, K, P, seed=None), (logits,)),
        "op_cuda_function": lambda: (S._sample_cuda, op_args),
        "op_dispatcher": lambda: (torch.ops.fusekern.sample.default, op_args),
        "fusekern_graph": lambda: (torch.compile(chain, backend="fusekern"), (logits,)),
        "stock_graph": lambda: (torch.compile(chain), (logits,)),
    }
    chosen = args.ways.split(",") if args.ways else list(ways)
    unknown = sorted(set(chosen) - set(ways))
    if unknown:
        raise SystemExit(f"unknown ways {unknown}; known: {', '.join(ways)}")
    out, info = RowWriter(args.csv), versions()
    with torch.no_grad():
        for name in chosen:
            f, a = ways[name]()
            for rep in range(2):  # the second pass is the one to read
                us = per_call_us(f, a, args.calls, warmup=20)
                print(f"{name:18s} B={args.batch} pass {rep}: {us:7.2f} us per call", flush=True)
                out.write(dict(B=args.batch, V=V, way=name, timing_pass=rep, us_per_call=round(us, 2), **info))
    out.close()


if __name__ == "__main__":
    main()
