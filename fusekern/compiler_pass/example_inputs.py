"""The real example inputs of the graph being compiled, for decisions that only their values can inform.

Post-grad passes see fake tensors. A few choices depend on values the graph does not show: whether GPTQ's
``g_idx`` is sorted decides if a guarded hand-tuned layout can ever pay (an act-order checkpoint would always
fail the op's check and run slower code than stock). The backend publishes the example inputs it was given
while inductor compiles; ``value_of`` maps a placeholder of the graph being rewritten to its example, only
where the placeholders and the inputs line up one to one with equal shapes, strides and dtypes (AOT autograd
deduplicating or adding inputs makes them not line up: then nothing is known). Such a value is a hint about
the first call only: whatever is decided from it must stay correct for other values (the op checks again).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("fusekern_example_inputs", default=None)


@contextlib.contextmanager
def provided(inputs: Sequence[Any]):
    token = _CURRENT.set(list(inputs))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def value_of(node: torch.fx.Node) -> torch.Tensor | None:
    """The real example tensor behind placeholder ``node``, or None when it cannot be told for sure."""
    inputs = _CURRENT.get()
    if inputs is None or node.op != "placeholder":
        return None
    placeholders = [n for n in node.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return None
    for n, real in zip(placeholders, inputs):  # every tensor must line up, not only this one
        fake = n.meta.get("val")
        if isinstance(fake, torch.Tensor) != isinstance(real, torch.Tensor):
            return None
        if isinstance(fake, torch.Tensor) and (_hints(fake.shape) != tuple(real.shape) or fake.dtype != real.dtype
                                               or _hints(fake.stride()) != tuple(real.stride())):
            return None
    real = inputs[placeholders.index(node)]
    if not isinstance(real, torch.Tensor) or isinstance(real, FakeTensor) or real.device.type == "meta":
        return None
    return real


def _hints(sizes) -> tuple:
    """Sizes as ints, a symbolic one by its hint: comparing a SymInt itself would add a guard (and fix the
    user's dynamic batch size to the example's)."""
    return tuple(v.node.hint if isinstance(v, torch.SymInt) else int(v) for v in sizes)


_INT_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


def digest(inputs: Sequence[Any]) -> str:
    """What of the example inputs' values can change a rewrite, as a short hash for inductor's FX graph cache
    key (the passes' ``uuid``): whether each integer vector of more than 64 entries is sorted into equal
    groups (GPTQ's g_idx), and the values of small ones that look like shift tables (multiples of 2, 4 or 8
    below 32, each once). Other inputs (token ids, positions, seeds) do not enter it, so they do not split
    the cache."""
    import hashlib

    from fusekern.kernels.layout_guard import holds

    features = []
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.device.type == "meta" \
                or t.dtype not in _INT_DTYPES or sum(s != 1 for s in t.shape) != 1:
            continue
        try:
            flat = t.detach().reshape(-1)
            n = flat.numel()
            if n <= 64:
                values = flat.tolist()
                step = 32 // n if n and 32 % n == 0 else 0
                if step >= 2 and sorted(values) == list(range(0, 32, step)):
                    features.append((i, tuple(values)))
            else:
                top = int(flat.max())
                if top >= 0 and n % (top + 1) == 0:
                    features.append((i, holds(flat, "groups", n // (top + 1))))
        except (RuntimeError, TypeError, NotImplementedError):  # a tensor subclass or layout without values here
            features.append((i, "opaque"))
    return hashlib.sha256(repr(features).encode()).hexdigest()[:16] if features else ""
