"""Route a scaled GEMM to the CuTe DSL kernel when it is installed, on Hopper, and takes the arguments.

Kept apart from ``scaled_mm`` so that importing the Triton path never imports cutlass (seconds), and so
that a missing or broken CuTe install degrades to the Triton kernel instead of failing the op.
``FUSEKERN_CUTE=0`` turns the route off (A/B benchmarks, debugging).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("fusekern")


@functools.cache
def _module():
    if os.environ.get("FUSEKERN_CUTE", "1") == "0":
        return None
    try:
        from fusekern.kernels import cute_scaled_mm
    except Exception as e:  # cutlass missing or incompatible: the Triton kernel serves every case
        log.info("fusekern: CuTe DSL kernels unavailable (%s: %s); using Triton", type(e).__name__, e)
        return None
    return cute_scaled_mm


# Which kernel is faster, by measurement (H200, N = K = 8192, benchmarks/results/h200/scaled_mm.csv at
# 9772445): FP8 rowwise, Triton / CuTe: 28 / 122 us at M = 16, 220 / 249 us at M = 2048, 968 / 881 us at
# M = 8192; bf16 + column scale + bias at M = 2048: 450 / 406 us. The CuTe kernel has no split-K or
# swapped small-M tile yet, so it only takes the large products.
CUTE_MIN_M = {1: 4096, 2: 128}  # by operand bytes


def prefers_cute(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape[0] >= CUTE_MIN_M.get(a.element_size(), 1 << 62)


def try_cute_scaled_mm(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype):
    """The CuTe kernel's result, or None when it does not apply (the caller then uses Triton)."""
    if not prefers_cute(a, b):
        return None
    mod = _module()
    if mod is None:
        return None
    if a_block is not None and (group_n, group_k) != (128, 128):
        return None
    kwargs = dict(row=row, col=col, bias=bias, residual=residual, out_dtype=out_dtype, a_block=a_block, b_block=b_block)
    if mod.supports(a, b, **kwargs) is not None:
        return None
    return mod.run_supported(a, b, row, col, bias, residual, out_dtype, a_block, b_block)
