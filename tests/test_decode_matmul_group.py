"""Fused decode -> matmuls on the same activation become one ``fusekern::decode_mm_group`` call
(``fusekern.patterns.decode.group``), whose results are the members' own.

CPU: the rewrite groups q / k / v-like projections (two or three per call, same K and packed layout, no
bias), leaves alone what cannot share a call (another K, a bias, another layout), can be disabled by
name, and the compiled module matches eager; the op checks its leaves. GPU: the tuner's choice (one
launch or the members' own) agrees with the members' own launches at the decoder's q / k / v shapes.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fusekern.demo import QuantLinear
from fusekern.kernels import decode_mm as dm
from fusekern.kernels import decode_mm_group as dmg
from fusekern.testing import assert_compiled, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Projections(torch.nn.Module):
    """Linear layers in the demo's W4A16 (or another format) reading the same rows; ``ks`` their input
    widths (a layer on another K reads a slice of x); layers in ``bias_on`` add a bias inside
    ``F.linear`` (an addmm)."""

    def __init__(self, ns, k=256, weights="w4a16", ks=None, bias_on=(), device=DEVICE):
        super().__init__()
        self.ks = ks or [k] * len(ns)
        self.lins = torch.nn.ModuleList(QuantLinear(kk, n, weights, device) for kk, n in zip(self.ks, ns))
        self.bias = {i: torch.randn(n, dtype=torch.bfloat16, device=device)
                     for i, n in enumerate(ns) if i in bias_on}

    def forward(self, x):
        outs = []
        for i, (lin, kk) in enumerate(zip(self.lins, self.ks)):
            packed = [getattr(lin, f"packed{j}") for j in range(lin.n_packed)]
            outs.append(_int4_k_stack_bias(x[..., :kk], *packed, self.bias[i]) if i in self.bias
                        else lin(x[..., :kk]))
        return torch.cat([o * (i + 1) for i, o in enumerate(outs)], dim=-1)  # consumers of each output


def _int4_k_stack_bias(x, wp, s, z, b):
    """The demo's W4A16 decode (decode_zoo.int4_k_stack) with a bias in the linear."""
    g = wp.shape[1] * 2 // s.shape[1]
    w = torch.stack([wp & 0xF, wp >> 4], dim=-1).view(wp.shape[0], -1)
    return F.linear(x, (w.to(x.dtype) - z.repeat_interleave(g, dim=1)) * s.repeat_interleave(g, dim=1), b)


def _x(k=256, m=1, device=DEVICE):
    return torch.randn(m, k, dtype=torch.bfloat16, device=device)


def test_qkv_become_one_call_and_match_eager():
    torch.manual_seed(0)
    mod = Projections([256, 128, 128])
    assert_compiled(mod, (_x(),), fired={"decode_matmul": 3, "decode_matmul_group": 1},
                    gone=["fusekern.decode_mm.default"], present=["fusekern.decode_mm_group.default"])


def test_each_layers_view_of_3d_rows_is_one_activation():
    """[B, T, K] rows: each linear layer reshapes them to [B * T, K] with a view of its own."""
    torch.manual_seed(7)
    mod = Projections([256, 128, 128])
    x = torch.randn(2, 1, 256, dtype=torch.bfloat16, device=DEVICE)
    assert_compiled(mod, (x,), fired={"decode_matmul": 3, "decode_matmul_group": 1},
                    gone=["fusekern.decode_mm.default"])


def test_five_projections_make_a_group_of_three_and_one_of_two():
    torch.manual_seed(1)
    mod = Projections([128, 64, 64, 256, 128])
    assert_compiled(mod, (_x(m=3),), fired={"decode_matmul": 5, "decode_matmul_group": 2},
                    gone=["fusekern.decode_mm.default"])


def test_what_cannot_share_a_call_stays_alone():
    """Another K (a slice of x: another activation too) and a bias added in the matmul stay separate
    decode_mm calls; the two that share everything are grouped."""
    torch.manual_seed(2)
    other_k = Projections([128, 128, 64], ks=[256, 256, 128])
    assert_compiled(other_k, (_x(),), fired={"decode_matmul": 3, "decode_matmul_group": 1},
                    present=["fusekern.decode_mm.default", "fusekern.decode_mm_group.default"])
    torch.manual_seed(3)
    fp8 = Projections([128, 128], weights="fp8")  # fp8 per channel: another packed layout, grouped too
    assert_compiled(fp8, (_x(),), fired={"decode_matmul": 2, "decode_matmul_group": 1})
    torch.manual_seed(4)
    biased = Projections([128, 128, 64], bias_on=(1,))
    assert_compiled(biased, (_x(),), fired={"decode_matmul": 3, "decode_matmul_group": 1},
                    present=["fusekern.decode_mm.default", "fusekern.decode_mm_group.default"])


def test_a_constant_table_leaf_is_moved_up():
    """NVFP4 decodes through a lookup table, a graph constant the rewrite lifts right before each
    matmul: the later members' lifted tables move up to the group call."""
    torch.manual_seed(8)
    mod = Projections([128, 64, 64], weights="nvfp4")
    assert_compiled(mod, (_x(),), fired={"decode_matmul": 3, "decode_matmul_group": 1},
                    gone=["fusekern.decode_mm.default"])


def test_disabled_by_name():
    torch.manual_seed(5)
    mod = Projections([256, 128, 128])
    assert_compiled(mod, (_x(),), fired={"decode_matmul": 3}, present=["fusekern.decode_mm.default"],
                    options={"fusekern.disable": ["decode_matmul_group"]})


def test_leaves_that_cannot_share_a_launch_do_not_decide_for_other_layers(monkeypatch):
    """The tuner's answer is cached per programs (each layer's weights share them). One layer whose leaves
    cannot share a launch (``group_args`` refuses them) runs its members apart without caching that, so
    the next layer's leaves are still measured; members no one program can serve are cached at once; and a config
    cached from another layer, met by leaves that cannot share a launch, runs each member alone."""
    monkeypatch.setattr(dmg, "_groupable", lambda *a: True)
    monkeypatch.setattr(dmg.pg, "group_args", lambda *a: None)
    monkeypatch.setattr(dmg, "_tuned", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has none)
    from fusekern.patterns.decode.formats import recognize
    from fusekern.patterns.decode.layout import PackedLayout, derive_layout
    from fusekern.patterns.decode.program import DecodeProgram
    from fusekern.testing.decode_cones import decode_program
    from fusekern.testing.decode_zoo import BY_NAME

    x, members, programs = torch.randn(1, 256, dtype=torch.bfloat16), [], []
    for n in (64, 32):
        case = BY_NAME["int4_k_stack"]
        text, leaves, consts = decode_program(case.fn, x, *case.make(256, n, 128, "cpu"))
        prog = DecodeProgram.from_text(text)
        layout = derive_layout(prog, recognize(prog, consts), consts).to_text()
        members.append(leaves)
        programs.append(text)
    assert dmg.tuned_choice(x, members, programs, layout) == dmg.SEPARATE
    assert dmg._tuned == {}
    # where one program cannot serve them (here: a layout packed along N), the answer holds for every layer
    awq = PackedLayout.from_text(layout)
    awq = dataclasses.replace(awq, pack_axis="N")
    assert dmg.tuned_choice(x, members, programs, awq.to_text()) == dmg.SEPARATE
    assert list(dmg._tuned.values()) == [dmg.SEPARATE]
    # a config cached from another layer meets leaves that cannot share a launch: each member runs alone
    monkeypatch.setattr(dmg, "tuned_choice", lambda *a: dmg.pm.PackedGemv(32, 128, 1, 4))
    got = dmg._decode_mm_group_cuda(x, [t for m in members for t in m], programs, layout)
    want = dmg._separate(x, members, programs, layout)
    assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))


def _skewed_int8_group(skew: int = 4):
    """(x, members, programs, layout text, layout) of two int8 projections whose second member's codes start
    ``skew`` bytes past the first's end (``test_packed_gemv_group.members_in_one_buffer``: 4 is 4 bytes off 16)."""
    from test_packed_gemv_group import members_in_one_buffer

    from fusekern.patterns.decode.formats import recognize
    from fusekern.patterns.decode.layout import derive_layout
    from fusekern.patterns.decode.program import DecodeProgram
    from fusekern.testing.decode_cones import decode_program
    from fusekern.testing.decode_zoo import BY_NAME

    x, members, _ = members_in_one_buffer(256, skew)
    programs, lay = [], None
    for m in members:
        text, _, consts = decode_program(BY_NAME["int8_channel"].fn, x.cpu(), *(t.cpu() for t in m))
        prog = DecodeProgram.from_text(text)
        lay = derive_layout(prog, recognize(prog, consts), consts)
        programs.append(text)
    return x, members, programs, lay.to_text(), lay


def test_a_layer_whose_codes_start_unaligned_does_not_decide_for_the_others(monkeypatch):
    """1-byte codes are read as int32 words where they start 4-byte aligned. One layer whose second member
    starts 1 byte off cannot share a launch with its first (another word reading), but another layer's
    leaves for the same programs may: that layer's members run apart and nothing is cached for the others."""
    monkeypatch.setattr(dmg, "_groupable", lambda *a: True)  # (x on the CPU)
    monkeypatch.setattr(dmg, "_tuned", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has none)
    x, members, programs, layout, lay = _skewed_int8_group(1)
    assert members[1][0].data_ptr() % 4 == 1
    assert dmg.pg.group_args(x, members, lay, 256, [64, 40]) is None
    assert dmg.tuned_choice(x, members, programs, layout) == dmg.SEPARATE
    assert dmg._tuned == {}


def check_vector_k_choice_met_by_skewed_codes(monkeypatch):
    """A K-vector config tuned on a layer whose codes were 16-byte aligned, met by members that are not,
    runs as the same tiles read word by word: one grouped launch, each member's output its own launch's."""
    from fusekern.kernels import packed_mm as pm

    x, members, programs, layout, lay = _skewed_int8_group()
    cfg = pm.PackedGemv(32, 128, 2, 4, vec_k=True)
    monkeypatch.setattr(dmg, "tuned_choice", lambda *a: cfg)
    monkeypatch.setattr(dmg, "_separate", lambda *a: pytest.fail("ran the members one by one"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has none)
    calls = []
    real = dmg.pg.gemv_group
    monkeypatch.setattr(dmg.pg, "gemv_group", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    got = dmg._decode_mm_group_cuda(x, [t for m in members for t in m], programs, layout)
    rows = dataclasses.replace(cfg, vec_k=False)
    assert calls == [cfg, rows]
    for g, m, n in zip(got, members, (64, 40)):
        assert torch.equal(g, pm.gemv(x, m, lay, 256, n, rows))


def test_a_vector_k_choice_met_by_skewed_codes_stays_one_launch(monkeypatch):
    check_vector_k_choice_met_by_skewed_codes(monkeypatch)


@pytest.mark.gpu
def test_gpu_a_vector_k_choice_met_by_skewed_codes_stays_one_launch(monkeypatch):
    check_vector_k_choice_met_by_skewed_codes(monkeypatch)


@pytest.mark.gpu
def test_gpu_tuner_skips_vector_k_configs_for_skewed_codes():
    """The tuner measures no K-vector config on members whose codes are not all 16-byte aligned
    (``gemv_group`` returns None for them) and keeps a grouped config or the members' own launches."""
    x, members, programs, layout, _ = _skewed_int8_group()
    dmg._tuned.clear()
    choice = dmg.tuned_choice(x, members, programs, layout)
    assert choice == dmg.SEPARATE or not choice.vec_k
    got = dmg.decode_mm_group(x, [t for m in members for t in m], programs, layout)
    want = dmg._separate(x, members, programs, layout)
    for g, w in zip(got, want):
        assert rel_err(g.float(), w.float()) < 1e-2


def test_op_checks_its_leaves():
    torch.manual_seed(5)
    mod = Projections([128, 64], device="cpu")
    x = _x(device="cpu")
    from fusekern.testing.decode_cones import decode_program
    lin = mod.lins[0]
    text, leaves, _ = decode_program(lin.decode, x, *(getattr(lin, f"packed{i}") for i in range(lin.n_packed)))
    with pytest.raises(ValueError, match="read 6 leaves, got 5"):
        dmg.decode_mm_group(x, leaves + leaves[:2], [text, text], "")
    got = dmg.decode_mm_group(x, leaves + leaves, [text, text], "")
    want = dm.decode_mm(x, leaves, text, None, "")
    assert len(got) == 2 and all(torch.equal(g, want) for g in got)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["w4a16", "fp8"])
def test_gpu_qkv_choice_matches_the_members(weights):
    """The decoder's q / k / v at one row: whatever the tuner picks (one launch or three), each output
    is within the members' own launch's rounding and the float64 reference's tolerance."""
    torch.manual_seed(6)
    mod = Projections([4096, 1024, 1024], k=4096, weights=weights)
    x = _x(k=4096)
    compiled = torch.compile(mod, backend="fusekern")
    got = compiled(x)
    want = mod(x)
    for g, w in zip(got.split([4096, 1024, 1024], -1), want.split([4096, 1024, 1024], -1)):
        assert rel_err(g.float(), w.float()) < 1e-2
    assert dmg._tuned, "the group op was not tuned on the GPU"
