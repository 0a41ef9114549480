"""The compiled graph calls fusekern's ops' CUDA paths as Python functions, not through the dispatcher.

Inductor lowers an op it has no lowering for to a fallback kernel, and its Python wrapper calls it as
``torch.ops.fusekern.<op>.default(...)``. The dispatcher then matches the arguments against the schema,
copies each string (a decode program is 1-5 kB) into C++ and back into a fresh Python str, and calls the
Python kernel: about 9 µs per call on a 2-core AMD EPYC, against 0.13 for a plain Python call and 0.45 for
this module's checks (``benchmarks/proto/probe_dispatch_cost.py``, ``benchmarks/results/cpu/
dispatch_cost.csv``; ``benchmarks/profile_op_host.py`` measures the same on a GPU machine). That is a large
share of a replayed decode op's host time, which without CUDA graphs exceeds its 5-30 µs kernel at
decode sizes (the fused decode step was bound by the host).

Here each op keeps inductor's own fallback (the same layout constraint on its inputs, the same output
layout and arguments), and the generated line calls ``extern_kernels.fusekern_<op>`` instead: inductor's
namespace for extern kernels, which every wrapper module imports and which ``ExternKernelChoice`` fills
the same way. That entry runs the op's CUDA function where the dispatcher would run it: the op's first
tensor argument on CUDA (every fusekern op's inputs share its device), no dispatch mode active (fake
tensors, FlopCounterMode...), the profiler off (its trace names the op), no input asking for gradients
under grad mode (the dispatcher's autograd fallback handles that: the ops have no derivative). Otherwise, and in the C++ wrapper (AOTInductor), the
line goes through ``torch.ops`` as before.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable

import torch

_ENTRIES: dict = {}  # op overload -> (name in extern_kernels, CUDA function)
# The modules that define ops and ``register`` them (imported by ``install``: the passes import kernels lazily).
KERNEL_MODULES = ("decode_attention", "decode_mm", "decode_mm_group", "fp8_kv_attention", "masked_argmax", "sampler",
                  "scaled_mm", "w8a16_linear")


# Set by fusekern's backend around its compile: the lowering below renames the fallback only then. The lowering
# table is inductor's, global to the process: a stock ``backend="inductor"`` compile of a graph calling a fusekern
# op must keep inductor's own ``torch.ops`` line, which its FX cache key describes (a cached wrapper naming
# ``extern_kernels.fusekern_*`` failed in a later process that had not run fusekern's backend).
_ACTIVE = contextvars.ContextVar("fusekern_direct_calls", default=False)


@contextlib.contextmanager
def active():
    """Compiles inside this context (fusekern's backend) emit the direct calls."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def register(op: torch._ops.OpOverload, cuda_fn: Callable) -> None:
    """Let compiled graphs call ``cuda_fn`` for ``op`` on CUDA (same signature as the op's CUDA kernel).
    Takes effect at the backend's next ``install`` (kernels are imported without inductor)."""
    _ENTRIES[op] = ("fusekern_" + op._schema.name.split("::")[-1], cuda_fn)


def _tensors_want_grad(args) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in a):
            return True
    return False


def _through_op(args, kwargs) -> bool:
    """Would the dispatcher do anything but call the op's CUDA function? (Not a CUDA tensor first, a
    dispatch mode or the profiler active, or an input that wants gradients under grad mode.)"""
    first = args[0]
    return (type(first) is not torch.Tensor or not first.is_cuda or bool(torch._C._len_torch_dispatch_stack())
            or torch.autograd.profiler._is_profiler_enabled
            or (torch.is_grad_enabled() and _tensors_want_grad((*args, *kwargs.values()))))


def _call(op, cuda_fn, *args, **kwargs):
    if _through_op(args, kwargs):
        return op(*args, **kwargs)
    return cuda_fn(*args, **kwargs)


def install() -> None:
    """Put every registered op's entry in ``extern_kernels`` and make inductor's fallback lowering of the op
    emit it (idempotent; both are global). Called by the backend before each compile, cache hits included:
    a cached wrapper module looks the entry up when it runs."""
    import importlib

    from torch._inductor import lowering as L
    from torch._inductor.select_algorithm import extern_kernels

    for module in KERNEL_MODULES:
        importlib.import_module(f"fusekern.kernels.{module}")
    for op, (name, cuda_fn) in _ENTRIES.items():
        existing = getattr(extern_kernels, name, None)
        if existing is None:
            setattr(extern_kernels, name, functools.partial(_call, op, cuda_fn))
        elif not (isinstance(existing, functools.partial) and existing.args[0] is op):
            raise RuntimeError(f"fusekern: extern_kernels.{name} is taken by something else")
        if getattr(L.lowerings.get(op), "_fusekern_direct", False):
            continue
        if op not in L.lowerings:
            # what inductor's implicit fallback would register: the op's layout constraint tag (custom ops
            # default to inductor's configured constraint)
            from torch._library.utils import get_layout_constraint_tag

            L.make_fallback(op, layout_constraint=L.tag_to_layout_constraint(get_layout_constraint_tag(op)),
                            warn=False)
        L.lowerings[op] = _direct_lowering(op, name, L.lowerings[op])


def _direct_lowering(op, name: str, fallback):
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    def lower(*args, **kwargs):
        start = len(V.graph.operations)
        out = fallback(*args, **kwargs)
        if _ACTIVE.get() and not V.graph.cpp_wrapper:
            for node in V.graph.operations[start:]:
                if isinstance(node, ir.FallbackKernel) and node.op_overload is op:
                    node.python_kernel_name = f"extern_kernels.{name}"
        return out

    lower._fusekern_direct = True
    lower._is_fallback_handler = getattr(fallback, "_is_fallback_handler", False)
    return lower
