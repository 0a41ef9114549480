"""The decode step's kernels as the GPU runs them under a CUDA graph: each kernel's time and the idle gap
before it, for stock torch.compile and backend="fusekern" (the demo's decoder layers, W4A16).

do_bench_cudagraph's number is kernels + gaps; torch.profiler's table (profile_e2e_decode.py) has only the
kernels, and without a graph the host hides the gaps. This replays one captured step under the profiler
and prints its kernels in order.

    python benchmarks/profile_e2e_timeline.py [--batch 1] [--backends inductor,fusekern] [--replays 5]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_e2e_decode import layers_fn  # noqa: E402

import fusekern  # noqa: E402,F401  (registers the backend)
from fusekern.demo import LLAMA3_8B_SHAPED, PROMPT_LEN, Decoder  # noqa: E402


def graph_of(f, args):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # fusekern measures its candidates on the first calls
            f(*args)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f(*args)
    return g


def kernels_of(g, replays):
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    prof.export_chrome_trace(path)
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    os.unlink(path)
    ks = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per = len(ks) // replays
    return [ks[i * per:(i + 1) * per] for i in range(replays)]


def report(name, runs):
    spans = []
    for run in runs:
        spans.append(run[-1]["ts"] + run[-1]["dur"] - run[0]["ts"])
    best = runs[sorted(range(len(runs)), key=lambda i: spans[i])[len(runs) // 2]]  # the median replay
    busy = sum(k["dur"] for k in best)
    span = best[-1]["ts"] + best[-1]["dur"] - best[0]["ts"]
    print(f"== {name}: {len(best)} kernels, span {span:.1f} us (median of {len(runs)} replays), "
          f"kernels {busy:.1f} us, gaps {span - busy:.1f} us")
    prev_end = None
    for k in best:
        gap = 0.0 if prev_end is None else k["ts"] - prev_end
        prev_end = k["ts"] + k["dur"]
        print(f"  {k['dur']:7.1f} {gap:5.1f}  {k['name'][:90]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--backends", default="inductor,fusekern")
    ap.add_argument("--replays", type=int, default=5)
    args = ap.parse_args()
    cfg = LLAMA3_8B_SHAPED
    torch.manual_seed(0)
    model = Decoder(cfg, "w4a16", args.batch, "cuda").eval()
    pos = torch.tensor([PROMPT_LEN], device="cuda")
    x = torch.randn(args.batch, 1, cfg.dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for backend in args.backends.split(","):
            f = torch.compile(layers_fn(model), backend=backend)
            report(backend, kernels_of(graph_of(f, (x, pos)), args.replays))


if __name__ == "__main__":
    main()
