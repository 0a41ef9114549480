"""GPTQ's ``scales[g_idx]`` form: act-order gathers on the generated kernel, a sorted g_idx on the hand-tuned ones.

The rewrite passes the op the program as written and a guarded layout (the program read with k // G and its
packed layout); the op checks g_idx once per set of leaves. On CPU the op's CUDA entry runs in the Triton
interpreter, so the guard's choice and both kernels' results are checked here; the compiled CPU path always
evaluates the program as written.
"""
import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import layout_guard
from fusekern.patterns.decode.program import DecodeProgram
from fusekern.patterns.decode.rewrite import rewrite_decode_matmuls
from fusekern.testing import assert_compiled, rel_err
from fusekern.testing.decode_cones import post_grad_graph
from fusekern.testing.decode_zoo import BY_NAME, gptq_g_idx, gptq_model

aten = torch.ops.aten
packed_mm = dm.pm.packed_mm
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K, N, G = 256, 64, 64
ONLY_STRUCTURAL = {"fusekern.disable": ["scale_folding"]}


def weights(g_idx, seed=0):
    torch.manual_seed(seed)
    case = BY_NAME["gptq_g_idx_sorted"]
    qweight, qzeros, scales, _ = case.make(K, N, G, "cpu")
    return qweight, qzeros, scales, g_idx


def sorted_index():
    return (torch.arange(K) // G).to(torch.int32)


def act_order_index(seed=1):
    return (torch.randperm(K, generator=torch.Generator().manual_seed(seed)) // G).to(torch.int32)


def rewritten(ws, M=3, fn=gptq_g_idx):
    """The decode_mm call the rewrite makes for ``fn``: (x, leaves, program, layout), values."""
    x = torch.randn(M, K, dtype=torch.bfloat16)
    gm, inputs = post_grad_graph(fn, x, *ws)
    assert rewrite_decode_matmuls(gm.graph) == 1
    op = next(n for n in gm.graph.nodes if n.target == dm.decode_mm.default)
    by_name = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs))
    leaves = [by_name[a] for a in op.args[1]]
    return x, leaves, op.args[2], op.args[4]


def test_rewrite_guards_the_gptq_layout():
    x, leaves, program, layout = rewritten(weights(sorted_index()))
    assert layout_guard.is_guarded(layout)
    sorted_program, sorted_layout, checks = layout_guard._parse(layout)
    prog, fast = DecodeProgram.from_text(program), DecodeProgram.from_text(sorted_program)
    (leaf, kind, group), = checks
    assert (kind, group) == ("groups", G) and prog.leaves[leaf].shape == (K,)
    assert not any(ins.op == "load" and ins.args[0] == leaf for ins in fast.instrs)  # g_idx not read there
    # with the index sorted, both programs are the same weight, bit for bit
    bound = prog.bind(leaves, "cpu")
    assert torch.equal(prog.evaluate(bound), fast.evaluate(bound))


def test_guard_chooses_per_leaf_set():
    _, leaves, program, layout = rewritten(weights(sorted_index()))
    sorted_program, sorted_layout, checks = layout_guard._parse(layout)
    assert layout_guard.resolve(program, layout, leaves) == (sorted_program, sorted_layout)
    assert layout_guard.resolve(program, layout, leaves) == (sorted_program, sorted_layout)  # (remembered)
    i = DecodeProgram.from_text(program).taken(len(leaves)).index(checks[0][0])
    for bad in (act_order_index(), sorted_index().flip(0), sorted_index() + 1, (torch.arange(K) // (G // 2)).int()):
        other = list(leaves)
        other[i] = bad
        assert layout_guard.resolve(program, layout, other) == (program, "")
    assert layout_guard.resolve(program, "", leaves) == (program, "")  # unguarded: as given


@pytest.mark.parametrize("index", ["sorted", "act_order"])
def test_op_matches_the_reference_either_way(index, monkeypatch):
    """The op's CUDA entry (interpreter on CPU): hand-tuned kernels for the sorted index, the generated kernel
    for act-order, each against the program as written in float64."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has none)
    ws = weights(sorted_index())
    x, leaves, program, layout = rewritten(ws)
    if index == "act_order":
        i = DecodeProgram.from_text(program).taken(len(leaves)).index(layout_guard._parse(layout)[2][0][0])
        leaves[i] = act_order_index()
    packed = []
    monkeypatch.setattr(dm.pm, "packed_mm", lambda *a, **k: packed.append(1) or packed_mm(*a, **k))
    x = torch.randn(5, K, dtype=torch.bfloat16)
    prog = DecodeProgram.from_text(program)
    ref64 = x.double() @ prog.evaluate(prog.bind(leaves, "cpu")).double()
    got = dm._decode_mm_cuda(x.to(DEVICE), [t.to(DEVICE) for t in leaves], program, None, layout)
    assert got.dtype == torch.bfloat16 and rel_err(got.cpu(), ref64) <= 1e-2
    assert bool(packed) == (index == "sorted")  # the hand-tuned kernels ran only where g_idx checked


@pytest.mark.parametrize("name", ["gptq_g_idx_sorted", "gptq_act_order", "gptq_model"])
def test_compiled_gptq_g_idx_matches_eager(name):
    case = BY_NAME[name]
    torch.manual_seed(0)
    args = (torch.randn(4, K, dtype=torch.bfloat16), *case.make(K, N, G, "cpu"))
    assert_compiled(case.fn, args, fired={"decode_matmul": 1} if case.fires else {}, options=ONLY_STRUCTURAL)


def test_a_constant_sorted_index_needs_no_guard():
    """g_idx built in forward (a graph constant): checked by the rewrite itself."""
    qweight, qzeros, scales, _ = weights(sorted_index())

    def fn(x, qweight, qzeros, scales):
        g_idx = torch.tensor((torch.arange(K) // G).tolist(), dtype=torch.int32)
        return gptq_g_idx(x, qweight, qzeros, scales, g_idx)

    x = torch.randn(3, K, dtype=torch.bfloat16)
    gm, inputs = post_grad_graph(fn, x, qweight, qzeros, scales)
    assert rewrite_decode_matmuls(gm.graph) == 1
    op = next(n for n in gm.graph.nodes if n.target == dm.decode_mm.default)
    layout = op.args[4]
    assert layout and not layout_guard.is_guarded(layout)
    assert_compiled(fn, (x, qweight, qzeros, scales), fired={"decode_matmul": 1}, options=ONLY_STRUCTURAL)


def test_shift_tables_in_buffers_are_checked_too():
    """GPTQModel's module holds its shift table (two views): the graph passes them like weights. The rewrite
    assumes the sequential 4-bit table and the op checks all three leaves."""
    torch.manual_seed(0)
    ws = BY_NAME["gptq_model"].make(K, N, G, "cpu")
    x, leaves, program, layout = rewritten(ws, fn=gptq_model)
    assert layout_guard.is_guarded(layout)
    checks = layout_guard._parse(layout)[2]
    assert sorted(kind for _, kind, _ in checks) == ["groups", "values", "values"]
    assert {param for _, kind, param in checks if kind == "values"} == {tuple(range(0, 32, 4))}
    assert layout_guard.resolve(program, layout, leaves)[1] == layout_guard._parse(layout)[1]
    taken = DecodeProgram.from_text(program).taken(len(leaves))
    for i, kind, _ in checks:
        if kind != "values":
            continue
        other = list(leaves)
        other[taken.index(i)] = leaves[taken.index(i)].flip(0).flip(-1)  # another packing order
        assert layout_guard.resolve(program, layout, other) == (program, "")


class GPTQModelLinear(torch.nn.Module):
    """GPTQModel's TorchQuantLinear, reduced to its dequantize-and-matmul: buffers as the module keeps them."""

    def __init__(self, ws):
        super().__init__()
        for name, t in zip(("qweight", "qzeros", "scales", "g_idx", "wf_zero", "wf_neg"), ws):
            self.register_buffer(name, t)

    def forward(self, x):
        return gptq_model(x, self.qweight, self.qzeros, self.scales, self.g_idx, self.wf_zero, self.wf_neg)


@pytest.mark.usefixtures("no_compile_caches")
@pytest.mark.parametrize("packing", ["gptq", "reversed", "act_order"])
def test_module_with_buffers_compiles_to_eager(packing):
    """The module form through the backend. The example inputs it is compiled for decide: GPTQ's table and
    a sorted g_idx fire (guarded); another shift table (the fields reversed) or an act-order g_idx would fail
    the op's check on every call and run slower code than stock, so the rewrite declines."""
    import fusekern

    torch.manual_seed(1)
    ws = list(BY_NAME["gptq_model"].make(K, N, G, "cpu"))
    if packing == "reversed":
        ws[4], ws[5] = ws[4].flip(-1).contiguous(), ws[5].flip(0).contiguous()
    if packing == "act_order":
        ws[3] = act_order_index()
    m = GPTQModelLinear(ws)
    x = torch.randn(4, K, dtype=torch.bfloat16)
    fires = packing == "gptq"
    assert_compiled(m, (x,), fired={"decode_matmul": 1} if fires else {}, options=ONLY_STRUCTURAL)
    if not fires:
        reasons = [r.reason for r in fusekern.match_report().rejections() if r.pattern == "decode_matmul"]
        assert any("gathered by data" in r for r in reasons), reasons


class AWQBufferLinear(torch.nn.Module):
    """AWQ with its shift table held in a buffer (not built in forward): the graph passes it like a weight."""

    def __init__(self, qweight, qzeros, scales, shifts):
        super().__init__()
        for name, t in zip(("qweight", "qzeros", "scales", "shifts"), (qweight, qzeros, scales, shifts)):
            self.register_buffer(name, t)

    def forward(self, x):
        k = self.qweight.shape[0]
        w = ((self.qweight[:, :, None] >> self.shifts) & 15).reshape(k, -1)
        z = ((self.qzeros[:, :, None] >> self.shifts) & 15).reshape(self.qzeros.shape[0], -1)
        g = k // self.scales.shape[0]
        w = (w - torch.repeat_interleave(z, g, dim=0)).to(x.dtype) * torch.repeat_interleave(self.scales, g, dim=0)
        return x @ w


@pytest.mark.usefixtures("no_compile_caches")
@pytest.mark.parametrize("order", ["awq", "sequential", "other"])
def test_a_buffered_shift_table_is_read_as_the_one_the_example_holds(order):
    """The candidate tables are tried in turn (sequential first): the first whose layout derives used to be
    taken even where the example input held AWQ's order, and the rewrite then declined, leaving AWQ with a
    buffered table to the generated kernel. A table that is neither runs the generated kernel, as before."""
    import fusekern
    from fusekern.patterns.decode.formats import AWQ_ORDER

    torch.manual_seed(2)
    qweight, qzeros, scales = BY_NAME["awq"].make(K, N, G, "cpu")
    fields = {"awq": [4 * j for j in AWQ_ORDER], "sequential": list(range(0, 32, 4)),
              "other": [28, 24, 20, 16, 12, 8, 4, 0]}[order]
    m = AWQBufferLinear(qweight, qzeros, scales, torch.tensor(fields, dtype=torch.int32))
    x = torch.randn(4, K, dtype=torch.bfloat16)
    assert_compiled(m, (x,), fired={"decode_matmul": 1}, options=ONLY_STRUCTURAL)
    notes = [r.reason for g in fusekern.match_report().graphs for r in g.notes if r.pattern == "decode_matmul"]
    expected = {"awq": "awq, 4-bit", "sequential": "int4, 4-bit", "other": "generic decode"}[order]
    assert any(n.startswith(expected) for n in notes), notes


def test_a_narrowing_cast_of_g_idx_is_not_read_as_sorted():
    """``scales[g.bool().long()]`` reads rows 0 / 1, not the leaf's values: no k // G reading, eager's result."""
    def fn(x, qweight, qzeros, scales, g_idx):
        return gptq_g_idx(x, qweight, qzeros, scales, g_idx.bool().int())

    ws = weights(sorted_index())
    x = torch.randn(3, K, dtype=torch.bfloat16)
    gm, inputs = post_grad_graph(fn, x, *ws)
    assert rewrite_decode_matmuls(gm.graph) == 0  # no k // G reading: gathered rows, no layout, declined
    assert_compiled(fn, (x, *ws), fired={}, options=ONLY_STRUCTURAL)


def test_g_idx_written_in_place_is_checked_again(monkeypatch):
    """load_state_dict of an act-order checkpoint into a module that already ran: the version counter moves,
    the guard checks again and the op leaves the k // G kernels."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x, leaves, program, layout = rewritten(weights(sorted_index()))
    i = DecodeProgram.from_text(program).taken(len(leaves)).index(layout_guard._parse(layout)[2][0][0])
    assert layout_guard.resolve(program, layout, leaves)[1]
    leaves = [t.to(DEVICE) for t in leaves]
    assert layout_guard.resolve(program, layout, leaves)[1]
    leaves[i].copy_(act_order_index().to(DEVICE))
    assert layout_guard.resolve(program, layout, leaves) == (program, "")
    got = dm._decode_mm_cuda(x.to(DEVICE), leaves, program, None, layout)
    prog = DecodeProgram.from_text(program)
    cpu = [t.cpu() for t in leaves]
    assert rel_err(got.cpu(), x.double() @ prog.evaluate(prog.bind(cpu, "cpu")).double()) <= 1e-2


def test_a_large_constant_g_idx_is_checked_when_compiling():
    """A sorted g_idx built in forward with more entries than the program embeds: checked by the rewrite (a
    copy of a constant reaches the op afresh every call, which would miss the op's per-leaf-set memory)."""
    Kl = 512
    GL = (torch.arange(Kl) // 64).tolist()

    def fn(x, w, s):
        return x @ (w.to(x.dtype) * s[torch.tensor(GL, dtype=torch.int32).long()])

    args = (torch.randn(2, Kl, dtype=torch.bfloat16), torch.randint(-128, 128, (Kl, 16), dtype=torch.int8),
            torch.rand(Kl // 64, 16, dtype=torch.bfloat16) + 0.5)
    gm, inputs = post_grad_graph(fn, *args)
    assert rewrite_decode_matmuls(gm.graph) == 1
    op = next(n for n in gm.graph.nodes if n.target == dm.decode_mm.default)
    assert op.args[4] and not layout_guard.is_guarded(op.args[4])
    assert_compiled(fn, args, fired={"decode_matmul": 1}, options=ONLY_STRUCTURAL)


@pytest.mark.usefixtures("no_compile_caches")
def test_reading_example_values_keeps_the_batch_dynamic():
    """value_of compares shapes through their hints: comparing the SymInt itself guarded the batch size and
    recompiled the graph for every new M."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import fusekern

    torch._dynamo.reset()
    fusekern.reset_match_report()
    m = GPTQModelLinear(BY_NAME["gptq_model"].make(K, N, G, "cpu"))
    counter = CompileCounterWithBackend("fusekern")
    f = torch.compile(m, backend=counter, dynamic=True)
    for M in (4, 7, 9):
        x = torch.randn(M, K, dtype=torch.bfloat16)
        assert rel_err(f(x), m(x)) <= 1e-2
    assert counter.frame_count == 1
    assert fusekern.match_report().fired().get("decode_matmul") == 1


def test_example_digest_keys_only_what_a_rewrite_reads():
    """The FX graph cache key part: g_idx sorted or not and shift-table values change it; token ids, positions
    and seeds do not enter it."""
    from fusekern.compiler_pass.example_inputs import digest

    ws = list(BY_NAME["gptq_model"].make(K, N, G, "cpu"))
    act = list(ws)
    act[3] = act_order_index()
    awq = list(ws)
    awq[4] = torch.tensor([[0, 16, 4, 20, 8, 24, 12, 28]], dtype=torch.int32)
    assert len({digest(ws), digest(act), digest(awq)}) == 3
    assert digest(ws) == digest([t.clone() for t in ws])
    others = [torch.randint(0, 32000, (1, 77)), torch.arange(5, 12), torch.tensor([1234]), torch.tensor([3]),
              torch.randn(8, 8)]
    assert digest(others) == ""


def test_op_replays_without_checking_again_until_g_idx_is_written(monkeypatch):
    """The op keys its launch replay by the write counts of the leaves the guard checks: while they hold, a
    call replays with no guard lookup; after an in-place write the guard checks again, and the act-order
    values leave the k // G kernels (the result is the program's as written)."""
    from test_replay import _InterpretedLaunch

    from fusekern.kernels import replay

    if DEVICE != "cuda":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(replay, "launch", lambda jit_fn, grid, args, kwargs, record:
                            _InterpretedLaunch(jit_fn, grid, args, kwargs) if record else jit_fn[grid](*args, **kwargs))
    monkeypatch.setattr(dm, "_REPLAYS", dm.LeafCache())
    x, leaves, program, layout = rewritten(weights(sorted_index()))
    leaves = [t.to(DEVICE) for t in leaves]
    i = DecodeProgram.from_text(program).taken(len(leaves)).index(layout_guard._parse(layout)[2][0][0])
    resolved, paths = [], []
    real_resolve, real_path = layout_guard.resolve, dm.decode_mm_triton
    monkeypatch.setattr(layout_guard, "resolve", lambda *a: resolved.append(1) or real_resolve(*a))
    monkeypatch.setattr(dm, "decode_mm_triton",
                        lambda *a, record=None, **k: (record is not None and paths.append(k.get("layout")))
                        or real_path(*a, record=record, **k))
    prog = DecodeProgram.from_text(program)

    def reference(x):
        cpu = [t.cpu() for t in leaves]
        return x.double() @ prog.evaluate(prog.bind(cpu, "cpu")).double()

    dm._decode_mm_cuda(x.to(DEVICE), leaves, program, None, layout)
    assert len(resolved) == 1 and len(paths) == 1 and paths[0]  # the guarded (packed) layout
    x2 = torch.randn(3, K, dtype=torch.bfloat16)
    got = dm._decode_mm_cuda(x2.to(DEVICE), leaves, program, None, layout)
    assert len(resolved) == 1 and len(paths) == 1  # replayed: no guard lookup, no path
    assert rel_err(got.cpu(), reference(x2)) <= 1e-2
    leaves[i].copy_(act_order_index().to(DEVICE))
    got = dm._decode_mm_cuda(x2.to(DEVICE), leaves, program, None, layout)
    assert len(resolved) == 2 and paths[1:] == [""]  # checked again: the program as written
    assert rel_err(got.cpu(), reference(x2)) <= 1e-2
