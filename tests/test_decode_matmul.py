"""The structural dequant -> matmul matcher: cones, decode programs, formats, generated kernels, near misses.

CPU: every decode in the zoo (each format issue 3 names, and five spellings of one int4 format) is
analysed, recognized, compiled through ``backend="fusekern"`` and compared with eager; the generated
Triton kernel runs in the interpreter against its float64 reference on odd shapes, poisoned outputs,
strided and misaligned inputs. Property tests draw shapes, group sizes, dtypes and packings.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusekern.kernels import decode_mm as dm
from fusekern.patterns.decode.analysis import Unsupported, analyse, find_cone
from fusekern.patterns.decode.formats import recognize
from fusekern.patterns.decode.program import DecodeProgram
from fusekern.testing import assert_compiled, rel_err
from fusekern.testing.decode_cones import decode_program, node_values, post_grad_graph
from fusekern.testing.decode_zoo import BY_NAME, CASES

aten = torch.ops.aten
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# The exact W8A16 patterns run first; switch them off where a case is about the structural matcher.
EXACT = ["w8a16_linear_scale_bias", "w8a16_linear_scale", "w8a16_dequant_linear_bias", "w8a16_dequant_linear",
         "w8a16_dequant_linear_col_scale", "w8a16_dequant_fp32_linear"]
# The structural decode matcher alone: the exact W8A16 patterns and the scale-folding family (which folds the
# scale of a plain 16-bit weight) off.
ONLY_STRUCTURAL = {"fusekern.disable": [*EXACT, "scale_folding"]}


def sizes(case, K=256, N=96):
    """(K, N, G) for a zoo case: odd N where the format allows it, 128-multiples for 128x128 blocks."""
    if case.name == "fp8_block":
        return 256, 384, 128
    G = case.group if case.group != 128 else 64
    return K, N, G


def captured(case, M=3, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    K, N, G = sizes(case)
    ws = case.make(K, N, G, "cpu")
    x = torch.randn(M, K, dtype=dtype)
    gm, inputs = post_grad_graph(case.fn, x, *ws)
    mm = next(n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default))
    return gm, inputs, mm, x, ws


# ----------------------------------------------------------------------------- analysis and formats


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_program_computes_the_users_weight(case):
    gm, inputs, mm, _, _ = captured(case)
    env = node_values(gm, inputs)
    cone = find_cone(mm)
    prog = analyse(cone)
    leaves = [env[leaf] for leaf in cone.leaves]
    want = env[cone.root]
    got = prog.evaluate(leaves)
    assert got.dtype == want.dtype and got.shape == want.shape
    # Exact except where eager rounds a bf16 intermediate that the program (like inductor) keeps in fp32.
    assert rel_err(got, want) <= (0 if case.name != "hqq" else TOL[torch.bfloat16])
    again = DecodeProgram.from_text(prog.to_text())
    assert torch.equal(again.evaluate(leaves), got)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_format_is_recognized(case):
    gm, _, mm, _, _ = captured(case)
    cone = find_cone(mm)
    prog = analyse(cone)
    consts = {i: getattr(gm, leaf.target) for i, leaf in enumerate(cone.leaves) if leaf.op == "get_attr"}
    fmt = recognize(prog, consts)
    assert fmt.name == case.format, fmt.describe()


def test_format_details():
    """What the recognizer reads off the probes: packing axis, field order, groups, zero points."""
    def fmt_of(name):
        gm, _, mm, _, _ = captured(BY_NAME[name])
        cone = find_cone(mm)
        consts = {i: getattr(gm, leaf.target) for i, leaf in enumerate(cone.leaves) if leaf.op == "get_attr"}
        return recognize(analyse(cone), consts)

    g = fmt_of("gptq")
    assert (g.bits, g.pack_axis, g.pack_order, g.scale, g.group_k, g.zero) == (4, "K", tuple(range(8)), "group", 64, "packed")
    a = fmt_of("awq")
    assert (a.pack_axis, a.pack_order, a.zero) == ("N", (0, 4, 1, 5, 2, 6, 3, 7), "packed")
    n = fmt_of("int4_n")
    assert (n.pack_axis, n.pack_order, n.zero) == ("N", (0, 1), "const")
    assert fmt_of("fp8_block").scale == "block" and fmt_of("fp8_block").group_n == 128
    assert fmt_of("fp8_tensor").scale == "tensor"
    assert fmt_of("int8_channel").scale == "channel"
    mx, nv = fmt_of("mxfp4"), fmt_of("nvfp4")
    assert (mx.scale_encoding, mx.group_k, mx.global_scale) == ("e8m0", 32, False)
    assert (nv.scale_encoding, nv.group_k, nv.global_scale) == ("fp8", 16, True)
    assert fmt_of("hqq").zero == "float"


def test_five_spellings_give_one_program_semantics():
    """stack vs cat, cast before / after the subtraction, shifts by tensor vs ints, view vs reshape,
    [:, None] vs unsqueeze: the same weights decode to the same values and the same format."""
    names = ["int4_k_stack", "int4_k_cat", "int4_k_shift_tensor", "int4_k_arange"]
    K, N, G = sizes(BY_NAME[names[0]])
    torch.manual_seed(3)
    ws = BY_NAME[names[0]].make(K, N, G, "cpu")
    x = torch.randn(2, K, dtype=torch.bfloat16)
    decoded, formats = [], set()
    for name in names:
        gm, inputs = post_grad_graph(BY_NAME[name].fn, x, *ws)
        env = node_values(gm, inputs)
        mm = next(n for n in gm.graph.nodes if n.target == aten.mm.default)
        cone = find_cone(mm)
        prog = analyse(cone)
        w = prog.evaluate([env[leaf] for leaf in cone.leaves])
        decoded.append(w if w.shape == (K, N) else w.t())
        formats.add(recognize(prog, {i: getattr(gm, l.target) for i, l in enumerate(cone.leaves) if l.op == "get_attr"}))
    for w in decoded[1:]:
        assert torch.equal(w, decoded[0])
    assert len({f.describe() for f in formats}) == 1


# ----------------------------------------------------------------------------- through the backend


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_zoo_compiles_and_matches_eager(case):
    K, N, G = sizes(case)
    torch.manual_seed(1)
    ws = case.make(K, N, G, "cpu")
    x = torch.randn(5, K, dtype=torch.bfloat16)
    if not case.fires:  # gathered rows with no packed layout: declined, measured slower than stock
        _declined(case.fn, (x, *ws), "gathered by data")
        return
    check = assert_compiled(case.fn, (x, *ws), fired={"decode_matmul": 1}, gone=["aten.mm.default"],
                            present=["fusekern.decode_mm.default"], options=ONLY_STRUCTURAL)
    assert check.errors[0] <= TOL[torch.bfloat16]


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "awq", "int4_k_shift_tensor"])
def test_tables_built_in_the_decode_travel_in_the_program(name):
    """A table the user's decode builds with ``torch.tensor(...)`` is embedded in the op's program: the graph
    neither copies it per call (``lift_fresh_copy``) nor passes it, and the result still matches eager."""
    case = BY_NAME[name]
    K, N, G = sizes(case)
    torch.manual_seed(2)
    ws = case.make(K, N, G, "cpu")
    check = assert_compiled(case.fn, (torch.randn(3, K, dtype=torch.bfloat16), *ws), fired={"decode_matmul": 1},
                            gone=["aten.mm.default", "aten.lift_fresh_copy.default"],
                            present=["fusekern.decode_mm.default"], options=ONLY_STRUCTURAL)
    assert check.errors[0] <= TOL[torch.bfloat16]


class _NVFP4Linear(torch.nn.Module):
    """NVFP4 weights held as parameters."""

    def __init__(self, K, N):
        super().__init__()
        for name, t in zip(("codes", "s_block", "s_global"), BY_NAME["nvfp4"].make(K, N, 16, "cpu")):
            self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))

    def forward(self, x):
        return BY_NAME["nvfp4"].fn(x, self.codes, self.s_block, self.s_global)


def test_lookup_tables_travel_in_the_program_under_freezing():
    """With inductor's ``freezing`` its constant folding turns the user's ``lift_fresh_copy`` of the E2M1
    literal into a plain constant: the table is still embedded (the decode looks values up in it), and the
    per-tensor scale stays an argument of the op (a value per layer would give every layer its own program)."""
    torch.manual_seed(4)
    model = _NVFP4Linear(256, 128)
    with torch.no_grad():
        check = assert_compiled(model, (torch.randn(3, 256, dtype=torch.bfloat16),), fired={"decode_matmul": 1},
                                options={**ONLY_STRUCTURAL, "freezing": True})
    call = next(line for g in check.graphs for line in g.splitlines() if "fusekern.decode_mm" in line)
    assert '["float32",[16],[1],[0.0,0.5,1.0,1.5,2.0,3.0,4.0,6.0,-0.0,' in call, call[:600]
    assert '["float32",[1],[1]]' in call, call[:600]  # the global scale: no values


def test_constant_tensors_tell_signed_zeros_apart():
    """Tables that differ only in the sign of a zero get their own tensors (0.0 == -0.0 as floats); equal
    tables with NaN share one."""
    from fusekern.patterns.decode.program import Leaf, constant_tensor

    plus, minus = Leaf(torch.float32, (2,), (1,), (0.0, 1.0)), Leaf(torch.float32, (2,), (1,), (-0.0, 1.0))
    a, b = constant_tensor(plus, "cpu"), constant_tensor(minus, "cpu")
    assert not torch.signbit(a[0]) and torch.signbit(b[0])
    nan = Leaf(torch.float32, (2,), (1,), (float("nan"), 1.0))
    assert constant_tensor(nan, "cpu") is constant_tensor(Leaf(torch.float32, (2,), (1,), (float("nan"), 1.0)), "cpu")


def test_program_constants_round_trip_and_bind():
    """``with_constants`` embeds a table by value; the text round-trips; ``bind`` takes either every leaf or
    the inputs only (then one tensor per table and device); a wrong count is a clear error."""
    prog = DecodeProgram.from_text(dm.report_program("mxfp4", N=256, K=256))
    table = next(i for i, leaf in enumerate(prog.leaves) if leaf.numel == 16)
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    held = DecodeProgram.from_text(prog.with_constants({table: values}).to_text())
    assert held.leaves[table].values == tuple(values.tolist()) and table not in held.inputs
    others = [torch.zeros(leaf.shape, dtype=leaf.dtype) for leaf in (held.leaves[i] for i in held.inputs)]
    bound = held.bind(others, "cpu")
    assert bound[table] is held.bind(others, "cpu")[table] and torch.equal(bound[table], values)
    assert torch.equal(torch.signbit(bound[table]), torch.signbit(values))  # -0.0 kept
    every = held.bind([*others[:table], values, *others[table:]], "cpu")
    assert every[table] is not bound[table]
    with pytest.raises(ValueError, match="reads 2 leaves"):
        held.bind(others[:1], "cpu")
    with pytest.raises(ValueError, match="constant"):
        prog.with_constants({table: values.to(torch.float64)})


def test_report_names_the_format():
    import fusekern

    case = BY_NAME["gptq"]
    K, N, G = sizes(case)
    assert_compiled(case.fn, (torch.randn(2, K, dtype=torch.bfloat16), *case.make(K, N, G, "cpu")),
                    fired={"decode_matmul": 1})
    text = str(fusekern.match_report())
    assert "gptq, 4-bit, 8 per int32 along K" in text, text


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes(dtype):
    def fn(x, wp, s):
        w = torch.stack([wp & 15, wp >> 4], -1).reshape(wp.shape[0], -1).to(x.dtype) - 8
        return F.linear(x, w * s.repeat_interleave(32, 1))

    wp = torch.randint(0, 256, (48, 80), dtype=torch.uint8)
    s = (torch.rand(48, 5) * 0.1).to(dtype)
    check = assert_compiled(fn, (torch.randn(7, 160, dtype=dtype), wp, s), fired={"decode_matmul": 1})
    assert check.errors[0] <= TOL[dtype]


class AWQLinear(torch.nn.Module):
    """Weights as buffers, as a model holds them: dynamo keeps their shapes static under dynamic=True."""

    def __init__(self, K, N, G):
        super().__init__()
        for name, t in zip(("qweight", "qzeros", "scales"), BY_NAME["awq"].make(K, N, G, "cpu")):
            self.register_buffer(name, t)

    def forward(self, x):
        return BY_NAME["awq"].fn(x, self.qweight, self.qzeros, self.scales)


def test_dynamic_m_and_3d_activations():
    K, N, G = sizes(BY_NAME["awq"])
    layer = AWQLinear(K, N, G)
    x = torch.randn(2, 3, K, dtype=torch.bfloat16)
    assert_compiled(layer, (x,), fired={"decode_matmul": 1}, dynamic=True,
                    extra_args=[(torch.randn(2, 9, K, dtype=torch.bfloat16),),
                                (torch.randn(3, 4, K, dtype=torch.bfloat16),)])


def test_both_activation_dims_dynamic():
    """The form the exact W8A16 patterns miss (batch and sequence both symbolic): the structural matcher
    reads only the weight's cone, so the activation's shapes do not matter."""
    w = torch.randint(-128, 128, (48, 64), dtype=torch.int8)
    s = torch.rand(48, dtype=torch.bfloat16) * 0.01

    def fn(x):
        return F.linear(x, w.to(x.dtype) * s[:, None])

    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 1)
    more = [(torch.randn(b, m, 64, dtype=torch.bfloat16),) for b, m in ((5, 3), (3, 17))]
    assert_compiled(fn, (x,), fired={"decode_matmul": 1}, extra_args=more, options=ONLY_STRUCTURAL)


def test_bias_through_addmm():
    def fn(x, wp, s, b):
        w = torch.cat([(wp & 15)[..., None], (wp >> 4)[..., None]], -1).view(wp.shape[0], -1)
        return F.linear(x, (w.to(x.dtype) - 8) * s[:, None], b)

    wp = torch.randint(0, 256, (40, 64), dtype=torch.uint8)
    args = (torch.randn(6, 128, dtype=torch.bfloat16), wp, torch.rand(40, dtype=torch.bfloat16) * 0.1,
            torch.randn(40, dtype=torch.bfloat16))
    assert_compiled(fn, args, fired={"decode_matmul": 1}, gone=["aten.addmm.default"])


def test_ldexp_and_where_decodes():
    """Microscaling written with ldexp, a sign bit taken with where: still one decode."""
    def fn(x, mant, e):
        m = torch.where(mant < 0, -(mant.abs().to(torch.float32)), mant.to(torch.float32)) / 8
        return F.linear(x, torch.ldexp(m, e.to(torch.int32)[:, None]).to(x.dtype))

    args = (torch.randn(3, 64, dtype=torch.bfloat16), torch.randint(-8, 8, (32, 64), dtype=torch.int8),
            torch.randint(-4, 4, (32,), dtype=torch.int8))
    assert_compiled(fn, args, fired={"decode_matmul": 1}, gone=["aten.ldexp.Tensor"])


def test_batched_weights_through_bmm():
    def fn(x, wq, s):  # [E, K, N] int8 experts, per-expert-channel scales
        return torch.bmm(x, wq.to(x.dtype) * s[:, None, :])

    wq = torch.randint(-128, 128, (3, 64, 40), dtype=torch.int8)
    args = (torch.randn(3, 5, 64, dtype=torch.bfloat16), wq, torch.rand(3, 40, dtype=torch.bfloat16) * 0.1)
    assert_compiled(fn, args, fired={"decode_matmul": 1}, gone=["aten.bmm.default"])


def test_noncontiguous_packed_weights():
    def fn(x, wp, s):
        w = torch.stack([wp & 15, wp >> 4], -1).reshape(wp.shape[0], -1).to(x.dtype) - 8
        return F.linear(x, w * s[:, None])

    wp = torch.randint(0, 256, (64, 48), dtype=torch.uint8).t()  # [48, 64] with strides (1, 48)
    args = (torch.randn(4, 128, dtype=torch.bfloat16), wp, torch.rand(48, dtype=torch.bfloat16) * 0.1)
    assert_compiled(fn, args, fired={"decode_matmul": 1})


# ----------------------------------------------------------------------------- near misses


def _declined(fn, args, reason_part):
    import fusekern

    assert_compiled(fn, args, fired={}, options=ONLY_STRUCTURAL)
    reasons = [r.reason for r in fusekern.match_report().rejections() if r.pattern == "decode_matmul"]
    assert any(reason_part in r for r in reasons), reasons


def test_declines_when_the_dequantized_weight_is_also_returned():
    def fn(x, w, s):
        wd = w.to(x.dtype) * s[:, None]
        return F.linear(x, wd) + wd.sum()

    _declined(fn, (torch.randn(3, 32, dtype=torch.bfloat16), torch.randint(-9, 9, (16, 32), dtype=torch.int8),
                   torch.rand(16, dtype=torch.bfloat16)), "needed anyway")


def test_declines_activations_as_leaves():
    def fn(x, w):
        return x @ (w.to(x.dtype) * x[0, :, None])  # the "scale" comes from the activation

    _declined(fn, (torch.randn(3, 32, dtype=torch.bfloat16), torch.randint(-9, 9, (32, 16), dtype=torch.int8)),
              "activation")


def test_declines_reductions_inside_the_cone():
    def fn(x, w):
        wf = w.to(x.dtype)
        return F.linear(x, wf - wf.mean(dim=1, keepdim=True))

    _declined(fn, (torch.randn(3, 32, dtype=torch.bfloat16), torch.randint(-9, 9, (16, 32), dtype=torch.int8)),
              "in the weight's computation")


def test_large_lookup_tables_are_gathers():
    """A table past MAX_TABLE entries is not a format's lookup table (it does not travel in the program), but
    its gather is followed like GPTQ act-order's scales: fused by the generated kernel, eager's result."""
    def fn(x, codes, table):
        return F.linear(x, table[codes.long()].to(x.dtype))

    args = (torch.randn(3, 32, dtype=torch.bfloat16), torch.randint(-300, 300, (16, 32), dtype=torch.int16),
            torch.randn(300))
    assert_compiled(fn, args, fired={"decode_matmul": 1}, options=ONLY_STRUCTURAL)
    text, _, _ = decode_program(fn, *args)
    prog = DecodeProgram.from_text(text)
    assert all(leaf.values is None for leaf in prog.leaves) and recognize(prog).name == "generic"


def test_index_arithmetic_on_gathered_values():
    """A gathered index read through a view: row-major flattening lands element g at table[g // w, g % w],
    computed by shifts and masks for a power-of-two w (exact, against eager); any other divisor declines."""
    def flat(x, codes, table):
        return F.linear(x, table.reshape(-1)[codes.long()].to(x.dtype))

    args = (torch.randn(3, 32, dtype=torch.bfloat16), torch.randint(-256, 256, (16, 32), dtype=torch.int16),
            torch.randn(16, 16))
    gm, inputs = post_grad_graph(flat, *args)
    mm = next(n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default))
    env = node_values(gm, inputs)
    cone = find_cone(mm)
    assert torch.equal(analyse(cone).evaluate([env[leaf] for leaf in cone.leaves]), env[mm.args[1]])
    _declined(flat, args, "gathered by data")  # (a 2-D table read at data: rows gathered, no packed layout)
    _declined(flat, (torch.randn(3, 32, dtype=torch.bfloat16), torch.randint(0, 144, (16, 32), dtype=torch.int16),
                     torch.randn(12, 12)), "division of a gathered index by 12")

    def two(x, w, s, gi, gj):  # two index tensors
        return F.linear(x, (w.to(x.dtype) * s[gi.long()[:, None], gj.long()[None, :]]))

    _declined(two, (torch.randn(3, 32, dtype=torch.bfloat16), torch.randint(-9, 9, (16, 32), dtype=torch.int8),
                    torch.rand(4, 4, dtype=torch.bfloat16), torch.randint(0, 4, (16,), dtype=torch.int32),
                    torch.randint(0, 4, (32,), dtype=torch.int32)), "2 index tensors")


def test_scale_per_k_block_shared_by_every_column():
    """A load whose index has k // 64 and no n (a scale per block of k, the same for every column): the
    generated kernels read it as one scalar per tile row (a masked row load of a scalar did not compile)."""
    K, R = 256, 4

    def views(x, w, s):
        return x @ (w.to(x.dtype) * s.view(R, 1).expand(R, K // R).reshape(K, 1))

    def gathered(x, w, s, g):
        return x @ (w.to(x.dtype) * s[g.long().repeat_interleave(K // R)])

    torch.manual_seed(0)
    w8 = torch.randint(-128, 128, (K, 32), dtype=torch.int8)
    for fn, extra in ((views, (torch.rand(R, dtype=torch.bfloat16) + 0.5,)),
                      (gathered, (torch.rand(R, 32, dtype=torch.bfloat16) + 0.5, torch.randperm(R).int()))):
        x = torch.randn(3, K, dtype=torch.bfloat16)
        text, leaves, _ = decode_program(fn, x, w8, *extra)
        want = dm.decode_mm_reference(x.double(), leaves, text)
        for cfg in (dm.DequantConfig(), dm.Config(1, 32, 64, 1, 1, 4, 1), dm.Config(16, 32, 64, 2, 1, 4, 2)):
            got = dm.decode_mm_triton(x.to(DEVICE), [t.to(DEVICE) for t in leaves], text, None, config=cfg)
            assert rel_err(got.cpu(), want) <= TOL[torch.bfloat16], (fn.__name__, cfg)


@pytest.mark.parametrize("order", ["act_order", "negative", "columns"])
def test_gathered_rows_of_scales_and_zeros(order):
    """``scales[g_idx]`` read at every k: act-order permutations, torch's negative indices (wrapped), and a
    gather along the second dim (``s[:, g]``): the program is eager's weight exactly, and the generated kernel
    computes it; the rewrite declines these (no packed layout, slower than stock when measured)."""
    torch.manual_seed(3)
    K, N, G = 256, 40, 32
    if order == "columns":
        def fn(x, w, s, gi):
            return F.linear(x, w.to(x.dtype) * s[:, gi.long()])
        gi = (torch.randperm(K) // G).to(torch.int64)
        args = (torch.randn(5, K, dtype=torch.bfloat16), torch.randint(-128, 128, (N, K), dtype=torch.int8),
                torch.rand(N, K // G, dtype=torch.bfloat16) + 0.5, gi)
    else:
        def fn(x, w, s, z, gi):
            q = w.to(torch.int16) - z[gi.long()].to(torch.int16)
            return x @ (q.to(x.dtype) * s[gi.long()])
        gi = (torch.randperm(K) // G).to(torch.int32)
        if order == "negative":
            gi = gi - K // G  # the same rows, counted from the end
        args = (torch.randn(5, K, dtype=torch.bfloat16), torch.randint(0, 16, (K, N), dtype=torch.uint8),
                torch.rand(K // G, N, dtype=torch.bfloat16) + 0.5, torch.randint(0, 16, (K // G, N), dtype=torch.uint8),
                gi)
    gm, inputs = post_grad_graph(fn, *args)
    mm = next(n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default))
    env = node_values(gm, inputs)
    cone = find_cone(mm)
    prog = analyse(cone)
    assert torch.equal(prog.evaluate([env[leaf] for leaf in cone.leaves]), env[mm.args[1]])
    assert recognize(prog).name == "generic"
    _declined(fn, args, "gathered by data")  # (measured slower than stock: the graph stays)
    text, leaves, _ = decode_program(fn, *args)  # the generated kernel, which a failed layout check runs
    want = dm.decode_mm_reference(args[0].double(), leaves, text)
    got = dm.decode_mm_triton(args[0].to(DEVICE), [t.to(DEVICE) for t in leaves], text, None,
                              config=dm.Config(1, 32, 64, 1, 1, 4, 1))
    assert rel_err(got.cpu(), want) <= TOL[torch.bfloat16]


def test_plain_weights_are_not_candidates():
    import fusekern

    def fn(x, w, s):
        return F.linear(x, w * s[:, None])  # bf16 weight: nothing to decode

    assert_compiled(fn, (torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16),
                         torch.rand(16, dtype=torch.bfloat16)), fired={}, options=ONLY_STRUCTURAL)
    assert not [r for r in fusekern.match_report().rejections() if r.pattern == "decode_matmul"]


def test_declines_index_math_that_overflows_int32():
    """Shapes are never materialized: the analysis reads fake tensors only."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(x, wp, s):
        w = torch.stack([wp & 15, wp >> 4], -1).reshape(wp.shape[0], -1).to(x.dtype)
        return torch.mm(x, (w * s[:, None]).t())

    N, K = 65536, 65536  # the decoded weight has 2**32 elements
    args = (torch.empty(64, K, dtype=torch.bfloat16, device="meta"),
            torch.empty(N, K // 2, dtype=torch.uint8, device="meta"), torch.empty(N, dtype=torch.bfloat16, device="meta"))
    from torch._inductor.decomposition import select_decomp_table

    gm = make_fx(fn, tracing_mode="fake", decomposition_table=select_decomp_table())(*args)
    gm.graph.eliminate_dead_code()
    mm = next(n for n in gm.graph.nodes if n.target == aten.mm.default)
    with pytest.raises(Unsupported, match="overflow int32"):
        analyse(find_cone(mm))


# ----------------------------------------------------------------------------- the generated kernel


def _program(case, seed=0):
    torch.manual_seed(seed)
    K, N, G = sizes(case)
    text, leaves, _ = decode_program(case.fn, torch.randn(3, K, dtype=torch.bfloat16), *case.make(K, N, G, "cpu"))
    return text, [t.to(DEVICE) for t in leaves]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("M", [1, 5, 70, 300])
def test_generated_kernel_matches_reference(case, M):
    text, leaves = _program(case)
    prog = DecodeProgram.from_text(text)
    x = torch.randn(M, prog.K, device=DEVICE).to(torch.bfloat16)
    cfg = dm.select_config(M, prog.N, prog.K)
    ws = None
    if isinstance(cfg, dm.Config):  # the fused paths write a workspace: poison it
        ws = torch.full((cfg.SPLIT_K, 1, M, prog.N), float("nan"), device=DEVICE,
                        dtype=torch.float32 if cfg.SPLIT_K > 1 else torch.bfloat16)
    got = dm.decode_mm_triton(x, leaves, text, workspace=ws)
    want = dm.decode_mm_reference(x, leaves, text)
    assert not got.isnan().any()
    assert rel_err(got, want) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("cfg", [dm.Config(1, 16, 32, 3, 1, 4, 2), dm.Config(16, 32, 32, 2, 1, 4, 2),
                                 dm.Config(16, 32, 32, 2, 1, 4, 2, SWAP_AB=True), dm.Config(32, 16, 64, 1, 2, 4, 2),
                                 dm.DequantConfig(BLOCK_K=32, BLOCK_N=16)],
                         ids=["gemv_split3", "dot_split2", "dot_swap_split2", "dot_grouped", "dequant"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_generated_kernel_paths_and_layouts(cfg, layout):
    text, leaves = _program(BY_NAME["gptq"], seed=4)
    prog = DecodeProgram.from_text(text)
    M = 37
    x = torch.randn(M, prog.K, device=DEVICE).to(torch.float16)
    if layout == "strided":
        x = torch.cat([x, x], 1)[:, ::2]
    elif layout == "misaligned":
        x = torch.cat([torch.zeros(1, dtype=x.dtype, device=DEVICE), x.flatten()])[1:].view(M, prog.K)
    # The program decodes to bf16 for a bf16 graph: rebuild it for fp16 activations.
    text = text.replace('"bfloat16"', '"float16"')
    leaves = [t.to(torch.float16) if t.dtype == torch.bfloat16 else t for t in leaves]
    bias = torch.randn(prog.N, device=DEVICE).to(torch.float16)
    got = dm.decode_mm_triton(x, leaves, text, bias=bias, config=cfg)
    want = dm.decode_mm_reference(x, leaves, text, bias=bias)
    assert rel_err(got, want) <= TOL[torch.float16]


def test_kernel_rejects_bad_input():
    text, leaves = _program(BY_NAME["int4_k_sym"])
    prog = DecodeProgram.from_text(text)
    with pytest.raises(ValueError, match="does not fit"):
        dm.decode_mm(torch.randn(2, prog.K + 1, dtype=torch.bfloat16, device=DEVICE), leaves, text, None)
    with pytest.raises(ValueError, match="decoded weight is"):
        dm.decode_mm(torch.randn(2, prog.K, device=DEVICE), leaves, text, None)
    with pytest.raises(ValueError, match="leaf 0"):
        dm.decode_mm(torch.randn(2, prog.K, dtype=torch.bfloat16, device=DEVICE), [leaves[0][:1], *leaves[1:]], text, None)
    with pytest.raises(ValueError, match="not a decode program's text"):
        dm.decode_mm(torch.randn(2, prog.K, dtype=torch.bfloat16, device=DEVICE), leaves, "{" + text, None)
    with pytest.raises(ValueError, match="bias is on meta"):  # (was read as if it were x's: off by 2e38)
        dm.decode_mm(torch.randn(2, prog.K, dtype=torch.bfloat16, device=DEVICE), leaves, text,
                     torch.empty(prog.N, dtype=torch.bfloat16, device="meta"))
    x = torch.randn(2, prog.K, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="does not broadcast"):  # (rows of bias != M: a broadcast error later)
        dm.decode_mm(x, leaves, text, torch.randn(3, prog.N, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="not a packed layout's text"):  # (was a bare JSONDecodeError)
        dm.decode_mm_triton(x, leaves, text, None, layout="{not json")


# ----------------------------------------------------------------------------- property tests


def _int4_decode(axis: str, word: torch.dtype, G: int, sym: bool):
    """A user decode: int4 packed along ``axis`` in ``word`` words (sequential nibbles), groups of G along K."""
    per = word.itemsize * 2

    def fn(x, wp, s, z):
        shifts = torch.arange(0, 4 * per, 4, dtype=torch.int32, device=wp.device)
        if axis == "K":  # wp [N, K/per]
            q = ((wp.to(torch.int32)[:, :, None] >> shifts) & 15).reshape(wp.shape[0], -1)
        else:  # wp [N/per, K]
            q = ((wp.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, wp.shape[1])
        q = q.reshape(q.shape[0], -1, G)
        q = (q - 8) if sym else (q - z[..., None])
        return F.linear(x, (q.to(x.dtype) * s[..., None]).reshape(q.shape[0], -1))

    return fn


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_words=st.integers(1, 6), k_groups=st.integers(1, 3), G=st.sampled_from([32, 64, 128]),
    axis=st.sampled_from(["K", "N"]), word=st.sampled_from([torch.uint8, torch.int32]),
    sym=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    M=st.integers(1, 40),
)
def test_property_int4_packings(n_words, k_groups, G, axis, word, sym, dtype, M):
    per = word.itemsize * 2
    K = G * k_groups
    N = per * n_words if axis == "N" else 8 * n_words + 3
    if axis == "N":
        wp = torch.randint(-2**31 if word == torch.int32 else 0, 2**31 - 1 if word == torch.int32 else 256,
                           (N // per, K), dtype=torch.int64).to(word)
    else:
        wp = torch.randint(-2**31 if word == torch.int32 else 0, 2**31 - 1 if word == torch.int32 else 256,
                           (N, K // per), dtype=torch.int64).to(word)
    s = (torch.rand(N, K // G) * 0.05 + 0.01).to(dtype)
    z = torch.randint(0, 16, (N, K // G), dtype=torch.int32)
    fn = _int4_decode(axis, word, G, sym)
    x = torch.randn(M, K, dtype=dtype)
    gm, inputs = post_grad_graph(fn, x, wp, s, z)
    mm = next(n for n in gm.graph.nodes if n.target == aten.mm.default)
    cone = find_cone(mm)
    prog = analyse(cone)
    fmt = recognize(prog)
    assert (fmt.bits, fmt.pack_axis, fmt.pack_order, fmt.group_k) == (4, axis, tuple(range(per)), G if k_groups > 1 else K)
    assert fmt.zero == ("const" if sym else "int")
    env = node_values(gm, inputs)
    leaves = [env[leaf] for leaf in cone.leaves]
    assert torch.equal(prog.evaluate(leaves), env[cone.root])
    got = dm.decode_mm_triton(x.to(DEVICE), [t.to(DEVICE) for t in leaves], prog.to_text())
    assert rel_err(got, dm.decode_mm_reference(x.to(DEVICE), [t.to(DEVICE) for t in leaves], prog.to_text())) <= TOL[dtype]


# -- near misses a review probe found (each fired, or broke the compile, before its fix) ------------------------


@pytest.mark.usefixtures("no_compile_caches")
def test_addmm_bias_of_another_dtype_raises_as_in_eager():
    """An fp32 bias with a bf16 activation: eager's addmm raises (FakeTensor's does not check), the rewrite
    declines and the compiled function raises the same error (it returned a tensor)."""
    import fusekern

    x = torch.randn(8, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randint(-128, 128, (32, 64), dtype=torch.int8, device=DEVICE)
    s = torch.rand(32, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(32, device=DEVICE)

    def f(x, w, s, b):
        return F.linear(x, w.to(x.dtype) * s[:, None], b)

    with pytest.raises(RuntimeError, match="dtype"):
        f(x, w, s, b)
    torch._dynamo.reset()
    fusekern.reset_match_report()
    with pytest.raises(RuntimeError, match="dtype"):
        torch.compile(f, backend="fusekern")(x, w, s, b)
    assert dict(fusekern.match_report().fired()) == {}
    assert any("eager's addmm raises" in r.reason for r in fusekern.match_report().rejections())


def test_integer_power_of_two_is_not_exp2():
    """``2 ** e`` of int32 e is an integer power (0 for e < 0): it is declined, not emitted as exp2 (Triton
    has no integer exp2: the generated kernel failed to compile)."""
    x = torch.randn(3, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randint(-128, 128, (32, 64), dtype=torch.int8, device=DEVICE)
    e = torch.randint(-3, 3, (32,), dtype=torch.int32, device=DEVICE)

    def f(x, w, e):
        return F.linear(x, (w.to(torch.float32) * (2 ** e)[:, None]).to(x.dtype))

    with pytest.raises(Unsupported, match="integer power"):
        decode_program(f, x, w, e)
    assert_compiled(f, (x, w, e), fired={}, tol=0.0)


@pytest.mark.usefixtures("no_compile_caches")
def test_packed_weight_marked_dynamic_is_declined_without_a_guard():
    """A packed weight whose N is marked dynamic: the analysis once read its size with int(), which
    specialized N and made the compile fail (ConstraintViolationError); now it declines and compiles."""
    import fusekern

    N, K, G = 64, 256, 64

    def f(x, wp, s):
        n = wp.shape[0]
        w = torch.stack([wp & 0xF, wp >> 4], -1).view(n, -1, G).to(x.dtype) - 8
        return F.linear(x, (w * s[..., None]).view(n, K))

    x = torch.randn(5, K, dtype=torch.bfloat16, device=DEVICE)
    wp = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=DEVICE)
    s = (torch.rand(N, K // G) * 0.02).to(DEVICE, torch.bfloat16)
    torch._dynamo.mark_dynamic(wp, 0)
    torch._dynamo.mark_dynamic(s, 0)
    torch._dynamo.reset()
    fusekern.reset_match_report()
    out = torch.compile(f, backend="fusekern")(x, wp, s)
    assert torch.equal(out, f(x, wp, s)) or rel_err(out.double(), f(x, wp, s).double()) < 1e-2
    assert any("symbolic shape" in r.reason for r in fusekern.match_report().rejections())


def test_autoawq_reorder_folds_into_awqs_packed_layout(monkeypatch):
    """AutoAWQ's dequantize_gemm reorders unpacked columns by a tensor built from arange and a constant list:
    the analysis folds that constant (8 * (n // 8) + T[n % 8]) so the program reads the packed words at
    n // 8 as AWQ's own form does, and the hand-tuned AWQ kernels run (interpreter on CPU), against float64."""
    from fusekern.kernels import layout_guard
    from fusekern.patterns.decode.rewrite import rewrite_decode_matmuls

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    case = BY_NAME["awq_reorder"]
    torch.manual_seed(0)
    K, N, G = 256, 64, 64
    ws = case.make(K, N, G, "cpu")
    x = torch.randn(3, K, dtype=torch.bfloat16)
    gm, inputs = post_grad_graph(case.fn, x, *ws)
    assert rewrite_decode_matmuls(gm.graph) == 1
    op = next(n for n in gm.graph.nodes if n.target == dm.decode_mm.default)
    by_node = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs))
    leaves, program, layout = [by_node[a] for a in op.args[1]], op.args[2], op.args[4]
    assert layout and not layout_guard.is_guarded(layout)
    assert not DecodeProgram.from_text(program).row_gathers()
    packed = []
    real = dm.pm.packed_mm
    monkeypatch.setattr(dm.pm, "packed_mm", lambda *a, **k: packed.append(1) or real(*a, **k))
    got = dm._decode_mm_cuda(x.to(DEVICE), [t.to(DEVICE) for t in leaves], program, None, layout)
    assert packed and rel_err(got.cpu(), case.fn(x.double(), *ws).double()) <= TOL[torch.bfloat16]



def test_an_identity_order_folds_to_nothing():
    """``w[:, arange(N)]`` (a no-op reorder) folds to the plain column index: no table is carried, and the
    format is the one the decode has without it."""
    def fn(x, w, s):
        return F.linear(x, w[:, torch.arange(w.shape[1])].to(x.dtype) * s[:, None])

    args = (torch.randn(3, 64, dtype=torch.bfloat16), torch.randint(-128, 128, (16, 64), dtype=torch.int8),
            torch.rand(16, dtype=torch.bfloat16) + 0.5)
    text, _, _ = decode_program(fn, *args)
    prog = DecodeProgram.from_text(text)
    assert not prog.embedded_values() and not prog.lookups() and recognize(prog).name == "int8"
    assert_compiled(fn, args, fired={"decode_matmul": 1}, options=ONLY_STRUCTURAL)


def test_a_float_cast_to_bool_is_nonzero_not_truncation():
    """``scale.bool()`` (masking out pruned channels) is ``scale != 0`` in torch: scales below 1 are True. The
    decode program truncated first (every scale below 1 became False: an all-zero output), both where the
    op evaluates the program and in the generated kernel."""
    def skip_dead_channels(x, w, s):
        return F.linear(x, torch.where(s.bool()[:, None], w.to(x.dtype) * s[:, None], 0.0))

    K, N = 256, 96
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    s = (torch.rand(N) * 0.02 + 0.005).to(torch.bfloat16)
    s[::7] = 0
    x = torch.randn(3, K, dtype=torch.bfloat16)
    assert_compiled(skip_dead_channels, (x, w, s), fired={"decode_matmul": 1}, options=ONLY_STRUCTURAL)
    text, leaves, _ = decode_program(skip_dead_channels, x, w, s)
    weight = torch.where(s.bool()[:, None], w.to(torch.bfloat16) * s[:, None], 0.0)  # eager's bf16 weight
    want = x.double() @ weight.double().t()
    assert rel_err(dm.decode_mm_reference(x.double(), leaves, text), want) < 1e-6
    got = dm.decode_mm_triton(x.to(DEVICE), [t.to(DEVICE) for t in leaves], text, None,
                              config=dm.Config(1, 32, 64, 1, 1, 4, 1))
    assert rel_err(got.cpu(), want) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("cfg", [dm.Config(1, 16, 32, 2, 1, 4, 2), dm.DequantConfig(BLOCK_K=32, BLOCK_N=16)],
                         ids=["gemv", "dequant"])
def test_generated_kernel_wraps_abs(cfg):
    """``|-128|`` is -128 in int8 (torch and the program wrap it; the generated ``tl.abs`` gave +128, and the tuner
    checks its configs against the same generated code: found in review)."""
    g = torch.Generator().manual_seed(3)
    M, K, N = 3, 128, 48
    x = torch.randn(M, K, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    w[:, ::7] = -128
    s = (torch.rand(N, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    w, s = w.to(DEVICE), s.to(DEVICE)

    def absolute(x, w, s):
        return x @ (w.abs().to(x.dtype) * s[:, None]).t()

    text, leaves, _ = decode_program(absolute, x, w, s)
    assert "abs" in text
    got = dm.decode_mm_triton(x, leaves, text, config=cfg)
    assert rel_err(got, absolute(x, w, s)) <= TOL[torch.bfloat16]


@pytest.mark.gpu  # (Triton's interpreter turns e4m3fn's NaN code into a number before the max)
@pytest.mark.parametrize("cfg", [dm.Config(1, 16, 32, 2, 1, 4, 2), dm.DequantConfig(BLOCK_K=32, BLOCK_N=16)],
                         ids=["gemv", "dequant"])
def test_generated_kernel_keeps_nan_through_max(cfg):
    """``torch.maximum`` propagates an fp8 NaN code; ``tl.maximum`` drops it unless asked (found in review)."""
    g = torch.Generator().manual_seed(3)
    M, K, N = 3, 128, 48
    x = torch.randn(M, K, generator=g).to(DEVICE, torch.bfloat16)
    s = (torch.rand(N, generator=g) * 0.02 + 0.001).to(DEVICE, torch.bfloat16)
    w8 = torch.randn(N, K, generator=g).to(torch.float8_e4m3fn)
    w8.view(torch.uint8)[5, 9] = 0x7F  # e4m3fn's NaN
    w8 = w8.to(DEVICE)
    lo = torch.full((N, 1), -0.5, dtype=torch.bfloat16, device=DEVICE)

    def floored(x, w8, s, lo):
        return x @ torch.maximum(w8.to(x.dtype) * s[:, None], lo).t()

    text, leaves, _ = decode_program(floored, x, w8, s, lo)
    assert '"max"' in text
    got = dm.decode_mm_triton(x, leaves, text, config=cfg)
    want = floored(x, w8, s, lo)
    assert want[:, 5].isnan().all() and rel_err(got, want) <= TOL[torch.bfloat16]


def test_a_packed_choice_met_by_unaligned_codes_decodes_the_weight_once(monkeypatch):
    """The op's config is chosen per program and M on the first layer's leaves; another layer with the same program
    whose codes start 1 byte off (a view into a shared buffer) does not fit int4_mma_sync's word loads. The op
    raised there; now it decodes that layer's weight once and multiplies (what the group op does too)."""
    from fusekern.kernels import int4_mma_sync as ims
    from fusekern.patterns.decode.layout import derive_layout

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has none)
    K, N = 256, 64
    ws = BY_NAME["int4_k_sym"].make(K, N, 128, DEVICE)
    x = torch.randn(1, K, dtype=torch.bfloat16, device=DEVICE)
    text, leaves, consts = decode_program(BY_NAME["int4_k_sym"].fn, x.cpu(), *(w.cpu() for w in ws))
    leaves = [t.to(DEVICE) for t in leaves]
    prog = DecodeProgram.from_text(text)
    layout = derive_layout(prog, recognize(prog, consts), consts).to_text()
    cfg = ims.Int4MmaSync(SPLIT_K=1)
    buf = torch.empty(leaves[0].numel() + 1, dtype=torch.uint8, device=DEVICE)
    skewed = buf[1:].view(leaves[0].shape)
    skewed.copy_(leaves[0])
    layer2 = [skewed, *leaves[1:]]
    assert skewed.data_ptr() % 4 == 1
    with pytest.raises(ValueError, match="aligned"):  # the kernel itself refuses these codes
        dm.decode_mm_triton(x, layer2, text, None, cfg, layout=layout)
    monkeypatch.setattr(dm, "select_config", lambda *a, **k: cfg)  # the choice kept for the program (CPU: untimed)
    monkeypatch.setattr(dm, "tuned_config", lambda *a, **k: cfg)  # (on a GPU: the tuner's)
    want = dm._decode_mm_cpu(x.cpu(), [t.cpu() for t in leaves], text, None)
    for ls in (leaves, layer2):
        got = dm.decode_mm_triton(x, ls, text, None, layout=layout)
        assert rel_err(got.cpu(), want) < TOL[torch.bfloat16]
