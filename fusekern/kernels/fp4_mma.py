"""MXFP4 weights (E2M1 codes two per byte along K, one E8M0 scale per 32 k and column) times a few bf16 rows
(M <= 64) on Hopper tensor cores, decoded in registers.

``out[M, N] = x[M, K] @ W + bias`` with ``W[k, n] = e2m1(q[n, k]) * 2 ** (e[n, k // 32] - 127)``, the codes
uint8 ``[N, K/2]`` (low nibble first, read as int32 words of 8 consecutive k) and the scales uint8 ``[N, K/32]``:
what ``fusekern.testing.decode_zoo.mxfp4`` (and OCP's MX format) computes.

Why: the CUDA-core GEMV and the ``tl.dot`` tile (``packed_mm``) decode E2M1 through fp16 arithmetic per value;
at M = 16 the tile took 65 us at N = K = 8192 on the H200, 7.7x the bandwidth floor (docs/results-h200.md).
This is ``int4_mma`` (swap AB on WGMMA, each thread loading the words it decodes, K split over programs and
reduced in the launch) with another decode:
- E2M1 -> bf16 by an in-register lookup table (Hopper has no E2M1 convert): ``prmt`` picks one byte of an
  8-byte table per 3-bit magnitude, so two ``prmt`` give the low and the high bytes of four bf16 values
  (0, 0.5, 1, 1.5, 2, 3, 4, 6), two more interleave them into bf16 pairs, and one LOP3 ORs in the sign bits.
- The scale goes in before the MMA: one packed bf16 multiply per two values by ``2 ** (e - 127)`` (a bf16
  power of two, exact), so the product is the weight eager computes (in fp32, then rounded to bf16), and the
  MMA accumulates across MX blocks directly (no fp32 rescale of the accumulator per 32 k).
- The values of a word go to the MMA k-slots its thread feeds (``int4_mma._w_tile``'s order) and x is read
  in the same order (``int4_mma._x_tile``): a word holds 8 consecutive k, all in one MX block.
Triton's CPU interpreter cannot run inline PTX: there ``ASM`` is False and the same values come from fp32
arithmetic (rounded to bf16 as the multiply rounds).
H200, weights read from DRAM (``benchmarks/results/h200/fp4_mma_sweep.csv``): 32.4 us at N = K = 8192 and M = 16
(the ``tl.dot`` tile 64.6, the floor 8.4); at M = 1 the GEMV stays faster (21.0 against 31.4). About 23
instructions per word of 8 values decode it, int4_mma's nibbles take 11: that is what holds it at 3.8x the floor.

Read top to bottom: config and layout check -> decode -> kernel -> launcher -> builds.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusekern.kernels import replay
from fusekern.kernels.int4_mma import (
    _GROUP, GROUP, _bf16_rounded, _load_words_nc, _x_tile, block_m, check_rows_and_bias, slot_tile, split_buffers,
    store_transposed,
)
from fusekern.kernels.intmath import cdiv
from fusekern.kernels.leaf_cache import LeafCache
from fusekern.patterns.decode.layout import PackedLayout

M_MAX = 64  # x's rows are padded to the MMA's N side: 16, 32 or 64 (``int4_mma.block_m``)
MX_BLOCK = 32  # k per E8M0 scale
_MX_BLOCK = tl.constexpr(MX_BLOCK)  # (the kernel's copy)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class Fp4Mma:
    BLOCK_N: int = 128
    SPLIT_K: int = 8
    num_warps: int = 4


@functools.lru_cache(maxsize=256)
def layout_fits(lay: PackedLayout) -> bool:
    """Can the kernel read this layout exactly? MXFP4: E2M1 codes two per byte along K (low nibble first,
    ``[N, K/2]``), E8M0 scales ``[N, K/32]``, no zero point, no global scale. (NVFP4's E4M3 scales per 16 and
    its global scale, and any other layout, keep the other kernels.)"""
    return e2m1_bytes_along_k(lay) and lay.scale_enc == "e8m0" and lay.group_k == MX_BLOCK and lay.glob < 0


def e2m1_bytes_along_k(lay: PackedLayout) -> bool:
    """E2M1 codes two per byte along K (low nibble first, ``[N, K/2]``), scales ``[N, K/group_k]`` per column,
    no zero point: what the FP4 kernels read (each then asks for its scale encodings and block sizes)."""
    return (lay.code_dims == ("n", "k") and lay.bits == 4 and lay.per_word == 2 and lay.pack_axis == "K"
            and tuple(lay.order) == (0, 1) and lay.value == "e2m1" and lay.scale >= 0
            and lay.scale_dims == ("n", "k") and lay.group_n == 1 and lay.zero == "" and float(lay.zero_value) == 0.0)


def fits(lay: PackedLayout, M: int, K: int, x_dtype=None) -> bool:
    """Where the dispatcher may offer it: MXFP4, bf16 rows up to 64, whole 128-k tiles."""
    return M <= M_MAX and layout_fits(lay) and K % GROUP == 0 and x_dtype in (None, torch.bfloat16)


# ----------------------------------------------------------------------------- decode


# The lookup tables: byte c of (lo0, lo1) / (hi0, hi1) is the low / high byte of bf16(c-th E2M1 magnitude)
# 0, 0.5, 1, 1.5 | 2, 3, 4, 6 = 0x0000, 0x3F00, 0x3F80, 0x3FC0 | 0x4000, 0x4040, 0x4080, 0x40C0 (shared with
# ``fp4_mma_sync``, as ``e2m1_pairs_ptx``).
E2M1_TABLE_PTX = "mov.b32 lo0, 0xC0800000; mov.b32 lo1, 0xC0804000; mov.b32 hi0, 0x3F3F3F00; mov.b32 hi1, 0x40404040; "


def e2m1_pairs_ptx(w: str, sc: str, r: tuple[str, str, str, str]) -> str:
    """PTX that decodes the 8 E2M1 codes of word ``w`` into the bf16 pairs (n0, n4), (n1, n5), (n2, n6), (n3, n7)
    (registers ``r``) times the bf16 multiplier ``sc`` (in both halves), through the tables ``E2M1_TABLE_PTX``
    loads. The caller declares the scratch registers sa, sb, pa, qa, pb, qb, t, lo0, lo1, hi0, hi1 (.b32)."""
    r0, r1, r2, r3 = r
    return (
        # selectors: the magnitudes of nibbles (0, 1, 4, 5) and (2, 3, 6, 7), sign bits cleared
        f"prmt.b32 sa, {w}, {w}, 0x0020; and.b32 sa, sa, 0x7777; prmt.b32 sb, {w}, {w}, 0x0031; "
        "and.b32 sb, sb, 0x7777; "
        "prmt.b32 pa, lo0, lo1, sa; prmt.b32 qa, hi0, hi1, sa; prmt.b32 pb, lo0, lo1, sb; prmt.b32 qb, hi0, hi1, sb; "
        # bf16 pairs (n0, n4), (n1, n5), (n2, n6), (n3, n7): low and high bytes interleaved
        f"prmt.b32 {r0}, pa, qa, 0x6240; prmt.b32 {r1}, pa, qa, 0x7351; "
        f"prmt.b32 {r2}, pb, qb, 0x6240; prmt.b32 {r3}, pb, qb, 0x7351; "
        # the sign of nibble i (bit 4 i + 3) to bit 15 / 31 of its pair, then the scale
        f"shl.b32 t, {w}, 12; lop3.b32 {r0}, {r0}, t, 0x80008000, 0xF8; mul.rn.bf16x2 {r0}, {r0}, {sc}; "
        f"shl.b32 t, {w}, 8; lop3.b32 {r1}, {r1}, t, 0x80008000, 0xF8; mul.rn.bf16x2 {r1}, {r1}, {sc}; "
        f"shl.b32 t, {w}, 4; lop3.b32 {r2}, {r2}, t, 0x80008000, 0xF8; mul.rn.bf16x2 {r2}, {r2}, {sc}; "
        f"lop3.b32 {r3}, {r3}, {w}, 0x80008000, 0xF8; mul.rn.bf16x2 {r3}, {r3}, {sc}; ")


_DECODE_ASM = tl.constexpr(
    "{ .reg .b32 sa, sb, pa, qa, pb, qb, r0, r1, r2, r3, t, sc, lo0, lo1, hi0, hi1; .reg .pred z; "
    + E2M1_TABLE_PTX
    # the scale: bf16 2 ** (e - 127) in both halves (e = 0: 2 ** -127, a subnormal)
    + "shl.b32 sc, $9, 7; setp.eq.u32 z, $9, 0; selp.b32 sc, 0x40, sc, z; prmt.b32 sc, sc, sc, 0x1010; "
    + e2m1_pairs_ptx("$8", "sc", ("r0", "r1", "r2", "r3"))
    + "mov.b32 {$0, $1}, r0; mov.b32 {$2, $3}, r1; mov.b32 {$4, $5}, r2; mov.b32 {$6, $7}, r3; }")  # (jit reads it)


@triton.jit
def _e2m1_scaled(w, SHIFT: tl.constexpr, scale):
    """The E2M1 code at bit SHIFT of each word times scale, rounded to bf16, in fp32 (the interpreter's twin)."""
    c = (w >> SHIFT) & 7
    e = c >> 1
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * m))
    v = tl.where(((w >> (SHIFT + 3)) & 1) == 1, -mag, mag)
    return _bf16_rounded(v * scale)


@triton.jit
def _decode8(w, e, ASM: tl.constexpr):
    """The 8 codes of each word times its E8M0 scale e (uint8 as int32), in ``int4_mma._decode8``'s order
    n0, n4, n1, n5, n2, n6, n3, n7: bf16 (fp32 in the interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(_DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, e],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        s = tl.exp2((e - 127).to(tl.float32))
        return (_e2m1_scaled(w, 0, s), _e2m1_scaled(w, 16, s), _e2m1_scaled(w, 4, s), _e2m1_scaled(w, 20, s),
                _e2m1_scaled(w, 8, s), _e2m1_scaled(w, 24, s), _e2m1_scaled(w, 12, s), _e2m1_scaled(w, 28, s))


@triton.jit
def _load_scales_nc(ptrs, ASM: tl.constexpr):
    """E8M0 bytes at ``ptrs`` as int32, each thread loading the scales of the words it decodes."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return tl.load(ptrs).to(tl.int32)


@triton.jit
def _w_tile(words, e, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N, 16] words and their scales -> the [BLOCK_N, 128] MMA tile in ``int4_mma._w_tile``'s slot order."""
    v0, v4, v1, v5, v2, v6, v3, v7 = _decode8(words, e, ASM)
    return slot_tile(v0, v4, v1, v5, v2, v6, v3, v7, BLOCK_N)


# ----------------------------------------------------------------------------- kernel


@triton.jit(do_not_specialize=["M"])  # one compile serves every M of a BLOCK_M
def fp4_mma_kernel(x_ptr, q_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N: tl.constexpr, K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr,
                   BLOCK_M: tl.constexpr = 16):
    """One column tile [BLOCK_N] of out^T over one K slice (whole 128-k tiles): the words [N, K/8] (int32)
    and scales [N, K/32] (uint8) are contiguous, so every offset is a compile-time multiple of N and K."""
    BKW: tl.constexpr = _GROUP // 8  # words per column per tile
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    if N % BLOCK_N == 0:
        ln = offs_n
    else:
        ln = tl.minimum(offs_n, N - 1)  # columns past N read column N - 1 (in bounds) and are not stored
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    TILES: tl.constexpr = K // _GROUP
    PER: tl.constexpr = TILES // SPLIT_K
    kw = tl.arange(0, BKW)[None, :]
    wp = q_ptr + ln[:, None] * (K // 8) + kw  # the tile's words, tile 0
    sp = s_ptr + ln[:, None] * (K // _MX_BLOCK) + kw // 4  # word kw's scale (8 k per word, 32 per scale)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(pid_k * PER, (pid_k + 1) * PER):
        words = _load_words_nc(wp + t * BKW, ASM)
        e = _load_scales_nc(sp + t * (_GROUP // _MX_BLOCK), ASM)
        wt = _w_tile(words, e, BLOCK_N, ASM)
        xt = _x_tile(x_ptr, t * _GROUP, offs_m, mmask, K, BLOCK_M)
        if ASM:
            acc = tl.dot(wt, xt, acc)
        else:  # the interpreter multiplies bf16 dot operands as raw 16-bit integers: fp32 (exact products)
            acc = tl.dot(wt, xt.to(tl.float32), acc, input_precision="ieee")
    store_transposed(acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, pid_n, pid_k, offs_m, offs_n, mmask, nmask, M, N,
                     HAS_BIAS, SPLIT_K, ASM)


# ----------------------------------------------------------------------------- launcher


_LEAVES_OK = LeafCache()  # leaf sets already checked for a layout and shape


def check(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Fp4Mma, bias=None) -> None:
    """Bad input gets a clear error (the dispatcher then skips this kernel for the shape)."""
    if not layout_fits(lay):
        raise ValueError("fp4_mma: the kernel reads MXFP4 only (see layout_fits)")
    check_rows_and_bias("fp4_mma", x, M_MAX, K, N, bias)
    if K % GROUP or (K // GROUP) % cfg.SPLIT_K or cfg.BLOCK_N not in (64, 128, 256):
        raise ValueError(f"fp4_mma: K = {K} (a multiple of {GROUP}) and {cfg} do not fit")
    if _LEAVES_OK.get((lay, K, N), leaves) is None:  # the same weight tensors come back every token
        codes, scales = leaves[lay.code], leaves[lay.scale]
        for t, shape in ((codes, (N, K // 2)), (scales, (N, K // MX_BLOCK))):
            if tuple(t.shape) != shape or not t.is_contiguous() or t.element_size() != 1:
                raise ValueError(f"fp4_mma: a leaf is {t.dtype} {tuple(t.shape)} with strides {t.stride()}, the "
                                 f"kernel reads a contiguous 1-byte {shape}")
        if codes.data_ptr() % 4:
            raise ValueError("fp4_mma: the packed bytes must start 4-byte aligned (they are read as words)")
        _LEAVES_OK.put((lay, K, N), leaves, True)


def fp4_mma(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Fp4Mma, bias=None,
            workspace: torch.Tensor | None = None, record=None) -> torch.Tensor:
    """``x [M, K] @ W + bias`` (bias: None or a contiguous [N] vector). workspace: the ``[SPLIT_K, M, N]``
    fp32 buffer of the split-K partials (tests pass one full of NaN; unused without a split). record:
    called with a ``replay.Replay`` of this call (a contiguous x, no workspace given)."""
    rec = record is not None and workspace is None and x.is_contiguous()
    check(x, leaves, lay, K, N, cfg, bias)
    x = x.contiguous()  # (the kernel reads rows K apart; a copy of at most 64 rows where they are not)
    M = x.shape[0]
    tiles_n = cdiv(N, cfg.BLOCK_N)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    ws, cnt = split_buffers(out, cfg.SPLIT_K, tiles_n, workspace, "fp4_mma")
    q = leaves[lay.code].view(torch.int32)
    s = leaves[lay.scale].view(torch.uint8)
    launch = replay.launch(fp4_mma_kernel, (tiles_n, cfg.SPLIT_K), (
        x, q, s, bias if bias is not None else out, out, ws, cnt, M), dict(
        N=N, K=K, HAS_BIAS=bias is not None, BLOCK_N=cfg.BLOCK_N, SPLIT_K=cfg.SPLIT_K, BLOCK_M=block_m(M),
        ASM=not _INTERPRET, num_warps=cfg.num_warps, num_stages=1), rec)
    if rec and launch.replayable:
        record(replay.split_k_replay(launch, M, N, x.dtype, cfg.SPLIT_K, None if bias is not None else 0))
    return out


# ----------------------------------------------------------------------------- builds for the report


def aot_builds():
    """The configs the dispatcher offers at N = K = 8192 for MXFP4 at M = 1 and 16 (one split per variant:
    the split does not change the code)."""
    from fusekern.kernels import decode_mm as dm
    from fusekern.kernels.catalog import TritonBuild
    from fusekern.kernels.packed_mm import REPORT_LAYOUTS

    lay = REPORT_LAYOUTS["mxfp4"][0]
    N = K = 8192
    builds = []
    for M in (1, 16):
        for cfg in dm._packed_candidates(M, N, K, 132, lay):
            if isinstance(cfg, Fp4Mma):
                args = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*u8", bias_ptr="*bf16", out_ptr="*bf16",
                            ws_ptr="*fp32", cnt_ptr="*i32", M=3)  # M is not specialized (no hint)
                ce = dict(N=N, K=K, HAS_BIAS=False, BLOCK_N=cfg.BLOCK_N, SPLIT_K=cfg.SPLIT_K, ASM=True,
                          BLOCK_M=block_m(M))
                builds.append(TritonBuild("fp4_mma", f"mxfp4 BLOCK_N={cfg.BLOCK_N} SPLIT_K={cfg.SPLIT_K} "
                                          f"w{cfg.num_warps} M={M} [{N}x{K}]", fp4_mma_kernel, args, ce,
                                          cfg.num_warps, 1))
                break
    return builds
