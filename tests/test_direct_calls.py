"""Compiled graphs call fusekern's ops' CUDA functions directly, not through the dispatcher
(``fusekern/compiler_pass/direct_calls.py``), and go through the op wherever the dispatcher would do
something else than call that function."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

from fusekern.compiler_pass import direct_calls
from fusekern.kernels import decode_mm as dm
from fusekern.testing import decode_zoo as zoo

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DECODE_MM = dm.decode_mm.default  # (importing the module defines the op)


class _SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _gptq(M=3, K=256, N=136, device=DEVICE):
    case = next(c for c in zoo.CASES if c.name == "gptq")
    g = torch.Generator().manual_seed(1)
    weights = case.make(K, N, case.group, device)
    x = torch.randn(M, K, generator=g, dtype=torch.bfloat16).to(device)
    return case.fn, x, weights


@pytest.mark.usefixtures("no_compile_caches")
def test_compiled_graph_calls_the_entry_and_it_computes_what_the_op_computes():
    fn, x, weights = _gptq()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fusekern")
    out, (code,) = run_and_get_code(compiled, x, *weights)
    assert "extern_kernels.fusekern_decode_mm(" in code
    assert "torch.ops.fusekern.decode_mm.default(" not in code
    args, kwargs = _entry_args(compiled, x, weights)
    from torch._inductor.select_algorithm import extern_kernels

    direct = extern_kernels.fusekern_decode_mm(*args, **kwargs)
    through_op = DECODE_MM(*args, **kwargs)
    assert torch.equal(direct, through_op) and torch.equal(out, direct)


def _entry_args(compiled, x, weights):
    """The arguments the compiled graph hands ``extern_kernels.fusekern_decode_mm`` (looked up per call)."""
    from torch._inductor.select_algorithm import extern_kernels

    real, seen = extern_kernels.fusekern_decode_mm, []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    extern_kernels.fusekern_decode_mm = spy
    try:
        compiled(x, *weights)
    finally:
        extern_kernels.fusekern_decode_mm = real
    assert len(seen) == 1
    return seen[0]


def test_install_is_idempotent_and_keeps_inductors_layout_constraint():
    from torch._inductor import lowering as L
    from torch._inductor.select_algorithm import extern_kernels

    direct_calls.install()
    first = L.lowerings[DECODE_MM]
    direct_calls.install()
    assert L.lowerings[DECODE_MM] is first and first._fusekern_direct
    assert L.maybe_layout_constraints(DECODE_MM) is not None  # as inductor's own fallback for a custom op
    for op, (name, fn) in direct_calls._ENTRIES.items():
        entry = getattr(extern_kernels, name)
        assert entry.args == (op, fn) and L.lowerings[op]._fusekern_direct


def test_entry_goes_through_the_op_off_cuda():
    def never(*args, **kwargs):
        raise AssertionError("the CUDA function was called for CPU tensors")

    fn, x, weights = _gptq(device="cpu")
    args = _op_args(fn, x, weights)
    want = DECODE_MM(*args)
    got = direct_calls._call(DECODE_MM, never, *args)
    assert torch.equal(got, want)


def _op_args(fn, x, weights):
    """The decode op's arguments in a compiled graph of ``fn``."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fusekern")
    compiled(x, *weights)  # (compiled outside the spy: the backend's install checks the entry)
    args, kwargs = _entry_args(compiled, x, weights)
    assert not kwargs
    return args


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_compile_caches")
def test_gpu_entry_calls_the_cuda_function_unless_the_dispatcher_would_do_more():
    fn, x, weights = _gptq()
    args = _op_args(fn, x, weights)
    calls = []

    def spy(*a, **k):
        calls.append(1)
        return torch.ops.fusekern.decode_mm.default(*a, **k)

    direct_calls._call(DECODE_MM, spy, *args)
    assert calls == [1]
    with _SeenOps() as seen:  # a dispatch mode: through the op (the mode sees it)
        direct_calls._call(DECODE_MM, spy, *args)
    assert calls == [1] and any(f is DECODE_MM for f, _, _ in seen.calls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):  # the trace names the op
        direct_calls._call(DECODE_MM, spy, *args)
    assert calls == [1]
    wants_grad = [args[0].detach().clone().requires_grad_(), *args[1:]]
    with torch.enable_grad(), warnings.catch_warnings():  # autograd's key: through the op (torch 2.11 warns
        warnings.simplefilter("ignore")  # that no autograd kernel is registered; it does not raise)
        direct_calls._call(DECODE_MM, spy, *wants_grad)
    assert calls == [1]  # (the spy, the CUDA function, was not called)


@pytest.mark.usefixtures("no_compile_caches")
def test_stock_inductor_keeps_the_ops_own_line_after_a_fusekern_compile():
    """The fallback lowering is global to the process: once fusekern's backend had installed it, a stock
    ``backend="inductor"`` compile of a graph calling a fusekern op also named ``extern_kernels.fusekern_*``, and its
    FX cache entry failed in a later process that never ran fusekern's backend (found in review)."""
    fn, x, weights = _gptq()
    torch._dynamo.reset()
    run_and_get_code(torch.compile(fn, backend="fusekern"), x, *weights)  # installs the direct lowering
    args, kwargs = _entry_args(torch.compile(fn, backend="fusekern"), x, weights)
    torch._dynamo.reset()

    def calls_the_op(x, *leaves):
        return DECODE_MM(x, list(leaves), *args[2:], **kwargs)

    out, (code,) = run_and_get_code(torch.compile(calls_the_op, backend="inductor"), args[0], *args[1])
    assert "extern_kernels.fusekern_decode_mm(" not in code
    assert torch.equal(out, DECODE_MM(*args, **kwargs))
