"""Several packed weights on the same rows in one GEMV launch (``fusekern.kernels.packed_gemv_group``).

Each member's output must be exactly what its own ``packed_mm.gemv`` launch with the same config gives
(bit for bit: the same program runs, only its pointers move), and within the float64 reference's
tolerance. CPU: the Triton interpreter on small shapes with column tails, split K (NaN-poisoned
partials) and none, two and three members; members that cannot share a launch (another layout's
strides, a global scale) are refused. GPU: the decoder's q / k / v shapes.
"""
import functools

import pytest
import torch

from fusekern.kernels import fp8_mma as f8
from fusekern.kernels import int4_mma as im
from fusekern.kernels import int4_mma_sync as ims
from fusekern.kernels import packed_gemv_group as pg
from fusekern.kernels import packed_mm as pm
from fusekern.patterns.decode.formats import recognize
from fusekern.patterns.decode.layout import derive_layout
from fusekern.patterns.decode.program import DecodeProgram
from fusekern.kernels.intmath import next_power_of_2
from fusekern.testing import rel_err
from fusekern.testing.decode_cones import decode_program
from fusekern.testing.decode_zoo import BY_NAME

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}


def member(fmt, K, N, x, seed):
    """(leaves, layout) of the zoo's ``fmt`` weight at N x K, groups of 128, on x's device."""
    return _member(fmt, K, N, x.dtype, x.device, seed)


@functools.lru_cache(maxsize=32)  # (tracing a 4096-wide decode takes seconds; the GPU tests reuse them)
def _member(fmt, K, N, dtype, device, seed):
    torch.manual_seed(seed)
    case = BY_NAME[fmt]
    ws = [w.to(dtype) if w.dtype in (torch.bfloat16, torch.float16, torch.float32) else w
          for w in case.make(K, N, 128, "cpu")]
    text, leaves, consts = decode_program(case.fn, torch.randn(1, K, dtype=dtype), *ws)
    prog = DecodeProgram.from_text(text)
    return [t.to(device) for t in leaves], derive_layout(prog, recognize(prog, consts), consts)


def _check(fmt, K, Ns, M, cfg, dtype=torch.bfloat16, members=None):
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    made = [member(fmt, K, n, x, seed) for seed, n in enumerate(Ns)]
    lay = made[0][1]
    assert all(m[1] == lay for m in made)
    members = members or [m[0] for m in made]
    ws = None
    if cfg.SPLIT_K > 1:
        ws = torch.full((cfg.SPLIT_K * M * sum(Ns),), float("nan"), device=DEVICE)  # poisoned partials
    from fusekern.kernels import decode_mm_group as dmg

    got = dmg.group_launch(x, members, lay, K, Ns, cfg, workspace=ws)  # (the GEMV's, or int4_mma_sync's)
    assert got is not None and len(got) == len(Ns)
    if ws is not None:  # every member wrote its partials to its own part (none left poisoned)
        assert not ws.isnan().any()
    for leaves, n, out in zip(members, Ns, got):
        alone = pm.packed_mm(x, leaves, lay, K, n, cfg)
        want = pm.packed_mm_reference(x, leaves, lay, K, n)
        assert out.shape == (M, n) and out.dtype == dtype and not out.isnan().any()
        assert torch.equal(out, alone)
        assert rel_err(out.float().cpu(), want.float().cpu()) < TOL[dtype]


@pytest.mark.parametrize("fmt", ["int4_k_stack", "int8_channel", "mxfp4"])
@pytest.mark.parametrize("Ns,M,split_k", [((64, 32, 32), 1, 2), ((96, 40), 2, 1), ((40, 72, 24), 1, 3)],
                         ids=["three_split", "two_tails_no_split", "three_tails_split"])
def test_group_matches_each_launch(fmt, Ns, M, split_k):
    _check(fmt, 256, list(Ns), M, pm.PackedGemv(32, 128, split_k, 4))


@pytest.mark.parametrize("Ns,M,cfg", [((64, 32, 40), 1, ims.Int4MmaSync(SPLIT_K=2)),
                                      ((96, 136), 3, ims.Int4MmaSync(SPLIT_K=1, GROUPS_PER_WARP=2)),
                                      ((64, 40), 8, ims.Int4MmaSync(SPLIT_K=2))],
                         ids=["three_split", "two_tails_two_groups", "eight_rows"])
def test_int4_mma_sync_group_matches_each_launch(Ns, M, cfg):
    """``int4_mma_sync``'s grouped launch: each member's output is its own launch's, bit for bit."""
    _check("int4_k_stack", 256, list(Ns), M, cfg)


def test_int4_mma_sync_group_needs_one_program():
    """GPTQ's [K/8, N] words have strides that depend on N: no grouped launch (the members run alone)."""
    x = torch.randn(1, 256, dtype=torch.bfloat16, device=DEVICE)
    made = [member("gptq", 256, n, x, seed) for seed, n in enumerate((64, 32))]
    assert ims.int4_mma_sync_group(x, [m[0] for m in made], made[0][1], 256, [64, 32],
                                   ims.Int4MmaSync(SPLIT_K=1)) is None


@pytest.mark.parametrize("K,Ns,M,cfg", [(512, (64, 32, 40), 3, im.Int4Mma(64, 2, 4)),
                                        (384, (96, 136), 17, im.Int4Mma(128, 1, 4, scale_first=True)),
                                        (384, (128, 64), 40, im.Int4Mma(64, 3, 4))],
                         ids=["three_tails_split", "two_tails_32_rows_scale_first", "whole_tiles_64_rows"])
def test_int4_mma_group_matches_each_launch(K, Ns, M, cfg):
    """``int4_mma``'s grouped launch (up to 64 rows: x padded to 16, 32 or 64): each member's output is its own
    launch's, bit for bit, split K partials NaN-poisoned."""
    _check("int4_k_stack", K, list(Ns), M, cfg)


@pytest.mark.parametrize("Ns,M,split_k", [((64, 32, 40), 16, 2), ((128, 64), 33, 1)],
                         ids=["three_split", "two_64_rows"])
def test_int4_mma_group_tma_matches_each_launch(Ns, M, split_k):
    """With TMA words (each member through its own descriptor): each output is its own TMA launch's."""
    _check("int4_k_stack", 256, list(Ns), M, im.Int4Mma(64, split_k, 4, tma=True, num_stages=3))


def test_int4_mma_group_refuses_per_member_strides_and_mixed_tma():
    """GPTQ's [K/8, N] words (strides that depend on N) and members whose words are 16-byte aligned for some
    only (TMA for those alone, as their own launches would): None, and the members run alone."""
    x = torch.randn(16, 256, dtype=torch.bfloat16, device=DEVICE)
    gptq = [member("gptq", 256, n, x, seed) for seed, n in enumerate((64, 32))]
    assert im.int4_mma_group(x, [m[0] for m in gptq], gptq[0][1], 256, [64, 32], im.Int4Mma(64, 1, 4)) is None
    ks = [member("int4_k_stack", 256, n, x, seed) for seed, n in enumerate((64, 32))]
    codes = torch.empty(32 * 128 + 4, dtype=torch.uint8, device=DEVICE)[4:].view(32, 128)  # 4 bytes off 16
    codes.copy_(ks[1][0][0])
    skewed = [ks[0][0], [codes, *ks[1][0][1:]]]
    tma = im.Int4Mma(64, 1, 4, tma=True, num_stages=3)
    assert im.int4_mma_group(x, skewed, ks[0][1], 256, [64, 32], tma) is None
    outs = im.int4_mma_group(x, skewed, ks[0][1], 256, [64, 32], im.Int4Mma(64, 1, 4))  # direct loads: fine
    assert outs is not None and torch.equal(outs[1], im.int4_mma(x, skewed[1], ks[0][1], 256, 32, im.Int4Mma(64, 1, 4)))


@pytest.mark.parametrize("fmt,Ns,M,cfg", [
    ("fp8_channel", (64, 32, 40), 16, f8.Fp8Mma(64, 128, 2)),
    ("fp8_block", (256, 384), 9, f8.Fp8Mma(64, 128, 3)),
    ("int8_group_asym", (96, 40), 5, f8.Fp8Mma(64, 128, 1, num_warps=8)),
    ("int8_channel", (64, 136, 24), 2, f8.Fp8Mma(128, 128, 2))],
    ids=["fp8_three_split", "fp8_block_scales", "int8_zeros_no_split", "int8_three_tails"])
def test_fp8_mma_group_matches_each_launch(fmt, Ns, M, cfg):
    """``fp8_mma``'s grouped launch (8-bit codes along K, 2-16 rows): each member's output is its own launch's,
    bit for bit, split K partials NaN-poisoned (block scales, 8-bit zero points, column tails)."""
    _check(fmt, 384, list(Ns), M, cfg)


def test_fp8_mma_group_codes_not_16_bytes_apart():
    """Members whose codes lie a multiple of 16 bytes apart let the kernel know it (QA = 16: vector loads);
    4 bytes off, the same launch reads them without that promise, and each output is still its own launch's."""
    K, Ns = 256, [64, 40]
    x = torch.randn(16, K, dtype=torch.bfloat16, device=DEVICE)
    made = [member("fp8_channel", K, n, x, seed) for seed, n in enumerate(Ns)]
    buf = torch.empty(Ns[1] * K + 4, dtype=torch.uint8, device=DEVICE)
    codes = buf[4:].view(made[1][0][0].dtype).view(Ns[1], K)
    codes.copy_(made[1][0][0])
    assert (codes.data_ptr() - made[0][0][0].data_ptr()) % 16 == 4
    _check("fp8_channel", K, Ns, 16, f8.Fp8Mma(64, 128, 2), members=[made[0][0], [codes, *made[1][0][1:]]])


@pytest.mark.parametrize("fmt", ["fp8_channel", "int8_channel"])
def test_byte_codes_read_as_words(fmt):
    """fp8 and int8 codes viewed as bytes, then read four at a time as int32 words (pointer offsets in
    bytes, cast after the move); two members, split K; also read in K vectors."""
    _check(fmt, 256, [64, 40], 1, pm.PackedGemv(32, 128, 2, 4))
    _check(fmt, 256, [64, 40], 1, pm.PackedGemv(32, 128, 2, 4, vec_k=True))


def members_in_one_buffer(K: int, skew: int):
    """Two int8 members (64 and 40 rows of K) laid out in one byte buffer, member 1 ``skew`` bytes past the
    end of member 0 (K a multiple of 16: skew 0 keeps its codes 16-byte aligned, 4 does not; still whole
    int32 words). Returns (x, members, layout)."""
    x = torch.randn(1, K, dtype=torch.bfloat16, device=DEVICE)
    made = [member("int8_channel", K, n, x, seed) for seed, n in enumerate((64, 40))]
    buf = torch.zeros(104 * K + 16, dtype=torch.int8, device=DEVICE)
    q0 = buf[:64 * K].view(64, K)
    q1 = buf[64 * K + skew:104 * K + skew].view(40, K)
    q0.copy_(made[0][0][0])
    q1.copy_(made[1][0][0])
    return x, [[q0, *made[0][0][1:]], [q1, *made[1][0][1:]]], made[0][1]


@pytest.mark.parametrize("gap", [2**31, -2**31, 2**33], ids=["2GiB_after", "2GiB_before", "8GiB_after"])
def test_fp8_mma_group_members_gigabytes_apart(gap):
    """Members' codes 16-byte multiples apart take the aligned build (QA = 16), whose offset once came
    divided by 16 and was multiplied back in 32 bits: from 2 GiB apart it wrapped and member 1 read other
    memory. One CPU buffer holds both (pages never written cost nothing); each output must be its own
    launch's."""
    K, Ns = 256, [64, 40]
    x = torch.randn(4, K, dtype=torch.bfloat16)
    made = [member("fp8_channel", K, n, x, seed) for seed, n in enumerate(Ns)]
    lay, dt = made[0][1], made[0][0][0].dtype
    span = abs(gap) + max(Ns) * K
    buf = torch.empty(span + 64, dtype=torch.uint8)
    starts = (0, gap) if gap > 0 else (-gap, 0)
    codes = []
    for (leaves, _), n, at in zip(made, Ns, starts):
        q = buf[at:at + n * K].view(dt).view(n, K)
        q.copy_(leaves[0])
        codes.append(q)
    assert (codes[1].data_ptr() - codes[0].data_ptr()) == gap
    members = [[q, *leaves[1:]] for q, (leaves, _) in zip(codes, made)]
    cfg = f8.Fp8Mma(64, 128, 1)
    outs = f8.fp8_mma_group(x, members, lay, K, Ns, cfg)
    assert outs is not None
    for o, m, n in zip(outs, members, Ns):
        assert torch.equal(o, f8.fp8_mma(x, m, lay, K, n, cfg))


def check_vector_k_alignment():
    """Aligned members take a K-vector config as one launch, each output its own launch's; members one of
    whose codes start 4 bytes off 16 are refused (None: the hint would be false), and run grouped with
    the same tiles read word by word."""
    K = 256
    cfg = pm.PackedGemv(32, 128, 2, 4, vec_k=True)
    x, aligned, lay = members_in_one_buffer(K, 0)
    outs = pg.gemv_group(x, aligned, lay, K, [64, 40], cfg)
    assert outs is not None
    for o, m, n in zip(outs, aligned, (64, 40)):
        assert torch.equal(o, pm.gemv(x, m, lay, K, n, cfg))
    x, skewed, lay = members_in_one_buffer(K, 4)
    assert skewed[1][0].data_ptr() % 16 == 4
    assert pg.gemv_group(x, skewed, lay, K, [64, 40], cfg) is None
    rows = pm.PackedGemv(32, 128, 2, 4)
    outs = pg.gemv_group(x, skewed, lay, K, [64, 40], rows)
    for o, m, n in zip(outs, skewed, (64, 40)):
        assert torch.equal(o, pm.gemv(x, m, lay, K, n, rows))
        assert rel_err(o.float().cpu(), pm.packed_mm_reference(x, m, lay, K, n).float().cpu()) < TOL[torch.bfloat16]


def test_vector_k_reads_need_every_members_codes_16_byte_aligned():
    check_vector_k_alignment()


@pytest.mark.gpu
def test_gpu_vector_k_reads_need_every_members_codes_16_byte_aligned():
    check_vector_k_alignment()


def test_members_before_member_zero_and_inside_one_buffer():
    """Negative offsets (members allocated before member 0) and members that are row slices of one
    buffer (small positive offsets)."""
    K, Ns, x = 256, [64, 32, 32], torch.randn(1, 256, dtype=torch.bfloat16, device=DEVICE)
    made = [member("int8_channel", K, n, x, seed) for seed, n in enumerate(Ns)]
    cfg = pm.PackedGemv(32, 128, 2, 4)
    q = torch.cat([m[0][0] for m in made])  # one [128, K] int8 buffer, each member a row slice of it
    s = torch.cat([m[0][1] for m in made])
    starts = [0, 64, 96]
    sliced = [[q[a:a + n], s[a:a + n]] for a, n in zip(starts, Ns)]
    assert sliced[1][0].data_ptr() - sliced[0][0].data_ptr() == 64 * K
    _check("int8_channel", K, Ns, 1, cfg, members=sliced)
    backwards = sliced[::-1]  # member 0 last in the buffer: the others lie before it
    assert backwards[1][0].data_ptr() - backwards[0][0].data_ptr() == -32 * K
    _check("int8_channel", K, Ns[::-1], 1, cfg, members=backwards)


def test_fp16_rows_and_whole_tiles():
    _check("int4_k_stack", 256, [64, 64, 128], 2, pm.PackedGemv(64, 128, 2, 4), dtype=torch.float16)


def test_members_that_cannot_share_a_launch_are_refused():
    """GPTQ's [K/8, N] words (row stride N: another per member), a global scale (NVFP4), one member or
    four: None, and the caller launches them one by one."""
    K = 256
    x = torch.randn(1, K, dtype=torch.bfloat16, device=DEVICE)
    gptq = [member("gptq", K, n, x, i) for i, n in enumerate((64, 32))]
    assert pg.group_args(x, [m[0] for m in gptq], gptq[0][1], K, [64, 32]) is None
    nv = [member("nvfp4", K, n, x, i) for i, n in enumerate((64, 64))]
    assert pg.group_args(x, [m[0] for m in nv], nv[0][1], K, [64, 64]) is None
    ks = [member("int4_k_stack", K, 64, x, i) for i in range(4)]
    lay = ks[0][1]
    assert pg.group_args(x, [ks[0][0]], lay, K, [64]) is None
    assert pg.group_args(x, [m[0] for m in ks], lay, K, [64] * 4) is None
    assert pg.group_args(x, [m[0] for m in ks[:3]], lay, K, [64] * 3) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("M", [16, 33])
@pytest.mark.parametrize("Ns", [(4096, 1024, 1024), (14336, 14336)], ids=["qkv", "gate_up"])
def test_gpu_int4_mma_group_every_config_the_tuner_may_pick(Ns, M):
    """At 16 and 33 rows (x padded to 16 and 64), every ``int4_mma`` config the dispatcher offers for the summed
    width, and the same tiles without TMA (``with_plain_loads``), gives each member its own launch's output."""
    from fusekern.kernels import decode_mm_group as dmg
    from fusekern.kernels.device_info import sm_count

    lay = member("int4_k_stack", 4096, Ns[0], torch.empty(1, 4096, dtype=torch.bfloat16, device=DEVICE), 0)[1]
    cfgs = [c for c in dmg.group_candidates(next_power_of_2(M), sum(Ns), 4096, sm_count(torch.device(DEVICE)), lay)
            if isinstance(c, im.Int4Mma)]
    assert cfgs and any(c.tma for c in cfgs)
    for cfg in with_plain_loads(cfgs):
        _check("int4_k_stack", 4096, list(Ns), M, cfg)


def with_plain_loads(cfgs: list) -> list:
    """The configs and what the grouped op runs instead where a layer's codes are not 16-byte aligned
    (``decode_mm_group._plain_loads``: the tuner never times those, so the GPU tests run them)."""
    from fusekern.kernels import decode_mm_group as dmg

    return list(dict.fromkeys([*cfgs, *(p for p in map(dmg._plain_loads, cfgs) if p is not None)]))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_channel", "int8_channel"])
@pytest.mark.parametrize("Ns", [(4096, 1024, 1024), (14336, 14336)], ids=["qkv", "gate_up"])
def test_gpu_fp8_mma_group_every_config_the_tuner_may_pick(fmt, Ns):
    """At 16 rows, every ``fp8_mma`` config the dispatcher offers for the summed width gives each member its own
    launch's output."""
    from fusekern.kernels import decode_mm_group as dmg
    from fusekern.kernels.device_info import sm_count

    lay = member(fmt, 4096, Ns[0], torch.empty(1, 4096, dtype=torch.bfloat16, device=DEVICE), 0)[1]
    cfgs = [c for c in dmg.group_candidates(16, sum(Ns), 4096, sm_count(torch.device(DEVICE)), lay)
            if isinstance(c, f8.Fp8Mma)]
    assert cfgs
    for cfg in cfgs:
        _check(fmt, 4096, list(Ns), 16, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_k_stack", "int8_channel", "fp8_channel"])
@pytest.mark.parametrize("Ns", [(4096, 1024, 1024), (14336, 14336), (4096, 1000, 1000)],
                         ids=["qkv", "gate_up", "uneven"])
def test_gpu_every_config_the_tuner_may_pick(fmt, Ns):
    """At a decoder's q / k / v and gate / up shapes, every GEMV (and, for int4, ``int4_mma_sync``) config
    the dispatcher offers for the summed width (what ``decode_mm_group`` may choose) gives each member its
    own launch's output. "uneven": members whose widths are not all whole tiles, where the group's launch
    takes the masked address path for a member whose own launch would not."""
    from fusekern.kernels import decode_mm_group as dmg
    from fusekern.kernels.device_info import sm_count

    lay = member(fmt, 4096, Ns[0], torch.empty(1, 4096, dtype=torch.bfloat16, device=DEVICE), 0)[1]
    cfgs = dmg.group_candidates(1, sum(Ns), 4096, sm_count(torch.device(DEVICE)), lay)
    assert cfgs
    for cfg in with_plain_loads(cfgs):
        _check(fmt, 4096, list(Ns), 1, cfg)


def test_group_candidates_are_the_dispatchers_gemv_configs():
    """The grouped launch is offered the dispatcher's GEMV configs for the summed width, those reading K in
    vectors included (``gemv_group`` refuses them per call where the codes are not 16-byte aligned)."""
    from fusekern.kernels import decode_mm as dm
    from fusekern.kernels import decode_mm_group as dmg

    lay = member("fp8_channel", 256, 64, torch.empty(1, 256, dtype=torch.bfloat16), 0)[1]
    offered = [c for c in dm._packed_candidates(1, 28672, 4096, 132, lay) if isinstance(c, pm.PackedGemv)]
    assert any(c.vec_k for c in offered)
    got = dmg.group_candidates(1, 28672, 4096, 132, lay)
    assert got == offered
    # int4 along K: int4_mma_sync's configs too (up to 8 bf16 rows)
    int4 = member("int4_k_stack", 256, 64, torch.empty(1, 256, dtype=torch.bfloat16), 0)[1]
    sync = [c for c in dm._packed_candidates(1, 28672, 4096, 132, int4) if isinstance(c, ims.Int4MmaSync)]
    assert sync and [c for c in dmg.group_candidates(1, 28672, 4096, 132, int4) if isinstance(c, ims.Int4MmaSync)] \
        == sync
    assert not any(isinstance(c, ims.Int4MmaSync) for c in dmg.group_candidates(1, 28672, 4096, 132, int4,
                                                                                 torch.float16))
    # and int4_mma's up to 64 rows, TMA configs included
    mma = [c for c in dm._packed_candidates(16, 28672, 4096, 132, int4) if isinstance(c, im.Int4Mma)]
    assert any(c.tma for c in mma) and any(not c.tma for c in mma)
    assert [c for c in dmg.group_candidates(16, 28672, 4096, 132, int4) if isinstance(c, im.Int4Mma)] == mma
    assert not any(isinstance(c, im.Int4Mma) for c in dmg.group_candidates(16, 28672, 4096, 132, int4,
                                                                           torch.float16))
    # and fp8_mma's for 8-bit codes up to 16 rows
    fp8 = [c for c in dm._packed_candidates(16, 28672, 4096, 132, lay) if isinstance(c, f8.Fp8Mma)]
    assert fp8 and [c for c in dmg.group_candidates(16, 28672, 4096, 132, lay) if isinstance(c, f8.Fp8Mma)] == fp8


def test_the_grouped_op_reaches_every_row_count_a_grouped_kernel_takes():
    """The op's row limit (``GROUP_M_MAX``: past it the members run alone, untimed) is the largest row bucket
    the grouped kernels are offered at: int4_mma's 64 for int4 along K (it once stopped at the GEMV's 4, and
    the tuner never timed int4_mma_group)."""
    from fusekern.kernels import decode_mm_group as dmg

    int4 = member("int4_k_stack", 256, 64, torch.empty(1, 256, dtype=torch.bfloat16), 0)[1]
    offered = [m for m in (1, 2, 4, 8, 16, 32, 64, 128) if dmg.group_candidates(m, 6144, 4096, 132, int4)]
    assert offered[-1] == dmg.GROUP_M_MAX == 64
