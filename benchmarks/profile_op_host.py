"""Host time of one fused decode linear per call, by the way it is called: through the dispatcher
(``torch.ops.fusekern.decode_mm``), through the compiled graph's direct entry (``extern_kernels.
fusekern_decode_mm``, ``fusekern/compiler_pass/direct_calls.py``), the op's CUDA function itself, and the
whole compiled graph, fusekern's and stock inductor's. A small weight (the GPU keeps up with the host),
back-to-back calls, wall time per call.

    python benchmarks/profile_op_host.py [--calls 3000] [--format gptq] [--size 1024] [--csv out.csv]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import RowWriter, per_call_us, versions  # noqa: E402

import fusekern  # noqa: E402,F401  (registers the backend)
from fusekern.testing import decode_zoo as zoo  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--format", default="gptq")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    from torch._inductor.select_algorithm import extern_kernels

    from fusekern.kernels import decode_mm as dm

    case = next(c for c in zoo.CASES if c.name == args.format)
    K = N = args.size
    weights = case.make(K, N, case.group, "cuda")
    x = torch.randn(args.rows, K, device="cuda", dtype=torch.bfloat16)
    fused = torch.compile(case.fn, backend="fusekern")
    stock = torch.compile(case.fn)
    with torch.no_grad():
        fused(x, *weights)
        stock(x, *weights)
        seen = []
        entry = getattr(extern_kernels, "fusekern_decode_mm", None)
        if entry is not None:  # the op's arguments, as the compiled graph passes them
            extern_kernels.fusekern_decode_mm = lambda *a, **k: seen.append((a, k)) or entry(*a, **k)
            fused(x, *weights)
            extern_kernels.fusekern_decode_mm = entry
        ways = {"fusekern_graph": (fused, (x, *weights)), "stock_graph": (stock, (x, *weights))}
        if seen:
            (op_args, op_kwargs), = seen
            assert not op_kwargs
            ways.update(op_dispatcher=(torch.ops.fusekern.decode_mm.default, op_args),
                        op_direct_entry=(entry, op_args), op_cuda_function=(dm._decode_mm_cuda, op_args))
        out, info = RowWriter(args.csv), versions()
        for name, (f, a) in ways.items():
            for rep in range(2):
                us = per_call_us(f, a, args.calls, warmup=50)
                print(f"{name:18s} pass {rep}: {us:7.2f} us per call", flush=True)
                out.write(dict(format=args.format, M=args.rows, N=N, K=K, way=name, timing_pass=rep,
                               us_per_call=round(us, 2), **info))
        out.close()


if __name__ == "__main__":
    main()
