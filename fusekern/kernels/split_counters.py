"""Zeroed int32 counters for kernels that finish a split reduction in the same launch.

A kernel split over several programs (K slices of a GEMV, chunks of a row) writes each program's
partial result, then counts itself in with an atomic add; the program that brings the count to the
number of splits combines the partials in a fixed order (deterministic) and sets the counter back to
zero for the next launch. One buffer per device: kernels on the current stream run one after another,
so they can share it; two such kernels running concurrently on different streams of one device would
not. The first (warm-up) call of a shape allocates it, before any CUDA-graph capture, outside any graph's
memory pool (``lasting``).
"""
from __future__ import annotations

import torch

from fusekern.kernels.lasting import lasting

_COUNTERS: dict = {}
_OUTGROWN: list = []  # replaced buffers stay allocated: CUDA graphs captured with them still use them


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed counters on ``device``."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = lasting(lambda: torch.zeros(max(n, 16384), device=device, dtype=torch.int32), torch.device(device))
        _COUNTERS[device] = buf
    return buf
