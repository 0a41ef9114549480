"""Scaled GEMM with a composable epilogue (the scale-folding family's kernel).

    out[m, n] = cast( acc[m, n] * row[m] * col[n] + bias[n] + residual[m, n] )
    acc[m, n] = sum_k a[m, k] * b[n, k]                                   (plain)
              = sum_kb a_block[m, kb] * b_block[n // GN, kb] * sum_{k in kb} a[m, k] * b[n, k]   (block-scaled)

a is ``[M, K]`` and b ``[N, K]`` (any strides), each fp8 (e4m3 / e5m2), int8, bf16 or fp16; every
epilogue input is optional. The product runs on tensor cores in the operands' own type when both have
the same one (fp8 and int8 products are exact, accumulated in fp32 / int32); mixed operands are widened
in registers to the 16-bit type among them (int8 and fp8 values are exact in bf16 and fp16). Block
scales (DeepSeek-style 1 x GK activation / GN x GK weight blocks) multiply each K block's partial sum
before it joins the fp32 accumulator, so the fp8 products never see a scale and nothing is dequantized.

Read top to bottom: dtype rules -> configs -> the Triton kernel -> launcher -> reference -> custom op.
On Hopper the FP8 and 16-bit K-major cases go to the CuTe DSL kernel (``cute_scaled_mm``) when it is
installed and takes the arguments; this Triton kernel is the fallback for the rest, for other GPUs and
for the CPU tests (interpreter). On CPU the op computes in fp32 with the same epilogue.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusekern.compiler_pass import direct_calls
from fusekern.kernels.intmath import cdiv, needs_i64
from fusekern.kernels.remat import block_index, remat_flags
from fusekern.kernels.w8a16_linear import _tile_coords  # grouped tile order, shared with the W8A16 GEMM

# Bumped whenever a kernel or its heuristics change; part of the compiler passes' cache key.
KERNEL_VERSION = "scaled_mm-2"

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
EIGHT_BIT_DTYPES = (*FP8_DTYPES, torch.int8)
SIXTEEN_BIT_DTYPES = (torch.bfloat16, torch.float16)
OPERAND_DTYPES = (*EIGHT_BIT_DTYPES, *SIXTEEN_BIT_DTYPES)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------- dtype rules


def compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype | None:
    """The type the tensor cores multiply in, or None when no exact choice exists.

    Same type: that type. One 16-bit and one 8-bit operand: the 16-bit type (8-bit values widen
    exactly). Two different 8-bit types: bf16. Two different 16-bit types: None (one would round).
    """
    if a not in OPERAND_DTYPES or b not in OPERAND_DTYPES:
        return None
    if a == b:
        return a
    wide = {d for d in (a, b) if d in SIXTEEN_BIT_DTYPES}
    if len(wide) == 2:
        return None
    return wide.pop() if wide else torch.bfloat16


def check_args(a, b, row=None, col=None, bias=None, residual=None, a_block=None, b_block=None,
               group_n: int = 0, group_k: int = 0, out_dtype=torch.bfloat16) -> None:
    """Raise ValueError (naming the argument) unless the arguments describe one scaled GEMM."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"scaled_mm: a and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K:
        raise ValueError(f"scaled_mm: K of a ({K}) and b ({b.shape[1]}) differ")
    if compute_dtype(a.dtype, b.dtype) is None:
        raise ValueError(f"scaled_mm: operand dtypes {a.dtype} x {b.dtype} are not supported "
                         f"(each of {[str(d) for d in OPERAND_DTYPES]}, not two different 16-bit types)")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"scaled_mm: out_dtype {out_dtype} is not one of {OUT_DTYPES}")
    for name, t, shape in (("row", row, (M,)), ("col", col, (N,)), ("bias", bias, (N,)), ("residual", residual, (M, N))):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"scaled_mm: {name} has shape {tuple(t.shape)}, expected {shape}")
        if not t.dtype.is_floating_point or t.dtype.itemsize == 1 or t.dtype == torch.float64:
            raise ValueError(f"scaled_mm: {name} dtype {t.dtype} is not fp32 / bf16 / fp16")
    if (a_block is None) != (b_block is None):
        raise ValueError("scaled_mm: a_block and b_block go together")
    if a_block is not None:
        if group_k < 1 or group_n < 1:
            raise ValueError(f"scaled_mm: block scales need group sizes, got group_n={group_n} group_k={group_k}")
        kb, nb = -(-K // group_k), -(-N // group_n)
        # One row of a_block broadcasts over M (an activation without block scales).
        if tuple(a_block.shape) not in ((M, kb), (1, kb)) or tuple(b_block.shape) != (nb, kb):
            raise ValueError(f"scaled_mm: block scales of shapes {tuple(a_block.shape)} and {tuple(b_block.shape)} "
                             f"do not fit groups {group_n}x{group_k}: expected {(M, kb)} and {(nb, kb)}")
        for name, t in (("a_block", a_block), ("b_block", b_block)):
            if t.dtype not in SCALE_DTYPES:
                raise ValueError(f"scaled_mm: {name} dtype {t.dtype} is not fp32 / bf16 / fp16")
    devices = {t.device for t in (a, b, row, col, bias, residual, a_block, b_block) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"scaled_mm: arguments on several devices {sorted(map(str, devices))}")


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class Config:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int
    remat: str = "epilogue"


MIN_GROUP_K_8BIT = 32  # Triton's 8-bit tl.dot takes K >= 32 on NVIDIA GPUs: a K tile fits in one block-scale group


@functools.lru_cache(maxsize=4096)
def select_config(M: int, N: int, K: int, operand_bytes: int, group_k: int = 0) -> Config:
    """A launch config for one problem size (H200 sweep: benchmarks/sweep_scaled_mm.py).

    operand_bytes: bytes per element of the multiplied type (1: fp8 / int8, 2: bf16 / fp16). A K tile
    of 128 bytes per row keeps the loads 128-byte wide in either type. Block-scaled products take a K
    tile no longer than the scale group (each tile must sit inside one group).
    """
    block_k = 128 if operand_bytes == 1 else 64
    if group_k:
        block_k = min(block_k, group_k)
    if M <= 16:
        # No remat hints: at this tile the epilogue's re-read cost 8 registers (fp8 rowwise on Triton 3.6,
        # bf16 + residual on 3.9) and saved none in any case (python -m fusekern.kernels.report).
        cfg = Config(16, 64, block_k * 2 if not group_k else block_k, 1, 4, 5, remat="off")
    elif M <= 64:
        cfg = Config(64, 64, block_k, 1, 4, 4)
    elif M <= 256:
        cfg = Config(64, 128, block_k, 8, 4, 4)
    else:
        cfg = Config(128, 128, block_k, 8, 8, 4)
    return cfg


# ----------------------------------------------------------------------------- the kernel


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, row_ptr, col_ptr, bias_ptr, res_ptr, out_ptr,
              stride_row, stride_col, stride_bias, stride_rm, stride_rn, stride_om, stride_on,
              HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
              I64: tl.constexpr = False):
    """The epilogue pieces in the order the fold defines: row scale, column scale, bias, residual, cast."""
    m_mask = offs_m < M
    n_mask = offs_n < N
    if I64:  # (an output or residual past 2**31 elements)
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    out = acc.to(tl.float32)
    if HAS_ROW:
        out = out * tl.load(row_ptr + offs_m * stride_row, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_COL:
        out = out * tl.load(col_ptr + offs_n * stride_col, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n * stride_bias, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        r_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
        out = out + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scaled_mm_kernel(
    a_ptr, b_ptr, out_ptr, row_ptr, col_ptr, bias_ptr, res_ptr, ablk_ptr, bblk_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_on,
    stride_row, stride_col, stride_bias, stride_rm, stride_rn,
    stride_abm, stride_abk, stride_bbn, stride_bbk,
    GROUP_N, GROUP_K,
    HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    COMPUTE: tl.constexpr,  # 0: multiply in the operands' type; 1 / 2 / 3: widen both to bf16 / fp16 / fp32 first
    INT_DOT: tl.constexpr,  # int8 x int8: exact int32 accumulation
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    REMAT_EPILOGUE: tl.constexpr, REMAT_LOOP: tl.constexpr,
    I64: tl.constexpr = False,  # 64-bit offsets: some operand reaches past 2**31 elements (``needs_i64``)
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M / N read row 0 (always valid) instead of masking every load; the epilogue drops them.
    offs_m_ld = tl.where(offs_m < M, offs_m, 0)
    offs_n_ld = tl.where(offs_n < N, offs_n, 0)
    if I64:
        offs_m_ld = offs_m_ld.to(tl.int64)
        offs_n_ld = offs_n_ld.to(tl.int64)
    a_offs = offs_m_ld[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_offs = offs_n_ld[:, None] * stride_bn + offs_k[None, :] * stride_bk
    a_ptrs = a_ptr + a_offs
    b_ptrs = b_ptr + b_offs
    if BLOCK_SCALED:
        ablk_ptrs = ablk_ptr + offs_m_ld * stride_abm
        bblk_ptrs = bblk_ptr + (offs_n_ld // GROUP_N) * stride_bbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if INT_DOT and not BLOCK_SCALED else tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if REMAT_LOOP:
            k0 = k * BLOCK_K
            if I64:
                k0 = k0.to(tl.int64)
            a_ptrs = a_ptr + k0 * stride_ak + a_offs
            b_ptrs = b_ptr + k0 * stride_bk + b_offs
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            # Zeroed after the load, not through `other=`: the interpreter cannot cast a constant to fp8.
            k_mask = offs_k[None, :] < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_mask)
            b = tl.load(b_ptrs, mask=k_mask)
        if COMPUTE == 1:
            a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
        elif COMPUTE == 2:
            a, b = a.to(tl.float16), b.to(tl.float16)
        elif COMPUTE == 3:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if not EVEN_K:
            a = tl.where(k_mask, a, tl.zeros_like(a))
            b = tl.where(k_mask, b, tl.zeros_like(b))
        if BLOCK_SCALED:
            # A fresh partial per K tile, scaled by its group's scales before it joins the fp32 sum.
            part = tl.dot(a, tl.trans(b), out_dtype=tl.int32 if INT_DOT else tl.float32).to(tl.float32)
            kb = (k * BLOCK_K) // GROUP_K
            sa = tl.load(ablk_ptrs + kb * stride_abk).to(tl.float32)
            sb = tl.load(bblk_ptrs + kb * stride_bbk).to(tl.float32)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32 if INT_DOT else tl.float32)
        if not REMAT_LOOP:
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

    if REMAT_EPILOGUE:  # epilogue offsets from a fresh read of the block index, not held across the loop
        pid_m, pid_n = _tile_coords(block_index(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _epilogue(acc, offs_m, offs_n, M, N, row_ptr, col_ptr, bias_ptr, res_ptr, out_ptr,
              stride_row, stride_col, stride_bias, stride_rm, stride_rn, stride_om, stride_on,
              HAS_ROW, HAS_COL, HAS_BIAS, HAS_RES, I64)


# ----------------------------------------------------------------------------- launcher

_COMPUTE_CODES = {torch.bfloat16: 1, torch.float16: 2}


def _compute_constexprs(a_dtype: torch.dtype, b_dtype: torch.dtype) -> dict:
    cd = compute_dtype(a_dtype, b_dtype)
    if _INTERPRETING and cd in FP8_DTYPES:
        # The interpreter has no fp8 dot; fp8 values and their products are exact in fp32.
        return dict(COMPUTE=3, INT_DOT=False)
    if a_dtype == b_dtype:
        return dict(COMPUTE=0, INT_DOT=a_dtype == torch.int8)
    return dict(COMPUTE=_COMPUTE_CODES[cd], INT_DOT=False)


def _stride(t: torch.Tensor | None, dim: int = 0) -> int:
    return 0 if t is None else t.stride(dim)


def scaled_mm_triton(a, b, row=None, col=None, bias=None, residual=None, a_block=None, b_block=None,
                     group_n: int = 0, group_k: int = 0, out_dtype=torch.bfloat16, *, config: Config | None = None,
                     wrap=None):
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    ``wrap=torch.library.wrap_triton`` records the launch for inductor instead of running it; the caller
    traces this under ``torch.func.functionalize`` (see ``traced_for_inductor``)."""
    check_args(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype)
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty((M, N), device=a.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return scaled_mm_cpu(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype)
    blocked = a_block is not None
    if blocked and a_block.shape[0] != M:
        a_block = a_block.expand(M, -1)  # stride 0: the one row serves every row
    if blocked and (group_k < 16 or group_k & (group_k - 1)):
        raise ValueError(f"scaled_mm: the Triton kernel needs a power-of-two K group >= 16, got {group_k}")
    cd = compute_dtype(a.dtype, b.dtype)
    if blocked and cd.itemsize == 1 and group_k < MIN_GROUP_K_8BIT:
        raise ValueError(f"scaled_mm: 8-bit operands multiply in K tiles of {MIN_GROUP_K_8BIT} or more (the tensor "
                         f"cores' 8-bit dot), which a K group of {group_k} would split")
    cfg = config or select_config(M, N, K, cd.itemsize, group_k if blocked else 0)
    if blocked and cfg.BLOCK_K > group_k:
        raise ValueError(f"scaled_mm: BLOCK_K={cfg.BLOCK_K} exceeds the scale group {group_k}")
    grid = (cdiv(M, cfg.BLOCK_M) * cdiv(N, cfg.BLOCK_N),)
    (wrap(_scaled_mm_kernel) if wrap is not None else _scaled_mm_kernel)[grid](
        a, b, out, row, col, bias, residual, a_block, b_block,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        _stride(row), _stride(col), _stride(bias), _stride(residual, 0), _stride(residual, 1) if residual is not None else 0,
        _stride(a_block, 0), _stride(a_block, 1) if blocked else 0, _stride(b_block, 0), _stride(b_block, 1) if blocked else 0,
        max(group_n, 1), max(group_k, 1),
        HAS_ROW=row is not None, HAS_COL=col is not None, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        BLOCK_SCALED=blocked, EVEN_K=K % cfg.BLOCK_K == 0, I64=needs_i64(a, b, out, residual, a_block, b_block),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_compute_constexprs(a.dtype, b.dtype),
        # Inductor finds what a wrapped kernel writes by reading its TTIR and cannot read the inline asm of
        # the block-index remat hint (it would then assume every input is written and clone the weight).
        **remat_flags(cfg.remat if wrap is None else "off"),
    )
    return out


def traced_for_inductor(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype):
    """For a rewrite with a fixed M on CUDA: the Triton launch as a functional HOP that inductor emits in
    its own wrapper. At decode sizes the op's per-call Python dispatch costs several times the kernel
    (H200, M = 16, N = K = 8192: about 135 us of host time per call against a 20 us kernel)."""
    launch = functools.partial(scaled_mm_triton, group_n=group_n, group_k=group_k, out_dtype=out_dtype,
                               wrap=torch.library.wrap_triton)
    tensors = (a, b, row, col, bias, residual, a_block, b_block)
    present = [i for i, t in enumerate(tensors) if t is not None]

    def run(*given):
        args = [None] * len(tensors)
        for i, t in zip(present, given):
            args[i] = t
        return launch(*args)

    return torch.func.functionalize(run)(*(tensors[i] for i in present))


# ----------------------------------------------------------------------------- reference and CPU path


def _expand_blocks(t: torch.Tensor, rows: int, cols: int, group_r: int, group_c: int) -> torch.Tensor:
    return t.repeat_interleave(group_r, 0)[:rows].repeat_interleave(group_c, 1)[:, :cols]


def _scaled_mm_math(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype, acc_dtype):
    M, K = a.shape
    N = b.shape[0]
    av, bv = a.to(acc_dtype), b.to(acc_dtype)
    if a_block is not None:
        av = av * _expand_blocks(a_block.to(acc_dtype).expand(M, -1), M, K, 1, group_k)
        bv = bv * _expand_blocks(b_block.to(acc_dtype), N, K, group_n, group_k)
    out = av @ bv.t()
    if row is not None:
        out = out * row.to(acc_dtype)[:, None]
    if col is not None:
        out = out * col.to(acc_dtype)[None, :]
    if bias is not None:
        out = out + bias.to(acc_dtype)
    if residual is not None:
        out = out + residual.to(acc_dtype)
    return out.to(out_dtype)


def scaled_mm_reference(a, b, row=None, col=None, bias=None, residual=None, a_block=None, b_block=None,
                        group_n: int = 0, group_k: int = 0, out_dtype=torch.bfloat16):
    """Plain PyTorch in float64 (float32 on devices without float64 matmul): the ground truth.
    ``out_dtype=torch.float64`` keeps the result unrounded."""
    check_args(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k,
               torch.float32 if out_dtype == torch.float64 else out_dtype)
    acc = torch.float64 if a.device.type == "cpu" else torch.float32
    return _scaled_mm_math(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype, acc)


def scaled_mm_cpu(a, b, row=None, col=None, bias=None, residual=None, a_block=None, b_block=None,
                  group_n: int = 0, group_k: int = 0, out_dtype=torch.bfloat16):
    """fp32 math, the kernel's epilogue order (what the op computes on CPU)."""
    check_args(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype)
    return _scaled_mm_math(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype, torch.float32)


# ----------------------------------------------------------------------------- builds for the report

REPORT_SHAPES = ((16, 8192, 8192), (2048, 8192, 8192), (4096, 7168, 7168))


def aot_builds():
    """The configs ``select_config`` picks for the benchmark shapes: fp8 rowwise (row + col + bias),
    bf16 with column scale and residual, fp8 128 x 128 block-scaled."""
    from fusekern.kernels.catalog import TritonBuild

    builds = []
    cases = (("fp8_rowwise", "*fp8e4nv", 1, dict(HAS_ROW=True, HAS_COL=True, HAS_BIAS=True, HAS_RES=False), 0),
             ("bf16_col_res", "*bf16", 2, dict(HAS_ROW=False, HAS_COL=True, HAS_BIAS=False, HAS_RES=True), 0),
             ("fp8_block", "*fp8e4nv", 1, dict(HAS_ROW=False, HAS_COL=False, HAS_BIAS=False, HAS_RES=False), 128))
    for M, N, K in REPORT_SHAPES:
        for label, ptr, nbytes, flags, gk in cases:
            cfg = select_config(M, N, K, nbytes, gk)
            args = dict(a_ptr=ptr, b_ptr=ptr, out_ptr="*bf16", row_ptr="*fp32", col_ptr="*fp32", bias_ptr="*bf16",
                        res_ptr="*bf16", ablk_ptr="*fp32", bblk_ptr="*fp32", M=M, N=N, K=K,
                        stride_am=K, stride_ak=1, stride_bn=K, stride_bk=1, stride_om=N, stride_on=1,
                        stride_row=1, stride_col=1, stride_bias=1, stride_rm=N, stride_rn=1,
                        stride_abm=-(-K // 128), stride_abk=1, stride_bbn=-(-K // 128), stride_bbk=1,
                        GROUP_N=128, GROUP_K=128)
            const = dict(flags, BLOCK_SCALED=bool(gk), COMPUTE=0, INT_DOT=False, EVEN_K=K % cfg.BLOCK_K == 0,
                         BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M)
            name = f"BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} BLOCK_K={cfg.BLOCK_K} w{cfg.num_warps} s{cfg.num_stages}"
            builds.append(TritonBuild(f"scaled_mm_{label}", f"{name} [{M}x{N}x{K}]", _scaled_mm_kernel, args, const,
                                      cfg.num_warps, cfg.num_stages, cfg.remat))
    return builds


# ----------------------------------------------------------------------------- custom op
# The plain dispatcher API (define + per-device impl + fake), as for w8a16_linear: custom_op's Python
# wrappers cost more per call than a decode-sized GEMM runs. Inference-only: no autograd kernel.

torch.library.define(
    "fusekern::scaled_mm",
    "(Tensor a, Tensor b, Tensor? row, Tensor? col, Tensor? bias, Tensor? residual, Tensor? a_block, "
    "Tensor? b_block, int group_n, int group_k, ScalarType out_dtype) -> Tensor",
)


def _scaled_mm_cuda(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype):
    """CuTe DSL kernel where it applies (Hopper, K-major, aligned), else the Triton kernel."""
    from fusekern.kernels import cute_dispatch

    out = cute_dispatch.try_cute_scaled_mm(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype)
    if out is not None:
        return out
    return scaled_mm_triton(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype)


torch.library.impl("fusekern::scaled_mm", "CUDA")(_scaled_mm_cuda)  # (kept callable: tests, direct_calls)
direct_calls.register(torch.ops.fusekern.scaled_mm.default, _scaled_mm_cuda)


@torch.library.impl("fusekern::scaled_mm", "CPU")
def _scaled_mm_cpu_impl(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype):
    return scaled_mm_cpu(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype)


@torch.library.register_fake("fusekern::scaled_mm")
def _scaled_mm_fake(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype):
    check_args(a, b, row, col, bias, residual, a_block, b_block, group_n, group_k, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


scaled_mm = torch.ops.fusekern.scaled_mm
