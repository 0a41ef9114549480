"""Zeroed int32 counters for kernels that finish a split reduction in the same launch.

A kernel split over several programs (K slices of a GEMV, chunks of a row) writes each program's
partial result, then counts itself in with an atomic add; the program that brings the count to the
number of splits combines the partials in a fixed order (deterministic) and sets the counter back to
zero for the next launch. Kernels on one stream run one after another and can share counters; kernels
on two streams of a device may run at once, and sharing would let one launch's count finish the other's
(a sum of partials not yet written, or a counter left non-zero: wrong outputs, silently). So there is one
buffer per device and stream, made on the stream's first call of a shape, outside any graph's memory pool
(``lasting``). Inductor's CUDA graphs warm up on the stream they then capture on, so the capture finds that
stream's buffer. A capture on a stream that never ran outside one (``torch.cuda.graph``'s own side stream)
takes the buffer of the first stream the device used, as every launch did before counters were per
stream; graphs captured so must not be replayed while split kernels run on that first stream or in another
such graph. Counters made during a capture (none fit) are zeroed by the graph's own replay, so they serve
that capture's launch only.
"""
from __future__ import annotations

import torch

from fusekern.kernels.lasting import lasting

_COUNTERS: dict = {}  # (device, stream) -> counters, zeroed at rest
_FIRST: dict = {}  # device -> the key of its first buffer
_OUTGROWN: list = []  # replaced buffers stay allocated: CUDA graphs captured with them still use them


def stream_of(device: torch.device) -> int:
    """The raw handle of ``device``'s current stream (0 off CUDA): what a launch's counters are keyed by."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed counters on ``device``, for launches on its current stream."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, stream_of(device))
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if buf is None and capturing:
        buf = _COUNTERS.get(_FIRST.get(device))  # a stream seen only in captures: the first stream's buffer
        if buf is not None and buf.numel() >= n:
            return buf
    new = lasting(lambda: torch.zeros(max(n, 16384), device=device, dtype=torch.int32), device)
    if capturing:  # zeroed when the graph runs, not now: never handed to a launch outside this graph
        _OUTGROWN.append(new)
    else:
        if buf is not None:
            _OUTGROWN.append(buf)
        _COUNTERS[key] = new
        _FIRST.setdefault(device, key)
    return new
