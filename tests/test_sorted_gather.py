"""GPTQ's ``scales[g_idx]`` form: act-order gathers on the generated kernel, a sorted g_idx on the hand-tuned ones.

The rewrite passes the op the program as written and a guarded layout (the program read with k // G and its
packed layout); the op checks g_idx once per set of leaves. On CPU the op's CUDA entry runs in the Triton
interpreter, so the guard's choice and both kernels' results are checked here; the compiled CPU path always
evaluates the program as written.
"""
import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import sorted_gather as sg
from fusekern.patterns.decode.program import DecodeProgram
from fusekern.patterns.decode.rewrite import rewrite_decode_matmuls
from fusekern.testing import assert_compiled, rel_err
from fusekern.testing.decode_cones import post_grad_graph
from fusekern.testing.decode_zoo import BY_NAME, gptq_g_idx

aten = torch.ops.aten
packed_mm = dm.pm.packed_mm
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


def rewritten(ws, M=3):
    """The decode_mm call the rewrite makes for gptq_g_idx: (x, leaves, program, bias, layout), values."""
    x = torch.randn(M, K, dtype=torch.bfloat16)
    gm, inputs = post_grad_graph(gptq_g_idx, x, *ws)
    assert rewrite_decode_matmuls(gm.graph) == 1
    op = next(n for n in gm.graph.nodes if n.target == dm.decode_mm.default)
    by_name = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs))
    leaves = [by_name[a] for a in op.args[1]]
    return x, leaves, op.args[2], op.args[4]


def test_rewrite_guards_the_gptq_layout():
    x, leaves, program, layout = rewritten(weights(sorted_index()))
    assert sg.is_guarded(layout)
    sorted_program, sorted_layout, checks = sg._parse(layout)
    prog, fast = DecodeProgram.from_text(program), DecodeProgram.from_text(sorted_program)
    (leaf, group), = checks
    assert group == G and prog.leaves[leaf].shape == (K,)
    assert not any(ins.op == "load" and ins.args[0] == leaf for ins in fast.instrs)  # g_idx not read there
    # with the index sorted, both programs are the same weight, bit for bit
    bound = prog.bind(leaves, "cpu")
    assert torch.equal(prog.evaluate(bound), fast.evaluate(bound))


def test_guard_chooses_per_leaf_set():
    _, leaves, program, layout = rewritten(weights(sorted_index()))
    sorted_program, sorted_layout, checks = sg._parse(layout)
    assert sg.resolve(program, layout, leaves) == (sorted_program, sorted_layout)
    assert sg.resolve(program, layout, leaves) == (sorted_program, sorted_layout)  # (remembered)
    i = DecodeProgram.from_text(program).taken(len(leaves)).index(checks[0][0])
    for bad in (act_order_index(), sorted_index().flip(0), sorted_index() + 1, (torch.arange(K) // (G // 2)).int()):
        other = list(leaves)
        other[i] = bad
        assert sg.resolve(program, layout, other) == (program, "")
    assert sg.resolve(program, "", leaves) == (program, "")  # unguarded: as given


@pytest.mark.parametrize("index", ["sorted", "act_order"])
def test_op_matches_the_reference_either_way(index, monkeypatch):
    """The op's CUDA entry (interpreter on CPU): hand-tuned kernels for the sorted index, the generated kernel
    for act-order, each against the program as written in float64."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has none)
    ws = weights(sorted_index())
    x, leaves, program, layout = rewritten(ws)
    if index == "act_order":
        i = DecodeProgram.from_text(program).taken(len(leaves)).index(sg._parse(layout)[2][0][0])
        leaves[i] = act_order_index()
    packed = []
    monkeypatch.setattr(dm.pm, "packed_mm", lambda *a, **k: packed.append(1) or packed_mm(*a, **k))
    x = torch.randn(5, K, dtype=torch.bfloat16)
    prog = DecodeProgram.from_text(program)
    ref64 = x.double() @ prog.evaluate(prog.bind(leaves, "cpu")).double()
    got = dm._decode_mm_cuda(x, leaves, program, None, layout)
    assert got.dtype == torch.bfloat16 and rel_err(got, ref64) <= 1e-2
    assert bool(packed) == (index == "sorted")  # the hand-tuned kernels ran only where g_idx checked


@pytest.mark.parametrize("name", ["gptq_g_idx_sorted", "gptq_act_order"])
def test_compiled_gptq_g_idx_matches_eager(name):
    case = BY_NAME[name]
    torch.manual_seed(0)
    args = (torch.randn(4, K, dtype=torch.bfloat16), *case.make(K, N, G, "cpu"))
    assert_compiled(case.fn, args, fired={"decode_matmul": 1}, options=ONLY_STRUCTURAL)


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
    assert layout and not sg.is_guarded(layout)
    assert_compiled(fn, (x, qweight, qzeros, scales), fired={"decode_matmul": 1}, options=ONLY_STRUCTURAL)
