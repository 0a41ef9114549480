"""GPTQ-layout int4 weights times a few bf16 rows (M <= 16) on Hopper tensor cores, decoded in registers.

``out[M, N] = x[M, K] @ W + bias`` with ``W[k, n] = (q[k, n] - z[k // 128, n] - c) * s[k // 128, n]`` read from
GPTQ's leaves as they are: codes int32 ``[K/8, N]`` (k = 8 kw + i in bits [4i, 4i + 4)), zeros int32
``[K/128, N/8]`` (column n in bits [4 (n % 8), ...)), float scales ``[K/128, N]``, c a small integer constant.

Why it is faster than the CUDA-core GEMV (``packed_mm``) at M = 16 and not slower at M = 1:
- Swap AB: ``acc[BLOCK_N, 16] += dot(W^T tile [BLOCK_N, 128], x^T tile [128, 16])``: N fills the MMA's
  64-row side, x's rows are padded to 16 by masking. One K tile is one group of 128, so each tile's product
  is scaled once per column (``acc += d * s``), never per value.
- Two values per instruction: ``lop3(w >> 4i, 0x000F000F, 0x43004300)`` is the bf16 pair
  (128 + q_i, 128 + q_{i+4}) (exact), and one packed bf16 subtraction of 128 + z + c leaves q - z - c,
  a small integer, exact in bf16 (3 SHF + 4 LOP3 + 4 HADD2 per word of 8 values).
- No trip through shared memory for the weights: which MMA k-slot a value takes does not change the sum
  as long as x is read with the same permutation, so the 8 values of a word are placed in the slots that
  the thread holding the word feeds to the MMA (join / reshape / permute below; Triton then emits no layout
  conversion for the A operand), and each thread loads exactly the words it decodes (inline
  ``ld.global.nc``: offsets are immediates from one base because N and K are compile-time constants).
- Split K over SPLIT_K programs per column tile, reduced in the same launch by the last program of the
  tile (split order: deterministic), as the GEMV does.
H200, N = K = 8192 (`benchmarks/results/h200/gptq_mma_variants.csv`): 15.8 us at M = 1 (GEMV 16.9) and
17.8 at M = 16 (swap-AB ``packed_dot`` 52, GEMV 209). The dispatcher times it against the other kernels per
shape (``decode_mm.tuned_config``).

Read top to bottom: config and layout check -> decode helpers -> kernel -> launcher -> builds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusekern.kernels.intmath import cdiv
from fusekern.kernels.split_counters import split_counters
from fusekern.patterns.decode.layout import PackedLayout

GROUP = 128  # the K tile: one scale / zero row per tile
_GROUP = tl.constexpr(GROUP)  # (the kernels' copy: a jit function reads constexpr globals only)
M_MAX = 16   # x's rows are padded to the MMA's 16
_SEQ8 = tuple(range(8))
# inline PTX cannot run in Triton's CPU interpreter: the kernel then uses plain operations (same bits)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class GptqMma:
    BLOCK_N: int = 128
    SPLIT_K: int = 8
    num_warps: int = 4


def layout_fits(lay: PackedLayout) -> bool:
    """Is this GPTQ's layout, with groups of 128 along K and a zero offset c in 0..16 (GPTQ v1 stores zeros
    minus one)? z + c is OR-ed into the mantissa of bf16 128 (7 bits: 0 <= z + c < 128) and the
    subtraction stays exact. (Any other layout keeps the other kernels.)"""
    return (lay.code_dims == ("k", "n") and lay.bits == 4 and lay.per_word == 8 and lay.pack_axis == "K"
            and tuple(lay.order) == _SEQ8 and lay.value == "uint" and lay.glob < 0
            and lay.scale >= 0 and lay.scale_dims == ("k", "n") and lay.scale_enc == "float"
            and lay.group_k == GROUP and lay.group_n == 1
            and lay.zero == "packed" and lay.zero_dims == ("k", "n") and lay.zero_per_word == 8
            and tuple(lay.zero_order) == _SEQ8
            and float(lay.zero_value).is_integer() and 0 <= lay.zero_value <= 16)


def split_k_for(N: int, K: int, cfg_block_n: int, sms: int, per_sm: int) -> int:
    """About ``per_sm`` programs per SM: the largest divisor of the K tiles (no empty or uneven split) at
    most that many, and at most 16."""
    tiles_k = K // GROUP
    want = max(1, min(cdiv(per_sm * sms, cdiv(N, cfg_block_n)), 16, tiles_k))
    return max(d for d in range(1, want + 1) if tiles_k % d == 0)


# ----------------------------------------------------------------------------- decode helpers


@triton.jit
def _load_words(ptrs, ASM: tl.constexpr):
    """int32 code words at ``ptrs``, each thread loading the words it decodes (inline ld.global.nc: the
    layout follows the consumer, so the words need no shared memory; tl.load would pick a coalesced
    layout and convert through shared memory)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return tl.load(ptrs)


@triton.jit
def _nibble(w, SHIFT: tl.constexpr):
    """bf16 128 + ((w >> SHIFT) & 15), built from its bits (the plain twin of one half of the LOP3)."""
    return (((w >> SHIFT) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _decode8(w, ASM: tl.constexpr):
    """The 8 nibbles of each word as bf16 128 + q, in the order q0, q4, q1, q5, q2, q6, q3, q7: one LOP3
    per pair (q_i, q_{i+4}) of ``w >> 4i``."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 a, t; "
            "lop3.b32 a, $8, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$0, $1}, a; "
            "shr.b32 t, $8, 4; lop3.b32 a, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$2, $3}, a; "
            "shr.b32 t, $8, 8; lop3.b32 a, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$4, $5}, a; "
            "shr.b32 t, $8, 12; lop3.b32 a, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$6, $7}, a; }",
            "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        return (_nibble(w, 0), _nibble(w, 16), _nibble(w, 4), _nibble(w, 20), _nibble(w, 8), _nibble(w, 24),
                _nibble(w, 12), _nibble(w, 28))


@triton.jit
def _w_tile(words, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N, 16] words (column n, word kw of the tile) -> the [BLOCK_N, 128] bf16 MMA tile of 128 + q
    in slot order: slot 32 c + 16 p1 + 8 p0 + 2 t + h holds nibble (2 p1 + p0) + 4 h of word 4 c + t.
    For the A operand, thread t (of 4) of a quad holds k-slot pairs (2t, 2t + 1) and (2t + 8, 2t + 9) of
    each k16 block: with this order they are the pairs of its own words, and the reshape lands in the
    operand layout without a conversion."""
    v0, v4, v1, v5, v2, v6, v3, v7 = _decode8(words, ASM)
    b = tl.join(tl.join(tl.join(v0, v4), tl.join(v1, v5)), tl.join(tl.join(v2, v6), tl.join(v3, v7)))
    b = tl.reshape(b, (BLOCK_N, 4, 4, 2, 2, 2))  # n, c, t, h, p0, p1
    b = tl.permute(b, (0, 1, 5, 4, 2, 3))  # n, c, p1, p0, t, h
    return tl.reshape(b, (BLOCK_N, 128))


@triton.jit
def _x_tile(x_ptr, k0, offs_m, mmask, K: tl.constexpr):
    """x[:, k0:k0 + 128] ([16, 128], rows >= M read 0) as the [128, 16] B tile in ``_w_tile``'s slot order
    (real k = 32 c + 8 t + 4 h + 2 p1 + p0). Rows K apart: immediate offsets."""
    xn = tl.load(x_ptr + offs_m[:, None] * K + k0 + tl.arange(0, 128)[None, :], mask=mmask[:, None],
                 other=0.0)
    xr = tl.reshape(xn, (16, 4, 4, 2, 2, 2))  # m, c, t, h, p1, p0
    xr = tl.permute(xr, (1, 4, 5, 2, 3, 0))  # c, p1, p0, t, h, m
    return tl.reshape(xr, (128, 16))


@triton.jit
def _round_to(v, out_ptr, ASM: tl.constexpr):
    """fp32 -> the output dtype, rounded to nearest even (the interpreter's bf16 conversion truncates)."""
    if ASM or out_ptr.dtype.element_ty != tl.bfloat16:
        return v.to(out_ptr.dtype.element_ty)
    else:
        b = v.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)


# ----------------------------------------------------------------------------- kernel


@triton.jit(do_not_specialize=["M"])  # one compile serves every M <= 16
def gptq_mma_kernel(x_ptr, q_ptr, z_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M,
                    N: tl.constexpr, K: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr):
    """One column tile [BLOCK_N] of out^T over one K slice (whole 128-row groups)."""
    BKW: tl.constexpr = _GROUP // 8  # words per column per tile
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    if N % BLOCK_N == 0:
        ln = offs_n
    else:
        ln = tl.minimum(offs_n, N - 1)  # columns past N read column N - 1 (in bounds) and are not stored
    offs_m = tl.arange(0, 16)
    mmask = offs_m < M
    TILES: tl.constexpr = K // _GROUP
    PER: tl.constexpr = TILES // SPLIT_K  # SPLIT_K divides TILES (split_k_for)
    zshift = 4 * (ln % 8)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    wp = q_ptr + ln[:, None] + tl.arange(0, BKW)[None, :] * N  # the tile's words, tile 0
    for t in range(pid_k * PER, (pid_k + 1) * PER):
        words = _load_words(wp + t * (BKW * N), ASM)
        z = (tl.load(z_ptr + t * (N // 8) + ln // 8) >> zshift) & 15
        s = tl.load(s_ptr + t * N + ln).to(tl.float32)
        wt = _w_tile(words, BLOCK_N, ASM)  # 128 + q
        if ASM:  # (128 + q) - (128 + z + c): small integers, exact in bf16 (one HADD2 per 2 values)
            wt = wt - ((z + ZERO_OFFSET) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)[:, None]
            d = tl.dot(wt, _x_tile(x_ptr, t * _GROUP, offs_m, mmask, K))  # fp32 [BLOCK_N, 16]
        else:  # the interpreter adds and multiplies bf16 tensors as raw 16-bit integers: fp32, exact here
            wt = wt.to(tl.float32) - (z.to(tl.float32) + (128.0 + ZERO_OFFSET))[:, None]
            d = tl.dot(wt, _x_tile(x_ptr, t * _GROUP, offs_m, mmask, K).to(tl.float32),
                       input_precision="ieee")
        acc += d * s[:, None]
    # out^T: out[m, n] = acc[n, m]. (Offsets written out at each use: one shared offset tensor was
    # computed before the loop and held through it, 167 registers against 128.)
    omask = mmask[None, :] & nmask[:, None]
    if SPLIT_K > 1:
        tl.store(ws_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=omask)
        tl.debug_barrier()  # every thread's partial is written before the count (release below)
        cnt = cnt_ptr + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tot = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
            for sk in range(SPLIT_K):  # split order: deterministic; L2 reads (.cg): written by other SMs
                tot += tl.load(ws_ptr + (sk * M + offs_m[None, :]) * N + offs_n[:, None], mask=omask, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            if HAS_BIAS:
                tot += tl.load(bias_ptr + offs_n, mask=nmask, other=0).to(tl.float32)[:, None]
            tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], _round_to(tot, out_ptr, ASM), mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], _round_to(acc, out_ptr, ASM), mask=omask)


# ----------------------------------------------------------------------------- launcher


def check(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: GptqMma) -> None:
    """Bad input gets a clear error (the dispatcher then skips this kernel for the shape)."""
    q, z, s = leaves[lay.code], leaves[lay.zero_leaf], leaves[lay.scale]
    if not layout_fits(lay):
        raise ValueError("gptq_mma: the layout is not GPTQ's with groups of 128")
    if x.dim() != 2 or not 1 <= x.shape[0] <= M_MAX or x.shape[1] != K or x.dtype != torch.bfloat16:
        raise ValueError(f"gptq_mma: x must be bf16 [M <= {M_MAX}, {K}], got {x.dtype} {tuple(x.shape)}")
    if K % GROUP or N % 8 or (K // GROUP) % cfg.SPLIT_K:
        raise ValueError(f"gptq_mma: K = {K} (a multiple of {GROUP}), N = {N} (of 8) and {cfg} do not fit")
    want = ((q, (K // 8, N), torch.int32), (z, (K // GROUP, N // 8), torch.int32), (s, (K // GROUP, N), None))
    for t, shape, dtype in want:
        if tuple(t.shape) != shape or not t.is_contiguous() or (dtype is not None and t.dtype != dtype):
            raise ValueError(f"gptq_mma: a leaf is {t.dtype} {tuple(t.shape)} with strides {t.stride()}, "
                             f"the kernel reads contiguous {shape}")
    if s.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gptq_mma: scales must be a float dtype, got {s.dtype}")


def gptq_mma(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: GptqMma, bias=None,
             workspace: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W + bias`` (bias: None or a contiguous [N] vector). workspace: the ``[SPLIT_K, M, N]``
    fp32 buffer of the split-K partials (tests pass one full of NaN)."""
    check(x, leaves, lay, K, N, cfg)
    x = x.contiguous()  # (the kernel reads rows K apart; a copy of at most 16 rows where they are not)
    M = x.shape[0]
    tiles_n = cdiv(N, cfg.BLOCK_N)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if cfg.SPLIT_K > 1:
        ws = workspace if workspace is not None else torch.empty((cfg.SPLIT_K, M, N), device=x.device,
                                                                 dtype=torch.float32)
        if tuple(ws.shape) != (cfg.SPLIT_K, M, N) or ws.dtype != torch.float32 or not ws.is_contiguous():
            raise ValueError(f"gptq_mma: workspace must be a contiguous float32 [{cfg.SPLIT_K}, {M}, {N}]")
        cnt = split_counters(x.device, tiles_n)
    else:
        ws = cnt = out
    gptq_mma_kernel[(tiles_n, cfg.SPLIT_K)](
        x, leaves[lay.code], leaves[lay.zero_leaf], leaves[lay.scale], bias if bias is not None else out, out,
        ws, cnt, M, N=N, K=K, ZERO_OFFSET=int(lay.zero_value), HAS_BIAS=bias is not None,
        BLOCK_N=cfg.BLOCK_N, SPLIT_K=cfg.SPLIT_K, ASM=not _INTERPRET, num_warps=cfg.num_warps, num_stages=1)
    return out


# ----------------------------------------------------------------------------- builds for the report


def aot_builds():
    """The configs the dispatcher offers for GPTQ at N = K = 8192 (``decode_mm._packed_candidates``)."""
    from fusekern.kernels.catalog import TritonBuild
    from fusekern.kernels.packed_mm import REPORT_LAYOUTS

    from fusekern.kernels import decode_mm as dm

    N = K = 8192
    lay = REPORT_LAYOUTS["gptq"][0]
    cfgs = dict.fromkeys(c for M in (1, 16) for c in dm._packed_candidates(M, N, K, 132, lay)
                         if isinstance(c, GptqMma))
    builds = []
    for cfg in cfgs:
        args = dict(x_ptr="*bf16", q_ptr="*i32", z_ptr="*i32", s_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16",
                    ws_ptr="*fp32", cnt_ptr="*i32", M=3)  # M is not specialized (no hint)
        ce = dict(N=N, K=K, ZERO_OFFSET=0, HAS_BIAS=False, BLOCK_N=cfg.BLOCK_N, SPLIT_K=cfg.SPLIT_K, ASM=True)
        builds.append(TritonBuild("gptq_mma", f"BLOCK_N={cfg.BLOCK_N} SPLIT_K={cfg.SPLIT_K} w{cfg.num_warps} "
                                  f"[{N}x{K}]", gptq_mma_kernel, args, ce, cfg.num_warps, 1))
    return builds
