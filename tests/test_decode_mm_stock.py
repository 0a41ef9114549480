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
from fusekern.testing.decode_cones import decode_program
from fusekern.testing.decode_zoo import BY_NAME

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


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


# ----------------------------------------------------------------------------- the tuner


@pytest.fixture
def tuner(monkeypatch):
    """``tuned_config`` on CPU: the decode-once kernel (interpreter) as the one kernel candidate, and injected
    times per config type; returns the list of configs timed."""
    monkeypatch.setattr(dm, "_tuned", {})
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
    CUDA graph captured after a call with that shape; a shape not run before the capture takes a kernel."""
    text, leaves = program("gptq", 1024, 512, device="cuda", seed=7)
    x = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setattr(dm, "_tuned", {(text, "", 64, 1, x.device): stock.StockConfig()})
    got = dm.decode_mm(x, leaves, text, None, "")
    want = dm.decode_mm_reference(x, leaves, text)
    assert rel_err(got, want) <= 1e-2
    g = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(g):
        out = dm.decode_mm(static_x, leaves, text, None, "")
    static_x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(out, dm.decode_mm_reference(static_x, leaves, text)) <= 1e-2
    # 48 rows share the 64-row bucket (stock) but were never run: the capture takes the untimed kernel
    x48 = torch.randn(48, 1024, dtype=torch.bfloat16, device="cuda")
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        out48 = dm.decode_mm(x48, leaves, text, None, "")
    out48.fill_(float("nan"))
    g2.replay()
    torch.cuda.synchronize()
    assert rel_err(out48, dm.decode_mm_reference(x48, leaves, text)) <= 1e-2
