"""Integer helpers for host code (grids, splits, block sizes).

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function`` objects in Triton 3.6 (so that
kernels can call them too): from host code each call costs about 4 us of wrapper (measured on a CPU), and a
decode-step launcher makes several per call. These are the same arithmetic as plain functions; kernels
keep using ``tl.cdiv``.
"""
from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for positive y, as ``triton.cdiv`` computes it."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n = 0), as ``triton.next_power_of_2`` computes it."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    return n + 1


def needs_i64(*tensors) -> bool:
    """Whether the element offset of some element of these tensors (strided views included; None skipped)
    passes 2**31 - 1: a kernel indexing them with 32-bit offsets would wrap, so it takes its ``I64`` build.
    An offset computed for a lane that a mask drops may wrap harmlessly; every loaded or stored one is at
    most this reach."""
    reach = 0
    for t in tensors:
        if t is not None and t.numel():
            reach = max(reach, sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())))
    return reach > 2**31 - 1
