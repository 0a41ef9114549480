"""W8A16 linear: ``out = (x @ w.T) * scale[n] (+ bias[n])`` with int8 weights.

x is fp16/bf16 ``[M, K]``, w is int8 ``[N, K]`` (any strides), scale and bias are ``[N]``.

Read top to bottom: configs and heuristics -> Triton kernels -> launcher -> reference -> custom op.

Three paths, chosen at run time by M (so dynamic M works), thresholds from H200 sweeps
(benchmarks/sweep_w8a16_linear.py):
- small M: ``_w8a16_splitk_kernel`` solves the transposed problem ``out.T = w @ x.T`` on tensor
  cores so the large N fills the MMA's M side (Hopper has no MMA under 64 rows), with split-K when
  there are too few column tiles to fill the SMs. The int8 weight is read once and converted in
  registers; partial sums are reduced in a fixed order (deterministic).
- medium M: ``_w8a16_gemm_kernel``, a tiled tensor-core GEMM that converts the int8 tile after its
  load and applies scale and bias in the epilogue.
- large M (compute-bound): ``_dequant_kernel`` writes ``w * scale`` once in the activation dtype and
  cuBLAS does the GEMM. Measured on H200 at M=2048, N=K=8192 the fused Triton GEMM ran at 519 us
  against 338 us for cuBLAS alone: Triton's mixed-input pipeline does not keep up with WGMMA there.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusekern.compiler_pass import direct_calls
from fusekern.kernels.device_info import sm_count
from fusekern.kernels.intmath import cdiv, needs_i64
from fusekern.kernels.remat import block_index, remat_flags

# Bumped whenever a kernel or its heuristics change; part of the compiler passes' cache key.
KERNEL_VERSION = "w8a16_linear-4"

SUPPORTED_ACT_DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class SplitKConfig:
    """Small M: transposed tensor-core product, BLOCK_M fixed at 16 (the MMA's N side)."""

    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    SPLIT_K: int = 1  # > 1: fp32 partial sums to a workspace, then _splitk_epilogue_kernel
    remat: str = "off"  # rematerialization hints: off | epilogue | full (fusekern.kernels.remat)


@dataclass(frozen=True)
class GemmConfig:
    """Medium M: tiled GEMM with grouped tile order."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int
    remat: str = "off"  # rematerialization hints: off | epilogue | full (fusekern.kernels.remat)


@dataclass(frozen=True)
class DequantConfig:
    """Large M: dequantize once, then cuBLAS."""

    BLOCK_N: int = 32
    BLOCK_K: int = 256


# M thresholds between the paths (H200 sweeps, N = K = 8192 and 4096 x 14336).
SMALL_M_MAX = 16
GEMM_M_MAX = 256


@functools.lru_cache(maxsize=4096)
def select_config(M: int, N: int, K: int, sm_count: int = 132) -> SplitKConfig | GemmConfig | DequantConfig:
    """The path and launch config for one problem size."""
    if M <= SMALL_M_MAX:
        # Measured: with column tiles of 64 for at least 3/4 of the SMs (128 tiles at N=8192) the plain
        # tiled kernel (BLOCK_M=16) was best (34.8 us at 1x8192x8192); with fewer tiles the SMs starve
        # and split-K wins (32.5 us against 46 us at 1x4096x14336, 64 tiles).
        # Rematerialization hints were measured slower here (30.6 / 13.1 us full against 29.6 / 12.6 off,
        # benchmarks/results/h200/remat.csv): both small-M kernels ship with them off.
        if 4 * cdiv(N, 64) >= 3 * sm_count:
            return GemmConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=4, remat="off")
        tiles = cdiv(N, 32)
        split_k = max(1, min(4, (2 * sm_count) // max(tiles, 1), cdiv(K, 256)))
        return SplitKConfig(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=5, SPLIT_K=split_k, remat="off")
    if M <= GEMM_M_MAX:
        # Rematerialization: "full" measured 78.6 us against 80.2 us off at 64x8192x8192, same registers
        # (benchmarks/results/h200/remat.csv; with a masked K tail it was 0.6% slower).
        return GemmConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, remat="full")
    return DequantConfig()


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _w8a16_splitk_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_s, stride_b, stride_om, stride_on,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REMAT_EPILOGUE: tl.constexpr,
    REMAT_LOOP: tl.constexpr,
    I64: tl.constexpr = False,  # 64-bit offsets: x, w or out reaches past 2**31 elements (``needs_i64``)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    # Split-K: this program reduces k-tiles [k_begin, k_end) and (if SPLIT_K > 1) writes raw fp32
    # partial sums to out_ptr, a [SPLIT_K, M, N] workspace; the epilogue then runs once per output.
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, k_tiles)
    if I64:
        k_begin = k_begin.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamp out-of-range rows instead of masking every load: the stores are masked.
    offs_n_ld = tl.where(offs_n < N, offs_n, 0)
    offs_m_ld = tl.where(offs_m < M, offs_m, 0)
    if I64:
        offs_n_ld = offs_n_ld.to(tl.int64)
        offs_m_ld = offs_m_ld.to(tl.int64)
    # REMAT_LOOP: the loop carries loop-invariant 32-bit tile offsets and a scalar k; otherwise pointer tensors.
    w_offs = offs_n_ld[:, None] * stride_wn + offs_k[None, :] * stride_wk
    x_offs = offs_m_ld[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + w_offs + k_begin * BLOCK_K * stride_wk
    x_ptrs = x_ptr + x_offs + k_begin * BLOCK_K * stride_xk

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_begin, k_end):
        if REMAT_LOOP:
            k0 = k * BLOCK_K
            if I64:
                k0 = k0.to(tl.int64)
            w_ptrs = w_ptr + k0 * stride_wk + w_offs
            x_ptrs = x_ptr + k0 * stride_xk + x_offs
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            k_mask = offs_k[None, :] < K - k * BLOCK_K
            w = tl.load(w_ptrs, mask=k_mask, other=0)
            x = tl.load(x_ptrs, mask=k_mask, other=0.0)
        # Transposed problem: out.T[BLOCK_N, BLOCK_M] = w[BLOCK_N, K] @ x.T[K, BLOCK_M].
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
        if not REMAT_LOOP:
            w_ptrs += BLOCK_K * stride_wk
            x_ptrs += BLOCK_K * stride_xk

    if REMAT_EPILOGUE:  # epilogue offsets from a fresh read of the block index, not held across the loop
        offs_n = block_index(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = block_index(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if I64:
        offs_n = offs_n.to(tl.int64)
        offs_m = offs_m.to(tl.int64)
    if SPLIT_K > 1:
        split = block_index(2) if REMAT_EPILOGUE else tl.program_id(2)
        if I64:
            split = split.to(tl.int64)
        ws_ptrs = out_ptr + split * M * N + offs_n[:, None] + offs_m[None, :] * N
        tl.store(ws_ptrs, acc, mask=n_mask[:, None] & m_mask[None, :])
    else:
        offs_n_ld = tl.where(n_mask, offs_n, 0)
        out = acc * tl.load(scale_ptr + offs_n_ld * stride_s).to(tl.float32)[:, None]
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n_ld * stride_b).to(tl.float32)[:, None]
        o_ptrs = out_ptr + offs_n[:, None] * stride_on + offs_m[None, :] * stride_om
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _splitk_epilogue_kernel(
    ws_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N,
    stride_s, stride_b, stride_om, stride_on,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    I64: tl.constexpr = False,  # 64-bit offsets: the workspace or out reaches past 2**31 elements
):
    # Sums the SPLIT_K partials of [M, N] in a fixed order (deterministic), then scale, bias, cast.
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    ws = ws_ptr  # advanced by M * N per split: a 64-bit pointer, where i * M * N would be formed in 32 bits
    for i in tl.static_range(SPLIT_K):
        acc += tl.load(ws + offs, mask=mask, other=0.0)
        ws += M * N
    n = offs % N
    m = offs // N
    out = acc * tl.load(scale_ptr + n * stride_s, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n * stride_b, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n * stride_on, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row-tiles share each column tile of w while it sits in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _w8a16_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_s, stride_b, stride_om, stride_on,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    REMAT_EPILOGUE: tl.constexpr,
    REMAT_LOOP: tl.constexpr,
    I64: tl.constexpr = False,  # 64-bit offsets: x, w or out reaches past 2**31 elements (``needs_i64``)
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m_ld = tl.where(offs_m < M, offs_m, 0)
    offs_n_ld = tl.where(offs_n < N, offs_n, 0)
    if I64:
        offs_m_ld = offs_m_ld.to(tl.int64)
        offs_n_ld = offs_n_ld.to(tl.int64)
    # REMAT_LOOP: the loop carries loop-invariant 32-bit tile offsets and a scalar k; otherwise pointer tensors.
    x_offs = offs_m_ld[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    w_offs = offs_n_ld[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BN, BK]
    x_ptrs = x_ptr + x_offs
    w_ptrs = w_ptr + w_offs

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if REMAT_LOOP:
            k0 = k * BLOCK_K
            if I64:
                k0 = k0.to(tl.int64)
            x_ptrs = x_ptr + k0 * stride_xk + x_offs
            w_ptrs = w_ptr + k0 * stride_wk + w_offs
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k[None, :] < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=k_mask, other=0.0)
            w = tl.load(w_ptrs, mask=k_mask, other=0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        if not REMAT_LOOP:
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk

    if REMAT_EPILOGUE:  # epilogue offsets from a fresh read of the block index, not held across the loop
        pid_m, pid_n = _tile_coords(block_index(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if I64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    scale = tl.load(scale_ptr + offs_n * stride_s, mask=n_mask, other=0.0).to(tl.float32)
    out = acc * scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n * stride_b, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_kernel(
    w_ptr, scale_ptr, out_ptr,
    N, K,
    stride_wn, stride_wk, stride_s,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    I64: tl.constexpr = False,  # 64-bit offsets: w or out reaches past 2**31 elements (``needs_i64``)
):
    # out[n, k] = w[n, k] * scale[n], rounded once to out's dtype; out is contiguous [N, K].
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    if I64:  # both: a transposed weight's k stride is N
        offs_n = offs_n.to(tl.int64)
        offs_k = offs_k.to(tl.int64)
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk, mask=mask, other=0)
    scale = tl.load(scale_ptr + offs_n * stride_s, mask=offs_n < N, other=0.0).to(tl.float32)
    out = w.to(tl.float32) * scale[:, None]
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launcher


def _check_args(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"w8a16_linear: x and w must be 2-D, got x{tuple(x.shape)} w{tuple(w.shape)}")
    if w.dtype != torch.int8:
        raise TypeError(f"w8a16_linear: w must be int8, got {w.dtype}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"w8a16_linear: K mismatch, x{tuple(x.shape)} w{tuple(w.shape)}")
    n = w.shape[0]
    if scale.shape != (n,):
        raise ValueError(f"w8a16_linear: scale must have shape ({n},), got {tuple(scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"w8a16_linear: bias must have shape ({n},), got {tuple(bias.shape)}")
    devices = {t.device for t in (x, w, scale, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"w8a16_linear: all tensors must be on one device, got {sorted(map(str, devices))}")
    for name, t in (("x", x), ("scale", scale), ("bias", bias)):  # real floating point values only
        if t is not None and (not t.dtype.is_floating_point or t.dtype.itemsize == 1):
            raise TypeError(f"w8a16_linear: {name} must be fp16, bf16, fp32 or fp64, got {t.dtype}")


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"w8a16_linear: out_dtype must be fp16, bf16, fp32 or fp64, got {out_dtype}")


def w8a16_linear_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    config: SplitKConfig | GemmConfig | DequantConfig | None = None,
    out: torch.Tensor | None = None,
    wrap=None,
) -> torch.Tensor:
    """Run the path that fits M (or the one ``config`` names).

    Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``. ``out`` (optional, [M, N]
    of out_dtype) receives the result: tests pass a NaN-poisoned buffer to prove every element is written.
    ``wrap=torch.library.wrap_triton`` records the launches for inductor instead of running them; the
    caller must trace this under ``torch.func.functionalize`` (see ``traced_for_inductor``).
    """
    launch = wrap if wrap is not None else (lambda kernel: kernel)
    _check_args(x, w, scale, bias)
    if x.dtype not in SUPPORTED_ACT_DTYPES:
        raise TypeError(f"w8a16_linear_triton: x must be fp16 or bf16, got {x.dtype}")
    M, K = x.shape
    N = w.shape[0]
    out_dtype = out_dtype or x.dtype
    if out is not None and (out.shape != (M, N) or out.dtype != out_dtype or out.device != x.device):
        raise ValueError(f"w8a16_linear_triton: out must be {(M, N)} {out_dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if config is None and M > 0 and N > 0 and K > 0:
        sms = sm_count(x.device)
        config = select_config(M, N, K, sms)
        if isinstance(config, DequantConfig) and _fp16_wider(x, out_dtype):  # (see _dequant_then_mm)
            config = select_config(GEMM_M_MAX, N, K, sms)
    if isinstance(config, DequantConfig):
        # cuBLAS allocates its own result: copy only when the caller asked for a buffer.
        result = _dequant_then_mm(x, w, scale, bias, out_dtype, config, launch)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=out_dtype)
    if M == 0 or N == 0 or K == 0:
        out.zero_()
        return out if bias is None else out.add_(bias)

    bias_arg = bias if bias is not None else scale  # never read when HAS_BIAS is False
    strides = (
        x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        scale.stride(0), bias_arg.stride(0), out.stride(0), out.stride(1),
    )
    meta = dict(HAS_BIAS=bias is not None, EVEN_K=K % config.BLOCK_K == 0, **remat_flags(config.remat),
                num_warps=config.num_warps, num_stages=config.num_stages)
    if isinstance(config, SplitKConfig):
        split_k = max(1, min(config.SPLIT_K, cdiv(K, config.BLOCK_K)))
        # With split-K the kernel writes fp32 partials; the epilogue kernel then writes `out`.
        dst = torch.empty((split_k, M, N), device=x.device, dtype=torch.float32) if split_k > 1 else out
        grid = (cdiv(N, config.BLOCK_N), cdiv(M, 16), split_k)
        launch(_w8a16_splitk_kernel)[grid](
            x, w, scale, bias_arg, dst, M, N, K, *strides,
            SPLIT_K=split_k, BLOCK_M=16, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
            I64=needs_i64(x, w, dst), **meta,
        )
        if split_k > 1:
            block = 1024
            launch(_splitk_epilogue_kernel)[(cdiv(M * N, block),)](
                dst, scale, bias_arg, out, M, N, *strides[4:],
                HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=block, I64=needs_i64(dst, out), num_warps=4,
            )
    else:
        grid = (cdiv(M, config.BLOCK_M) * cdiv(N, config.BLOCK_N),)
        launch(_w8a16_gemm_kernel)[grid](
            x, w, scale, bias_arg, out, M, N, K, *strides,
            BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
            GROUP_M=config.GROUP_M, I64=needs_i64(x, w, out), **meta,
        )
    return out


def _fp16_wider(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """fp16 activations and a result wider than fp16: no fp16 intermediate may stand between them."""
    return x.dtype == torch.float16 and out_dtype.itemsize > 2


def _dequant_then_mm(x, w, scale, bias, out_dtype, config: DequantConfig, launch) -> torch.Tensor:
    """Large M: ``w * scale`` rounded once to x's dtype, then one cuBLAS GEMM (bias in its epilogue).

    fp16 x with a wider result (an fp32 scale or bias after the matmul): rounding ``w * s`` or the product to
    fp16 would lose what the op promises (inf past 65504 at a scale above 1 or large outputs, subnormals for tiny
    scales). The automatic choice gives that case the tiled kernel instead (``_fp16_wider``); a caller who asks
    for this path gets it in fp32 (exact, slow). ``torch.mm(..., out_dtype=torch.float32)`` would be the fast
    form, but torch's fake-tensor support for it is recent (pytorch#159023), and this path is traced for inductor.
    """
    if _fp16_wider(x, out_dtype):
        out = torch.mm(x.float(), w.to(torch.float32).t()) * scale.float()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
    N, K = w.shape
    w_deq = torch.empty((N, K), device=x.device, dtype=x.dtype)
    grid = (cdiv(N, config.BLOCK_N), cdiv(K, config.BLOCK_K))
    launch(_dequant_kernel)[grid](
        w, scale, w_deq, N, K, w.stride(0), w.stride(1), scale.stride(0),
        BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, I64=needs_i64(w, w_deq), num_warps=4,
    )
    if bias is not None and bias.dtype == x.dtype:
        return torch.addmm(bias, x, w_deq.t()).to(out_dtype)
    out = torch.mm(x, w_deq.t())
    if bias is not None:
        out = out.float() + bias.float()
    return out.to(out_dtype)


def traced_for_inductor(x, w, scale, bias, out_dtype) -> torch.Tensor:
    """For a replacement traced with a fixed M on CUDA: the launches as functional Triton HOPs.

    Inductor then emits the launches in its own wrapper, with no per-call Python dispatch (at decode
    that dispatch costs more than the kernel). Functionalization is required: traced as mutations of a
    fresh buffer, the result would be the unwritten buffer and the launch dead code.
    """
    launch = functools.partial(w8a16_linear_triton, out_dtype=out_dtype, wrap=torch.library.wrap_triton)
    if bias is None:
        return torch.func.functionalize(lambda x, w, s: launch(x, w, s, None))(x, w, scale)
    return torch.func.functionalize(launch)(x, w, scale, bias)


# ----------------------------------------------------------------------------- builds for the report

# The shapes the configs are chosen for (Llama-style layers; issue 4's benchmark shapes).
REPORT_SHAPES = ((8192, 8192), (4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
REPORT_MS = (1, 16, 64, 256, 2048)


def shipped_configs() -> dict:
    """Each config ``select_config`` picks for the report shapes -> the first (M, N, K) that picks it."""
    picked = {}
    for n, k in REPORT_SHAPES:
        for m in REPORT_MS:
            picked.setdefault(select_config(m, n, k), (m, n, k))
    return picked


def aot_builds():
    """Every config ``select_config`` picks for the report shapes, bf16 activations, with bias.

    Each is specialized for the first (M, N, K) that picks it, contiguous tensors. Loop kernels are listed
    with K a multiple of BLOCK_K and with K 64 short of it (the masked tail): both variants run.
    """
    from fusekern.kernels.catalog import TritonBuild

    builds = []
    for cfg, (M, N, K) in shipped_configs().items():
        if isinstance(cfg, DequantConfig):
            args = dict(w_ptr="*i8", scale_ptr="*fp32", out_ptr="*bf16", N=N, K=K, stride_wn=K, stride_wk=1, stride_s=1)
            builds.append(TritonBuild("w8a16_dequant", f"BLOCK_N={cfg.BLOCK_N} BLOCK_K={cfg.BLOCK_K} w4", _dequant_kernel,
                                      args, dict(BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K), num_warps=4))
            continue
        split_k = cfg.SPLIT_K if isinstance(cfg, SplitKConfig) else 1
        for even_k in (True, False):
            k_ = K if even_k else K - 64
            args = dict(x_ptr="*bf16", w_ptr="*i8", scale_ptr="*fp32", bias_ptr="*bf16",
                        out_ptr="*fp32" if split_k > 1 else "*bf16",  # split-K writes fp32 partials
                        M=M, N=N, K=k_, stride_xm=k_, stride_xk=1, stride_wn=k_, stride_wk=1, stride_s=1,
                        stride_b=1, stride_om=N, stride_on=1)
            common = dict(HAS_BIAS=True, EVEN_K=even_k, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K)
            label = f"BLOCK_N={cfg.BLOCK_N} BLOCK_K={cfg.BLOCK_K} w{cfg.num_warps} s{cfg.num_stages}"
            label += f" [{M}x{N}x{k_}]"
            if isinstance(cfg, SplitKConfig):
                builds.append(TritonBuild(
                    "w8a16_splitk", f"BLOCK_M=16 {label} SPLIT_K={split_k}", _w8a16_splitk_kernel, args,
                    dict(common, SPLIT_K=split_k, BLOCK_M=16), cfg.num_warps, cfg.num_stages, cfg.remat))
            else:
                builds.append(TritonBuild(
                    "w8a16_gemm", f"BLOCK_M={cfg.BLOCK_M} {label}", _w8a16_gemm_kernel, args,
                    dict(common, BLOCK_M=cfg.BLOCK_M, GROUP_M=cfg.GROUP_M), cfg.num_warps, cfg.num_stages, cfg.remat))
        if split_k > 1:
            args = dict(ws_ptr="*fp32", scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", M=M, N=N,
                        stride_s=1, stride_b=1, stride_om=N, stride_on=1)
            builds.append(TritonBuild("w8a16_splitk_epilogue", f"SPLIT_K={split_k} BLOCK=1024 w4", _splitk_epilogue_kernel,
                                      args, dict(HAS_BIAS=True, SPLIT_K=split_k, BLOCK=1024), num_warps=4))
    return builds


# ----------------------------------------------------------------------------- reference


def w8a16_linear_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain PyTorch in float64 (float32 on devices without float64 matmul): the ground truth."""
    acc_dtype = torch.float64 if x.device.type == "cpu" else torch.float32
    out = (x.to(acc_dtype) @ w.to(acc_dtype).t()) * scale.to(acc_dtype)
    if bias is not None:
        out = out + bias.to(acc_dtype)
    return out.to(out_dtype or x.dtype)


# ----------------------------------------------------------------------------- custom op
# Registered with the plain dispatcher API (define + per-device impl + fake) rather than
# torch.library.custom_op: custom_op's Python wrappers (autograd, backend_impl, a dynamo-disable frame)
# cost more CPU per call than the decode kernel runs on the GPU (measured on H200, M=1, N=K=8192).
# The op is inference-only: the int8 weight has no gradient and no autograd kernel is registered.

torch.library.define(
    "fusekern::w8a16_linear",
    "(Tensor x, Tensor w, Tensor scale, Tensor? bias, ScalarType out_dtype) -> Tensor",
)


def _w8a16_linear_cuda(x, w, scale, bias, out_dtype):
    """``(x @ w.T) * scale + bias`` for int8 w, as one fused kernel."""
    _check_out_dtype(out_dtype)
    if x.dtype in SUPPORTED_ACT_DTYPES:
        return w8a16_linear_triton(x, w, scale, bias, out_dtype)  # checks its arguments
    return _w8a16_linear_cpu(x, w, scale, bias, out_dtype)


torch.library.impl("fusekern::w8a16_linear", "CUDA")(_w8a16_linear_cuda)  # (kept callable: tests, direct_calls)
direct_calls.register(torch.ops.fusekern.w8a16_linear.default, _w8a16_linear_cuda)


def _w8a16_linear_cpu(x, w, scale, bias, out_dtype):
    """fp32 accumulation, the same math as the kernel."""
    _check_args(x, w, scale, bias)
    _check_out_dtype(out_dtype)
    out = (x.float() @ w.float().t()) * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# (registered, not decorated: the decorator returns None, and the CUDA kernel falls back to this)
torch.library.impl("fusekern::w8a16_linear", "CPU")(_w8a16_linear_cpu)


@torch.library.register_fake("fusekern::w8a16_linear")
def _w8a16_linear_fake(x, w, scale, bias, out_dtype):
    _check_args(x, w, scale, bias)
    _check_out_dtype(out_dtype)
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


w8a16_linear = torch.ops.fusekern.w8a16_linear
