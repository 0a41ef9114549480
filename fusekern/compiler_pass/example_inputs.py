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
        if isinstance(fake, torch.Tensor) and (tuple(fake.shape) != tuple(real.shape) or fake.dtype != real.dtype
                                               or tuple(fake.stride()) != tuple(real.stride())):
            return None
    real = inputs[placeholders.index(node)]
    if not isinstance(real, torch.Tensor) or isinstance(real, FakeTensor) or real.device.type == "meta":
        return None
    return real
