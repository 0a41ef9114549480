"""Decode attention launches recorded on a call and replayed on later calls of the same layouts.

The decode ops (``replay``) replay their first launch because their Python path and Triton's JIT launch
cost more host time than the kernel. The attention ops (``decode_attention``, ``fp8_kv_attention``) have
the same problem, once per layer and token, but none of their inputs is a weight: q, the KV cache, its
scales and the mask can all be other tensors at every call. So the replay is keyed by the call's layouts,
not by tensor identity: every input's shape, strides, dtype, device and 16-byte alignment (the JIT
specializes pointers on it; every int the launch passes derives from the shapes and strides), the float
arguments, the current device and stream (the split counters are per stream). A call that matches writes
its tensors' addresses, a fresh output and fresh split workspaces into the recorded argument slots and
calls the compiled kernel's launcher; the op's checks are skipped, since they read only what the key
holds. A launch is recorded only where every input slot got the op's tensor itself (no copy: a q made
contiguous, a scale moved to the GPU), outside CUDA-graph capture.
"""
from __future__ import annotations

import torch

from fusekern.kernels import replay
from fusekern.kernels.split_counters import stream_of

OUT, ACC, ML = "out", "acc", "ml"  # slot sources besides the inputs: the output and the two workspaces
_MAX_ENTRIES = 4096


def call_key(tensors, *scalars) -> tuple:
    """What a recorded launch assumed of a call (module docstring); the stream's raw handle comes last."""
    parts = [None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
             for t in tensors]
    device = tensors[0].device
    if device.type != "cuda":
        return (*parts, *scalars, -1, 0)
    return (*parts, *scalars, replay._current_device(), stream_of(device))


class AttentionReplay:
    """A recorded attention launch: ``sources`` maps kernel argument names to an input's position in the
    op's tensors or to ``OUT`` / ``ACC`` / ``ML``; the output and, split, the fp32 workspaces (element
    counts ``ws``) are made per call."""

    def __init__(self, launch: replay.Launch, sources: dict, out_shape: tuple, out_dtype: torch.dtype,
                 ws: tuple[int, int] | None):
        self.launch, self.out_shape, self.out_dtype, self.ws = launch, out_shape, out_dtype, ws
        self.slots = launch.slots(*sources)
        self.sources = tuple(sources.values())

    def __call__(self, tensors, stream: int | None = None) -> torch.Tensor:
        device = tensors[0].device
        made = {OUT: torch.empty(self.out_shape, dtype=self.out_dtype, device=device)}
        if self.ws is not None:
            made[ACC] = torch.empty(self.ws[0], dtype=torch.float32, device=device)
            made[ML] = torch.empty(self.ws[1], dtype=torch.float32, device=device)
        self.launch.run(self.slots, [made[s] if isinstance(s, str) else tensors[s] for s in self.sources], stream)
        return made[OUT]


def record_if_direct(record, launch: replay.Launch | None, sources: dict, tensors, out: torch.Tensor,
                     ws: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Hand ``record`` the replay of ``launch`` if every input slot got the op's tensor itself (the same
    address; otherwise the launch ran on a copy the replay would not make) and the workspaces are the
    two fresh fp32 buffers the sources name."""
    if record is None or launch is None or not launch.replayable:
        return
    for name, s in sources.items():
        if not isinstance(s, str) and _address(launch.args[launch.index[name]]) != tensors[s].data_ptr():
            return
    record(AttentionReplay(launch, sources, tuple(out.shape), out.dtype,
                           None if ws is None else (ws[0].numel(), ws[1].numel())))


def _address(arg) -> int:
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else arg


def recorder(cache: dict, key):
    """Where an op's call keeps its replay, or None while a CUDA graph is captured (the op's timing choice
    cannot be made then, and the recorded launch would be a capture's)."""
    if torch.cuda.is_current_stream_capturing():
        return None

    def put(rep):
        if len(cache) >= _MAX_ENTRIES:
            cache.clear()
        cache[key] = rep
    return put
