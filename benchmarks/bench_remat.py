"""Rematerialization hints on the GPU: every loop kernel, every default config, each mode timed.

    python benchmarks/bench_remat.py [--csv benchmarks/results/h200/remat.csv]

For each config ``select_config`` ships (at the first report shape that picks it, as in
``fusekern.kernels.report``), with K a multiple of BLOCK_K and 64 short of it: runs the kernel in modes
off / epilogue / full, checks it against the reference, reads registers and spills from the launched
kernel, and times it with CUDA graphs (no launcher overhead). The three modes are timed in rounds,
interleaved, and the median of the round medians is reported, so clock drift does not favour one mode.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import triton.testing

from bench_common import versions, warm_up_clocks, write_csv
from fusekern.kernels import w8a16_linear as k
from fusekern.kernels.remat import REMAT_MODES
from fusekern.testing import rel_err

ROUNDS = 5


class Recorder:
    """A ``wrap`` for the launcher that keeps the compiled kernels it launched (for n_regs / n_spills)."""

    def __init__(self):
        self.launched = []

    def __call__(self, kernel):
        recorder = self

        class Launch:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    compiled = kernel[grid](*args, **kwargs)
                    recorder.launched.append((kernel.__name__, compiled))
                    return compiled
                return run
        return Launch()


def cases():
    for cfg, (M, N, K) in k.shipped_configs().items():
        if not isinstance(cfg, k.DequantConfig):
            yield cfg, (M, N, K)
            yield cfg, (M, N, K - 64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    warm_up_clocks()
    meta = versions()
    rows = []
    for cfg, (M, N, K) in cases():
        torch.manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randint(-128, 128, (N, K), device="cuda", dtype=torch.int8)
        s = torch.rand(N, device="cuda") * 0.01 + 1e-3
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        ref = k.w8a16_linear_reference(x, w, s, b, torch.float32)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        runs, info = {}, {}
        for mode in REMAT_MODES:
            c = dataclasses.replace(cfg, remat=mode)
            out.fill_(float("nan"))
            rec = Recorder()
            k.w8a16_linear_triton(x, w, s, b, config=c, out=out, wrap=rec)
            torch.cuda.synchronize()
            name, compiled = rec.launched[0]
            info[mode] = dict(kernel=name, registers=compiled.n_regs, spills=compiled.n_spills, rel_err=rel_err(out, ref))
            runs[mode] = lambda c=c: k.w8a16_linear_triton(x, w, s, b, config=c, out=out)
        times = {mode: [] for mode in REMAT_MODES}
        for _ in range(ROUNDS):
            for mode in REMAT_MODES:
                times[mode].append(triton.testing.do_bench_cudagraph(runs[mode], rep=50, return_mode="median") * 1e3)
        for mode in REMAT_MODES:
            us = statistics.median(times[mode])
            i = info[mode]
            ok = i["rel_err"] < 1e-2
            rows.append(dict(**meta, kernel=i["kernel"], config=repr(dataclasses.replace(cfg, remat=mode)),
                             M=M, N=N, K=K, remat=mode, median_us=round(us, 2), registers=i["registers"],
                             spills=i["spills"], rel_err=f"{i['rel_err']:.2e}", correct=ok))
            print(f"{i['kernel']:22s} {M:4d}x{N:6d}x{K:6d} {mode:9s} {us:8.2f} us  regs {i['registers']:3d}  "
                  f"spills {i['spills']}  rel_err {i['rel_err']:.1e} {'ok' if ok else 'WRONG'}  {cfg}", flush=True)
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
