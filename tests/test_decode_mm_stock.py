"""The stock fallback of ``decode_mm`` (issue 4: a replacement never loses to the graph it replaces).

CPU: the stock computation (the decode program's torch semantics compiled by plain ``torch.compile``) against
the decode reference for each format, with a bias, on dynamic rows without a compile per row count; the tuner
keeping it where it times fastest, a kernel where that is faster, never a stock result that is off, and not
timing it at all with ``FUSEKERN_STOCK_FALLBACK=0``. The kernels run in the interpreter and the times are
injected (no test times anything). GPU: the registered op on the stock choice, inside and outside a CUDA
graph capture.
"""
from __future__ import annotations

import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import decode_mm_stock as stock
from fusekern.patterns.decode.program import DecodeProgram
from fusekern.testing import rel_err
from fusekern.patterns.decode.analysis import analyse, find_cone
from fusekern.testing.decode_cones import decode_program, node_values, post_grad_graph
from fusekern.testing.decode_zoo import BY_NAME

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


@pytest.fixture(autouse=True)
def fresh_stock_state(monkeypatch):
    """Each test starts with no compiled variant (conftest resets Dynamo between tests, which would count as
    guard misses of the variants other tests compiled for the same program text)."""
    monkeypatch.setattr(stock, "_COMPILED", {})
    monkeypatch.setattr(stock, "_FRESH", {})
    monkeypatch.setattr(stock, "_MISSED", set())


def program(name: str, K: int = 256, N: int = 96, dtype=torch.bfloat16, device=DEVICE, seed=0):
    """(program text, bound leaves) of a zoo format's decode, drawn fresh."""
    case = BY_NAME[name]
    torch.manual_seed(seed)
    G = 128 if name == "fp8_block" else 64
    ws = case.make(K, N, G, device)
    text, leaves, _ = decode_program(case.fn, torch.randn(2, K, dtype=dtype, device=device), *ws)
    return text, DecodeProgram.from_text(text).bind(leaves, torch.device(device))


@pytest.mark.parametrize("name", ["gptq", "awq", "int8_group_asym", "fp8_block", "mxfp4", "nvfp4", "hqq"])
def test_stock_computation_matches_the_reference(name):
    K, N = 256, 384 if name == "fp8_block" else 96
    text, leaves = program(name, K, N, device="cpu")
    bias = torch.randn(N, dtype=torch.bfloat16)
    for M, b in ((3, None), (7, bias), (1, None), (33, bias)):
        x = torch.randn(M, K, dtype=torch.bfloat16)
        got = stock.stock_mm(text, x, leaves, b)
        want = dm.decode_mm_reference(x, leaves, text, b)
        assert got.shape == want.shape and got.dtype == x.dtype
        assert rel_err(got, want) <= TOL[torch.bfloat16], (name, M, rel_err(got, want))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_stock_computation_in_other_activation_dtypes(dtype):
    text, leaves = program("gptq", device="cpu")
    x = torch.randn(5, 256, dtype=dtype)
    got = stock.stock_mm(text, x, leaves)
    assert got.dtype == dtype
    assert rel_err(got, dm.decode_mm_reference(x, leaves, text)) <= TOL[dtype]


def test_rows_are_dynamic():
    """One graph for every row count above one (and one for a single row): a server's changing batch must not
    compile again on each new size."""
    text, leaves = program("int4_k_stack", device="cpu", seed=1)
    stats = torch._dynamo.utils.counters["stats"]
    stock.stock_mm(text, torch.randn(4, 256, dtype=torch.bfloat16), leaves)
    before = stats["unique_graphs"]
    for M in (5, 9, 17, 130, 1, 2, 1):
        x = torch.randn(M, 256, dtype=torch.bfloat16)
        assert rel_err(stock.stock_mm(text, x, leaves), dm.decode_mm_reference(x, leaves, text)) <= 1e-2
    assert stats["unique_graphs"] - before <= 1  # the single row


def test_strided_activation():
    text, leaves = program("gptq", device="cpu", seed=2)
    x = torch.randn(6, 512, dtype=torch.bfloat16)[:, 1::2]  # stride 2 along K, offset by one element
    assert not x.is_contiguous()
    assert rel_err(stock.stock_mm(text, x, leaves), dm.decode_mm_reference(x, leaves, text)) <= 1e-2


@pytest.mark.parametrize("packed", [False, True], ids=["int8", "int4_pairs"])
def test_batched_program(packed):
    """A weight per batch entry (``bmm``: int8 experts, or two int4 per byte), with a bias of another dtype,
    one row and an empty batch of rows."""
    torch.manual_seed(8)
    B, K, N = 3, 64, 40

    def fn(x, wq, s):  # [B, K, N] codes (or [B, K / 2, N] bytes), per-expert-channel scales
        w = torch.stack([wq & 15, wq >> 4], 2).reshape(B, K, N).to(x.dtype) - 8 if packed else wq.to(x.dtype)
        return torch.bmm(x, w * s[:, None, :])

    wq = torch.randint(0, 256, (B, K // 2, N), dtype=torch.uint8) if packed else \
        torch.randint(-128, 128, (B, K, N), dtype=torch.int8)
    s = torch.rand(B, N, dtype=torch.bfloat16) * 0.1 + 0.01
    gm, inputs = post_grad_graph(fn, torch.randn(B, 5, K, dtype=torch.bfloat16), wq, s)
    env = node_values(gm, inputs)
    cone = find_cone(next(n for n in gm.graph.nodes if n.target == torch.ops.aten.bmm.default))
    prog = analyse(cone)
    text, leaves = prog.to_text(), [env[leaf] for leaf in cone.leaves]
    assert prog.batch == B
    leaves = prog.bind(leaves, torch.device("cpu"))
    bias = torch.randn(N, dtype=torch.float32)
    for M, b in ((5, None), (9, bias), (1, None), (0, bias)):
        x = torch.randn(B, M, K, dtype=torch.bfloat16)
        got = stock.stock_mm(text, x, leaves, b)
        want = dm.decode_mm_reference(x, leaves, text, b)
        assert got.shape == want.shape == (B, M, N) and got.dtype == x.dtype
        assert M == 0 or rel_err(got, want) <= 1e-2, (packed, M)
    x = torch.randn(B, 5, K, dtype=torch.bfloat16)
    assert rel_err(stock.stock_mm(text, x, leaves), fn(x, wq, s)) <= 1e-2  # and the user's own graph


def test_grad_and_inference_modes():
    """Grad mode, inference mode and inference tensors: none raises, none compiles a variant again."""
    text, leaves = program("int4_k_stack", device="cpu", seed=9)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    want = dm.decode_mm_reference(x, leaves, text)
    for _ in range(2):
        assert rel_err(stock.stock_mm(text, x, leaves), want) <= 1e-2
        with torch.no_grad():
            assert rel_err(stock.stock_mm(text, x, leaves), want) <= 1e-2
        with torch.inference_mode():
            xi = x.clone()
            assert rel_err(stock.stock_mm(text, xi, leaves), want) <= 1e-2
    assert not stock._FRESH


def test_autocast_and_grad_do_not_change_the_result():
    """The op ignores autocast (its kernels compute in the op's dtypes): so does the stock computation, and
    leaves that require grad give a result that does not."""
    text, leaves = program("awq", device="cpu", seed=10)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    want = stock.stock_mm(text, x, leaves)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(stock.stock_mm(text, x, leaves), want)
    grads = [t.clone().requires_grad_(t.is_floating_point()) for t in leaves]
    got = stock.stock_mm(text, x, grads)
    assert not got.requires_grad and torch.equal(got, want)


def test_a_variant_whose_guards_keep_missing_runs_a_kernel(monkeypatch):
    """After torch._dynamo.reset() a compiled variant would compile again: it is traced and compiled anew,
    up to FRESH_COMPILES times; then ``StockUnavailable``, and the op runs a kernel for it, with the right
    result."""
    monkeypatch.setattr(stock, "FRESH_COMPILES", 1)
    text, leaves = program("gptq", device="cpu", seed=12)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    want = dm.decode_mm_reference(x, leaves, text)
    assert rel_err(stock.stock_mm(text, x, leaves), want) <= 1e-2
    assert rel_err(stock.stock_mm(text, x, leaves), want) <= 1e-2  # (no miss: the same graph)
    assert not stock._FRESH
    torch._dynamo.reset()
    assert rel_err(stock.stock_mm(text, x, leaves), want) <= 1e-2  # compiled anew
    assert list(stock._FRESH.values()) == [1]
    torch._dynamo.reset()
    with pytest.raises(stock.StockUnavailable):
        stock.stock_mm(text, x, leaves)
    assert rel_err(dm.decode_mm_triton(x, leaves, text, config=stock.StockConfig()), want) <= 1e-2
    with pytest.raises(stock.StockUnavailable):  # remembered: no guard failure report on every call
        stock.stock_mm(text, x, leaves)


def test_caller_tensor_is_not_marked():
    text, leaves = program("gptq", device="cpu", seed=11)
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    stock.stock_mm(text, x, leaves)
    assert not getattr(x, "_dynamo_weak_dynamic_indices", None) and not getattr(x, "_dynamo_dynamic_indices", None)


# ----------------------------------------------------------------------------- the tuner


@pytest.fixture
def tuner(monkeypatch):
    """``tuned_config`` on CPU: the decode-once kernel (interpreter) as the one kernel candidate, and injected
    times per config type; returns the list of configs timed."""
    monkeypatch.setattr(dm, "_tuned", {})
    monkeypatch.setattr(dm, "timings", {})
    monkeypatch.setattr(dm, "device_candidates", lambda *a, **k: [dm.DequantConfig()])
    timed = []

    def set_times(times: dict):
        def fake_time(run, **_):
            cfg = run.args[4]  # functools.partial(decode_mm_triton, rows, leaves, text, bias, cfg, ...)
            run()
            timed.append(cfg)
            return times[type(cfg)]

        monkeypatch.setattr(dm, "_gpu_time", fake_time)
        return timed

    return set_times


def test_tuner_keeps_stock_where_it_is_fastest(tuner):
    timed = tuner({stock.StockConfig: 1.0, dm.DequantConfig: 2.0})
    text, leaves = program("gptq", device="cpu", seed=3)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    cfg = dm.tuned_config(x, leaves, text, None, 1, 16)
    assert cfg == stock.StockConfig() and set(map(type, timed)) == {stock.StockConfig, dm.DequantConfig}
    assert list(dm.timings.values()) == [{dm.DequantConfig(): 2.0, stock.StockConfig(): 1.0}]  # (benchmarks read it)
    got = dm.decode_mm_triton(x, leaves, text, config=cfg)
    assert rel_err(got, dm.decode_mm_reference(x, leaves, text)) <= 1e-2


def test_tuner_keeps_the_kernel_where_it_is_faster(tuner):
    tuner({stock.StockConfig: 3.0, dm.DequantConfig: 2.0})
    text, leaves = program("gptq", device="cpu", seed=4)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    assert dm.tuned_config(x, leaves, text, None, 1, 16) == dm.DequantConfig()


def test_a_stock_result_that_is_off_is_never_kept(tuner, monkeypatch):
    """The stock candidate is checked against the decode-once kernel like every other: fastest but wrong
    (here: its weight's scales doubled) loses."""
    tuner({stock.StockConfig: 1.0, dm.DequantConfig: 2.0})
    text, leaves = program("gptq", device="cpu", seed=5)
    real = stock.stock_mm
    monkeypatch.setattr(stock, "stock_mm", lambda t, x, lv, b=None: real(t, x, lv, b) * 2)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    assert dm.tuned_config(x, leaves, text, None, 1, 16) == dm.DequantConfig()


def test_fallback_off_times_only_the_kernels(tuner, monkeypatch):
    monkeypatch.setenv("FUSEKERN_STOCK_FALLBACK", "0")
    timed = tuner({stock.StockConfig: 1.0, dm.DequantConfig: 2.0})
    text, leaves = program("gptq", device="cpu", seed=6)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    assert dm.tuned_config(x, leaves, text, None, 1, 16) == dm.DequantConfig()
    assert not any(isinstance(c, stock.StockConfig) for c in timed)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_op_runs_the_stock_choice_and_captures_it(monkeypatch):
    """The op on a shape whose tuned choice is stock: the same result as the reference, also replayed from a
    CUDA graph captured after a call of that variant; a capture under another grad mode (a variant not run
    before: it would compile) takes a kernel, and so does one after a guard the variant key does not cover."""
    text, leaves = program("gptq", 1024, 512, device="cuda", seed=7)
    x = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setattr(dm, "_tuned", {(text, "", 64, 1, x.device): stock.StockConfig()})
    got = dm.decode_mm(x, leaves, text, None, "")
    assert rel_err(got, dm.decode_mm_reference(x, leaves, text)) <= 1e-2
    compiled = len(stock._COMPILED)

    def captured(rows, grad: bool):
        static_x = torch.empty_like(rows)
        g = torch.cuda.CUDAGraph()
        with torch.set_grad_enabled(grad), torch.cuda.graph(g):
            out = dm.decode_mm(static_x, leaves, text, None, "")
        static_x.copy_(rows)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        return out

    for grad in (True, False):
        for M in (64, 48):  # 48 rows: the variant's dynamic rows, in the same 64-row bucket
            rows = torch.randn(M, 1024, dtype=torch.bfloat16, device="cuda")
            assert rel_err(captured(rows, grad), dm.decode_mm_reference(rows, leaves, text)) <= 1e-2, (grad, M)
    assert len(stock._COMPILED) == compiled  # nothing compiled during the captures
