"""What calling a fusekern op through the dispatcher costs the host, on any machine (no GPU needed).

An op with ``fusekern::decode_mm``'s schema and a kernel that does nothing (it returns a tensor made
beforehand) is called as a compiled graph called it before ``compiler_pass/direct_calls.py``
(``torch.ops...default(x, leaves, program, None, layout)``, with a decode program and a layout of the
lengths a GPTQ layer's have), next to a plain Python call of the same kernel and to the entry's checks
(``direct_calls._through_op``). Wall time per call, back to back.

    python benchmarks/proto/probe_dispatch_cost.py [--calls 20000] [--csv out.csv]
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import time

import torch

from fusekern.compiler_pass import direct_calls

torch.library.define("fusekern_probe::decode_mm_like",
                     "(Tensor x, Tensor[] leaves, str program, Tensor? bias, str layout=\"\") -> Tensor")
_OUT = torch.empty(4)


def _kernel(x, leaves, program, bias, layout=""):
    return _OUT


torch.library.impl("fusekern_probe::decode_mm_like", "CPU")(_kernel)


def per_call_us(f, args, calls: int) -> float:
    for _ in range(200):
        f(*args)
    t0 = time.perf_counter()
    for _ in range(calls):
        f(*args)
    return (time.perf_counter() - t0) / calls * 1e6


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args()
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    leaves = [torch.randint(0, 9, (512, 4096), dtype=torch.int32), torch.randn(32, 4096).bfloat16(),
              torch.randint(0, 9, (32, 512), dtype=torch.int32)]
    op = torch.ops.fusekern_probe.decode_mm_like.default
    rows = []
    for program_len in (1141, 4096):  # a GPTQ layer's program is 1141 characters; its layout 324
        program, layout = "p" * program_len, "l" * 324
        args = (x, leaves, program, None, layout)
        ways = {"dispatcher": (op, args), "python_call": (_kernel, args),
                "entry_checks": (direct_calls._through_op, (args, {}))}
        for name, (f, fargs) in ways.items():
            us = per_call_us(f, fargs, a.calls)
            print(f"program {program_len:5d} chars  {name:13s} {us:6.2f} us per call", flush=True)
            rows.append(dict(program_chars=program_len, way=name, us_per_call=round(us, 2)))
    if a.csv:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__file__)).stdout.strip()
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, [*rows[0], "cpu", "cores", "torch", "git_sha"])
            w.writeheader()
            for r in rows:
                w.writerow(dict(r, cpu=_cpu_name(), cores=os.cpu_count(),
                                torch=torch.__version__, git_sha=sha))


if __name__ == "__main__":
    main()
