"""int4 weights packed along K times a few bf16 rows (M <= 64) on Hopper tensor cores, decoded in registers.

``out[M, N] = x[M, K] @ W + bias`` with ``W[k, n] = (q[k, n] - z - c) * s[k // 128, n]``, the codes q read as
they are from either packing of 8 consecutive k per 32-bit word (k = 8 w + i in bits [4i, 4i + 4)):
- GPTQ: int32 words ``[K/8, N]``;
- two per byte, low nibble first: uint8 ``[N, K/2]``, each row read as int32 words ``[N, K/8]``;
and the zero point z: none, a constant c (``q - 8``), GPTQ's nibbles packed along N (``[K/128, N/8]``
int32, plus a constant c: GPTQ v1 stores zeros minus one), or one 8-bit integer per group and column;
float scales per group of 128 and column, either way round.

Why it is faster than the CUDA-core GEMV (``packed_mm``) at M = 16 and not slower at M = 1:
- Swap AB: ``acc[BLOCK_N, 16] += dot(W^T tile [BLOCK_N, 128], x^T tile [128, 16])``: N fills the MMA's
  64-row side, x's rows are padded to 16 by masking (to 32 or 64 for more rows: ``block_m``). One K tile is
  one group of 128, so each tile's product is scaled once per column (``acc += d * s``), never per value.
- Two values per instruction: ``lop3(w >> 4i, 0x000F000F, 0x43004300)`` is the bf16 pair
  (128 + q_i, 128 + q_{i+4}) (exact), and one packed bf16 subtraction of 128 + z + c leaves q - z - c,
  a small integer, exact in bf16 (3 SHF + 4 LOP3 + 4 HADD2 per word of 8 values; 8-bit integer zeros
  take a second subtraction: 128 + z need not be exact in bf16, z and q - z are).
- No trip through shared memory for the weights: which MMA k-slot a value takes does not change the sum
  as long as x is read with the same permutation, so the 8 values of a word are placed in the slots that
  the thread holding the word feeds to the MMA (join / reshape / permute below; Triton then emits no layout
  conversion for the A operand), and each thread loads exactly the words it decodes (inline
  ``ld.global.nc``: offsets are immediates from one base because N, K and the strides are compile-time
  constants).
- Split K over SPLIT_K programs per column tile, reduced in the same launch by the last program of the
  tile (split order: deterministic), as the GEMV does.
- Optionally (``tma=True``) the words come through a TMA descriptor, pipelined num_stages deep through
  shared memory, and each group's scale and zero are loaded one tile ahead.
Two or three weights that multiply the same x (a decoder's q / k / v, gate / up) can share one launch
(``int4_mma_group``: the members' column tiles in one grid, as ``packed_gemv_group`` does; TMA words through
one descriptor per member): at 9-64 rows ``int4_mma_sync_group`` no longer applies, and small members (k / v)
leave most of the GPU idle in their own launches.
H200, GPTQ, N = K = 8192 (`benchmarks/results/h200/gptq_mma.csv`): 16.1 us at M = 1 (GEMV 17.1) and 17.4 at
M = 16 (the swap-AB ``packed_dot`` tile 574); with TMA words 15.7 and 16.6, and two codes per byte 18.6 and
19.2 against 22.4 and 24.3 direct (`int4_mma_tma_sweep.csv`). The dispatcher times every kernel per shape
and skips one whose output is off (``decode_mm.tuned_config``).

Read top to bottom: config and layout check -> decode helpers -> kernel -> launcher -> builds.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusekern.kernels import replay
from fusekern.kernels.group_member import pick as pick_member
from fusekern.kernels.intmath import cdiv, next_power_of_2
from fusekern.kernels.leaf_cache import LeafCache
from fusekern.kernels.split_counters import split_counters
from fusekern.kernels.split_k import add_partials
from fusekern.patterns.decode.layout import PackedLayout

GROUP = 128  # the K tile: one scale / zero row per tile
_GROUP = tl.constexpr(GROUP)  # (the kernels' copy: a jit function reads constexpr globals only)
M_MAX = 64   # x's rows are padded to the MMA's N side: 16, 32 or 64 (``block_m``)
_SEQ8 = tuple(range(8))
ZERO_MODES = {"": 0, "const": 0, "packed": 1, "int": 2}  # constant only / GPTQ's nibbles / 8-bit integers
TMA_KN, TMA_NK = 1, 2  # the kernel's TMA modes: words [K/8, N] (GPTQ) or [N, K/8] (two codes per byte); 0: no TMA
_TMA_KN = tl.constexpr(TMA_KN)
# inline PTX cannot run in Triton's CPU interpreter: the kernel then uses plain operations (same bits)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class Int4Mma:
    BLOCK_N: int = 128
    SPLIT_K: int = 8
    num_warps: int = 4
    tma: bool = False  # words through a TMA descriptor, pipelined num_stages deep (where aligned)
    num_stages: int = 1
    # bf16 scales: (q - z) * s rounded to bf16 before the MMA, as eager's dequantization rounds it, and the
    # MMA accumulates (128 registers with TMA, not 167: the scaled product's fp32 copy is gone)
    scale_first: bool = False
    # a register cap per thread (Triton's maxnreg launch option): 128 compiles the TMA variants without a
    # spill (sm_90a) and lets 4 programs share an SM instead of 3 (issue 4's counters in docs/results-h200.md);
    # not offered by the dispatcher: within 0.4-6% of the uncapped and scale_first variants either way on the H200
    # (benchmarks/results/h200/int4_mma_regs_sweep.csv)
    maxnreg: int | None = None


def _int32_words(lay: PackedLayout) -> bool:
    """GPTQ's int32 words (else two codes per byte along K, low nibble first)."""
    return lay.code_dims == ("k", "n")


@functools.lru_cache(maxsize=256)
def layout_fits(lay: PackedLayout) -> bool:
    """Can the kernel read this layout exactly? 4-bit unsigned codes, 8 consecutive k per 32-bit word in
    order, groups of 128 along K, float scales, no global scale; a constant zero offset c in 0..16 (z + c is
    OR-ed into the mantissa of bf16 128: 0 <= z + c < 128 keeps the subtraction exact), none beside 8-bit
    integer zeros. (Any other layout keeps the other kernels.)"""
    dims = (("k", "n"), ("n", "k"))
    codes = ((lay.code_dims == ("k", "n") and lay.per_word == 8 and tuple(lay.order) == _SEQ8)
             or (lay.code_dims == ("n", "k") and lay.per_word == 2 and tuple(lay.order) == (0, 1)))
    c = float(lay.zero_value)
    zero = (lay.zero == "" and c == 0) or (lay.zero == "const" and c.is_integer() and 0 <= c <= 16) or (
        lay.zero == "packed" and lay.zero_dims == ("k", "n") and lay.zero_per_word == 8
        and tuple(lay.zero_order) == _SEQ8 and c.is_integer() and 0 <= c <= 16) or (
        lay.zero == "int" and lay.zero_dims in dims and c == 0)
    return (codes and zero and lay.bits == 4 and lay.pack_axis == "K" and lay.value == "uint" and lay.glob < 0
            and lay.scale >= 0 and lay.scale_dims in dims and lay.scale_enc == "float"
            and lay.group_k == GROUP and lay.group_n == 1)


def block_m(M: int) -> int:
    """x's rows padded to the MMA's N side (a power of two, at least 16): the dispatcher's M bucket
    (``next_power_of_2``), so a config tuned for a bucket runs with the padding it was timed at."""
    return max(16, next_power_of_2(M))


def split_k_for(N: int, K: int, cfg_block_n: int, sms: int, per_sm: int) -> int:
    """About ``per_sm`` programs per SM: the largest divisor of the K tiles (no empty or uneven split) at
    most that many, and at most 16."""
    tiles_k = K // GROUP
    want = max(1, min(cdiv(per_sm * sms, cdiv(N, cfg_block_n)), 16, tiles_k))
    return max(d for d in range(1, want + 1) if tiles_k % d == 0)


# ----------------------------------------------------------------------------- decode helpers


@triton.jit
def _load_words_nc(ptrs, ASM: tl.constexpr):
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
    return slot_tile(v0, v4, v1, v5, v2, v6, v3, v7, BLOCK_N)


@triton.jit
def slot_tile(v0, v4, v1, v5, v2, v6, v3, v7, BLOCK_N: tl.constexpr):
    """Values i of each word ([BLOCK_N, 16] each, in ``_decode8``'s order) -> the [BLOCK_N, 128] tile in
    ``_w_tile``'s slot order, which ``_x_tile`` reads x in (also ``fp4_mma``'s E2M1 tile)."""
    b = tl.join(tl.join(tl.join(v0, v4), tl.join(v1, v5)), tl.join(tl.join(v2, v6), tl.join(v3, v7)))
    b = tl.reshape(b, (BLOCK_N, 4, 4, 2, 2, 2))  # n, c, t, h, p0, p1
    b = tl.permute(b, (0, 1, 5, 4, 2, 3))  # n, c, p1, p0, t, h
    return tl.reshape(b, (BLOCK_N, 128))


@triton.jit
def _x_tile(x_ptr, k0, offs_m, mmask, K: tl.constexpr, BLOCK_M: tl.constexpr):
    """x[:, k0:k0 + 128] ([BLOCK_M, 128], rows >= M read 0) as the [128, BLOCK_M] B tile in ``_w_tile``'s slot
    order (real k = 32 c + 8 t + 4 h + 2 p1 + p0). Rows K apart: immediate offsets."""
    xn = tl.load(x_ptr + offs_m[:, None] * K + k0 + tl.arange(0, 128)[None, :], mask=mmask[:, None],
                 other=0.0)
    xr = tl.reshape(xn, (BLOCK_M, 4, 4, 2, 2, 2))  # m, c, t, h, p1, p0
    xr = tl.permute(xr, (1, 4, 5, 2, 3, 0))  # c, p1, p0, t, h, m
    return tl.reshape(xr, (128, BLOCK_M))


@triton.jit
def _round_to(v, out_ptr, ASM: tl.constexpr):
    """fp32 -> the output dtype, rounded to nearest even (the interpreter's bf16 conversion truncates)."""
    if ASM or out_ptr.dtype.element_ty != tl.bfloat16:
        return v.to(out_ptr.dtype.element_ty)
    else:
        b = v.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_rounded(v):
    """fp32 v rounded to the nearest bf16 (ties to even), kept in fp32 (the interpreter's twin of a bf16
    product: its bf16 conversion truncates, and its dot reads bf16 operands as integers)."""
    b = v.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _zero_of(z_ptr, t, ln, ZMODE: tl.constexpr, SZK: tl.constexpr, SZN: tl.constexpr):
    """Tile t's zero point per column ln (int32; 0 without one)."""
    if ZMODE == 0:
        z = tl.zeros(ln.shape, tl.int32)
    elif ZMODE == 1:  # GPTQ: the nibble of column n in word n // 8
        z = (tl.load(z_ptr + t * SZK + (ln // 8) * SZN) >> (4 * (ln % 8))) & 15
    else:  # one 8-bit integer per group and column
        z = tl.load(z_ptr + t * SZK + ln * SZN).to(tl.int32)
    return z


@triton.jit
def _minus_zero(wt, z, ZMODE: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr):
    """The decoded tile of 128 + q ([BLOCK_N, 128] bf16) minus 128 + z + c (z: its group's zero point per
    column): small integers, exact (bf16; fp32 in the interpreter)."""
    if not ASM:  # the interpreter adds bf16 tensors as raw 16-bit integers: fp32, exact here
        return wt.to(tl.float32) - (z.to(tl.float32) + (128.0 + C))[:, None]
    elif ZMODE == 2:  # 128 + z may not be exact in bf16 (z up to 255): two subtractions
        return (wt - 128.0) - z.to(tl.bfloat16)[:, None]
    else:  # (128 + q) - (128 + z + c), both exact: one HADD2 per 2 values
        return wt - ((z + C) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)[:, None]


@triton.jit(do_not_specialize=["M"])  # one compile serves every M of a BLOCK_M
def int4_mma_kernel(x_ptr, q_ptr, z_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, q_desc, M,
                    N: tl.constexpr, K: tl.constexpr, SQK: tl.constexpr, SQN: tl.constexpr,
                    ZMODE: tl.constexpr, C: tl.constexpr, SZK: tl.constexpr, SZN: tl.constexpr,
                    SSK: tl.constexpr, SSN: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr, TMA: tl.constexpr = 0,
                    SCALE_FIRST: tl.constexpr = False, BLOCK_M: tl.constexpr = 16):
    """One column tile [BLOCK_N] of out^T over one K slice (whole 128-row groups): ``mma_program``."""
    mma_program(tl.program_id(0), tl.program_id(1), x_ptr, q_ptr, z_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                q_desc, M, N, N % BLOCK_N == 0, K, SQK, SQN, ZMODE, C, SZK, SZN, SSK, SSN, HAS_BIAS, BLOCK_N,
                SPLIT_K, ASM, TMA, SCALE_FIRST, BLOCK_M)


@triton.jit(do_not_specialize=["M", "N", "T1", "T2", "N1", "N2", "DQ1", "DQ2", "DS1", "DS2", "DZ1", "DZ2", "DO1",
                               "DO2", "DW1", "DW2"])  # (offsets between allocations change per weight)
def int4_mma_group_kernel(x_ptr, q_ptr, z_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, q_desc, q_desc1, q_desc2, M, N,
                          T1, T2, N1, N2, DQ1, DQ2, DS1, DS2, DZ1, DZ2, DO1, DO2, DW1, DW2,
                          K: tl.constexpr, SQK: tl.constexpr, SQN: tl.constexpr,
                          ZMODE: tl.constexpr, C: tl.constexpr, SZK: tl.constexpr, SZN: tl.constexpr,
                          SSK: tl.constexpr, SSN: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                          ASM: tl.constexpr, EVEN_N: tl.constexpr, TMA: tl.constexpr = 0,
                          SCALE_FIRST: tl.constexpr = False, BLOCK_M: tl.constexpr = 16):
    """Two or three weights that multiply the same x, in one launch (as ``packed_gemv_group``): member 0
    owns column tiles [0, T1), member 1 [T1, T2), member 2 [T2, tiles); N, N1, N2 are their widths, D*1 /
    D*2 the element offsets of members 1 and 2's words, scales, zeros, outputs ([M, N_i]) and split-K
    partials from member 0's. A member's split-K counters follow the previous member's. EVEN_N: every
    member's width is a multiple of BLOCK_N. TMA: each member's words through its own descriptor (q_desc,
    q_desc1, q_desc2), so the program is compiled once per member, each copy with its own pipelined loop."""
    pid = tl.program_id(0)
    in1 = pid >= T1
    in2 = pid >= T2
    first = pick_member(in1, in2, 0, T1, T2)  # the member's first column tile
    pid_n = pid - first
    q = q_ptr + pick_member(in1, in2, 0, DQ1, DQ2)
    z = z_ptr + pick_member(in1, in2, 0, DZ1, DZ2)
    s = s_ptr + pick_member(in1, in2, 0, DS1, DS2)
    out = out_ptr + pick_member(in1, in2, 0, DO1, DO2)
    ws = ws_ptr + pick_member(in1, in2, 0, DW1, DW2)
    n = pick_member(in1, in2, N, N1, N2)
    if TMA == 0:
        mma_program(pid_n, tl.program_id(1), x_ptr, q, z, s, out_ptr, out, ws, cnt_ptr + first, None, M, n,
                    EVEN_N, K, SQK, SQN, ZMODE, C, SZK, SZN, SSK, SSN, False, BLOCK_N, SPLIT_K, ASM, 0, SCALE_FIRST,
                    BLOCK_M)
    elif in2:
        mma_program(pid_n, tl.program_id(1), x_ptr, q, z, s, out_ptr, out, ws, cnt_ptr + first, q_desc2, M, n,
                    EVEN_N, K, SQK, SQN, ZMODE, C, SZK, SZN, SSK, SSN, False, BLOCK_N, SPLIT_K, ASM, TMA,
                    SCALE_FIRST, BLOCK_M)
    elif in1:
        mma_program(pid_n, tl.program_id(1), x_ptr, q, z, s, out_ptr, out, ws, cnt_ptr + first, q_desc1, M, n,
                    EVEN_N, K, SQK, SQN, ZMODE, C, SZK, SZN, SSK, SSN, False, BLOCK_N, SPLIT_K, ASM, TMA,
                    SCALE_FIRST, BLOCK_M)
    else:
        mma_program(pid_n, tl.program_id(1), x_ptr, q, z, s, out_ptr, out, ws, cnt_ptr + first, q_desc, M, n,
                    EVEN_N, K, SQK, SQN, ZMODE, C, SZK, SZN, SSK, SSN, False, BLOCK_N, SPLIT_K, ASM, TMA,
                    SCALE_FIRST, BLOCK_M)


@triton.jit
def mma_program(pid_n, pid_k, x_ptr, q_ptr, z_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, q_desc, M, N,
                EVEN_N: tl.constexpr, K: tl.constexpr, SQK: tl.constexpr, SQN: tl.constexpr, ZMODE: tl.constexpr,
                C: tl.constexpr, SZK: tl.constexpr, SZN: tl.constexpr, SSK: tl.constexpr, SSN: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr,
                TMA: tl.constexpr, SCALE_FIRST: tl.constexpr, BLOCK_M: tl.constexpr):
    """Column tile pid_n [BLOCK_N] of out^T over K slice pid_k (whole 128-row groups). Strides in elements of
    each leaf (the codes' in 32-bit words), compile-time constants: contiguous leaves of a fixed shape. N: a
    constant (one weight) or a member's width (a group's launch); EVEN_N: N is a multiple of BLOCK_N.
    TMA: the words come through ``q_desc`` (TMA_KN: GPTQ's [K/8, N]; TMA_NK: [N, K/8]), which Triton pipelines
    through shared memory num_stages deep; the load from shared memory lands in the layout the decode
    needs. Without it each tile's words are waited for a full memory latency."""
    BKW: tl.constexpr = _GROUP // 8  # words per column per tile
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    if EVEN_N:
        ln = offs_n
    else:
        ln = tl.minimum(offs_n, N - 1)  # columns past N read column N - 1 (in bounds) and are not stored
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    TILES: tl.constexpr = K // _GROUP
    PER: tl.constexpr = TILES // SPLIT_K  # SPLIT_K divides TILES (split_k_for)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    wp = q_ptr + ln[:, None] * SQN + tl.arange(0, BKW)[None, :] * SQK  # the tile's words, tile 0
    if TMA != 0:  # the next tile's scale and zero are loaded one tile ahead (the words are pipelined)
        s_next = tl.load(s_ptr + pid_k * PER * SSK + ln * SSN)
        z_next = _zero_of(z_ptr, pid_k * PER, ln, ZMODE, SZK, SZN)
    for t in range(pid_k * PER, (pid_k + 1) * PER):
        if TMA != 0:
            s = s_next.to(tl.float32)
            z = z_next
            tn = tl.minimum(t + 1, TILES - 1)  # (the last tile loads its own again: in bounds, unused)
            s_next = tl.load(s_ptr + tn * SSK + ln * SSN)
            z_next = _zero_of(z_ptr, tn, ln, ZMODE, SZK, SZN)
            if TMA == _TMA_KN:
                words = tl.trans(q_desc.load([t * BKW, pid_n * BLOCK_N]))
            else:
                words = q_desc.load([pid_n * BLOCK_N, t * BKW])
        else:
            words = _load_words_nc(wp + t * (BKW * SQK), ASM)
            s = tl.load(s_ptr + t * SSK + ln * SSN).to(tl.float32)
            z = _zero_of(z_ptr, t, ln, ZMODE, SZK, SZN)
        wt = _minus_zero(_w_tile(words, BLOCK_N, ASM), z, ZMODE, C, ASM)
        xt = _x_tile(x_ptr, t * _GROUP, offs_m, mmask, K, BLOCK_M)
        if SCALE_FIRST:  # (q - z) * s rounded to bf16 as eager's dequantization does, then accumulated
            if ASM:
                acc = tl.dot(wt * s.to(tl.bfloat16)[:, None], xt, acc)
            else:
                acc = tl.dot(_bf16_rounded(wt * s[:, None]), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            if ASM:
                d = tl.dot(wt, xt)  # fp32 [BLOCK_N, BLOCK_M]
            else:  # the interpreter multiplies bf16 dot operands as raw 16-bit integers: fp32 (exact products)
                d = tl.dot(wt, xt.to(tl.float32), input_precision="ieee")
            acc += d * s[:, None]
    store_transposed(acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, pid_n, pid_k, offs_m, offs_n, mmask, nmask, M, N,
                     HAS_BIAS, SPLIT_K, ASM)


@triton.jit
def store_transposed(acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, pid_n, pid_k, offs_m, offs_n, mmask, nmask, M, N,
                     HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr):
    """out^T: out[m, n] = acc[n, m] of a swap-AB tile (columns offs_n, rows offs_m), plus bias, rounded; split
    over K: the tile's last program sums the partials (``split_k``; also ``fp4_mma``'s epilogue). (Offsets
    written out at each use: one shared offset tensor was computed before the loop and held through it, 167
    registers against 128.)"""
    omask = mmask[None, :] & nmask[:, None]
    if SPLIT_K > 1:
        last, tot = add_partials(acc, ws_ptr, offs_m[None, :] * N + offs_n[:, None], M * N, pid_k, omask,
                                 cnt_ptr + pid_n, SPLIT_K)
        if last:
            if HAS_BIAS:
                tot += tl.load(bias_ptr + offs_n, mask=nmask, other=0).to(tl.float32)[:, None]
            tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], _round_to(tot, out_ptr, ASM), mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], _round_to(acc, out_ptr, ASM), mask=omask)


# ----------------------------------------------------------------------------- launcher


def _strides(dims: tuple, rows_k: int, N: int) -> tuple[int, int]:
    """(k, n) strides of a contiguous leaf with dims ("k", "n") [rows_k, N] or ("n", "k") [N, rows_k]."""
    return (N, 1) if dims == ("k", "n") else (1, rows_k)


def _shape(dims: tuple, rows_k: int, N: int) -> tuple[int, int]:
    return (rows_k, N) if dims == ("k", "n") else (N, rows_k)


def check(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Int4Mma, bias=None) -> None:
    """Bad input gets a clear error (the dispatcher then skips this kernel for the shape)."""
    if not layout_fits(lay):
        raise ValueError("int4_mma: the kernel cannot read this layout (see layout_fits)")
    check_rows_and_bias("int4_mma", x, M_MAX, K, N, bias)
    if K % GROUP or N % 8 or (K // GROUP) % cfg.SPLIT_K:
        raise ValueError(f"int4_mma: K = {K} (a multiple of {GROUP}), N = {N} (of 8) and {cfg} do not fit")
    if _LEAVES_OK.get((lay, K, N), leaves) is None:  # the same weight tensors come back every token
        check_k_leaves("int4_mma", leaves, lay, K, N)
        _LEAVES_OK.put((lay, K, N), leaves, True)


_LEAVES_OK = LeafCache()  # leaf sets already checked for a layout and shape


def check_rows_and_bias(name: str, x: torch.Tensor, m_max: int, K: int, N: int, bias) -> None:
    """x is bf16 [1..m_max, K] and bias None or a contiguous [N] vector on x's device (the int4 tensor-core
    kernels' activation contract); else a clear error naming the kernel."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= m_max or x.shape[1] != K or x.dtype != torch.bfloat16:
        raise ValueError(f"{name}: x must be bf16 [M <= {m_max}, {K}], got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous() or bias.device != x.device):
        raise ValueError(f"{name}: bias must be a contiguous [{N}] vector on {x.device}, got {tuple(bias.shape)}")


def check_k_leaves(name: str, leaves, lay: PackedLayout, K: int, N: int) -> None:
    """The leaves of int4 packed along K (GPTQ words or two codes per byte, 4-byte aligned: read as words)
    as ``check_group_leaves`` wants them; else a clear error naming the kernel."""
    if _int32_words(lay):
        code = (K // 8, N), (torch.int32,)
    else:
        code = (N, K // 2), (torch.uint8,)
        if leaves[lay.code].data_ptr() % 4:
            raise ValueError(f"{name}: the packed bytes must start 4-byte aligned (they are read as words)")
    check_group_leaves(name, leaves, lay, K, N, *code)


def check_group_leaves(name: str, leaves, lay: PackedLayout, K: int, N: int, code_shape, code_dtypes) -> None:
    """The codes (``code_shape``, one of ``code_dtypes``), the float scales per group of 128 and column and
    the zero points (GPTQ-style nibbles ``[K/128, N/8]`` or 8-bit integers) are contiguous, of the shapes and
    dtypes the int4 tensor-core kernels read; else a clear error naming the kernel."""
    groups = K // GROUP
    want = [(leaves[lay.code], code_shape, code_dtypes),
            (leaves[lay.scale], _shape(lay.scale_dims, groups, N), (torch.bfloat16, torch.float16, torch.float32))]
    if lay.zero == "packed":
        want.append((leaves[lay.zero_leaf], (groups, N // 8), (torch.int32,)))
    elif lay.zero == "int":
        want.append((leaves[lay.zero_leaf], _shape(lay.zero_dims, groups, N), (torch.uint8, torch.int8)))
    for t, shape, dtypes in want:
        if tuple(t.shape) != shape or not t.is_contiguous() or t.dtype not in dtypes:
            raise ValueError(f"{name}: a leaf is {t.dtype} {tuple(t.shape)} with strides {t.stride()}, the "
                             f"kernel reads a contiguous {'/'.join(str(d) for d in dtypes)} {shape}")


def int4_mma(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Int4Mma, bias=None,
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
    ws, cnt = split_buffers(out, cfg.SPLIT_K, tiles_n, workspace, "int4_mma")
    q = _words_i32(leaves, lay)
    z = leaves[lay.zero_leaf] if lay.zero in ("packed", "int") else q
    tma, desc = _tma_words(q, lay, cfg) if cfg.tma else (0, None)
    launch = replay.launch(int4_mma_kernel, (tiles_n, cfg.SPLIT_K), (
        x, q, z, leaves[lay.scale], bias if bias is not None else out, out, ws, cnt, desc, M), dict(
        **_constexprs(lay, K, N), HAS_BIAS=bias is not None, BLOCK_N=cfg.BLOCK_N, SPLIT_K=cfg.SPLIT_K, BLOCK_M=block_m(M),
        ASM=not _INTERPRET, TMA=tma, SCALE_FIRST=cfg.scale_first and leaves[lay.scale].dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})),
        rec)
    if rec and launch.replayable:
        record(replay.split_k_replay(launch, M, N, x.dtype, cfg.SPLIT_K, None if bias is not None else 0))
    return out


def group_leaves(x, members, lay: PackedLayout, K: int, Ns: list[int], cfg, check_member):
    """What a grouped launch of int4 weights packed along K shares (``int4_mma_group``, ``int4_mma_sync_group``):
    (member 0's compile-time arguments without N, each member's words, zeros and scales, members 1 and 2's
    element offsets of (words, scales, zeros) from member 0's), or None where the members cannot share one
    program: two to ``MAX_MEMBERS`` members with the same strides and constants (not GPTQ's ``[K/8, N]``
    words: their strides are N) and leaves a whole number of elements apart. Each member is first checked as
    its own launch would be (``check_member(x, leaves, lay, K, N, cfg)``: bad input raises)."""
    from fusekern.kernels.packed_gemv_group import MAX_MEMBERS, _offset

    if not 2 <= len(members) <= MAX_MEMBERS:
        return None
    for leaves, N in zip(members, Ns):
        check_member(x, leaves, lay, K, N, cfg)
    consts = [dict(_constexprs(lay, K, N)) for N in Ns]
    for c in consts:
        c.pop("N")
    if any(c != consts[0] for c in consts):
        return None
    words = [_words_i32(leaves, lay) for leaves in members]
    zeros = [leaves[lay.zero_leaf] if lay.zero in ("packed", "int") else w for leaves, w in zip(members, words)]
    scales = [leaves[lay.scale] for leaves in members]
    offsets = [[_offset(t[i], t[0]) if t[i].dtype == t[0].dtype else None for t in (words, scales, zeros)]
               for i in range(1, len(members))]
    if any(o is None for offs in offsets for o in offs):
        return None
    return consts[0], words, zeros, scales, offsets


def int4_mma_group(x: torch.Tensor, members, lay: PackedLayout, K: int, Ns: list[int], cfg: Int4Mma,
                   workspace: torch.Tensor | None = None, record=None) -> list[torch.Tensor] | None:
    """``[x @ W_i for each member]`` in one launch (members: each one's leaves; Ns: their N), or None where
    they cannot share one: another stride or constant between members (GPTQ's ``[K/8, N]`` words: their
    strides are N), leaves not a whole number of elements apart, TMA words for some members only (16-byte
    aligned words: each takes TMA in its own launch). Each output is the member's own ``int4_mma`` launch's
    with the same config, bit for bit. workspace: the fp32 ``[SPLIT_K * M * sum(Ns)]`` partials of a split
    launch. record: called with a replay of this call (a contiguous x, no workspace given)."""
    from fusekern.kernels.packed_gemv_group import MAX_MEMBERS, GemvGroupReplay, group_outputs, member_fields

    shared = group_leaves(x, members, lay, K, Ns, cfg, check)
    if shared is None:
        return None
    consts, words, zeros, scales, offsets = shared
    descs = [None] * MAX_MEMBERS
    tma = 0
    if cfg.tma:  # every member's words 16-byte aligned, or none through TMA (each as its own launch would)
        made = [_tma_words(w, lay, cfg) for w in words]
        if len({mode for mode, _ in made}) != 1:
            return None
        tma = made[0][0]
        if tma:
            descs = [d for _, d in made] + [made[-1][1]] * (MAX_MEMBERS - len(made))
    rec = record is not None and workspace is None and x.is_contiguous()
    x = x.contiguous()
    M = x.shape[0]
    tiles = [cdiv(n, cfg.BLOCK_N) for n in Ns]
    outs, ws, cnt, out_offsets, ws_offsets = group_outputs(x, Ns, cfg.SPLIT_K, sum(tiles), workspace,
                                                           "int4_mma_group")
    launch = replay.launch(int4_mma_group_kernel, (sum(tiles), cfg.SPLIT_K), (
        x, words[0], zeros[0], scales[0], outs[0], ws, cnt, *descs, M, Ns[0],
        *member_fields(tiles, Ns, offsets, out_offsets, ws_offsets)), dict(
        **consts, BLOCK_N=cfg.BLOCK_N, SPLIT_K=cfg.SPLIT_K, ASM=not _INTERPRET, TMA=tma,
        EVEN_N=all(n % cfg.BLOCK_N == 0 for n in Ns),
        SCALE_FIRST=cfg.scale_first and scales[0].dtype == torch.bfloat16, BLOCK_M=block_m(M),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})),
        rec)
    if rec and launch.replayable:
        record(GemvGroupReplay(launch, M, Ns, x.dtype, cfg.SPLIT_K))
    return outs


def split_buffers(out: torch.Tensor, split_k: int, tiles_n: int, workspace, name: str):
    """(fp32 partials [split_k, M, N], zeroed counters) for a launch split over K that reduces in place, or
    (out, out) without a split (the kernel then does not touch them). workspace: the caller's partials."""
    if split_k == 1:
        return out, out
    M, N = out.shape
    ws = workspace if workspace is not None else torch.empty((split_k, M, N), device=out.device, dtype=torch.float32)
    if tuple(ws.shape) != (split_k, M, N) or ws.dtype != torch.float32 or not ws.is_contiguous():
        raise ValueError(f"{name}: workspace must be a contiguous float32 [{split_k}, {M}, {N}]")
    return ws, split_counters(out.device, tiles_n)


def _words_i32(leaves, lay: PackedLayout) -> torch.Tensor:
    """The codes as int32 words ([K/8, N] GPTQ, or the bytes [N, K/2] read as [N, K/8])."""
    return leaves[lay.code] if _int32_words(lay) else leaves[lay.code].view(torch.int32)


def _tma_words(q: torch.Tensor, lay: PackedLayout, cfg: Int4Mma):
    """(TMA mode, descriptor) for the words ([K/8, N] or [N, K/8] int32, contiguous: checked), or (0, None)
    where the base is not 16-byte aligned (TMA's rule; the kernel then loads the words directly)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if q.data_ptr() % 16:
        return 0, None
    mode, block = _tma_tile(lay, cfg.BLOCK_N)
    return mode, TensorDescriptor(q, list(q.shape), list(q.stride()), block)


def _tma_tile(lay: PackedLayout, block_n: int) -> tuple[int, list[int]]:
    """The TMA mode and the words' box for one tile: [K/8 rows, N] or [N, K/8 columns]."""
    if _int32_words(lay):
        return TMA_KN, [GROUP // 8, block_n]
    return TMA_NK, [block_n, GROUP // 8]


@functools.lru_cache(maxsize=256)  # (per call otherwise: the op runs per token)
def _constexprs(lay: PackedLayout, K: int, N: int) -> dict:
    """The layout's compile-time arguments: shapes, strides, zero mode and constant."""
    groups = K // GROUP
    sqk, sqn = _strides(("k", "n") if _int32_words(lay) else ("n", "k"), K // 8, N)
    szk, szn = (N // 8, 1) if lay.zero == "packed" else _strides(lay.zero_dims, groups, N) if lay.zero == "int" \
        else (0, 0)
    ssk, ssn = _strides(lay.scale_dims, groups, N)
    return dict(N=N, K=K, SQK=sqk, SQN=sqn, ZMODE=ZERO_MODES[lay.zero], C=int(lay.zero_value), SZK=szk, SZN=szn,
                SSK=ssk, SSN=ssn)


# ----------------------------------------------------------------------------- builds for the report


def aot_builds():
    """The configs the dispatcher offers at N = K = 8192 (``decode_mm._packed_candidates``) for GPTQ and
    for two codes per byte with 8-bit zeros (the demo's W4A16), at M = 1 and 16, and x padded to 32 and 64
    rows (one split per variant: the split does not change the code)."""
    from fusekern.kernels import decode_mm as dm
    from fusekern.kernels.catalog import TritonBuild
    from fusekern.kernels.packed_mm import REPORT_LAYOUTS

    N = K = 8192
    builds = []
    for name in ("gptq", "int4_k_stack"):
        lay, (_, st, zt) = REPORT_LAYOUTS[name]
        cfgs = {(c, 16): None for M in (1, 16) for c in dm._packed_candidates(M, N, K, 132, lay)
                if isinstance(c, Int4Mma)}
        wide = {}
        for c in dm._packed_candidates(64, N, K, 132, lay):
            if isinstance(c, Int4Mma):
                wide.setdefault((c.BLOCK_N, c.tma, c.scale_first), c)
        cfgs.update({(c, bm): None for bm in (32, 64) for c in wide.values()})
        for cfg, bm in cfgs:
            tma, block = _tma_tile(lay, cfg.BLOCK_N) if cfg.tma else (0, None)
            args = dict(x_ptr="*bf16", q_ptr="*i32", z_ptr=zt, s_ptr=st, bias_ptr="*bf16", out_ptr="*bf16",
                        ws_ptr="*fp32", cnt_ptr="*i32", M=3,  # M is not specialized (no hint)
                        q_desc=f"tensordesc<i32{block}>" if tma else None)
            ce = dict(_constexprs(lay, K, N), HAS_BIAS=False, BLOCK_N=cfg.BLOCK_N, SPLIT_K=cfg.SPLIT_K, ASM=True,
                      TMA=tma, SCALE_FIRST=cfg.scale_first and st == "*bf16", BLOCK_M=bm)
            rows = f" BLOCK_M={bm}" if bm != 16 else ""
            builds.append(TritonBuild("int4_mma", f"{name}{rows} BLOCK_N={cfg.BLOCK_N} SPLIT_K={cfg.SPLIT_K} "
                                      f"w{cfg.num_warps}{f' tma s{cfg.num_stages}' if tma else ''}"
                                      f"{' scale_first' if cfg.scale_first else ''} [{N}x{K}]",
                                      int4_mma_kernel, args, ce, cfg.num_warps, cfg.num_stages))
    # the grouped launch for a decoder's q / k / v (4096 + 1024 + 1024 columns) at 16 rows, two codes per byte
    lay, (_, st, zt) = REPORT_LAYOUTS["int4_k_stack"]
    K, Ns = 4096, (4096, 1024, 1024)
    for cfg in (Int4Mma(128, 8, 4), Int4Mma(128, 8, 4, scale_first=True), Int4Mma(128, 8, 4, tma=True, num_stages=3)):
        # member fields: not multiples of 16 (no divisibility hint: do_not_specialize), offsets 64-bit
        members = dict(M=3, N=4099, T1=67, T2=83, N1=1027, N2=1027, DQ1=2**40 + 3, DQ2=-2**40 - 3,
                       DS1=2**40 + 3, DS2=-2**40 - 3, DZ1=2**40 + 3, DZ2=-2**40 - 3, DO1=2**40 + 3,
                       DO2=-2**40 - 3, DW1=2**40 + 3, DW2=2**41 + 3)
        tma, block = _tma_tile(lay, cfg.BLOCK_N) if cfg.tma else (0, None)
        desc = f"tensordesc<i32{block}>" if tma else None
        args = dict(x_ptr="*bf16", q_ptr="*i32", z_ptr=zt, s_ptr=st, out_ptr="*bf16", ws_ptr="*fp32",
                    cnt_ptr="*i32", q_desc=desc, q_desc1=desc, q_desc2=desc, **members)
        consts = {k: v for k, v in _constexprs(lay, K, Ns[0]).items() if k != "N"}
        ce = dict(consts, BLOCK_N=cfg.BLOCK_N, SPLIT_K=cfg.SPLIT_K, ASM=True, EVEN_N=True, TMA=tma,
                  SCALE_FIRST=cfg.scale_first and st == "*bf16", BLOCK_M=16)
        builds.append(TritonBuild("int4_mma_group", f"int4_k_stack BLOCK_N={cfg.BLOCK_N} SPLIT_K={cfg.SPLIT_K} "
                                  f"w{cfg.num_warps}{f' tma s{cfg.num_stages}' if tma else ''}"
                                  f"{' scale_first' if cfg.scale_first else ''} [16x({'+'.join(map(str, Ns))})x{K}]",
                                  int4_mma_group_kernel, args, ce, cfg.num_warps, cfg.num_stages))
    return builds
