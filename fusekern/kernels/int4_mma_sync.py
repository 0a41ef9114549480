"""int4 weights packed along K times up to 8 bf16 rows on warp-level tensor cores (mma.sync), all in registers.

``out[M, N] = x[M, K] @ W + bias`` with ``W[k, n] = (q[k, n] - z - c) * s[k // 128, n]``: the layouts that
``int4_mma`` reads (GPTQ's int32 words ``[K/8, N]`` or two codes per byte ``[N, K/2]``; zeros none, constant,
GPTQ nibbles or 8-bit integers; float scales per group of 128 and column).

Why: at a few rows the other kernels are bound by instruction issue, not by memory (docs/results-h200.md, issue
4): the CUDA-core GEMV spends ~5 instructions per weight (decode, a fp32 FMA per value, x and scales per word), and
``int4_mma``'s WGMMA needs x in shared memory and a trip through it for the scales, with barriers every
tile. Here each warp is on its own, with no shared memory and no barrier:
- Swap AB with ``mma.sync.m16n8k16``: a warp's A operand is 16 columns of W (16 x 16 k per instruction), B is
  x^T (16 k x 8 rows: up to 8 rows of x cost the same as one), the fp32 accumulator 16 columns x 8 rows.
- The sum does not care which k-slot a value takes, as long as x takes the same one. Lane (g, c) of a warp
  (g = lane / 4, c = lane % 4) holds A's rows g and g + 8 in k-slots {2c, 2c+1, 2c+8, 2c+9}: it loads the 4
  words (32 k) of its c-th quarter of a 128-k group for columns g and g + 8, and one LOP3 per pair of
  nibbles, ``(w >> 4s) & 0x000F000F | 0x43004300`` = bf16 (128 + q_s, 128 + q_{s+4}), is an A register as
  it stands (8 MMAs per group and lane). Lane (g, c) loads row g of x at the same 32 k and pairs x_s with
  x_{s+4} by PRMT: its B registers.
- 128 + q is exact in bf16 and the MMA sums in fp32, so a group's product is ``sum (128 + q) x``; a second
  MMA with A all ones gives ``sum x`` in the same registers, and per group and column
  ``acc += s * (d - (128 + z + c) * sum x)``: no subtraction per value.
- Each lane loads what it decodes (16-byte loads where the words run along K, past L1), the next group's
  words are loaded before this group's are decoded, and K is split over programs, reduced in the launch by the last
  program of a column tile (split order: deterministic), as ``int4_mma`` does.
Two or three weights that multiply the same x (a decoder's q / k / v, gate / up) can share one launch
(``int4_mma_sync_group``: the members' column tiles in one grid, as ``packed_gemv_group`` does).
The thread index comes from ``%tid.x`` (inline PTX), so the lanes' roles do not depend on how Triton lays
out the 1-D per-thread tensors. Triton's CPU interpreter cannot run inline PTX: there ``ASM`` is False, the
same bits come from plain operations and the warp's MMA is summed out by reshapes.

Read top to bottom: config and checks -> PTX helpers and their plain twins -> kernel -> launcher -> builds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusekern.kernels import replay
from fusekern.kernels.group_member import pick as pick_member
from fusekern.kernels.int4_mma import (
    GROUP, _GROUP, _constexprs, _round_to, _words_i32, _zero_of, check_k_leaves, check_rows_and_bias, layout_fits,
    split_buffers,
)
from fusekern.kernels.intmath import cdiv
from fusekern.kernels.leaf_cache import LeafCache
from fusekern.patterns.decode.layout import PackedLayout

M_MAX = 8  # x's rows are the MMA's 8 columns
WARP_COLUMNS = 16  # the MMA's 16 rows: columns of W per warp and column group
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class Int4MmaSync:
    SPLIT_K: int = 8
    num_warps: int = 4
    GROUPS_PER_WARP: int = 1  # 16-column groups per warp (x's registers and sum x shared between them)
    # groups of words loaded ahead of the one decoded (2: one column group per warp only; not offered by the
    # dispatcher: 0-25% slower than 1 on the H200, benchmarks/results/h200/int4_mma_sync_prefetch_sweep.csv).
    # 0, a probe field: each group's words loaded at the top of its own iteration, so the loop carries no copy
    # of them. With 1, the sm_90a SASS ends every iteration with 8 register copies of the next group's words
    # (the loop-carried values), which wait for those loads: the prefetch is waited for where it is issued,
    # and the copies are 8 of the loop's 157 instructions (one column group per warp). Not timed yet.
    PREFETCH: int = 1
    # the K loop unrolled this many times (Triton's loop_unroll_factor; 1: not at all). A probe field, not offered
    # by the dispatcher: compiled for sm_90a, 2 issues each group's word loads among the previous group's MMAs,
    # where the plain loop issues them next to the copies that wait for them (72 registers against 62: 7
    # programs of 4 warps per SM). Timed on an H100 (benchmarks/proto/probe_int4_sync_unroll.py,
    # benchmarks/results/h100/int4_mma_sync_unroll2_probe_1a995ee.csv): its best config within 2% of the plain
    # loop's best, 20% slower at the dispatcher's split 8 at 8192 x 8192
    UNROLL: int = 1

    @property
    def BLOCK_N(self) -> int:
        return WARP_COLUMNS * self.GROUPS_PER_WARP * self.num_warps


def fits(lay: PackedLayout, M: int, K: int, x_dtype=None) -> bool:
    """Where the dispatcher may offer it: ``int4_mma``'s layouts, bf16 rows up to 8, whole groups."""
    return M <= M_MAX and layout_fits(lay) and K % GROUP == 0 and x_dtype in (None, torch.bfloat16)


# ----------------------------------------------------------------------------- PTX helpers (and plain twins)


@triton.jit
def _thread_index(like, ASM: tl.constexpr):
    """Each element's hardware thread index (the interpreter's element e stands for thread e)."""
    if ASM:
        return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [like], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        return tl.arange(0, like.shape[0])


@triton.jit
def _load4(ptr, VEC: tl.constexpr, STRIDE: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr = False):
    """Four int32 at ptr, ptr + STRIDE, ... (one 16-byte load where VEC: STRIDE 1, 16-byte aligned). WORDS: the
    codes, read once, skip L1 (.L1::no_allocate; the 16-byte loads only, GPTQ's words go through tl.load) so
    that x and the scales, read again, stay there: 2-6% faster with the weights coming from DRAM
    (benchmarks/results/h200/int4_mma_sync_l1_probe.csv)."""
    if ASM and VEC and WORDS:
        return tl.inline_asm_elementwise("ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];",
                                         "=r,=r,=r,=r,l", [ptr], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    elif ASM and VEC:
        return tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return tl.load(ptr), tl.load(ptr + STRIDE), tl.load(ptr + 2 * STRIDE), tl.load(ptr + 3 * STRIDE)


@triton.jit
def _nibble_pairs(w, ASM: tl.constexpr):
    """bf16 pairs (128 + q_s, 128 + q_{s+4}) of a word's nibbles, s = 0..3, as int32 registers."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 $0, $4, 0x000F000F, 0x43004300, 0xEA; "
            "shr.b32 t, $4, 4; lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xEA; "
            "shr.b32 t, $4, 8; lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xEA; "
            "shr.b32 t, $4, 12; lop3.b32 $3, t, 0x000F000F, 0x43004300, 0xEA; }",
            "=r,=r,=r,=r,r", [w], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return ((w & 0x000F000F) | 0x43004300, ((w >> 4) & 0x000F000F) | 0x43004300,
                ((w >> 8) & 0x000F000F) | 0x43004300, ((w >> 12) & 0x000F000F) | 0x43004300)


@triton.jit
def _zip(a, b, ASM: tl.constexpr):
    """(low halves of a and b, high halves of a and b): pairs x_s with x_{s+4} of bf16x2 registers."""
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;",
                                         "=r,=r,r,r", [a, b], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return (a & 0xFFFF) | (b << 16), ((a >> 16) & 0xFFFF) | (b & -65536)


@triton.jit
def _lo(r):
    return (r << 16).to(tl.float32, bitcast=True)


@triton.jit
def _hi(r):
    return (r & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _per_lane(v, W: tl.constexpr):
    return tl.reshape(v, (W, 8, 4))  # warp, g, c


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ASM: tl.constexpr):
    """``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate) on per-thread registers: lane (g, c) gives A rows
    g / g + 8 at k-slots 2c, 2c+1 (a0 / a1) and 2c+8, 2c+9 (a2 / a3), B column g at the same slots (b0, b1),
    and gets D[g, 2c], D[g, 2c+1], D[g+8, 2c], D[g+8, 2c+1]."""
    if ASM:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
            "{$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:  # the warp's sum over its 4 lanes c and their slots, per (row, column)
        W: tl.constexpr = a0.shape[0] // 32
        b0l = _per_lane(_lo(b0), W)[:, None, :, :]
        b0h = _per_lane(_hi(b0), W)[:, None, :, :]
        b1l = _per_lane(_lo(b1), W)[:, None, :, :]
        b1h = _per_lane(_hi(b1), W)[:, None, :, :]
        top = tl.sum(_per_lane(_lo(a0), W)[:, :, None, :] * b0l + _per_lane(_hi(a0), W)[:, :, None, :] * b0h
                     + _per_lane(_lo(a2), W)[:, :, None, :] * b1l + _per_lane(_hi(a2), W)[:, :, None, :] * b1h,
                     axis=3)  # [W, 8 rows g, 8 columns]
        bot = tl.sum(_per_lane(_lo(a1), W)[:, :, None, :] * b0l + _per_lane(_hi(a1), W)[:, :, None, :] * b0h
                     + _per_lane(_lo(a3), W)[:, :, None, :] * b1l + _per_lane(_hi(a3), W)[:, :, None, :] * b1h,
                     axis=3)  # rows g + 8
        t0, t1 = tl.split(tl.reshape(top, (W, 8, 4, 2)))  # column 2c + e goes to lane (g, c)
        u0, u1 = tl.split(tl.reshape(bot, (W, 8, 4, 2)))
        T: tl.constexpr = W * 32
        return (c0 + tl.reshape(t0, (T,)), c1 + tl.reshape(t1, (T,)), c2 + tl.reshape(u0, (T,)),
                c3 + tl.reshape(u1, (T,)))


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _group_product(w0, w1, w2, w3, v0, v1, v2, v3, xs, ASM: tl.constexpr):
    """A 128-k group's ``sum (128 + q) x`` for this lane's rows g (words w) and g + 8 (words v), D layout."""
    z = tl.zeros(w0.shape, tl.float32)
    d0, d1, d2, d3 = z, z, z, z
    for i in tl.static_range(4):
        if i == 0:
            wa, wb = w0, v0
        elif i == 1:
            wa, wb = w1, v1
        elif i == 2:
            wa, wb = w2, v2
        else:
            wa, wb = w3, v3
        a0, a1, a2, a3 = _nibble_pairs(wa, ASM)
        b0, b1, b2, b3 = _nibble_pairs(wb, ASM)
        x04, x15, x26, x37 = xs[4 * i], xs[4 * i + 1], xs[4 * i + 2], xs[4 * i + 3]
        d0, d1, d2, d3 = _mma(a0, b0, a1, b1, x04, x15, d0, d1, d2, d3, ASM)
        d0, d1, d2, d3 = _mma(a2, b2, a3, b3, x26, x37, d0, d1, d2, d3, ASM)
    return d0, d1, d2, d3


@triton.jit
def _x_pairs(xq, ASM: tl.constexpr):
    """x's 16 registers of a lane's 32 k (bf16 pairs in k order) as the B registers of its 8 MMAs."""
    out = ()
    for i in tl.static_range(4):
        p01, p23, p45, p67 = xq[4 * i], xq[4 * i + 1], xq[4 * i + 2], xq[4 * i + 3]
        x04, x15 = _zip(p01, p45, ASM)
        x26, x37 = _zip(p23, p67, ASM)
        out = out + (x04, x15, x26, x37)
    return out


@triton.jit
def _x_rows(xq_ptr, t, ASM: tl.constexpr):
    """Group t's 32 k of this lane's x row (16 bf16 pairs, four 16-byte loads) as the B registers of its 8 MMAs."""
    xa = _load4(xq_ptr + t * 64, True, 1, ASM)
    xb = _load4(xq_ptr + t * 64 + 4, True, 1, ASM)
    xc = _load4(xq_ptr + t * 64 + 8, True, 1, ASM)
    xd = _load4(xq_ptr + t * 64 + 12, True, 1, ASM)
    return _x_pairs(xa + xb + xc + xd, ASM)


@triton.jit
def _sum_x(xs, ASM: tl.constexpr):
    """``sum x`` over the group per x row, in the D layout (an MMA with A all ones)."""
    one = tl.full(xs[0].shape, 0x3F803F80, tl.int32)
    z = tl.zeros(xs[0].shape, tl.float32)
    s0, s1, s2, s3 = z, z, z, z
    for j in tl.static_range(8):
        s0, s1, s2, s3 = _mma(one, one, one, one, xs[2 * j], xs[2 * j + 1], s0, s1, s2, s3, ASM)
    return s0, s1


@triton.jit
def _scale_zero(s_ptr, z_ptr, t, la, lb, ZMODE: tl.constexpr, C: tl.constexpr, SZK: tl.constexpr,
                SZN: tl.constexpr, SSK: tl.constexpr, SSN: tl.constexpr):
    """Group t's scales and 128 + z + c of columns la and lb (fp32), loaded before the group's MMAs."""
    sa = tl.load(s_ptr + t * SSK + la * SSN).to(tl.float32)
    sb = tl.load(s_ptr + t * SSK + lb * SSN).to(tl.float32)
    za = (_zero_of(z_ptr, t, la, ZMODE, SZK, SZN) + (128 + C)).to(tl.float32)
    zb = (_zero_of(z_ptr, t, lb, ZMODE, SZK, SZN) + (128 + C)).to(tl.float32)
    return sa, sb, za, zb


@triton.jit
def _folded(a0, a1, a2, a3, d, sx0, sx1, sz):
    """The accumulators of columns la (a0, a1) and lb (a2, a3) plus ``s * (d - (128 + z + c) * sum x)``
    (d: the group's product in the D layout; sz: ``_scale_zero``'s)."""
    sa, sb, za, zb = sz
    return (a0 + sa * (d[0] - za * sx0), a1 + sa * (d[1] - za * sx1), a2 + sb * (d[2] - zb * sx0),
            a3 + sb * (d[3] - zb * sx1))


@triton.jit(do_not_specialize=["M"])  # one compile serves every M
def int4_mma_sync_kernel(x_ptr, q_ptr, z_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M,
                         N: tl.constexpr, K: tl.constexpr, SQK: tl.constexpr, SQN: tl.constexpr,
                         ZMODE: tl.constexpr, C: tl.constexpr, SZK: tl.constexpr, SZN: tl.constexpr,
                         SSK: tl.constexpr, SSN: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                         GROUPS_PER_WARP: tl.constexpr, VEC: tl.constexpr, ASM: tl.constexpr,
                         THREADS: tl.constexpr, PREFETCH: tl.constexpr = 1, UNROLL: tl.constexpr = 1):
    """16 columns per warp and column group over one K slice (whole groups of 128): ``sync_program``."""
    sync_program(tl.program_id(0), tl.program_id(0), tl.program_id(1), x_ptr, q_ptr, z_ptr, s_ptr, bias_ptr,
                 out_ptr, ws_ptr, cnt_ptr, M, N, K, SQK, SQN, ZMODE, C, SZK, SZN, SSK, SSN, HAS_BIAS, SPLIT_K,
                 GROUPS_PER_WARP, VEC, ASM, THREADS, PREFETCH, UNROLL)


@triton.jit(do_not_specialize=["M", "N", "T1", "T2", "N1", "N2", "DQ1", "DQ2", "DS1", "DS2", "DZ1", "DZ2", "DO1",
                               "DO2", "DW1", "DW2"])  # (offsets between allocations change per weight)
def int4_mma_sync_group_kernel(x_ptr, q_ptr, z_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N,
                               T1, T2, N1, N2, DQ1, DQ2, DS1, DS2, DZ1, DZ2, DO1, DO2, DW1, DW2,
                               K: tl.constexpr, SQK: tl.constexpr, SQN: tl.constexpr,
                               ZMODE: tl.constexpr, C: tl.constexpr, SZK: tl.constexpr, SZN: tl.constexpr,
                               SSK: tl.constexpr, SSN: tl.constexpr, SPLIT_K: tl.constexpr,
                               GROUPS_PER_WARP: tl.constexpr, VEC: tl.constexpr, ASM: tl.constexpr,
                               THREADS: tl.constexpr, PREFETCH: tl.constexpr = 1, UNROLL: tl.constexpr = 1):
    """Two or three weights that multiply the same x, in one launch (as ``packed_gemv_group``): member 0
    owns column tiles [0, T1), member 1 [T1, T2), member 2 [T2, tiles); N, N1, N2 are their widths, D*1 /
    D*2 the element offsets of members 1 and 2's words, zeros, scales, outputs ([M, N_i]) and split-K
    partials from member 0's. The split-K counter is the program's own tile."""
    pid = tl.program_id(0)
    in1 = pid >= T1
    in2 = pid >= T2
    sync_program(pid - pick_member(in1, in2, 0, T1, T2), pid, tl.program_id(1), x_ptr,
                 q_ptr + pick_member(in1, in2, 0, DQ1, DQ2), z_ptr + pick_member(in1, in2, 0, DZ1, DZ2),
                 s_ptr + pick_member(in1, in2, 0, DS1, DS2), out_ptr, out_ptr + pick_member(in1, in2, 0, DO1, DO2),
                 ws_ptr + pick_member(in1, in2, 0, DW1, DW2), cnt_ptr, M, pick_member(in1, in2, N, N1, N2), K, SQK, SQN,
                 ZMODE, C, SZK, SZN, SSK, SSN, False, SPLIT_K, GROUPS_PER_WARP, VEC, ASM, THREADS, PREFETCH, UNROLL)


@triton.jit
def sync_program(pid_n, pid_cnt, pid_k, x_ptr, q_ptr, z_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N,
                 K: tl.constexpr, SQK: tl.constexpr, SQN: tl.constexpr, ZMODE: tl.constexpr, C: tl.constexpr,
                 SZK: tl.constexpr, SZN: tl.constexpr, SSK: tl.constexpr, SSN: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, GROUPS_PER_WARP: tl.constexpr, VEC: tl.constexpr,
                 ASM: tl.constexpr, THREADS: tl.constexpr, PREFETCH: tl.constexpr, UNROLL: tl.constexpr = 1):
    """Column tile pid_n (16 columns per warp and column group) over K slice pid_k (whole groups of 128).
    Strides in elements of each leaf (the codes' in 32-bit words), compile-time constants. VEC: the words
    run along K from 16-byte aligned rows (one 16-byte load per 4 words). pid_cnt: the tile's split-K
    counter. N: a constant (one weight) or a member's width (a group's launch)."""
    BLOCK_N: tl.constexpr = 16 * GROUPS_PER_WARP * (THREADS // 32)
    tid = _thread_index(tl.zeros((THREADS,), tl.int32), ASM)
    warp = tid // 32
    g = (tid % 32) // 4
    c = tid % 4
    TILES: tl.constexpr = K // _GROUP
    PER: tl.constexpr = TILES // SPLIT_K  # SPLIT_K divides TILES (split_k_for)
    t0 = pid_k * PER
    # columns of rows g and g + 8 (column groups j: warp's 16 * GROUPS_PER_WARP columns)
    n0 = pid_n * BLOCK_N + warp * (16 * GROUPS_PER_WARP) + g
    n1 = n0 + 8
    ln0 = tl.minimum(n0, N - 1)  # columns past N read column N - 1 (in bounds) and are not stored
    ln1 = tl.minimum(n1, N - 1)
    if GROUPS_PER_WARP == 2:
        n2 = n0 + 16
        n3 = n0 + 24
        ln2 = tl.minimum(n2, N - 1)
        ln3 = tl.minimum(n3, N - 1)
    # x row g (rows past M read row M - 1: only their own, unstored output columns see them)
    xq_ptr = x_ptr.to(tl.pointer_type(tl.int32)) + tl.minimum(g, M - 1).to(tl.int64) * (K // 2) + c * 16
    # this lane's 4 words of a group: words 4c .. 4c + 3 of the group's 16 per column
    wp0 = q_ptr + ln0.to(tl.int64) * SQN + (c * 4) * SQK
    wp1 = q_ptr + ln1.to(tl.int64) * SQN + (c * 4) * SQK
    GW: tl.constexpr = 16 * SQK  # a group's words
    if PREFETCH > 0:
        nw0, nw1, nw2, nw3 = _load4(wp0 + t0 * GW, VEC, SQK, ASM, True)
        nv0, nv1, nv2, nv3 = _load4(wp1 + t0 * GW, VEC, SQK, ASM, True)
    LAST = t0 + PER - 1
    if PREFETCH == 2:
        mw0, mw1, mw2, mw3 = _load4(wp0 + tl.minimum(t0 + 1, LAST) * GW, VEC, SQK, ASM, True)
        mv0, mv1, mv2, mv3 = _load4(wp1 + tl.minimum(t0 + 1, LAST) * GW, VEC, SQK, ASM, True)
    if GROUPS_PER_WARP == 2:
        wp2 = q_ptr + ln2.to(tl.int64) * SQN + (c * 4) * SQK
        wp3 = q_ptr + ln3.to(tl.int64) * SQN + (c * 4) * SQK
        if PREFETCH > 0:
            nu0, nu1, nu2, nu3 = _load4(wp2 + t0 * GW, VEC, SQK, ASM, True)
            ny0, ny1, ny2, ny3 = _load4(wp3 + t0 * GW, VEC, SQK, ASM, True)
    zero = tl.zeros((THREADS,), tl.float32)
    acc0, acc1, acc2, acc3 = zero, zero, zero, zero
    acc4, acc5, acc6, acc7 = zero, zero, zero, zero
    # (ptxas sinks the next group's word loads and this group's scale loads to the end of the iteration, next
    # to their first use, so the words are waited for in the iteration that issues them: about a third of
    # the warps' stall samples fall on the scale's first use, ncu, int4_mma_sync_stall_lines.csv. Pinning
    # the loads at the top with a fence, words through a cp.async ring in shared memory, and two MMA
    # chains per group, and the loop unrolled whole (loads then issued a group early, but 64 registers
    # spill) were all slower cold on the H200: int4_mma_sync_fence_probe.csv, _ring_probe.csv, _unroll_probe.csv.
    # The loads themselves are not the limit: this grid's word loads without the arithmetic run at a streaming
    # read's speed, and so does the loop without its word loads, sum-x MMAs and scale loads; with any one of
    # the three left in, it takes most of its time (int4_mma_sync_drop_probe.csv). Interleaved K slices,
    # scales staged in shared memory, warps started out of step and the fold done an iteration late did not
    # help: _strided_probe.csv, _stage_probe.csv, _nap_probe.csv, _late_fold_probe.csv. Nor did the three at
    # once (words through a ring, scales and sum x in shared-memory tables filled before the loop):
    # int4_sync_v2_probe.csv; the arithmetic alone takes about as long as the read.)
    for t in tl.range(t0, t0 + PER, loop_unroll_factor=UNROLL if UNROLL > 1 else None):  # (1: range's own SASS)
        tn = tl.minimum(t + PREFETCH, LAST)  # the words PREFETCH groups ahead (the last ones load it again)
        if PREFETCH == 0:  # this group's own words, loaded here: the loop carries no copy of them
            w0, w1, w2, w3 = _load4(wp0 + t * GW, VEC, SQK, ASM, True)
            v0, v1, v2, v3 = _load4(wp1 + t * GW, VEC, SQK, ASM, True)
        elif PREFETCH == 2:
            w0, w1, w2, w3 = nw0, nw1, nw2, nw3
            v0, v1, v2, v3 = nv0, nv1, nv2, nv3
            nw0, nw1, nw2, nw3 = mw0, mw1, mw2, mw3
            nv0, nv1, nv2, nv3 = mv0, mv1, mv2, mv3
            mw0, mw1, mw2, mw3 = _load4(wp0 + tn * GW, VEC, SQK, ASM, True)
            mv0, mv1, mv2, mv3 = _load4(wp1 + tn * GW, VEC, SQK, ASM, True)
        else:
            w0, w1, w2, w3 = nw0, nw1, nw2, nw3
            v0, v1, v2, v3 = nv0, nv1, nv2, nv3
            nw0, nw1, nw2, nw3 = _load4(wp0 + tn * GW, VEC, SQK, ASM, True)
            nv0, nv1, nv2, nv3 = _load4(wp1 + tn * GW, VEC, SQK, ASM, True)
        if GROUPS_PER_WARP == 2 and PREFETCH == 0:
            u0, u1, u2, u3 = _load4(wp2 + t * GW, VEC, SQK, ASM, True)
            y0, y1, y2, y3 = _load4(wp3 + t * GW, VEC, SQK, ASM, True)
        elif GROUPS_PER_WARP == 2:
            u0, u1, u2, u3 = nu0, nu1, nu2, nu3
            y0, y1, y2, y3 = ny0, ny1, ny2, ny3
            nu0, nu1, nu2, nu3 = _load4(wp2 + tn * GW, VEC, SQK, ASM, True)
            ny0, ny1, ny2, ny3 = _load4(wp3 + tn * GW, VEC, SQK, ASM, True)
        xs = _x_rows(xq_ptr, t, ASM)
        sz01 = _scale_zero(s_ptr, z_ptr, t, ln0, ln1, ZMODE, C, SZK, SZN, SSK, SSN)
        sx0, sx1 = _sum_x(xs, ASM)
        acc0, acc1, acc2, acc3 = _folded(acc0, acc1, acc2, acc3,
                                         _group_product(w0, w1, w2, w3, v0, v1, v2, v3, xs, ASM), sx0, sx1, sz01)
        if GROUPS_PER_WARP == 2:
            sz23 = _scale_zero(s_ptr, z_ptr, t, ln2, ln3, ZMODE, C, SZK, SZN, SSK, SSN)
            acc4, acc5, acc6, acc7 = _folded(acc4, acc5, acc6, acc7,
                                             _group_product(u0, u1, u2, u3, y0, y1, y2, y3, xs, ASM), sx0, sx1,
                                             sz23)
    # this lane's outputs: rows m = 2c, 2c + 1 of x, columns n0, n1 (and n2, n3)
    m0 = 2 * c
    if GROUPS_PER_WARP == 2:
        finish(out_ptr, bias_ptr, ws_ptr, cnt_ptr + pid_cnt, pid_k, acc0, acc1, acc2, acc3, m0, n0, n1,
               acc4, acc5, acc6, acc7, m0, n2, n3, M, N, True, HAS_BIAS, SPLIT_K, ASM)
    else:
        finish(out_ptr, bias_ptr, ws_ptr, cnt_ptr + pid_cnt, pid_k, acc0, acc1, acc2, acc3, m0, n0, n1,
               acc0, acc1, acc2, acc3, m0, n0, n1, M, N, False, HAS_BIAS, SPLIT_K, ASM)


@triton.jit
def finish(out_ptr, bias_ptr, ws_ptr, cnt, pid_k, a0, a1, a2, a3, ma, na0, na1, b0, b1, b2, b3, mb, nb0, nb1, M, N,
           TWO: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr):
    """A lane's outputs to out [M, N]: tile a (rows ma, ma + 1 by columns na0, na1) and, with TWO, tile b.
    Split over K: the fp32 partials, then the program that counts itself last at ``cnt`` (its column tile's
    counter) sums them in split order, resets the counter and stores (also ``fp4_mma_sync``'s epilogue)."""
    if SPLIT_K > 1:
        _partials(ws_ptr, a0, a1, a2, a3, pid_k, ma, ma + 1, na0, na1, M, N)
        if TWO:
            _partials(ws_ptr, b0, b1, b2, b3, pid_k, mb, mb + 1, nb0, nb1, M, N)
        tl.debug_barrier()  # every thread's partials are written before the count (release below)
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            a0, a1, a2, a3 = _summed(ws_ptr, ma, ma + 1, na0, na1, M, N, SPLIT_K)
            if TWO:
                b0, b1, b2, b3 = _summed(ws_ptr, mb, mb + 1, nb0, nb1, M, N, SPLIT_K)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            _store(out_ptr, bias_ptr, a0, a1, a2, a3, ma, ma + 1, na0, na1, M, N, HAS_BIAS, ASM)
            if TWO:
                _store(out_ptr, bias_ptr, b0, b1, b2, b3, mb, mb + 1, nb0, nb1, M, N, HAS_BIAS, ASM)
    else:
        _store(out_ptr, bias_ptr, a0, a1, a2, a3, ma, ma + 1, na0, na1, M, N, HAS_BIAS, ASM)
        if TWO:
            _store(out_ptr, bias_ptr, b0, b1, b2, b3, mb, mb + 1, nb0, nb1, M, N, HAS_BIAS, ASM)


@triton.jit
def _partials(ws_ptr, a0, a1, a2, a3, pid_k, m0, m1, n0, n1, M, N):
    """A lane's fp32 partials into ``ws`` [SPLIT_K, M, N] (rows m0, m1 by columns n0, n1)."""
    p0 = ws_ptr + (pid_k * M + m0).to(tl.int64) * N
    p1 = ws_ptr + (pid_k * M + m1).to(tl.int64) * N
    tl.store(p0 + n0, a0, mask=(m0 < M) & (n0 < N))
    tl.store(p1 + n0, a1, mask=(m1 < M) & (n0 < N))
    tl.store(p0 + n1, a2, mask=(m0 < M) & (n1 < N))
    tl.store(p1 + n1, a3, mask=(m1 < M) & (n1 < N))


@triton.jit
def _summed(ws_ptr, m0, m1, n0, n1, M, N, SPLIT_K: tl.constexpr):
    """The partials summed in split order (deterministic); L2 reads (.cg): other SMs wrote them."""
    z = tl.zeros(m0.shape, tl.float32)
    t0, t1, t2, t3 = z, z, z, z
    for sk in range(SPLIT_K):
        p0 = ws_ptr + (sk * M + m0).to(tl.int64) * N
        p1 = ws_ptr + (sk * M + m1).to(tl.int64) * N
        t0 += tl.load(p0 + n0, mask=(m0 < M) & (n0 < N), other=0.0, cache_modifier=".cg")
        t1 += tl.load(p1 + n0, mask=(m1 < M) & (n0 < N), other=0.0, cache_modifier=".cg")
        t2 += tl.load(p0 + n1, mask=(m0 < M) & (n1 < N), other=0.0, cache_modifier=".cg")
        t3 += tl.load(p1 + n1, mask=(m1 < M) & (n1 < N), other=0.0, cache_modifier=".cg")
    return t0, t1, t2, t3


@triton.jit
def _store(out_ptr, bias_ptr, v0, v1, v2, v3, m0, m1, n0, n1, M, N, HAS_BIAS: tl.constexpr, ASM: tl.constexpr):
    """Bias, rounding and the store of rows m0, m1 by columns n0, n1 of out [M, N]."""
    if HAS_BIAS:
        b0 = tl.load(bias_ptr + n0, mask=n0 < N, other=0).to(tl.float32)
        b1 = tl.load(bias_ptr + n1, mask=n1 < N, other=0).to(tl.float32)
        v0 += b0
        v1 += b0
        v2 += b1
        v3 += b1
    o0 = out_ptr + m0.to(tl.int64) * N
    o1 = out_ptr + m1.to(tl.int64) * N
    tl.store(o0 + n0, _round_to(v0, out_ptr, ASM), mask=(m0 < M) & (n0 < N))
    tl.store(o1 + n0, _round_to(v1, out_ptr, ASM), mask=(m1 < M) & (n0 < N))
    tl.store(o0 + n1, _round_to(v2, out_ptr, ASM), mask=(m0 < M) & (n1 < N))
    tl.store(o1 + n1, _round_to(v3, out_ptr, ASM), mask=(m1 < M) & (n1 < N))


# ----------------------------------------------------------------------------- launcher


_LEAVES_OK = LeafCache()  # leaf sets already checked for a layout and shape


def check(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Int4MmaSync, bias=None) -> None:
    """Bad input gets a clear error (the dispatcher then skips this kernel for the shape)."""
    if not layout_fits(lay):
        raise ValueError("int4_mma_sync: the kernel cannot read this layout (int4_mma.layout_fits)")
    check_rows_and_bias("int4_mma_sync", x, M_MAX, K, N, bias)
    if K % GROUP or (K // GROUP) % cfg.SPLIT_K or cfg.GROUPS_PER_WARP not in (1, 2) or cfg.PREFETCH not in (0, 1, 2) \
            or (cfg.PREFETCH == 2 and cfg.GROUPS_PER_WARP == 2) or cfg.UNROLL not in (1, 2, 4):
        raise ValueError(f"int4_mma_sync: K = {K} (a multiple of {GROUP}) and {cfg} do not fit")
    if _LEAVES_OK.get((lay, K, N), leaves) is None:  # the same weight tensors come back every token
        check_k_leaves("int4_mma_sync", leaves, lay, K, N)
        _LEAVES_OK.put((lay, K, N), leaves, True)


def int4_mma_sync(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Int4MmaSync, bias=None,
                  workspace: torch.Tensor | None = None, record=None) -> torch.Tensor:
    """``x [M, K] @ W + bias`` (bias: None or a contiguous [N] vector). workspace: the ``[SPLIT_K, M, N]``
    fp32 buffer of the split-K partials (tests pass one full of NaN; unused without a split). record:
    called with a ``replay.Replay`` of this call (a contiguous, 16-byte aligned x, no workspace given)."""
    check(x, leaves, lay, K, N, cfg, bias)
    x, rec = _rows(x, record is not None and workspace is None)
    M = x.shape[0]
    tiles_n = cdiv(N, cfg.BLOCK_N)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    ws, cnt = split_buffers(out, cfg.SPLIT_K, tiles_n, workspace, "int4_mma_sync")
    q = _words_i32(leaves, lay)
    z = leaves[lay.zero_leaf] if lay.zero in ("packed", "int") else q
    consts = _constexprs(lay, K, N)
    launch = replay.launch(int4_mma_sync_kernel, (tiles_n, cfg.SPLIT_K), (
        x, q, z, leaves[lay.scale], bias if bias is not None else out, out, ws, cnt, M), dict(
        **consts, HAS_BIAS=bias is not None, **_options(cfg, consts["SQK"] == 1 and q.data_ptr() % 16 == 0),
        num_warps=cfg.num_warps), rec)
    if rec and launch.replayable:
        record(replay.split_k_replay(launch, M, N, x.dtype, cfg.SPLIT_K, None if bias is not None else 0))
    return out


def _rows(x: torch.Tensor, record: bool):
    """(x as the kernel reads it: contiguous rows from a 16-byte aligned start, 16 bytes at a time; a copy
    of at most 8 rows where it is not, whether the call may be recorded: only an x read in place)."""
    if x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x, record
    return x.clone(memory_format=torch.contiguous_format), False


def _options(cfg: Int4MmaSync, vec: bool) -> dict:
    """The config's compile-time arguments, shared by the single and the grouped kernel."""
    return dict(SPLIT_K=cfg.SPLIT_K, GROUPS_PER_WARP=cfg.GROUPS_PER_WARP, VEC=vec, ASM=not _INTERPRET,
                THREADS=32 * cfg.num_warps, PREFETCH=cfg.PREFETCH, UNROLL=cfg.UNROLL)


def int4_mma_sync_group(x: torch.Tensor, members, lay: PackedLayout, K: int, Ns: list[int], cfg: Int4MmaSync,
                        workspace: torch.Tensor | None = None, record=None) -> list[torch.Tensor] | None:
    """``[x @ W_i for each member]`` in one launch (members: each one's leaves; Ns: their N), or None where
    they cannot share one: another stride or constant between members (e.g. GPTQ's ``[K/8, N]`` words),
    leaves not a whole number of elements apart, 16-byte loads for some members' words and not others'.
    Each output is the member's own launch's with the same config, bit for bit. workspace: the fp32
    ``[SPLIT_K * M * sum(Ns)]`` partials of a split launch. record: called with a replay of this call."""
    from fusekern.kernels.int4_mma import group_leaves
    from fusekern.kernels.packed_gemv_group import GemvGroupReplay, group_outputs, member_fields

    shared = group_leaves(x, members, lay, K, Ns, cfg, check)
    if shared is None:
        return None
    consts, words, zeros, scales, offsets = shared
    vec = consts["SQK"] == 1 and all(w.data_ptr() % 16 == 0 for w in words)
    if consts["SQK"] == 1 and not vec and any(w.data_ptr() % 16 == 0 for w in words):
        return None  # (16-byte loads for some members only: not each member's own launch)
    x, rec = _rows(x, record is not None and workspace is None)
    M = x.shape[0]
    tiles = [cdiv(n, cfg.BLOCK_N) for n in Ns]
    outs, ws, cnt, out_offsets, ws_offsets = group_outputs(x, Ns, cfg.SPLIT_K, sum(tiles), workspace,
                                                           "int4_mma_sync_group")
    launch = replay.launch(int4_mma_sync_group_kernel, (sum(tiles), cfg.SPLIT_K), (
        x, words[0], zeros[0], scales[0], outs[0], ws, cnt, M, Ns[0],
        *member_fields(tiles, Ns, offsets, out_offsets, ws_offsets)), dict(
        **consts, **_options(cfg, vec), num_warps=cfg.num_warps), rec)
    if rec and launch.replayable:
        record(GemvGroupReplay(launch, M, Ns, x.dtype, cfg.SPLIT_K))
    return outs


# ----------------------------------------------------------------------------- builds for the report


def aot_builds():
    """The configs the dispatcher offers for the demo's gate / up projection (N = 14336, K = 4096) at M = 1,
    for GPTQ and two codes per byte with 8-bit zeros (the demo's W4A16)."""
    from fusekern.kernels import decode_mm as dm
    from fusekern.kernels.catalog import TritonBuild
    from fusekern.kernels.packed_mm import REPORT_LAYOUTS

    builds = []
    for name in ("gptq", "int4_k_stack"):
        lay, (_, st, zt) = REPORT_LAYOUTS[name]
        for N, K in ((14336, 4096),):
            for cfg in dm._packed_candidates(1, N, K, 132, lay):
                if not isinstance(cfg, Int4MmaSync):
                    continue
                args = dict(x_ptr="*bf16", q_ptr="*i32", z_ptr=zt, s_ptr=st, bias_ptr="*bf16", out_ptr="*bf16",
                            ws_ptr="*fp32", cnt_ptr="*i32", M=3)  # M is not specialized (no hint)
                consts = _constexprs(lay, K, N)
                ce = {**consts, "HAS_BIAS": False, **_options(cfg, consts["SQK"] == 1), "ASM": True}
                builds.append(TritonBuild("int4_mma_sync", f"{name} GROUPS_PER_WARP={cfg.GROUPS_PER_WARP} "
                                          f"PREFETCH={cfg.PREFETCH} "
                                          f"SPLIT_K={cfg.SPLIT_K} w{cfg.num_warps} [{N}x{K}]",
                                          int4_mma_sync_kernel, args, ce, cfg.num_warps, 1))
    # the grouped launch for a decoder's q / k / v (4096 + 1024 + 1024 columns), two codes per byte
    lay, (_, st, zt) = REPORT_LAYOUTS["int4_k_stack"]
    K, Ns = 4096, (4096, 1024, 1024)
    for cfg in (Int4MmaSync(SPLIT_K=8),):
        # member fields: not multiples of 16 (no divisibility hint: do_not_specialize), offsets 64-bit
        members = dict(M=3, N=4099, T1=67, T2=83, N1=1027, N2=1027, DQ1=2**40 + 3, DQ2=-2**40 - 3,
                       DS1=2**40 + 3, DS2=-2**40 - 3, DZ1=2**40 + 3, DZ2=-2**40 - 3, DO1=2**40 + 3,
                       DO2=-2**40 - 3, DW1=2**40 + 3, DW2=2**41 + 3)
        args = dict(x_ptr="*bf16", q_ptr="*i32", z_ptr=zt, s_ptr=st, out_ptr="*bf16", ws_ptr="*fp32",
                    cnt_ptr="*i32", **members)
        consts = {k: v for k, v in _constexprs(lay, K, Ns[0]).items() if k != "N"}
        ce = {**consts, **_options(cfg, True), "ASM": True}
        builds.append(TritonBuild("int4_mma_sync_group", f"int4_k_stack GROUPS_PER_WARP={cfg.GROUPS_PER_WARP} "
                                  f"SPLIT_K={cfg.SPLIT_K} w{cfg.num_warps} [1x({'+'.join(map(str, Ns))})x{K}]",
                                  int4_mma_sync_group_kernel, args, ce, cfg.num_warps, 1))
    return builds
