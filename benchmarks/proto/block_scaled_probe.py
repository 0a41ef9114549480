"""Where the block-scaled FP8 CuTe GEMM loses a quarter against the rowwise one with the same tile (probe, H200).

    python benchmarks/proto/block_scaled_probe.py [--csv OUT.csv] [--shape 4096x7168x7168]

Why: the 128x128 block-scaled kernel ran 987-1041 TFLOP/s at M = 4096, N = K = 7168 where the rowwise kernel
with the same 128x128 tile ran 1366-1387 (docs/results-h200.md); issue 6 asks 1300. The only difference is the
main loop: each 128-deep K block's WGMMAs write a fresh fragment that 64 FFMAs per thread fold into the
accumulator, scaled by a_block * b_block loaded from global memory a block ahead. Each variant below changes
one thing of that loop (subclasses of the shipped kernel; the ones marked "wrong" compute a different product
and only say what a piece costs):

- ``base``: the shipped kernel;
- ``no_fold`` (wrong): the fragments are never folded (one register kept, so the MMAs stay);
- ``half_fold`` (wrong): half of each fragment is folded: is the cost linear in the FFMAs?
- ``no_scale_loads`` (wrong): scales are constants, no global loads in the loop;
- ``rowwise_128x128`` / ``rowwise_128x256``: the rowwise kernel at both tiles, same operands;
- ``base_ffma_yield``: the shipped kernel with its fold's FFMAs edited to let warps yield (``ffma_yield.py``,
  not measured yet), checked bit for bit against ``base``.

Every variant runs in a CUDA graph (``do_bench_cudagraph``, median); the right ones are checked against a
float32 reference.

Result (``benchmarks/results/h200/block_scaled_probe.csv``, git dbf233d, TFLOP/s): base 942, no_fold 1066,
half_fold 991, no_scale_loads 894, rowwise 128x128 1133, rowwise 128x256 1231: the fold's FFMAs cost about 12%,
the two-fragment loop about 6% (docs/results-h200.md has the ncu readings).
"""
from __future__ import annotations

import argparse
import csv
import sys

import torch
import triton.testing

sys.path.insert(0, "benchmarks")
from bench_common import versions, warm_up_clocks  # noqa: E402
from fusekern.kernels import cute_scaled_mm as csm  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

Base = csm._ScaledMmKernel


class NoFold(Base):
    @cute.jit
    def _fold(self, acc, frag, scales, buf, slot_of):
        acc[0] = acc[0] + frag[0]


class HalfFold(Base):
    @cute.jit
    def _fold(self, acc, frag, scales, buf, slot_of):
        n = cute.size(scales, mode=[1]) - 1
        scale = [scales[buf, j] * scales[buf, n] for j in range(n)]
        for i in cutlass.range_constexpr(cute.size(acc) // 2):
            acc[i] = acc[i] + frag[i] * scale[slot_of[i]]


class NoScaleLoads(Base):
    @cute.jit
    def _load_scales(self, scales, buf, mSA, mSB, sa_rows, sb_rows, kb):
        for j in cutlass.range_constexpr(len(sa_rows) + len(sb_rows)):
            scales[buf, j] = cutlass.Float32(1.0)


VARIANTS = {"base": (Base, True), "no_fold": (NoFold, False), "half_fold": (HalfFold, False),
            "no_scale_loads": (NoScaleLoads, False)}


def _use(kernel_class, tiles=None):
    """Route the next calls to ``kernel_class`` (and rowwise tiles ``tiles``), compiling afresh."""
    csm._ScaledMmKernel = kernel_class
    csm._COMPILED.clear()
    csm._PLANS.clear()
    csm._MARSHALS.clear()
    # the variants change the 128x128 tile's loop (since git 8cb811e large problems take 128x256 instead)
    csm.block_scaled_heuristics = lambda m, n=None, num_sms=132: (128, 128)
    if tiles is not None:
        csm.heuristics = lambda m, n, num_sms=132, _t=tiles: _t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shape", default="4096x7168x7168")
    args = ap.parse_args()
    M, N, K = (int(v) for v in args.shape.split("x"))
    warm_up_clocks()
    torch.manual_seed(0)
    a = (torch.randn(M, K, device="cuda") * 2).to(torch.float8_e4m3fn)
    b = (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn)
    sa = torch.rand(M, K // 128, device="cuda") + 0.5
    sb = torch.rand(N // 128, K // 128, device="cuda") + 0.5
    af = (a.float().view(M, K // 128, 128) * sa[..., None]).view(M, K)
    bf = (b.float().view(N // 128, 128, K // 128, 128) * sb[:, None, :, None]).view(N, K)
    ref = af @ bf.t()
    ref_row = a.float() @ b.float().t()
    del af, bf
    flops = 2 * M * N * K
    rows = []
    info = versions()
    runs = [(name, cls, right, lambda: csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, a_block=sa, b_block=sb),
             ref, None) for name, (cls, right) in VARIANTS.items()]
    runs += [(f"rowwise_{tm}x{tn}", Base, True, lambda: csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16), ref_row,
              (tm, tn)) for tm, tn in ((128, 128), (128, 256))]
    # last: every cubin loaded from here on has its long FFMA runs edited to let warps yield (ffma_yield.py)
    runs += [("base_ffma_yield", Base, True, runs[0][3], ref, None)]
    base_out = None
    for name, cls, right, fn, want, tiles in runs:
        if name == "base_ffma_yield":
            sys.path.insert(0, "benchmarks/proto")
            import ffma_yield

            ffma_yield.install()
        _use(cls, tiles)
        out = fn()
        if name == "base":
            base_out = out.clone()
        torch.cuda.synchronize()
        err = ((out.float() - want).norm() / want.norm()).item()
        us = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
        row = dict(variant=name, M=M, N=N, K=K, right=right, rel_err=f"{err:.2e}", us=round(us, 1),
                   tflops=round(flops / us / 1e6, 1), **info)
        if right and err > 2e-2:
            row["note"] = "WRONG"
        if name == "base_ffma_yield":  # the same instructions: the same bits as the base kernel
            row["note"] = "bits equal base" if torch.equal(out, base_out) else "DIFFERS FROM BASE"
        print(row, flush=True)
        rows.append(row)
    _use(Base)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()) + ["note"])
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
