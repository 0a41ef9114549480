"""Where the decode step's host time goes without a CUDA graph: the demo's decoder layers compiled with
stock ``torch.compile`` and with ``backend="fusekern"``, timed back to back (host-bound at B = 1), the
launches per step counted, and fusekern's Python time broken down with cProfile.

    python benchmarks/profile_e2e_host.py [--batch 1] [--calls 200] [--top 30] [--csv out.csv] [--first-batch 1]

``--first-batch B0``: call both compiled functions once at batch B0 first (a fresh model of that batch, the same
code), as ``bench_e2e_decode.py --batches B0,B`` does: Dynamo then recompiles the code for the second batch with a
symbolic batch dim (automatic dynamic shapes), and the profile is of that graph, as a server whose batch changes
runs it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import RowWriter, per_call_us, versions  # noqa: E402
from bench_e2e_decode import layers_fn  # noqa: E402

import fusekern  # noqa: E402,F401  (registers the backend)
from fusekern.demo import LLAMA3_8B_SHAPED, PROMPT_LEN, Decoder  # noqa: E402


def launches(f, args) -> dict:
    """Runtime API calls of one step that start GPU work, by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        f(*args)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if "Launch" in e.key or "Memcpy" in e.key or "Memset" in e.key:
            out[e.key] = e.count
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--first-batch", type=int, default=None)
    args = ap.parse_args()
    out, info = RowWriter(args.csv), versions()
    cfg = LLAMA3_8B_SHAPED
    pos = torch.tensor([PROMPT_LEN], device="cuda")
    if args.first_batch is not None:  # the same code compiled at another batch first (see the module doc)
        torch.manual_seed(0)
        first = Decoder(cfg, "w4a16", args.first_batch, "cuda").eval()
        x0 = torch.randn(args.first_batch, 1, cfg.dim, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for f in (torch.compile(layers_fn(first)), torch.compile(layers_fn(first), backend="fusekern")):
                f(x0, pos)
        del first
    torch.manual_seed(0)
    model = Decoder(cfg, "w4a16", args.batch, "cuda").eval()
    x = torch.randn(args.batch, 1, cfg.dim, device="cuda", dtype=torch.bfloat16)
    fns = {"stock": torch.compile(layers_fn(model)), "fusekern": torch.compile(layers_fn(model), backend="fusekern")}
    with torch.no_grad():
        for name, f in fns.items():
            for _ in range(5):
                f(x, pos)
        timed = {}
        for name, f in fns.items():  # twice: the second pass is the one to read
            for rep in range(2):
                timed[name, rep] = per_call_us(f, (x, pos), args.calls)
                print(f"{name:9s} pass {rep}: {timed[name, rep]:8.1f} us per call", flush=True)
        for name, f in fns.items():
            n = launches(f, (x, pos))
            print(f"{name:9s} launches per step: {n}", flush=True)
            for rep in range(2):
                out.write(dict(scope="layers", batch=args.batch, first_batch=args.first_batch, impl=name, timing_pass=rep,
                               us_per_call=round(timed[name, rep], 1), launches_per_step=sum(n.values()), **info))
        out.close()
        prof = cProfile.Profile()
        f = fns["fusekern"]
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(args.calls):
            f(x, pos)
        torch.cuda.synchronize()
        prof.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
        print(f"--- fusekern, {args.calls} calls, by {key}\n{s.getvalue()}")


if __name__ == "__main__":
    main()
