"""FP4 (E2M1) weights, two codes per byte along K, times up to 16 bf16 rows on warp-level tensor cores
(mma.sync), decoded in registers: MXFP4 (E8M0 scales per 32 k) and NVFP4 (E4M3 scales per 16 k, times a
global scale).

``out[M, N] = x[M, K] @ W + bias`` with ``W[k, n] = e2m1(q[n, k]) * s[n, k // GK] (* g)``, the codes uint8
``[N, K/2]`` (low nibble first, read as int32 words of 8 consecutive k), the scales ``[N, K/GK]`` (E8M0 as
uint8, or float8_e4m3fn) and g a one-element float tensor: what ``fusekern.testing.decode_zoo.mxfp4`` and
``nvfp4`` compute.

Why: at a few rows the FP4 kernels were 2.2-7.4x the bandwidth floor on the H200 (docs/results-h200.md, issue
4): the CUDA-core GEMV is bound by instruction issue, ``fp4_mma`` (WGMMA) needs x in shared memory and barriers
per tile, and NVFP4 had only the ``tl.dot`` tile at 2-64 rows. This is ``int4_mma_sync``'s schedule with
``fp4_mma``'s decode:
- Swap AB with ``mma.sync.m16n8k16``: a warp's A operand is 16 columns of W, B is x^T (8 rows per MMA; 9-16
  rows feed the same A registers to a second MMA), nothing goes through shared memory, no barrier.
- Lane (g, c) loads the 4 words (32 k) of its quarter of a 128-k group for columns g and g + 8 (one 16-byte
  load each) and row g of x at the same 32 k. Those 32 k are one MX block (two NVFP4 blocks), so a lane's
  scales are one (two) byte per column and group, turned into a bf16 multiplier once per group.
- E2M1 -> bf16 by ``fp4_mma``'s in-register lookup table (``prmt``; Hopper has no E2M1 convert), which yields
  the pairs (n_s, n_{s+4}) of a word: the A registers ``int4_mma_sync`` feeds its MMAs, so x is paired as
  there. One packed bf16 multiply per two values applies the scale, exactly (E2M1 times a power of two or an
  E4M3 value has at most 6 significant bits: the weight eager computes); the MMA then sums across blocks in
  fp32 with no rescale, and a global scale multiplies the fp32 sums once at the end.
- K is split over programs and reduced in the launch by the last program of a column tile (split order:
  deterministic), as ``int4_mma_sync`` does.
Triton's CPU interpreter cannot run inline PTX: there ``ASM`` is False, the decode runs in fp32 and the warp's
MMA is summed out by reshapes (``int4_mma_sync._mma``).
Where a weight overflows bf16 (E8M0 255 is inf; 253-254 times large codes), the result follows eager's bf16 weight,
not the float64 ``PackedLayout.weight_at``; a float64 global scale is applied in fp32.
H200, weight warm (``benchmarks/results/h200/fp4_mma_sync_sweep_*.csv``): 16 rows at N = K = 8192 in 30.5 us for
NVFP4 (the tl.dot tile 64.8) and 29.1 for MXFP4 (``fp4_mma`` 30.8), 3.4x the floor; one row about as fast as the
GEMV (18.2 against 18.6 us for MXFP4, 19.8 against 17.9 for NVFP4).

Read top to bottom: config and checks -> decode -> kernel -> launcher -> builds.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusekern.kernels import replay
from fusekern.kernels.fp4_mma import E2M1_TABLE_PTX, _e2m1_scaled, e2m1_bytes_along_k, e2m1_pairs_ptx
from fusekern.kernels.int4_mma import _GROUP, GROUP, check_rows_and_bias, split_buffers
from fusekern.kernels.int4_mma_sync import _load4, _mma, _rows, _thread_index, _x_rows, finish
from fusekern.kernels.intmath import cdiv
from fusekern.kernels.leaf_cache import LeafCache
from fusekern.patterns.decode.layout import PackedLayout

M_MAX = 16  # two MMAs of 8 x rows each
WARP_COLUMNS = 16  # the MMA's 16 rows: columns of W per warp
_WARP_COLUMNS = tl.constexpr(WARP_COLUMNS)  # (the kernel's copy)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class Fp4MmaSync:
    SPLIT_K: int = 8
    num_warps: int = 4

    @property
    def BLOCK_N(self) -> int:
        return WARP_COLUMNS * self.num_warps


@functools.lru_cache(maxsize=256)
def layout_fits(lay: PackedLayout) -> bool:
    """Can the kernel read this layout exactly? E2M1 codes two per byte along K (low nibble first, ``[N, K/2]``),
    no zero point, scales ``[N, K/GK]`` per 16 or 32 k and column: E8M0 or fp8 (E4M3, checked on the leaf),
    an optional one-element global scale. MXFP4 and NVFP4 are two of these."""
    return e2m1_bytes_along_k(lay) and lay.scale_enc in ("e8m0", "fp8") and lay.group_k in (16, 32)


def fits(lay: PackedLayout, M: int, K: int, x_dtype=None) -> bool:
    """Where the dispatcher may offer it: the layouts above, bf16 rows up to 16, whole 128-k groups."""
    return M <= M_MAX and layout_fits(lay) and K % GROUP == 0 and x_dtype in (None, torch.bfloat16)


# ----------------------------------------------------------------------------- decode


# fp4_mma's lookup-table decode without its per-word scale: $4 the word, $5 the bf16 multiplier in both halves; out
# the pairs (n_s, n_{s+4}).
# (into scratch registers first: the outputs are written only after the last read of the inputs)
_DECODE_ASM = tl.constexpr("{ .reg .b32 sa, sb, pa, qa, pb, qb, r0, r1, r2, r3, t, lo0, lo1, hi0, hi1; "
                           + E2M1_TABLE_PTX + e2m1_pairs_ptx("$4", "$5", ("r0", "r1", "r2", "r3"))
                           + "mov.b32 $0, r0; mov.b32 $1, r1; mov.b32 $2, r2; mov.b32 $3, r3; }")


@triton.jit
def _bits(v):
    """bf16 bits (low 16 of an int32) of fp32 v, already a bf16 value."""
    return (v.to(tl.int32, bitcast=True) >> 16) & 0xFFFF


@triton.jit
def _decode_pairs(w, sc, ASM: tl.constexpr):
    """The 8 codes of each word times the bf16 multiplier sc (both halves of an int32): bf16 pairs (n0, n4),
    (n1, n5), (n2, n6), (n3, n7) as int32 registers, the A registers of ``int4_mma_sync``'s slot order."""
    if ASM:
        return tl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,=r,=r,r,r", [w, sc],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        s = (sc << 16).to(tl.float32, bitcast=True)
        return (_bits(_e2m1_scaled(w, 0, s)) | (_bits(_e2m1_scaled(w, 16, s)) << 16),
                _bits(_e2m1_scaled(w, 4, s)) | (_bits(_e2m1_scaled(w, 20, s)) << 16),
                _bits(_e2m1_scaled(w, 8, s)) | (_bits(_e2m1_scaled(w, 24, s)) << 16),
                _bits(_e2m1_scaled(w, 12, s)) | (_bits(_e2m1_scaled(w, 28, s)) << 16))


@triton.jit
def _multiplier(ptr, E4M3: tl.constexpr):
    """The scale byte at ptr as a bf16 in both halves of an int32: E8M0 e -> 2 ** (e - 127) (e = 0: 2 ** -127,
    a subnormal; 255: inf, whose products with 0 are NaN as eager's), E4M3 exactly (NaN stays NaN)."""
    e = tl.load(ptr)
    if E4M3:
        f = e.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b = _bits(tl.where((e & 0x7F) == 0x7F, float("nan"), f))  # (the interpreter reads 0x7F as 480)
    else:
        ei = e.to(tl.int32)
        b = tl.where(ei == 0, 0x40, ei << 7)
    return b | (b << 16)


@triton.jit
def _group(w, v, sw, sv, xs, ys, a0, a1, a2, a3, b0, b1, b2, b3, GK: tl.constexpr, ROW_TILES: tl.constexpr,
           ASM: tl.constexpr):
    """A 128-k group's products added to the accumulators: columns g (words w, multipliers sw) and g + 8
    (v, sv) times x rows 0-7 (xs: a0..a3) and, with ROW_TILES = 2, rows 8-15 (ys: b0..b3). Word i holds k
    8i..8i+7 of the lane's 32: its multiplier is the lane's only one (GK = 32) or the one of its half (16)."""
    for i in tl.static_range(4):
        p0, p1, p2, p3 = _decode_pairs(w[i], sw[(i // 2) * (32 // GK - 1)], ASM)  # (GK = 32: sw[0])
        q0, q1, q2, q3 = _decode_pairs(v[i], sv[(i // 2) * (32 // GK - 1)], ASM)
        a0, a1, a2, a3 = _mma(p0, q0, p1, q1, xs[4 * i], xs[4 * i + 1], a0, a1, a2, a3, ASM)
        a0, a1, a2, a3 = _mma(p2, q2, p3, q3, xs[4 * i + 2], xs[4 * i + 3], a0, a1, a2, a3, ASM)
        if ROW_TILES == 2:
            b0, b1, b2, b3 = _mma(p0, q0, p1, q1, ys[4 * i], ys[4 * i + 1], b0, b1, b2, b3, ASM)
            b0, b1, b2, b3 = _mma(p2, q2, p3, q3, ys[4 * i + 2], ys[4 * i + 3], b0, b1, b2, b3, ASM)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _multipliers(sp, GK: tl.constexpr, E4M3: tl.constexpr):
    """A lane's multipliers for one column and group: its block's (GK = 32), or its two blocks' (16)."""
    if GK == 16:
        return _multiplier(sp, E4M3), _multiplier(sp + 1, E4M3)
    else:
        m = _multiplier(sp, E4M3)
        return m, m


# ----------------------------------------------------------------------------- kernel


@triton.jit(do_not_specialize=["M"])  # one compile serves every M of a ROW_TILES
def fp4_mma_sync_kernel(x_ptr, q_ptr, s_ptr, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M,
                        N: tl.constexpr, K: tl.constexpr, GK: tl.constexpr, E4M3: tl.constexpr,
                        HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                        ROW_TILES: tl.constexpr, VEC: tl.constexpr, ASM: tl.constexpr, THREADS: tl.constexpr):
    """16 columns per warp over one K slice (whole groups of 128). The words [N, K/8] (int32) and the scales
    [N, K/GK] (bytes) are contiguous, so every offset is a compile-time multiple of N and K. VEC: the words
    start 16-byte aligned (one 16-byte load per 4 words)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BLOCK_N: tl.constexpr = _WARP_COLUMNS * (THREADS // 32)
    tid = _thread_index(tl.zeros((THREADS,), tl.int32), ASM)
    warp = tid // 32
    g = (tid % 32) // 4
    c = tid % 4
    PER: tl.constexpr = (K // _GROUP) // SPLIT_K  # SPLIT_K divides the groups (split_k_for)
    t0 = pid_k * PER
    LAST = t0 + PER - 1
    n0 = pid_n * BLOCK_N + warp * _WARP_COLUMNS + g
    n1 = n0 + 8
    ln0 = tl.minimum(n0, N - 1)  # columns past N read column N - 1 (in bounds) and are not stored
    ln1 = tl.minimum(n1, N - 1)
    KW: tl.constexpr = K // 8  # words per column
    wp0 = q_ptr + ln0.to(tl.int64) * KW + c * 4  # this lane's words 4c .. 4c + 3 of each group's 16
    wp1 = q_ptr + ln1.to(tl.int64) * KW + c * 4
    SN: tl.constexpr = K // GK  # scales per column
    BL: tl.constexpr = 32 // GK  # blocks per lane and group
    sp0 = s_ptr + ln0.to(tl.int64) * SN + c * BL
    sp1 = s_ptr + ln1.to(tl.int64) * SN + c * BL
    # x rows g and g + 8 (rows past M read row M - 1: only their own, unstored outputs see them)
    xq0 = x_ptr.to(tl.pointer_type(tl.int32)) + tl.minimum(g, M - 1).to(tl.int64) * (K // 2) + c * 16
    xq1 = x_ptr.to(tl.pointer_type(tl.int32)) + tl.minimum(g + 8, M - 1).to(tl.int64) * (K // 2) + c * 16
    nw0, nw1, nw2, nw3 = _load4(wp0 + t0 * 16, VEC, 1, ASM, True)
    nv0, nv1, nv2, nv3 = _load4(wp1 + t0 * 16, VEC, 1, ASM, True)
    zero = tl.zeros((THREADS,), tl.float32)
    a0, a1, a2, a3 = zero, zero, zero, zero
    b0, b1, b2, b3 = zero, zero, zero, zero
    for t in range(t0, t0 + PER):
        w = (nw0, nw1, nw2, nw3)
        v = (nv0, nv1, nv2, nv3)
        tn = tl.minimum(t + 1, LAST)  # the next group's words, loaded before this one's decode
        nw0, nw1, nw2, nw3 = _load4(wp0 + tn * 16, VEC, 1, ASM, True)
        nv0, nv1, nv2, nv3 = _load4(wp1 + tn * 16, VEC, 1, ASM, True)
        sw = _multipliers(sp0 + t * (_GROUP // GK), GK, E4M3)
        sv = _multipliers(sp1 + t * (_GROUP // GK), GK, E4M3)
        xs = _x_rows(xq0, t, ASM)
        if ROW_TILES == 2:
            ys = _x_rows(xq1, t, ASM)
        else:
            ys = xs
        a0, a1, a2, a3, b0, b1, b2, b3 = _group(w, v, sw, sv, xs, ys, a0, a1, a2, a3, b0, b1, b2, b3, GK,
                                                ROW_TILES, ASM)
    if HAS_GLOBAL:
        gs = tl.load(g_ptr).to(tl.float32)
        a0, a1, a2, a3 = a0 * gs, a1 * gs, a2 * gs, a3 * gs
        b0, b1, b2, b3 = b0 * gs, b1 * gs, b2 * gs, b3 * gs
    # this lane's outputs: rows 2c, 2c + 1 (and 8 + 2c, 9 + 2c) of x, columns n0, n1
    m0 = 2 * c
    finish(out_ptr, bias_ptr, ws_ptr, cnt_ptr + pid_n, pid_k, a0, a1, a2, a3, m0, n0, n1, b0, b1, b2, b3, m0 + 8,
           n0, n1, M, N, ROW_TILES == 2, HAS_BIAS, SPLIT_K, ASM)


# ----------------------------------------------------------------------------- launcher


_LEAVES_OK = LeafCache()  # leaf sets already checked for a layout and shape


def check(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Fp4MmaSync, bias=None) -> None:
    """Bad input gets a clear error (the dispatcher then skips this kernel for the shape)."""
    if not layout_fits(lay):
        raise ValueError("fp4_mma_sync: the kernel reads E2M1 codes two per byte along K with E8M0 or E4M3 "
                         "scales per 16 or 32 k (MXFP4, NVFP4; see layout_fits)")
    check_rows_and_bias("fp4_mma_sync", x, M_MAX, K, N, bias)
    if K % GROUP or (K // GROUP) % cfg.SPLIT_K or cfg.num_warps not in (1, 2, 4, 8):
        raise ValueError(f"fp4_mma_sync: K = {K} (a multiple of {GROUP}) and {cfg} do not fit")
    key = (lay, K, N, x.device)  # (the device too: the checks below compare the leaves' devices with x's)
    if _LEAVES_OK.get(key, leaves) is None:  # the same weight tensors come back every token
        codes, scales = leaves[lay.code], leaves[lay.scale]
        sdt = (torch.float8_e4m3fn,) if lay.scale_enc == "fp8" else (torch.uint8,)
        for t, shape, dts in ((codes, (N, K // 2), (torch.uint8,)), (scales, (N, K // lay.group_k), sdt)):
            if tuple(t.shape) != shape or not t.is_contiguous() or t.dtype not in dts:
                raise ValueError(f"fp4_mma_sync: a leaf is {t.dtype} {tuple(t.shape)} with strides {t.stride()}, "
                                 f"the kernel reads a contiguous {dts[0]} {shape}")
        if codes.data_ptr() % 4:
            raise ValueError("fp4_mma_sync: the packed bytes must start 4-byte aligned (they are read as words)")
        if lay.glob >= 0:
            g = leaves[lay.glob]
            if g.numel() != 1 or not g.is_floating_point() or g.device != x.device:
                raise ValueError(f"fp4_mma_sync: the global scale must be one float on {x.device}, got "
                                 f"{g.dtype} {tuple(g.shape)} on {g.device}")
        for t in (codes, scales):
            if t.device != x.device:
                raise ValueError(f"fp4_mma_sync: the leaves must be on {x.device}, got {t.device}")
        _LEAVES_OK.put(key, leaves, True)


def fp4_mma_sync(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Fp4MmaSync, bias=None,
                 workspace: torch.Tensor | None = None, record=None) -> torch.Tensor:
    """``x [M, K] @ W + bias`` (bias: None or a contiguous [N] vector). workspace: the ``[SPLIT_K, M, N]``
    fp32 buffer of the split-K partials (tests pass one full of NaN; unused without a split). record:
    called with a ``replay.Replay`` of this call (a contiguous, 16-byte aligned x, no workspace given)."""
    check(x, leaves, lay, K, N, cfg, bias)
    x, rec = _rows(x, record is not None and workspace is None)
    M = x.shape[0]
    tiles_n = cdiv(N, cfg.BLOCK_N)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    ws, cnt = split_buffers(out, cfg.SPLIT_K, tiles_n, workspace, "fp4_mma_sync")
    q = leaves[lay.code].view(torch.int32)
    s = leaves[lay.scale].view(torch.uint8)
    glob = leaves[lay.glob] if lay.glob >= 0 else s
    launch = replay.launch(fp4_mma_sync_kernel, (tiles_n, cfg.SPLIT_K), (
        x, q, s, glob, bias if bias is not None else out, out, ws, cnt, M), dict(
        **_constexprs(lay, K, N), HAS_BIAS=bias is not None, SPLIT_K=cfg.SPLIT_K, ROW_TILES=row_tiles(M),
        VEC=q.data_ptr() % 16 == 0, ASM=not _INTERPRET, THREADS=32 * cfg.num_warps, num_warps=cfg.num_warps), rec)
    if rec and launch.replayable:
        record(replay.split_k_replay(launch, M, N, x.dtype, cfg.SPLIT_K, None if bias is not None else 0))
    return out


def row_tiles(M: int) -> int:
    """MMAs per k16 slice: one for up to 8 rows of x, two for 9-16."""
    return 1 if M <= 8 else 2


def _constexprs(lay: PackedLayout, K: int, N: int) -> dict:
    return dict(N=N, K=K, GK=lay.group_k, E4M3=lay.scale_enc == "fp8", HAS_GLOBAL=lay.glob >= 0)


# ----------------------------------------------------------------------------- builds for the report


def aot_builds():
    """The configs the dispatcher offers at N = K = 8192 for MXFP4 and NVFP4 at M = 1 and 16 (one split per
    variant: the split does not change the code)."""
    from fusekern.kernels import decode_mm as dm
    from fusekern.kernels.catalog import TritonBuild
    from fusekern.kernels.packed_mm import REPORT_LAYOUTS

    N = K = 8192
    builds = []
    for name in ("mxfp4", "nvfp4"):
        lay = REPORT_LAYOUTS[name][0]
        for M in (1, 16):
            for cfg in dm._packed_candidates(M, N, K, 132, lay):
                if isinstance(cfg, Fp4MmaSync):
                    args = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*u8", g_ptr="*fp32", bias_ptr="*bf16",
                                out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32", M=3)  # M: not specialized
                    ce = dict(**_constexprs(lay, K, N), HAS_BIAS=False, SPLIT_K=cfg.SPLIT_K, ROW_TILES=row_tiles(M),
                              VEC=True, ASM=True, THREADS=32 * cfg.num_warps)
                    builds.append(TritonBuild("fp4_mma_sync", f"{name} SPLIT_K={cfg.SPLIT_K} w{cfg.num_warps} "
                                              f"M={M} [{N}x{K}]", fp4_mma_sync_kernel, args, ce, cfg.num_warps, 1))
                    break
    return builds
