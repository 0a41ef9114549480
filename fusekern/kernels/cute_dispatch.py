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

from fusekern.kernels.intmath import cdiv, next_power_of_2

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
# Between these and CUTE_MIN_M neither kernel wins every run: at FP8 M = 2048 the CuTe kernel was faster
# in three runs of four (docs/results-h200.md, scale folding), by up to 15%. There the first product of a shape times
# both kernels on random operands of its shape and keeps the faster, per (N, K), M's power-of-two bucket, block
# scaling and device: a prefill of each new length must not pay a timing run (a quarter second or more).
MEASURE_MIN_M = {1: 1024}
_CHOSEN: dict[tuple, bool] = {}
_FAILED: set[tuple] = set()  # shapes whose CuTe compile or launch raised: Triton from then on


def prefers_cute(a: torch.Tensor, b: torch.Tensor, block: bool = False, groups: tuple = (128, 128)) -> bool:
    """Whether the CuTe kernel should take ``a @ b.T`` (block: block scales in ``groups`` of (N, K), which the
    kernel takes at 128 x 128 only: other groups are never timed for it). Real or fake operands: only their
    shapes, dtypes and device are read."""
    if a.dtype != b.dtype or (block and tuple(groups) != (128, 128)):
        return False
    M, N, K = a.shape[0], b.shape[0], a.shape[1]
    if not all(isinstance(d, int) for d in (M, N, K)):  # symbolic sizes: the threshold, without a guard
        return isinstance(M, int) and M >= CUTE_MIN_M.get(a.element_size(), 1 << 62)
    return choice(M, N, K, a.dtype, block, a.device)


def choice(M: int, N: int, K: int, dtype: torch.dtype, block: bool, device: torch.device, timer=None) -> bool:
    """The threshold outside the measured band; inside it (CUDA only) the cached measurement, taken on the
    first call (``timer(M, N, K, dtype, block, device)`` -> whether CuTe is faster; ``_cute_is_faster`` by
    default). While a CUDA graph is being captured nothing can be timed: the threshold answers then."""
    size = dtype.itemsize
    if M >= CUTE_MIN_M.get(size, 1 << 62):
        return True
    if M < MEASURE_MIN_M.get(size, 1 << 62) or device.type != "cuda":
        return False
    key = (next_power_of_2(M), N, K, dtype, block, device.index)
    if key not in _CHOSEN:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        try:
            _CHOSEN[key] = bool((timer or _cute_is_faster)(M, N, K, dtype, block, device))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for the operands: Triton serves the shape
            log.warning("fusekern: timing scaled_mm %dx%dx%d failed (%s: %s); using the Triton kernel",
                        M, N, K, type(e).__name__, e)
            _CHOSEN[key] = False
        log.info("fusekern: scaled_mm %dx%dx%d %s%s: %s kernel (measured)", M, N, K, dtype,
                 " block-scaled" if block else "", "CuTe" if _CHOSEN[key] else "Triton")
    return _CHOSEN[key]


def _cute_is_faster(M: int, N: int, K: int, dtype: torch.dtype, block: bool, device: torch.device) -> bool:
    """Time both kernels (median of ``triton.testing.do_bench``) on random operands of this shape, with row
    and column scales (or 128 x 128 block scales) and a bf16 output: the mainloop decides, not the epilogue."""
    import triton
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from fusekern.kernels.scaled_mm import scaled_mm_triton

    mod = _module()
    if mod is None:
        return False
    # A generator of its own: drawing from the device's default one would change what a seeded model samples
    # after this (the timing runs at compile time and at the first call of a new size).
    g = torch.Generator(device=device).manual_seed(0)
    with unset_fake_temporarily(), torch.no_grad(), torch.cuda.device(device):  # (the pass may run under a fake mode)
        a = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g).to(dtype)
        b = torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=g).to(dtype)
        row = col = a_block = b_block = None
        group_n = group_k = 0
        if block:  # one scale per 128 x 128 block, a partial block at the ends included
            a_block = torch.rand(M, cdiv(K, 128), device=device, generator=g) + 0.5
            b_block = torch.rand(cdiv(N, 128), cdiv(K, 128), device=device, generator=g) + 0.5
            group_n = group_k = 128
        else:
            row = torch.rand(M, device=device, generator=g) + 0.5
            col = torch.rand(N, device=device, generator=g) + 0.5
        args = (a, b, row, col, None, None, a_block, b_block, group_n, group_k, torch.bfloat16)
        if mod.supports(a, b, row=row, col=col, bias=None, residual=None, out_dtype=torch.bfloat16,
                        a_block=a_block, b_block=b_block) is not None:
            return False
        cute = triton.testing.do_bench(lambda: mod.run_supported(a, b, row, col, None, None, torch.bfloat16,
                                                                 a_block, b_block), return_mode="median")
        plain = triton.testing.do_bench(lambda: scaled_mm_triton(*args), return_mode="median")
    return cute < plain


def try_cute_scaled_mm(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype):
    """The CuTe kernel's result, or None when it does not apply or its compile or launch raised (the caller
    then uses Triton; a failure is logged once and that shape stays on Triton)."""
    if not prefers_cute(a, b, a_block is not None, (group_n, group_k)):
        return None
    mod = _module()
    if mod is None:
        return None
    kwargs = dict(row=row, col=col, bias=bias, residual=residual, out_dtype=out_dtype, a_block=a_block, b_block=b_block)
    if mod.supports(a, b, **kwargs) is not None:
        return None
    key = (next_power_of_2(a.shape[0]), *b.shape, a.dtype, out_dtype, a.device,  # (per bucket, as the choice)
           *(t is not None for t in (row, col, bias, residual, a_block)))
    if key in _FAILED:
        return None
    try:
        return mod.run_supported(a, b, row, col, bias, residual, out_dtype, a_block, b_block)
    except Exception as e:  # noqa: BLE001 - a compile or launch failure (out of memory, a toolchain issue)
        log.warning("fusekern: the CuTe scaled_mm failed for %s x %s (%s: %s); using the Triton kernel",
                    tuple(a.shape), tuple(b.shape), type(e).__name__, e)
        _FAILED.add(key)
        return None
