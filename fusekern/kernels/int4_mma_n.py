"""int4 weights packed along N (AWQ) times a few bf16 rows (M <= 16) on Hopper tensor cores, decoded in registers.

``out[M, N] = x[M, K] @ W + bias`` with ``W[k, n] = (q[k, n] - z - c) * s[k // 128, n]``, the codes read as
they are: int32 words ``[K, N/8]``, word (k, j) holding columns 8 j .. 8 j + 7 at row k, column 8 j + i in
bits [4 order[i], 4 order[i] + 4) (AWQ's order is 0, 4, 1, 5, 2, 6, 3, 7). The zero point z: none, a constant
c, nibbles packed the same way (``[K/128, N/8]`` int32, any order, plus a constant c), or one 8-bit integer
per group and column; float scales per group of 128 and column.

It is ``int4_mma`` (read that docstring first: swap AB, LOP3 decode into bf16 128 + q, no shared memory for
the weights, split K reduced in the launch) with the packing on the MMA's row side instead of its K side:
- The A operand ``W^T [BLOCK_N = 256, 64]`` of a 4-warp wgmma puts row ``l4 + 8 h + 16 w + 64 r`` (lane
  quad l4 of warp w; register bits h and r) in each thread. Thread (w, l4) decodes the words of column
  word ``8 w + l4`` and places a word's 8 values on its 8 rows (h, r): the tile's rows are a fixed
  permutation of its 256 columns, which the scales, zeros, bias and the store follow (``_columns``).
  Which output row holds which column does not change any sum, so nothing moves between threads.
- A bf16x2 A-operand register holds one row at two adjacent k, that is one nibble of two words: ``PRMT``
  pairs the halves of the words of k and k + 1, then one LOP3 per nibble gives the register
  (2 PRMT + 6 SHF + 8 LOP3 per 16 values, one more PRMT per 8 values than int4_mma's K packing).
- K tiles of 64 (two per group of 128): a thread then decodes 16 words per tile, as int4_mma does per
  128-deep tile of 128 columns. The words come straight from global memory (optionally the next tile's
  ahead) or through a TMA descriptor that Triton pipelines; K is split over programs sized for one wave.
x's rows are padded to 16 (masked loads). The dispatcher times it against the GEMV per shape
(``decode_mm._packed_candidates``). H200, AWQ, N = K = 8192: 19.4-19.8 us at M = 1 (the GEMV 57.3) and, in
the first version's run (K split in 8, scale first), 26.2 at M = 16 (decode + cuBLAS 112.1):
docs/results-h200.md, "AWQ on tensor cores".

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
from fusekern.kernels.int4_mma import (_bf16_rounded, _load_words_nc, _minus_zero, _nibble, _round_to,
                                       check_group_leaves, check_rows_and_bias, split_buffers)
from fusekern.kernels.intmath import cdiv
from fusekern.kernels.leaf_cache import LeafCache
from fusekern.kernels.split_k import add_partials
from fusekern.patterns.decode.layout import PackedLayout

GROUP = 128       # scale / zero groups along K
BLOCK_K = 64      # the K tile: two per group
_BLOCK_K = tl.constexpr(BLOCK_K)
BLOCK_N = 256     # the column tile: 32 words per k, 8 values per thread and word (see the module doc)
M_MAX = 16        # x's rows are padded to the MMA's N side of 16
ZERO_MODES = {"": 0, "const": 0, "packed": 1, "int": 2}  # constant only / nibbles packed along N / 8-bit integers
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # no inline PTX in the interpreter: plain ops


@dataclass(frozen=True)
class Int4MmaN:
    SPLIT_K: int = 8  # K slices per column tile: up to the number of 64-deep K tiles, uneven by one at most
    num_warps: int = 4  # one warpgroup (the row mapping assumes it)
    prefetch: bool = True  # the next K tile's words are loaded before this tile is decoded (direct loads)
    # bf16 scales: (q - z) * s rounded to bf16 before the MMA, as eager's dequantization rounds it
    scale_first: bool = False
    tma: bool = False  # words through a TMA descriptor, pipelined num_stages deep (where aligned)
    num_stages: int = 1
    maxnreg: int | None = None  # a register cap per thread (Triton's launch option)
    BLOCK_N: int = BLOCK_N  # (fixed: for the tuner's cache keys and reports, which read BLOCK_N)


def _encode(order) -> int:
    """A permutation of 0..7 as one integer, 4 bits per entry (a compile-time constant)."""
    return sum(int(v) << (4 * i) for i, v in enumerate(order))


def _inverse(order) -> tuple:
    inv = [0] * len(order)
    for i, v in enumerate(order):
        inv[v] = i
    return tuple(inv)


@functools.lru_cache(maxsize=256)
def layout_fits(lay: PackedLayout) -> bool:
    """Can the kernel read this layout exactly? 4-bit unsigned codes, 8 per int32 word along N in any order,
    groups of 128 along K, float scales, no global scale; zeros: a constant c in 0..16, nibbles packed 8 per
    word along N (plus such a c), or 8-bit integers. (Any other layout keeps the other kernels.)"""
    dims = (("k", "n"), ("n", "k"))
    perm = tuple(range(8))
    codes = (lay.code_dims == ("k", "n") and lay.per_word == 8 and tuple(sorted(lay.order)) == perm)
    c = float(lay.zero_value)
    zero = (lay.zero == "" and c == 0) or (lay.zero == "const" and c.is_integer() and 0 <= c <= 16) or (
        lay.zero == "packed" and lay.zero_dims == ("k", "n") and lay.zero_per_word == 8
        and tuple(sorted(lay.zero_order)) == perm and c.is_integer() and 0 <= c <= 16) or (
        lay.zero == "int" and lay.zero_dims in dims and c == 0)
    return (codes and zero and lay.bits == 4 and lay.pack_axis == "N" and lay.value == "uint" and lay.glob < 0
            and lay.scale >= 0 and lay.scale_dims in dims and lay.scale_enc == "float"
            and lay.group_k == GROUP and lay.group_n == 1)


def split_k_for(N: int, K: int, sms: int, per_sm: int) -> int:
    """The most K slices that keep every program in one wave of ``per_sm`` programs per SM (at least 1, at
    most 32 and the number of K tiles; slices may differ by one tile)."""
    return max(1, min((per_sm * sms) // cdiv(N, BLOCK_N), 32, K // BLOCK_K))


# ----------------------------------------------------------------------------- decode helpers


@triton.jit
def _decode_pairs(a, b, ASM: tl.constexpr):
    """Words a (row k) and b (row k + 1) -> per nibble i the pair (128 + q_i(a), 128 + q_i(b)) as bf16,
    in the order i = 0, 1, ..., 7 (a's value first): the halves of one A-operand register each."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi, t, r; "
            "prmt.b32 lo, $16, $17, 0x5410; prmt.b32 hi, $16, $17, 0x7632; "
            "lop3.b32 r, lo, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$0, $1}, r; "
            "shr.b32 t, lo, 4; lop3.b32 r, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$2, $3}, r; "
            "shr.b32 t, lo, 8; lop3.b32 r, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$4, $5}, r; "
            "shr.b32 t, lo, 12; lop3.b32 r, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$6, $7}, r; "
            "lop3.b32 r, hi, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$8, $9}, r; "
            "shr.b32 t, hi, 4; lop3.b32 r, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$10, $11}, r; "
            "shr.b32 t, hi, 8; lop3.b32 r, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$12, $13}, r; "
            "shr.b32 t, hi, 12; lop3.b32 r, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$14, $15}, r; }",
            "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r", [a, b], dtype=(tl.bfloat16,) * 16,
            is_pure=True, pack=1)
    else:
        return (_nibble(a, 0), _nibble(b, 0), _nibble(a, 4), _nibble(b, 4), _nibble(a, 8), _nibble(b, 8),
                _nibble(a, 12), _nibble(b, 12), _nibble(a, 16), _nibble(b, 16), _nibble(a, 20), _nibble(b, 20),
                _nibble(a, 24), _nibble(b, 24), _nibble(a, 28), _nibble(b, 28))


@triton.jit
def _w_tile_n(words, ASM: tl.constexpr):
    """[32, 64] words (column word j = 8 w + l4 of the tile, row k) -> the [256, 64] bf16 A tile of 128 + q:
    row l4 + 8 n2 + 16 w + 64 n0 + 128 n1 holds nibble n0 + 2 n1 + 4 n2 of word j (``_columns``)."""
    ab = tl.reshape(words, (32, _BLOCK_K // 2, 2))  # j, kk, e (k = 2 kk + e)
    a, b = tl.split(ab)
    a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7 = _decode_pairs(a, b, ASM)
    t = tl.join(tl.join(tl.join(tl.join(a0, b0), tl.join(a1, b1)), tl.join(tl.join(a2, b2), tl.join(a3, b3))),
                tl.join(tl.join(tl.join(a4, b4), tl.join(a5, b5)), tl.join(tl.join(a6, b6), tl.join(a7, b7))))
    t = tl.reshape(t, (4, 8, _BLOCK_K // 2, 2, 2, 2, 2))  # w, l4, kk, e, n0, n1, n2
    t = tl.permute(t, (5, 4, 0, 6, 1, 2, 3))  # n1, n0, w, n2, l4, kk, e
    return tl.reshape(t, (256, _BLOCK_K))


@triton.jit
def _columns(n0, INV: tl.constexpr):
    """The real column of each row of ``_w_tile_n``'s tile starting at column n0 (INV: the word's column
    of each nibble, 4 bits each)."""
    r = tl.arange(0, 256)
    j = (r // 16 % 4) * 8 + r % 8
    nib = (r // 64 % 2) + 2 * (r // 128) + 4 * (r // 8 % 2)
    return n0 + 8 * j + ((INV >> (4 * nib)) & 7)


@triton.jit
def _zero_n(z_ptr, g, ln, ZMODE: tl.constexpr, SZK: tl.constexpr, SZN: tl.constexpr, ZORD: tl.constexpr):
    """Group g's zero point per column ln (int32; 0 without one)."""
    if ZMODE == 0:
        z = tl.zeros(ln.shape, tl.int32)
    elif ZMODE == 1:  # the nibble at position order[n % 8] of word n // 8
        z = (tl.load(z_ptr + g * SZK + (ln // 8) * SZN) >> (4 * ((ZORD >> (4 * (ln % 8))) & 7))) & 15
    else:  # one 8-bit integer per group and column
        z = tl.load(z_ptr + g * SZK + ln * SZN).to(tl.int32)
    return z


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _x_tile(x_ptr, t, offs_m, mmask, K: tl.constexpr):
    """x[:, 64 t : 64 t + 64] as the [64, 16] B tile (rows past M read 0)."""
    return tl.load(x_ptr + offs_m[None, :] * K + t * _BLOCK_K + tl.arange(0, _BLOCK_K)[:, None],
                   mask=mmask[None, :], other=0.0)


@triton.jit
def _mma(wt, xt, acc, ASM: tl.constexpr):
    """acc + wt @ xt in fp32 (the interpreter multiplies bf16 dot operands as raw 16-bit integers: fp32,
    exact products, there)."""
    if ASM:
        return tl.dot(wt, xt, acc)
    else:
        return tl.dot(wt, xt.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _dot(wt, xt, ASM: tl.constexpr):
    """wt @ xt in fp32 (``_mma`` without an accumulator)."""
    if ASM:
        return tl.dot(wt, xt)
    else:
        return tl.dot(wt, xt.to(tl.float32), input_precision="ieee")


@triton.jit
def _scaled(wt, s, ASM: tl.constexpr):
    """(q - z) * s rounded to bf16, as eager's dequantization rounds it (fp32 in the interpreter)."""
    if ASM:
        return wt * s.to(tl.bfloat16)[:, None]
    else:
        return _bf16_rounded(wt * s[:, None])


@triton.jit
def _by_tiles(acc, x_ptr, wp, q_desc, z_ptr, s_ptr, lc, offs_m, mmask, pid_n, t0, t1,
              K: tl.constexpr, NW: tl.constexpr, ZMODE: tl.constexpr, C: tl.constexpr,
              SZK: tl.constexpr, SZN: tl.constexpr, ZORD: tl.constexpr, SSK: tl.constexpr, SSN: tl.constexpr,
              ASM: tl.constexpr, PREFETCH: tl.constexpr, SCALE_FIRST: tl.constexpr, TMA: tl.constexpr):
    """K tiles t0 .. t1 - 1, one per iteration (each loads its group's scale and zero: loading them once per
    group of two tiles, with a group per iteration, ran no faster on the H200: 19.7 against 19.8 us at
    N = K = 8192, M = 1, int4_mma_n_dispatch_2f93f19.csv; with TMA words 22.9 against 19.4)."""
    TILES: tl.constexpr = K // _BLOCK_K
    if TMA:  # the next tile's scale and zero are loaded a tile ahead (the words are pipelined)
        s_next = tl.load(s_ptr + (t0 // 2) * SSK + lc * SSN)
        z_next = _zero_n(z_ptr, t0 // 2, lc, ZMODE, SZK, SZN, ZORD)
    elif PREFETCH:
        words_next = _load_words_nc(wp + t0 * (_BLOCK_K * NW), ASM)
    for t in range(t0, t1):
        if TMA:
            words = tl.trans(q_desc.load([t * _BLOCK_K, pid_n * 32]))
            s = s_next.to(tl.float32)
            z = z_next
            gn = tl.minimum(t + 1, TILES - 1) // 2  # (the last tile loads its own again: in bounds, unused)
            s_next = tl.load(s_ptr + gn * SSK + lc * SSN)
            z_next = _zero_n(z_ptr, gn, lc, ZMODE, SZK, SZN, ZORD)
        else:
            if PREFETCH:
                words = words_next
                words_next = _load_words_nc(wp + tl.minimum(t + 1, TILES - 1) * (_BLOCK_K * NW), ASM)
            else:
                words = _load_words_nc(wp + t * (_BLOCK_K * NW), ASM)
            s = tl.load(s_ptr + (t // 2) * SSK + lc * SSN).to(tl.float32)
            z = _zero_n(z_ptr, t // 2, lc, ZMODE, SZK, SZN, ZORD)
        wt = _minus_zero(_w_tile_n(words, ASM), z, ZMODE, C, ASM)
        xt = _x_tile(x_ptr, t, offs_m, mmask, K)
        if SCALE_FIRST:
            acc = _mma(_scaled(wt, s, ASM), xt, acc, ASM)
        else:
            acc += _dot(wt, xt, ASM) * s[:, None]
    return acc


@triton.jit(do_not_specialize=["M"])
def int4_mma_n_kernel(x_ptr, q_ptr, z_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, q_desc, M,
                      N: tl.constexpr, K: tl.constexpr, INV: tl.constexpr,
                      ZMODE: tl.constexpr, C: tl.constexpr, SZK: tl.constexpr, SZN: tl.constexpr, ZORD: tl.constexpr,
                      SSK: tl.constexpr, SSN: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT_K: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
                      SCALE_FIRST: tl.constexpr, TMA: tl.constexpr = False):
    """One 256-column tile of out^T over one K slice of 64-deep tiles (slices differ by at most one tile).
    Leaves contiguous, strides and shapes compile-time constants (the codes: N / 8 words per row). TMA: the
    words come through ``q_desc`` ([K, N/8], 64 x 32 boxes), pipelined through shared memory by Triton;
    else each thread loads its own words (the next tile's ahead with PREFETCH)."""
    BLOCK_M: tl.constexpr = 16
    NW: tl.constexpr = N // 8  # words per row of codes
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    ln = _columns(pid_n * 256, INV)  # each row's column (>= N past the last whole word: not stored)
    nmask = ln < N
    lc = tl.minimum(ln, N - 1)  # (in bounds for the scale, zero and bias loads)
    jw = tl.minimum(pid_n * 32 + tl.arange(0, 32), NW - 1)  # the tile's word columns, clamped
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    wp = q_ptr + jw[:, None] + tl.arange(0, _BLOCK_K)[None, :] * NW  # tile 0's words [32, 64]
    acc = tl.zeros((256, BLOCK_M), dtype=tl.float32)
    TILES: tl.constexpr = K // _BLOCK_K
    acc = _by_tiles(acc, x_ptr, wp, q_desc, z_ptr, s_ptr, lc, offs_m, mmask, pid_n,
                    pid_k * TILES // SPLIT_K, (pid_k + 1) * TILES // SPLIT_K,
                    K, NW, ZMODE, C, SZK, SZN, ZORD, SSK, SSN, ASM, PREFETCH, SCALE_FIRST, TMA)
    omask = mmask[None, :] & nmask[:, None]
    if SPLIT_K > 1:  # the tile's last program sums the partials (``split_k``)
        last, tot = add_partials(acc, ws_ptr, offs_m[None, :] * N + ln[:, None], M * N, pid_k, omask,
                                 cnt_ptr + pid_n, SPLIT_K)
        if last:
            if HAS_BIAS:
                tot += tl.load(bias_ptr + lc).to(tl.float32)[:, None]
            tl.store(out_ptr + offs_m[None, :] * N + ln[:, None], _round_to(tot, out_ptr, ASM), mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + lc).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * N + ln[:, None], _round_to(acc, out_ptr, ASM), mask=omask)


# ----------------------------------------------------------------------------- launcher


def check(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Int4MmaN, bias=None) -> None:
    """Bad input gets a clear error (the dispatcher then skips this kernel for the shape)."""
    if not layout_fits(lay):
        raise ValueError("int4_mma_n: the kernel cannot read this layout (see layout_fits)")
    check_rows_and_bias("int4_mma_n", x, M_MAX, K, N, bias)
    if K % GROUP or N % 8 or not 1 <= cfg.SPLIT_K <= K // BLOCK_K or cfg.num_warps != 4:
        raise ValueError(f"int4_mma_n: K = {K} (a multiple of {GROUP}), N = {N} (of 8) and {cfg} do not fit")
    if _LEAVES_OK.get((lay, K, N), leaves) is None:  # the same weight tensors come back every token
        _check_leaves(leaves, lay, K, N)
        _LEAVES_OK.put((lay, K, N), leaves, True)


_LEAVES_OK = LeafCache()


def _check_leaves(leaves, lay: PackedLayout, K: int, N: int) -> None:
    check_group_leaves("int4_mma_n", leaves, lay, K, N, (K, N // 8), (torch.int32,))


def int4_mma_n(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Int4MmaN, bias=None,
               workspace: torch.Tensor | None = None, record=None) -> torch.Tensor:
    """``x [M, K] @ W + bias`` (bias: None or a contiguous [N] vector). workspace: the ``[SPLIT_K, M, N]``
    fp32 buffer of the split-K partials (tests pass one full of NaN; unused without a split). record:
    called with a ``replay.Replay`` of this call (a contiguous x, no workspace given)."""
    rec = record is not None and workspace is None and x.is_contiguous()
    check(x, leaves, lay, K, N, cfg, bias)
    x = x.contiguous()  # (the kernel reads rows K apart; a copy of at most 16 rows where they are not)
    M = x.shape[0]
    tiles_n = cdiv(N, BLOCK_N)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    ws, cnt = split_buffers(out, cfg.SPLIT_K, tiles_n, workspace, "int4_mma_n")
    q = leaves[lay.code]
    z = leaves[lay.zero_leaf] if lay.zero in ("packed", "int") else q
    desc = _tma_words(q) if cfg.tma else None
    launch = replay.launch(int4_mma_n_kernel, (tiles_n, cfg.SPLIT_K), (
        x, q, z, leaves[lay.scale], bias if bias is not None else out, out, ws, cnt, desc, M), dict(
        **_constexprs(lay, K, N), HAS_BIAS=bias is not None, SPLIT_K=cfg.SPLIT_K, ASM=not _INTERPRET,
        PREFETCH=cfg.prefetch, SCALE_FIRST=cfg.scale_first and leaves[lay.scale].dtype == torch.bfloat16,
        TMA=desc is not None, num_warps=4, num_stages=cfg.num_stages if desc is not None else 1,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})), rec)
    if rec and launch.replayable:
        record(replay.split_k_replay(launch, M, N, x.dtype, cfg.SPLIT_K, None if bias is not None else 0))
    return out


def _tma_words(q: torch.Tensor):
    """A TMA descriptor of the words [K, N/8] in 64 x 32 boxes, or None where TMA cannot read them (a base
    not 16-byte aligned, or rows of N/8 words not a multiple of 16 bytes): the kernel then loads directly."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if q.data_ptr() % 16 or q.shape[1] % 4:
        return None
    return TensorDescriptor(q, list(q.shape), list(q.stride()), [BLOCK_K, 32])


@functools.lru_cache(maxsize=256)  # (per call otherwise: the op runs per token)
def _constexprs(lay: PackedLayout, K: int, N: int) -> dict:
    """The layout's compile-time arguments: shapes, the nibble order, strides, zero mode and constant."""
    groups = K // GROUP
    if lay.zero == "packed":
        szk, szn = N // 8, 1
    elif lay.zero == "int":
        szk, szn = (N, 1) if lay.zero_dims == ("k", "n") else (1, groups)
    else:
        szk = szn = 0
    ssk, ssn = (N, 1) if lay.scale_dims == ("k", "n") else (1, groups)
    return dict(N=N, K=K, INV=_encode(_inverse(lay.order)), ZMODE=ZERO_MODES[lay.zero], C=int(lay.zero_value),
                SZK=szk, SZN=szn, ZORD=_encode(lay.zero_order if lay.zero == "packed" else range(8)),
                SSK=ssk, SSN=ssn)


# ----------------------------------------------------------------------------- builds for the report


def aot_builds():
    """The configs the dispatcher offers for AWQ at N = K = 8192 and M <= 16 (each distinct config once)."""
    from fusekern.kernels import decode_mm as dm
    from fusekern.kernels.catalog import TritonBuild
    from fusekern.kernels.packed_mm import REPORT_LAYOUTS

    N = K = 8192
    lay, (_, st, zt) = REPORT_LAYOUTS["awq"]
    cfgs = dict.fromkeys(c for M in (1, 16) for c in dm._packed_candidates(M, N, K, 132, lay)
                         if isinstance(c, Int4MmaN))
    builds = []
    for cfg in cfgs:
        args = dict(x_ptr="*bf16", q_ptr="*i32", z_ptr=zt, s_ptr=st, bias_ptr="*bf16", out_ptr="*bf16",
                    ws_ptr="*fp32", cnt_ptr="*i32", M=3,  # M is not specialized (no hint)
                    q_desc=f"tensordesc<i32[{BLOCK_K}, 32]>" if cfg.tma else None)
        ce = dict(_constexprs(lay, K, N), HAS_BIAS=False, SPLIT_K=cfg.SPLIT_K, ASM=True, PREFETCH=cfg.prefetch,
                  SCALE_FIRST=cfg.scale_first and st == "*bf16", TMA=cfg.tma)
        what = f"tma s{cfg.num_stages}" if cfg.tma else "prefetch" if cfg.prefetch else "direct"
        builds.append(TritonBuild("int4_mma_n", f"awq SPLIT_K={cfg.SPLIT_K} w4 {what}"
                                  f"{' scale_first' if cfg.scale_first else ''}"
                                  f"{f' maxnreg={cfg.maxnreg}' if cfg.maxnreg else ''} [{N}x{K}]",
                                  int4_mma_n_kernel, args, ce, 4, cfg.num_stages if cfg.tma else 1,
                                  maxnreg=cfg.maxnreg))
    return builds
