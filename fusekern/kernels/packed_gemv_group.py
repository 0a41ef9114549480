"""Two or three packed weights that multiply the same activation rows, in one GEMV launch.

A decoder's q / k / v (and gate / up) projections read the same x; launched one by one, each small GEMV
pays its own launch, ramp-up and split-K tail (on the H200 a 1024 x 4096 int4 GEMV takes 4.2 µs against a
0.5 µs floor). Here the members' column tiles share one grid: program ``pid`` along axis 0 finds its member
from the tile boundaries, moves the leaf, output and workspace pointers to that member's tensors and runs
the same program as ``packed_mm.packed_gemv_kernel`` (``packed_mm.gemv_program``). Nothing is copied or
repacked: a member's leaves are reached as element offsets from the first member's (any two tensors of
one dtype on a device are a whole number of elements apart in the address space when both are aligned to
their element size, which the launcher checks). Each member's output is the separate launch's, bit for
bit, with the same config. Configs that read K in vectors (``vec_k``) are grouped only where every
member's codes start 16-byte aligned: the launch then tells the compiler so (``QALIGN``). The member offsets
are runtime values; without that hint the compiler cannot prove the words aligned, loads them one by one in
another layout and sums in another order (on the H200 one output of 14336 came out a bf16 ulp off).

The members must share the activation, K, the packed layout and every leaf stride (e.g. int4 bytes
``[N, K/2]`` with scales ``[N, K/G]``: strides depend on K only); GPTQ's ``[K/8, N]`` words, whose strides
depend on N, and layouts with a global scale or packed along N are not grouped (``group_args`` returns
None and the caller launches the members one by one).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusekern.kernels import packed_mm as pm
from fusekern.kernels import replay
from fusekern.kernels.group_member import pick as pick_member
from fusekern.kernels.intmath import cdiv, needs_i64
from fusekern.kernels.split_counters import split_counters
from fusekern.patterns.decode.layout import PackedLayout

MAX_MEMBERS = 3
_MEMBER_ARGS = ["T1", "T2", "N1", "N2", "DQ1", "DQ2", "DS1", "DS2", "DZ1", "DZ2", "DO1", "DO2", "DW1", "DW2"]


@triton.jit(do_not_specialize=_MEMBER_ARGS)  # offsets between allocations change per weight: one compile
def packed_gemv_group_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, KW,
    stride_xm, stride_xk,
    sqk: tl.constexpr, sqn: tl.constexpr, ssk: tl.constexpr, ssn: tl.constexpr, szk: tl.constexpr,
    szn: tl.constexpr,  # compile-time constants, as in packed_gemv_kernel
    T1, T2, N1, N2, DQ1, DQ2, DS1, DS2, DZ1, DZ2, DO1, DO2, DW1, DW2,
    BITS: tl.constexpr, P: tl.constexpr, KPOS: tl.constexpr, VALUE: tl.constexpr, WORD_I32: tl.constexpr,
    ZERO: tl.constexpr, ZERO_VALUE: tl.constexpr, ZPW: tl.constexpr, ZORDER: tl.constexpr,
    SCALE: tl.constexpr, GK: tl.constexpr, GN: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC_K: tl.constexpr,
    ASM: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr, QALIGN: tl.constexpr = 1,
):
    """Member 0 owns column tiles [0, T1), member 1 [T1, T2), member 2 [T2, tiles); N, N1, N2 are their
    widths, D*1 / D*2 the element offsets of members 1 and 2's codes, scales, zeros, outputs ([M, N_i],
    contiguous) and split-K partials from member 0's. The split-K counter is the program's own tile.
    QALIGN: the codes' offsets are multiples of this many elements (16 bytes), checked by the launcher."""
    pid = tl.program_id(0)
    in1 = pid >= T1
    in2 = pid >= T2
    n = pick_member(in1, in2, N, N1, N2)
    first = pick_member(in1, in2, 0, T1, T2)
    dq = pick_member(in1, in2, 0, DQ1, DQ2)
    if QALIGN > 1:  # (a multiple already: the product tells the compiler, where tl.multiple_of on a scalar did not)
        dq = (dq // QALIGN) * QALIGN
    pm.gemv_program(pid - first, pid, tl.program_id(1), tl.program_id(2), x_ptr,
                    q_ptr + dq, s_ptr + pick_member(in1, in2, 0, DS1, DS2),
                    z_ptr + pick_member(in1, in2, 0, DZ1, DZ2), g_ptr, out_ptr, out_ptr + pick_member(in1, in2, 0, DO1, DO2),
                    ws_ptr + pick_member(in1, in2, 0, DW1, DW2), cnt_ptr, M, n, K, KW,
                    stride_xm, stride_xk, sqk, sqn, ssk, ssn, szk, szn, n, 1,
                    BITS, P, KPOS, VALUE, WORD_I32, ZERO, ZERO_VALUE, ZPW, ZORDER, SCALE, GK, GN, HAS_GLOBAL,
                    False, SPLIT_K, BLOCK_N, BLOCK_K, VEC_K, ASM, EVEN, I64)


def _offset(t: torch.Tensor, base: torch.Tensor) -> int | None:
    """How many elements of ``base``'s dtype ``t`` starts after ``base`` (None: not a whole number)."""
    d = t.data_ptr() - base.data_ptr()
    return d // base.element_size() if d % base.element_size() == 0 else None


def _one_program(members: list, lay: PackedLayout, K: int, Ns: list[int], anywhere: bool = False):
    """(word reading, member 0's pointers, strides and constexprs, every member's) where one program serves
    all members, else None. This depends on the programs and layout (a leaf's strides are its program's)
    and on whether 1-byte codes start 4-byte aligned (read as words), unless ``anywhere``: as if they did."""
    if not 2 <= len(members) <= MAX_MEMBERS or lay.pack_axis == "N" or lay.glob >= 0:
        return None
    words, common = [], []
    for leaves, N in zip(members, Ns):
        w = pm._words(lay, leaves[lay.code], anywhere)
        words.append(w)
        common.append(pm._common(lay, leaves, K, N, w[0]))
    if any(w != words[0] for w in words) or any(c[1:] != common[0][1:] for c in common):
        return None  # another word reading, stride or constexpr: not one program
    return words[0], common


def one_program(members: list, lay: PackedLayout, K: int, Ns: list[int]) -> bool:
    """Can one program serve these members, wherever their leaves lie (another layer's leaves for the same
    programs may start aligned where these do not)? ``group_args`` also needs the leaves where they are to
    agree and a whole number of elements apart."""
    return _one_program(members, lay, K, Ns, anywhere=True) is not None


def group_args(x: torch.Tensor, members: list, lay: PackedLayout, K: int, Ns: list[int]):
    """The shared arguments of a grouped launch (pointers and strides of member 0, constexprs) and each
    member's leaf pointers, or None where the members cannot share one launch (see the module doc)."""
    shared = _one_program(members, lay, K, Ns)
    if shared is None:
        return None
    word, common = shared
    ptrs = [c[0] for c in common]  # (q, s, z, g) per member
    offsets = []
    for p in ptrs[1:]:
        offs = [_offset(t, t0) for t, t0 in zip(p[:3], ptrs[0][:3])]
        if any(o is None for o in offs) or any(t.dtype != t0.dtype for t, t0 in zip(p[:3], ptrs[0][:3])):
            return None
        offsets.append(offs)
    return word, common[0], offsets


def gemv_group(x: torch.Tensor, members: list, lay: PackedLayout, K: int, Ns: list[int], cfg: pm.PackedGemv,
               workspace: torch.Tensor | None = None, record=None) -> list[torch.Tensor] | None:
    """``[x @ W_i for each member]`` in one launch (members: each one's leaves, Ns: their N), or None where
    they cannot share one (the caller runs ``packed_mm.gemv`` per member). workspace: the fp32
    ``[SPLIT_K * M * sum(Ns)]`` partials of a split launch (tests pass one full of NaN). record: called
    with a ``GemvGroupReplay`` of this call (no workspace given)."""
    M = x.shape[0]
    args = group_args(x, members, lay, K, Ns)
    if args is None:
        return None
    (word_i32, p, order), (ptrs, (kw, sqk, sqn, ssk, ssn, szk, szn), consts), offsets = args
    qalign = 16 // ptrs[0][0].element_size()
    if cfg.vec_k and (ptrs[0][0].data_ptr() % 16 or any(o[0] % qalign for o in offsets)):
        return None  # K-vector reads of codes not all 16-byte aligned: not one program (module doc)
    tiles = [cdiv(n, cfg.BLOCK_N) for n in Ns]
    outs, ws, cnt, out_offsets, ws_offsets = group_outputs(x, Ns, cfg.SPLIT_K, M * sum(tiles), workspace,
                                                           "gemv_group")
    even = K % cfg.BLOCK_K == 0 and all(n % cfg.BLOCK_N == 0 for n in Ns)
    i64 = needs_i64(*(leaves[lay.code] for leaves in members))
    q, s, z, g = ptrs
    rec = record is not None and workspace is None
    launch = replay.launch(packed_gemv_group_kernel, (sum(tiles), cfg.SPLIT_K, M), (
        x, q, s, z, g, outs[0], ws, cnt, M, Ns[0], K, kw,
        x.stride(0), x.stride(1), sqk, sqn, ssk, ssn, szk, szn,
        *member_fields(tiles, Ns, offsets, out_offsets, ws_offsets)), dict(
        P=p, KPOS=pm._kpos(order), WORD_I32=word_i32, SPLIT_K=cfg.SPLIT_K, BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K, VEC_K=cfg.vec_k, ASM=not pm._INTERPRET, EVEN=even, I64=i64,
        QALIGN=qalign if cfg.vec_k else 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts), rec)
    if rec and launch.replayable:
        record(GemvGroupReplay(launch, M, Ns, x.dtype, cfg.SPLIT_K))
    return outs


def group_outputs(x: torch.Tensor, Ns: list[int], split_k: int, counters: int, workspace, name: str):
    """A grouped launch's fresh outputs ``[M, N_i]``, its fp32 split-K partials (``[split_k * M * sum(Ns)]``,
    each member's part after the previous one's; workspace: the caller's, checked) and ``counters`` zeroed
    split counters, with the members' output and partial offsets from member 0's. Without a split the
    partials and counters are outs[0] (not touched)."""
    M = x.shape[0]
    outs = [torch.empty((M, n), device=x.device, dtype=x.dtype) for n in Ns]
    if split_k > 1:
        total = split_k * M * sum(Ns)
        ws = workspace if workspace is not None else torch.empty(total, device=x.device, dtype=torch.float32)
        if ws.numel() != total or ws.dtype != torch.float32 or not ws.is_contiguous():
            raise ValueError(f"{name}: workspace must be a contiguous float32 [{total}]")
        cnt = split_counters(x.device, counters)
        ws_offsets = [split_k * M * sum(Ns[:i]) for i in range(1, len(Ns))]
    else:
        ws = cnt = outs[0]
        ws_offsets = [0] * (len(Ns) - 1)
    out_offsets = [_offset(o, outs[0]) for o in outs[1:]]  # (fresh allocations: whole elements apart)
    return outs, ws, cnt, out_offsets, ws_offsets


def member_fields(tiles: list[int], Ns: list[int], leaf_offsets, out_offsets, ws_offsets) -> list[int]:
    """The grouped kernels' member arguments T1, T2, N1, N2, DQ1, DQ2, DS1, DS2, DZ1, DZ2, DO1, DO2, DW1,
    DW2 (leaf_offsets: the (codes, scales, zeros) element offsets of members 1 and 2 from member 0's)."""
    # member 2's fields repeat member 1's where there are two members (its first tile is past the grid)
    pad = (lambda v: v + v[-1:] * (MAX_MEMBERS - 1 - len(v)))
    t_bounds = pad([sum(tiles[:i]) for i in range(1, len(tiles))])
    if len(tiles) == 2:
        t_bounds[1] = sum(tiles)
    return [*t_bounds, *pad(Ns[1:]), *(v for i in range(3) for v in pad([o[i] for o in leaf_offsets])),
            *pad(out_offsets), *pad(ws_offsets)]


class GemvGroupReplay:
    """``gemv_group``'s launch replayed for a new activation: fresh outputs (their offsets from the first
    one are arguments) and fresh split-K partials per call; leaves and counters are the recorded ones.
    Returns None where the new outputs lie 2**31 elements or more apart and the recorded launch took
    32-bit offsets (the JIT types an unspecialized int by its value: the caller's path compiles the 64-bit
    variant)."""

    def __init__(self, launch, M: int, Ns: list[int], dtype: torch.dtype, split_k: int):
        self.launch, self.M, self.Ns, self.dtype, self.split_k = launch, M, list(Ns), dtype, split_k
        self.total = split_k * M * sum(Ns)
        self.slots = launch.slots("x_ptr", "out_ptr", "DO1", "DO2", "ws_ptr", *(() if split_k > 1 else ("cnt_ptr",)))
        self.narrow = all(_fits_i32(launch.args[i]) for i in self.slots[2:4])

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        outs = [torch.empty((self.M, n), device=x.device, dtype=self.dtype) for n in self.Ns]
        base, es = outs[0].data_ptr(), outs[0].element_size()
        d = [(o.data_ptr() - base) // es for o in outs[1:]]
        if self.narrow and not all(_fits_i32(v) for v in d):
            return None
        vals = (x, outs[0], d[0], d[-1])  # (two members: the second offset repeats the first)
        if self.split_k > 1:
            vals += (torch.empty(self.total, device=x.device, dtype=torch.float32),)
        else:
            vals += (outs[0], outs[0])
        self.launch.run(self.slots, vals)
        return outs


def aot_builds():
    """The grouped GEMV for a decoder's q / k / v (N = 4096 + 1024 + 1024, K = 4096, one row), in the
    layouts it takes, at the first two GEMV configs the dispatcher offers for 6144 columns."""
    from fusekern.kernels import decode_mm as dm
    from fusekern.kernels.catalog import TritonBuild

    K, Ns = 4096, (4096, 1024, 1024)
    builds = []
    for name in ("int4_k_stack", "mxfp4", "int8_channel", "fp8_channel"):
        lay, (qt, st, zt) = pm.REPORT_LAYOUTS[name]
        word_i32, p, order = pm._words(lay)
        kw = K // lay.per_word if lay.pack_axis == "K" else K
        sqn = kw // 4 if word_i32 else kw
        gemvs = [c for c in dm._packed_candidates(1, sum(Ns), K, 132, lay) if isinstance(c, pm.PackedGemv)]
        for cfg in gemvs[:2] + [c for c in gemvs if c.vec_k][:1]:
            # member fields: not multiples of 16 (no divisibility hint: do_not_specialize), offsets 64-bit
            members = dict(T1=67, T2=83, N1=1027, N2=1027, DQ1=2**40 + 3, DQ2=-2**40 - 3, DS1=2**40 + 3,
                           DS2=-2**40 - 3, DZ1=2**40 + 3, DZ2=-2**40 - 3, DO1=2**40 + 3, DO2=-2**40 - 3,
                           DW1=2**40 + 3, DW2=2**41 + 3)
            args = dict(x_ptr="*bf16", q_ptr=qt, s_ptr=st, z_ptr=zt, g_ptr="*fp32", out_ptr="*bf16",
                        ws_ptr="*fp32", cnt_ptr="*i32", M=3, N=Ns[0], K=K, KW=kw // 4 if word_i32 else kw,
                        stride_xm=K, stride_xk=1, sqk=1, sqn=sqn, ssk=0 if lay.scale_dims == ("n",) else 1,
                        ssn=1 if lay.scale_dims == ("n",) else K // lay.group_k, szk=1, szn=K // lay.group_k,
                        **members)
            ce = dict(pm._constexprs(lay, False), P=p, KPOS=pm._kpos(order), WORD_I32=word_i32,
                      SPLIT_K=cfg.SPLIT_K, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, VEC_K=cfg.vec_k, ASM=True,
                      EVEN=True, I64=False, QALIGN={"*u8": 16, "*i8": 16, "*i32": 4}[qt] if cfg.vec_k else 1)
            builds.append(TritonBuild("packed_gemv_group", f"{name} BLOCK_N={cfg.BLOCK_N} BLOCK_K={cfg.BLOCK_K} "
                                      f"SPLIT_K={cfg.SPLIT_K}{' vec_k' if cfg.vec_k else ''} w{cfg.num_warps} "
                                      f"s{cfg.num_stages} "
                                      f"[1x({'+'.join(map(str, Ns))})x{K}]", packed_gemv_group_kernel, args, ce,
                                      cfg.num_warps, cfg.num_stages))
    return builds


def _fits_i32(v: int) -> bool:
    return -2**31 <= v < 2**31
