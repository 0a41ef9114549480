"""8-bit weights (FP8 e4m3, int8, uint8) times up to 16 bf16 rows on tensor cores, the MMA in f16.

``out[M, N] = x[M, K] @ W + bias`` with ``W[k, n] = (v(q[n, k]) - z - c) * s[k // GK, n // GN] (* g)``: codes
``[N, K]`` along K, one per byte, read as e4m3 (no zero point) or as a signed / unsigned integer with no zero,
a constant one c, or one 8-bit integer z per scale group (plus c); float scales per channel, per tensor or per
block whose K extent is a multiple of the tile's (DeepSeek's 128 x 128), an optional one-element global scale
g: what ``fusekern.testing.decode_zoo.fp8_channel``, ``fp8_tensor``, ``fp8_block``, ``int8_channel``,
``int8_group`` and ``int8_group_asym`` compute. An 8-bit integer minus an 8-bit zero and a small constant is
an integer of magnitude below 2048: exact in f16, as every e4m3 value is, so the MMA's products are exact.

Why: at 2-16 rows FP8 weight-only ran on the generic swap-AB tile (``packed_mm.PackedDot``), which decodes each
code to fp32, casts it to bf16 for the MMA and sums its K splits in a second launch: 1.66-1.88x the floor at 16
rows on issue 4's shapes (issue 4 asks 1.4x). Here:
- e4m3 -> f16 is exact and one ``cvt.rn.f16x2.e4m3x2`` per pair (the cast to bf16 is slower than the fp32 route:
  29 against 26 us at 8192 x 8192, ``benchmarks/results/h200/fp8_dot_probe.csv``), and f16 x f16 products are
  exact in the MMA's fp32 sums, as bf16 x bf16 ones are.
- So x must be f16. Each K tile scales x's rows by a power of two that puts their largest |x| below 2**15 (in
  [2**14, 2**15) unless it is a subnormal fp32) and takes it off the tile's fp32 product, after the weight scale
  (so the sum overflows only where its true value does). A bf16 value converts exactly unless it is more than
  2**31 below its row's largest in the same 128 k (then it rounds to f16's subnormal grid, 2**-24 of the scaled
  values: an error below 2**-38 of that largest |x|; it matters only where that largest value meets small codes,
  as a row of ones with one 2**100 facing a zero code does: eager's fp32 sums keep the ones there, this tile
  loses them). Without the scaling |x| > 65504 would become inf (the unscaled tile was 5-10% faster).
- Swap AB (``tl.dot(W^T tile, x^T tile)``: N fills the MMA's 64-row side, x is padded to 16 rows), the scale row
  applied to each tile's product (a block scale loaded per tile, a per-channel or per-tensor one once).
- K is split over programs and reduced in the launch by the last program of a column tile, in split order
  (deterministic), with the counters of ``split_counters``.
Two or three weights that multiply the same x (a decoder's q / k / v, gate / up) can share one launch
(``fp8_mma_group``: the members' column tiles in one grid, as ``int4_mma_group`` does).
H200, CUDA graph (``benchmarks/proto/fp8_dot_probe.py``, ``fp8_dot_probe*.csv``): 16 rows at 8192 x 8192 in 24.4
us against the generic tile's 26.1, 14336 x 4096 22.9-24.0 against 25.6-25.8, 4096 x 14336 24.8 against 25.2.

Read top to bottom: config and checks -> kernel -> launcher -> builds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusekern.kernels import replay
from fusekern.kernels.group_member import pick as pick_member
from fusekern.kernels.int4_mma import check_rows_and_bias, split_buffers
from fusekern.kernels.intmath import cdiv
from fusekern.kernels.leaf_cache import LeafCache
from fusekern.kernels.remat import INTERPRETING
from fusekern.kernels.split_k import add_partials
from fusekern.patterns.decode.layout import PackedLayout, leaf_strides

M_MAX = 16  # x padded to the MMA's 16 columns


@dataclass(frozen=True)
class Fp8Mma:
    BLOCK_N: int = 64
    BLOCK_K: int = 128
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3


CODES = {"fp8": 0, "int": 1, "uint": 2}  # the kernel's CODE: how a byte reads
CODE_DTYPES = {"fp8": torch.float8_e4m3fn, "int": torch.int8, "uint": torch.uint8}
ZERO_MAX = 256  # |c| at most this (an integer): q - z - c stays an integer below 2048, exact in f16


def layout_fits(lay: PackedLayout) -> bool:
    """Codes ``[N, K]`` (one per byte, along K), float scales (per channel, tensor or block); e4m3 without a
    zero point, or 8-bit integers without one, with a constant one, or with an 8-bit integer one per scale
    group (``check`` verifies the zeros' dtype), the constant an integer of at most ``ZERO_MAX``."""
    if not (lay.value in CODES and lay.bits == 8 and lay.per_word == 1 and lay.code_dims == ("n", "k")
            and lay.scale >= 0 and lay.scale_enc == "float" and set(lay.scale_dims) <= {"n", "k", "1"}):
        return False
    if lay.value == "fp8" or lay.zero == "":
        return lay.zero == ""
    small = float(lay.zero_value).is_integer() and abs(lay.zero_value) <= ZERO_MAX
    return small and (lay.zero == "const" or (lay.zero == "int" and set(lay.zero_dims) <= {"n", "k", "1"}))


def fits(lay: PackedLayout, M: int, K: int, x_dtype=None, block_k: int = 128) -> bool:
    """Where the dispatcher may offer it: bf16 rows up to 16, scale groups that hold whole K tiles."""
    return M <= M_MAX and layout_fits(lay) and x_dtype in (None, torch.bfloat16) and _whole_tiles(lay, K, block_k)


def _whole_tiles(lay: PackedLayout, K: int, block_k: int) -> bool:
    """Each K tile lies in one scale group: one group along all of K, or groups of whole tiles."""
    return lay.group_k >= K or lay.group_k % block_k == 0


# ----------------------------------------------------------------------------- kernel


@triton.jit
def fp8_mma_kernel(
    x_ptr, q_ptr, s_ptr, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, sqn, ssk, ssn,
    GK: tl.constexpr, GN: tl.constexpr, SCALE_PER_TILE: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, z_ptr=None, szk=0, szn=0, CODE: tl.constexpr = 0, HAS_ZERO: tl.constexpr = False,
    C: tl.constexpr = 0.0,
):
    """One column tile over one K slice: ``fp8_program``."""
    fp8_program(tl.program_id(0), tl.program_id(1), x_ptr, q_ptr, s_ptr, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                M, N, K, stride_xm, sqn, ssk, ssn, GK, GN, SCALE_PER_TILE, HAS_GLOBAL, HAS_BIAS, SPLIT_K, BLOCK_M,
                BLOCK_N, BLOCK_K, z_ptr, szk, szn, CODE, HAS_ZERO, C)


@triton.jit(do_not_specialize=["M", "N", "T1", "T2", "N1", "N2", "DQ1", "DQ2", "DS1", "DS2", "DZ1", "DZ2", "DO1",
                               "DO2", "DW1", "DW2"])  # (offsets between allocations change per weight)
def fp8_mma_group_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N,
    T1, T2, N1, N2, DQ1, DQ2, DS1, DS2, DZ1, DZ2, DO1, DO2, DW1, DW2,
    K, stride_xm, sqn, ssk, ssn, szk, szn,
    GK: tl.constexpr, GN: tl.constexpr, SCALE_PER_TILE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CODE: tl.constexpr = 0,
    HAS_ZERO: tl.constexpr = False, C: tl.constexpr = 0.0, QA: tl.constexpr = 1,
):
    """Two or three weights that multiply the same x, in one launch (as ``packed_gemv_group``): member 0
    owns column tiles [0, T1), member 1 [T1, T2), member 2 [T2, tiles); N, N1, N2 are their widths, D*1 /
    D*2 the element offsets of members 1 and 2's codes, scales, zeros, outputs ([M,
    N_i]) and split-K partials from member 0's; the strides are every member's. A member's split-K counters
    follow the previous member's. No global scale and no bias (the grouped op has neither). QA = 16: the
    members' codes lie 16-byte multiples apart, which the compiler then knows (otherwise it cannot vectorize
    their loads: 255 registers and 708 bytes of spills for 128-column tiles, sm_90a)."""
    pid = tl.program_id(0)
    in1 = pid >= T1
    in2 = pid >= T2
    first = pick_member(in1, in2, 0, T1, T2)  # the member's first column tile
    dq = pick_member(in1, in2, 0, DQ1, DQ2)
    if QA > 1:  # (a multiple already: the product tells the compiler. The offset is passed whole, not divided by
        dq = (dq // QA) * QA  # QA, which a 32-bit multiply back would wrap from 2 GiB apart)
    fp8_program(pid - first, tl.program_id(1), x_ptr, q_ptr + dq,
                s_ptr + pick_member(in1, in2, 0, DS1, DS2), s_ptr, out_ptr, out_ptr + pick_member(in1, in2, 0, DO1, DO2),
                ws_ptr + pick_member(in1, in2, 0, DW1, DW2), cnt_ptr + first, M, pick_member(in1, in2, N, N1, N2), K, stride_xm,
                sqn, ssk, ssn, GK, GN, SCALE_PER_TILE, False, False, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K,
                z_ptr + pick_member(in1, in2, 0, DZ1, DZ2), szk, szn, CODE, HAS_ZERO, C)


@triton.jit
def fp8_program(pid_n, pid_k, x_ptr, q_ptr, s_ptr, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                M, N, K, stride_xm, sqn, ssk, ssn, GK: tl.constexpr, GN: tl.constexpr, SCALE_PER_TILE: tl.constexpr,
                HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, z_ptr, szk, szn, CODE: tl.constexpr,
                HAS_ZERO: tl.constexpr, C: tl.constexpr):
    """Column tile pid_n over K slice pid_k: ``out^T[BLOCK_N, BLOCK_M] = sum over K tiles of (W^T x^T) * 2**-e * s``.
    CODE (``CODES``): the bytes as e4m3, int8 or uint8; HAS_ZERO: an 8-bit integer zero per scale group at z_ptr
    (strides szk, szn); C: a constant taken off the integer codes too. cnt_ptr + pid_n: the tile's split-K
    counter."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    nmask = offs_n < N
    tiles = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(tiles, SPLIT_K)
    t0 = pid_k * per
    t1 = tl.minimum(t0 + per, tiles)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if not SCALE_PER_TILE:  # one scale along K (per channel or tensor), applied per tile all the same (below)
        s = tl.load(s_ptr + (offs_n // GN) * ssn, mask=nmask, other=0).to(tl.float32)
    for t in range(t0, t1):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(q_ptr + offs_n[:, None].to(tl.int64) * sqn + offs_k[None, :],
                    mask=nmask[:, None] & (offs_k[None, :] < K), other=0)
        xt = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None],
                     mask=(offs_m[None, :] < M) & (offs_k[:, None] < K), other=0.0).to(tl.float32)
        # per row of x: e = floor(log2(max |x|)) (-127 below fp32's normals: the scaled max stays under 2**15),
        # x times 2**(14 - e) and the product times 2**(e - 14), each as two powers of two that fp32 holds
        amax = tl.max(tl.abs(xt), axis=0)
        e = tl.where(amax > 0, ((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127, 0)
        u1 = (14 - e) >> 1
        u2 = (14 - e) - u1
        xs = xt * _pow2(u1)[None, :] * _pow2(u2)[None, :]
        d = tl.dot(_codes_f16(w, z_ptr, t * BLOCK_K, offs_n, nmask, szk, szn, GK, GN, CODE, HAS_ZERO, C),
                   xs.to(tl.float16))
        if SCALE_PER_TILE:  # block scales: the group holding this tile
            s = tl.load(s_ptr + ((t * BLOCK_K) // GK) * ssk + (offs_n // GN) * ssn, mask=nmask, other=0).to(tl.float32)
        # the scale before the power of two: the tile's sum overflows fp32 only where its true value does
        acc += d * s[:, None] * _pow2(-u1)[None, :] * _pow2(-u2)[None, :]
    n2 = offs_n[:, None]
    m2 = offs_m[None, :]
    mask = (n2 < N) & (m2 < M)
    if SPLIT_K > 1:  # the tile's last program sums the partials (``split_k``)
        last, acc = add_partials(acc, ws_ptr, m2.to(tl.int64) * N + n2, tl.cast(M, tl.int64) * N, pid_k, mask,
                                 cnt_ptr + pid_n, SPLIT_K)
        if last:
            _store(acc, g_ptr, bias_ptr, out_ptr, n2, m2, mask, N, HAS_GLOBAL, HAS_BIAS)
    else:
        _store(acc, g_ptr, bias_ptr, out_ptr, n2, m2, mask, N, HAS_GLOBAL, HAS_BIAS)


@triton.jit
def _codes_f16(w, z_ptr, k0, offs_n, nmask, szk, szn, GK: tl.constexpr, GN: tl.constexpr, CODE: tl.constexpr,
               HAS_ZERO: tl.constexpr, C: tl.constexpr):
    """The tile's bytes ([BLOCK_N, BLOCK_K] uint8) as exact f16 values: e4m3, or an integer minus its zero."""
    if CODE == 0:
        v = w.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        v = _bytes_f16(w, CODE == 1)
        if HAS_ZERO:  # the group holding this tile (groups hold whole tiles), one 8-bit integer per column
            z = tl.load(z_ptr + (k0 // GK) * szk + (offs_n // GN) * szn, mask=nmask, other=0).to(tl.float16)
            v = (v - (z + C).to(tl.float16)[:, None]).to(tl.float16)
        elif C != 0:
            v = (v - C).to(tl.float16)
    return v


@triton.jit
def _bytes_f16(w, SIGNED: tl.constexpr):
    """uint8 bytes as f16 integers, read as int8 (SIGNED) or uint8. On the GPU, four at a time by the
    magic-number trick: one PRMT puts two bytes under f16's exponent of 1024 (0x64XX is 1024 + XX exactly),
    one packed subtraction of 1024 (1152 for int8, whose bytes were offset by 128 with one XOR) leaves the
    integers: 5 instructions per 4 values, where Triton's own conversion takes an I2F per value and PRMTs."""
    if INTERPRETING:
        if SIGNED:
            v = w.to(tl.int8, bitcast=True).to(tl.float16)
        else:
            v = w.to(tl.float16)
    else:
        v = tl.inline_asm_elementwise(
            "{ .reg .b32 t, k; "
            + ("xor.b32 t, $2, 0x80808080; mov.b32 k, 0x64806480; " if SIGNED else "mov.b32 t, $2; mov.b32 k, 0x64006400; ")
            + "prmt.b32 $0, t, 0x64646464, 0x4140; prmt.b32 $1, t, 0x64646464, 0x4342; "
            "sub.rn.f16x2 $0, $0, k; sub.rn.f16x2 $1, $1, k; }",
            "=r,=r,r", [w], dtype=tl.float16, is_pure=True, pack=4)
    return v


@triton.jit
def _pow2(p):
    """2**p as fp32, for integer p in [-126, 127]."""
    return ((p + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _store(acc, g_ptr, bias_ptr, out_ptr, n2, m2, mask, N, HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Global scale, bias, the store of out[m, n] from the [BLOCK_N, BLOCK_M] tile."""
    if HAS_GLOBAL:
        acc = acc * tl.load(g_ptr).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n2, mask=n2 < N, other=0).to(tl.float32)
    tl.store(out_ptr + m2.to(tl.int64) * N + n2, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launcher


_LEAVES_OK = LeafCache()  # leaf sets already checked for a layout and shape


def check(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Fp8Mma, bias=None) -> None:
    """Bad input gets a clear error (the dispatcher then skips this kernel for the shape)."""
    if not layout_fits(lay):
        raise ValueError("fp8_mma: the kernel reads e4m3 or 8-bit integer codes [N, K] with float scales per "
                         "channel, tensor or block, and for integers at most an 8-bit zero point per scale group "
                         "(see layout_fits)")
    check_rows_and_bias("fp8_mma", x, M_MAX, K, N, bias)
    if not _whole_tiles(lay, K, cfg.BLOCK_K) or cfg.SPLIT_K < 1 or cfg.num_warps not in (4, 8):
        raise ValueError(f"fp8_mma: scale groups of {lay.group_k} along K = {K} and {cfg} do not fit (a group "
                         f"must hold whole {cfg.BLOCK_K}-deep K tiles)")
    key = (lay, K, N, x.device)
    if _LEAVES_OK.get(key, leaves) is None:  # the same weight tensors come back every token
        codes, scales = leaves[lay.code], leaves[lay.scale]
        want_dtype = CODE_DTYPES[lay.value]
        if tuple(codes.shape) != (N, K) or codes.stride(1) != 1 or codes.dtype != want_dtype:
            raise ValueError(f"fp8_mma: the codes are {codes.dtype} {tuple(codes.shape)} with strides "
                             f"{codes.stride()}, the kernel reads {str(want_dtype).removeprefix('torch.')} [{N}, {K}] "
                             f"with unit stride along K")
        if not scales.is_floating_point() or scales.element_size() < 2:
            raise ValueError(f"fp8_mma: the scales must be a 16-, 32- or 64-bit float tensor, got {scales.dtype}")
        size = {"n": cdiv(N, lay.group_n), "k": cdiv(K, lay.group_k), "1": 1}
        want = tuple(size[d] for d in lay.scale_dims)
        if tuple(scales.shape) != want:
            raise ValueError(f"fp8_mma: the scales are {tuple(scales.shape)}, the layout's {lay.scale_dims} over "
                             f"[{N}, {K}] in groups of {lay.group_n} x {lay.group_k} make {want}")
        leaf_list = [codes, scales] + ([leaves[lay.glob]] if lay.glob >= 0 else [])
        if lay.zero == "int":
            zeros = leaves[lay.zero_leaf]
            zwant = tuple(size[d] for d in lay.zero_dims)
            if zeros.dtype not in (torch.int8, torch.uint8) or tuple(zeros.shape) != zwant:
                raise ValueError(f"fp8_mma: the zero points must be int8 or uint8 {zwant} (the layout's "
                                 f"{lay.zero_dims} in groups of {lay.group_n} x {lay.group_k}), got {zeros.dtype} "
                                 f"{tuple(zeros.shape)}")
            leaf_list.append(zeros)
        if lay.glob >= 0:
            g = leaves[lay.glob]
            # (E8M0 is a float dtype that Triton's pointers do not take: a KeyError at launch otherwise)
            if g.numel() != 1 or not g.is_floating_point() or g.dtype == torch.float8_e8m0fnu:
                raise ValueError(f"fp8_mma: the global scale must be one float (not E8M0), got {g.dtype} "
                                 f"{tuple(g.shape)}")
        for t in leaf_list:
            if t.device != x.device:
                raise ValueError(f"fp8_mma: the leaves must be on {x.device}, got {t.device}")
        _LEAVES_OK.put(key, leaves, True)


def fp8_mma(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: Fp8Mma, bias=None,
            workspace: torch.Tensor | None = None, record=None) -> torch.Tensor:
    """``x [M, K] @ W + bias`` (bias: None or a contiguous [N] vector). workspace: the ``[SPLIT_K, M, N]``
    fp32 buffer of the split-K partials (tests pass one full of NaN; unused without a split). record:
    called with a ``replay.Replay`` of this call (x with unit stride along K, no workspace given)."""
    check(x, leaves, lay, K, N, cfg, bias)
    rec = record is not None and workspace is None
    if x.stride(1) != 1:  # (x is at most 16 rows)
        x, rec = x.contiguous(), False
    M = x.shape[0]
    tiles_n = cdiv(N, cfg.BLOCK_N)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    ws, cnt = split_buffers(out, cfg.SPLIT_K, tiles_n, workspace, "fp8_mma")
    q = leaves[lay.code].view(torch.uint8)
    s = leaves[lay.scale]
    g = leaves[lay.glob] if lay.glob >= 0 else s
    ssk, ssn = leaf_strides(s, lay.scale_dims)
    z = leaves[lay.zero_leaf] if lay.zero == "int" else None
    szk, szn = leaf_strides(z, lay.zero_dims)
    launch = replay.launch(fp8_mma_kernel, (tiles_n, cfg.SPLIT_K), (
        x, q, s, g, bias if bias is not None else out, out, ws, cnt, M, N, K, x.stride(0), q.stride(0), ssk, ssn),
        dict(GK=lay.group_k, GN=lay.group_n, SCALE_PER_TILE=lay.group_k < K, HAS_GLOBAL=lay.glob >= 0,
             HAS_BIAS=bias is not None, SPLIT_K=cfg.SPLIT_K, BLOCK_M=16, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
             z_ptr=z if z is not None else q, szk=szk, szn=szn, CODE=CODES[lay.value], HAS_ZERO=z is not None,
             C=float(lay.zero_value) if lay.zero in ("const", "int") else 0.0,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages), rec)
    if rec and launch.replayable:
        record(replay.split_k_replay(launch, M, N, x.dtype, cfg.SPLIT_K, None if bias is not None else 0))
    return out


def fp8_mma_group(x: torch.Tensor, members, lay: PackedLayout, K: int, Ns: list[int], cfg: Fp8Mma,
                  workspace: torch.Tensor | None = None, record=None) -> list[torch.Tensor] | None:
    """``[x @ W_i for each member]`` in one launch (members: each one's leaves; Ns: their N), or None where
    they cannot share one: a global scale, other strides or dtypes between members, leaves not a whole number
    of elements apart. Each output is the member's own ``fp8_mma`` launch's with the same config, bit for bit.
    workspace: the fp32 ``[SPLIT_K * M * sum(Ns)]`` partials of a split launch. record: called with a replay
    of this call (x with unit stride along K, no workspace given)."""
    from fusekern.kernels.packed_gemv_group import MAX_MEMBERS, GemvGroupReplay, _offset, group_outputs, member_fields

    if not 2 <= len(members) <= MAX_MEMBERS or lay.glob >= 0:
        return None
    for leaves, N in zip(members, Ns):
        check(x, leaves, lay, K, N, cfg)
    codes = [leaves[lay.code].view(torch.uint8) for leaves in members]
    scales = [leaves[lay.scale] for leaves in members]
    zeros = [leaves[lay.zero_leaf] if lay.zero == "int" else q for leaves, q in zip(members, codes)]
    strides = [(q.stride(0), *leaf_strides(sc, lay.scale_dims),
                *(leaf_strides(z, lay.zero_dims) if lay.zero == "int" else (0, 0))) for q, sc, z in
               zip(codes, scales, zeros)]
    if any(st != strides[0] for st in strides) or any(t.dtype != ts[0].dtype for ts in (scales, zeros) for t in ts):
        return None
    offsets = [[_offset(t[i], t[0]) for t in (codes, scales, zeros)] for i in range(1, len(members))]
    if any(o is None for offs in offsets for o in offs):
        return None
    qa = 16 if all(offs[0] % 16 == 0 for offs in offsets) else 1
    rec = record is not None and workspace is None
    if x.stride(1) != 1:  # (x is at most 16 rows)
        x, rec = x.contiguous(), False
    M = x.shape[0]
    tiles = [cdiv(n, cfg.BLOCK_N) for n in Ns]
    outs, ws, cnt, out_offsets, ws_offsets = group_outputs(x, Ns, cfg.SPLIT_K, sum(tiles), workspace, "fp8_mma_group")
    sqn, ssk, ssn, szk, szn = strides[0]
    launch = replay.launch(fp8_mma_group_kernel, (sum(tiles), cfg.SPLIT_K), (
        x, codes[0], scales[0], zeros[0], outs[0], ws, cnt, M, Ns[0],
        *member_fields(tiles, Ns, offsets, out_offsets, ws_offsets), K, x.stride(0), sqn, ssk, ssn, szk, szn),
        dict(GK=lay.group_k, GN=lay.group_n, SCALE_PER_TILE=lay.group_k < K, SPLIT_K=cfg.SPLIT_K, BLOCK_M=16,
             BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, CODE=CODES[lay.value], HAS_ZERO=lay.zero == "int",
             C=float(lay.zero_value) if lay.zero in ("const", "int") else 0.0, QA=qa,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages), rec)
    if rec and launch.replayable:
        record(GemvGroupReplay(launch, M, Ns, x.dtype, cfg.SPLIT_K))
    return outs


# ----------------------------------------------------------------------------- builds for the report


def aot_builds():
    """The configs the dispatcher offers at N = K = 8192, M = 16, for FP8 per channel and in 128 x 128 blocks,
    and int8 in groups of 128 without and with 8-bit zero points (one split per variant: the split does not
    change the loop)."""
    from fusekern.kernels import decode_mm as dm
    from fusekern.kernels.catalog import TritonBuild
    from fusekern.kernels.packed_mm import REPORT_LAYOUTS

    N = K = 8192
    channel = REPORT_LAYOUTS["fp8_channel"][0]
    block = dataclasses.replace(channel, scale_dims=("n", "k"), group_k=128, group_n=128)
    int8 = dataclasses.replace(channel, value="int", scale_dims=("n", "k"), group_k=128)
    int8_zero = dataclasses.replace(int8, zero="int", zero_leaf=2, zero_dims=("n", "k"))
    builds = []
    for name, lay, ssk, ssn in (("fp8_channel", channel, 0, 1), ("fp8_block", block, 1, K // 128),
                                ("int8_group", int8, 1, K // 128), ("int8_group_asym", int8_zero, 1, K // 128)):
        for cfg in dm._packed_candidates(16, N, K, 132, lay):
            if isinstance(cfg, Fp8Mma):
                args = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", g_ptr="*fp32", bias_ptr="*bf16",
                            out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32", M=3, N=N, K=K, stride_xm=K, sqn=K,
                            ssk=ssk, ssn=ssn)
                if lay.zero == "int":
                    args.update(z_ptr="*i8", szk=1, szn=K // 128)
                else:  # (the launcher passes the codes and zero strides in the zeros' place)
                    args.update(z_ptr="*u8", szk=0, szn=0)
                ce = dict(GK=lay.group_k, GN=lay.group_n, SCALE_PER_TILE=lay.group_k < K, HAS_GLOBAL=False,
                          HAS_BIAS=False, SPLIT_K=cfg.SPLIT_K, BLOCK_M=16, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                          CODE=CODES[lay.value], HAS_ZERO=lay.zero == "int", C=0.0)
                builds.append(TritonBuild("fp8_mma", f"{name} BLOCK_N={cfg.BLOCK_N} SPLIT_K={cfg.SPLIT_K} "
                                          f"w{cfg.num_warps} s{cfg.num_stages} M=16 [{N}x{K}]", fp8_mma_kernel, args,
                                          ce, cfg.num_warps, cfg.num_stages))
    # the grouped launch for a decoder's q / k / v (4096 + 1024 + 1024 columns, K = 4096) at 16 rows, FP8 per channel
    K, Ns = 4096, (4096, 1024, 1024)
    for cfg in dict.fromkeys(c for c in dm._packed_candidates(16, sum(Ns), K, 132, channel) if isinstance(c, Fp8Mma)):
        # member fields: not multiples of 16 (no divisibility hint: do_not_specialize), offsets 64-bit
        members = dict(M=3, N=4099, T1=67, T2=83, N1=1027, N2=1027, DQ1=2**40 + 3, DQ2=-2**40 - 3,
                       DS1=2**40 + 3, DS2=-2**40 - 3, DZ1=2**40 + 3, DZ2=-2**40 - 3, DO1=2**40 + 3,
                       DO2=-2**40 - 3, DW1=2**40 + 3, DW2=2**41 + 3)
        args = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", z_ptr="*u8", out_ptr="*bf16", ws_ptr="*fp32",
                    cnt_ptr="*i32", **members, K=K, stride_xm=K, sqn=K, ssk=0, ssn=1, szk=0, szn=0)
        ce = dict(GK=channel.group_k, GN=channel.group_n, SCALE_PER_TILE=channel.group_k < K, SPLIT_K=cfg.SPLIT_K,
                  BLOCK_M=16, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, CODE=CODES[channel.value], HAS_ZERO=False,
                  C=0.0, QA=16)
        builds.append(TritonBuild("fp8_mma_group", f"fp8_channel BLOCK_N={cfg.BLOCK_N} SPLIT_K={cfg.SPLIT_K} "
                                  f"w{cfg.num_warps} s{cfg.num_stages} [16x({'+'.join(map(str, Ns))})x{K}]",
                                  fp8_mma_group_kernel, args, ce, cfg.num_warps, cfg.num_stages))
    return builds
