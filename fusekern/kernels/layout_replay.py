"""Launches of ops whose inputs are not weights, recorded on a call and replayed on later calls of the same layouts.

The decode ops (``replay``) replay their first launch because their Python path and Triton's JIT launch
cost more host time than the kernel. The attention ops (``decode_attention``, ``fp8_kv_attention``) and the
greedy sampler (``masked_argmax``) have the same problem, once per layer or token, but none of their inputs
is a weight: q, the KV cache, its scales, the mask, the logits can all be other tensors at every call. So
the replay is keyed by the call's layouts, not by tensor identity: every input's shape, strides, dtype,
device and address modulo 16 (the JIT specializes pointers on 16-byte alignment, and a kernel may need
less, as ``fp8_kv_attention``'s 4-byte words do: the residue, not only whether it is 0; every int the launch
passes derives from the shapes and strides), the op's other arguments, the current device and stream (the split
counters are per stream). A call that matches writes its tensors' addresses and fresh buffers (the
output, split workspaces) into the recorded argument slots and calls the compiled kernel's launcher; the
op's checks are skipped, since they read only what the key holds. A launch is recorded only where every
input slot got the op's tensor itself (no copy: a q made contiguous, a scale moved to the GPU) and where
no other argument came from a tensor's value, outside CUDA-graph capture.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusekern.kernels import replay


@dataclass(frozen=True)
class New:
    """A slot source: buffer ``i`` of the replay's ``buffers``, made per call (buffer 0 is the output)."""
    i: int


OUT = New(0)
_MAX_ENTRIES = 4096


def output_slots(split: bool, workspaces: tuple[str, str]) -> dict:
    """The sources of a split-reduction launch's output, workspace and counter slots: split, the output and two
    fresh workspaces (``New`` 0, 1, 2) and the recorded per-stream counters; unsplit, every one of them takes the
    output, as the launchers pass it (``split_plan``)."""
    if split:
        return {"out_ptr": OUT, workspaces[0]: New(1), workspaces[1]: New(2)}
    return {"out_ptr": OUT, workspaces[0]: OUT, workspaces[1]: OUT, "cnt_ptr": OUT}


def call_key(tensors, *scalars) -> tuple:
    """What a recorded launch assumed of a call (module docstring); the stream's raw handle comes last."""
    parts = [None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)
             for t in tensors]
    return (*parts, *scalars, *replay.device_key(tensors[0].device))


_ALIGN = 256  # a workspace's offset in the call's arena: past the JIT's 16-byte pointer specialization, whole lines


class LayoutReplay:
    """Recorded launches, run in order into the same new buffers: ``steps`` holds (launch, sources) pairs,
    ``sources`` mapping kernel argument names to an input's position in the op's tensors or to a ``New``
    buffer; ``buffers`` holds each new buffer's (shape, dtype); ``prepare(view)``, where given, fills new
    buffers before the first launch (the sampler's seed draw: ``view(i)`` is buffer ``i`` as a tensor) and
    holds no tensor. Returns buffer 0.

    Buffer 0, the output the caller keeps, is allocated alone; the others are workspaces that die with the
    call, carved from one allocation at ``_ALIGN``-byte offsets (the sampler's nine cost nine allocator calls
    of host time otherwise). Compiled launches take them as addresses; launches that need tensors (the
    tests' interpreted ones, without ``takes_addresses``) get views of the arena."""

    def __init__(self, steps, buffers: list, prepare=None):
        self.buffers, self.prepare = buffers, prepare
        self.steps = tuple((launch, launch.slots(*sources), tuple(sources.values())) for launch, sources in steps)
        self.offsets, size = [0], 0
        for shape, dtype in buffers[1:]:
            self.offsets.append(size)
            size += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        self.arena_bytes = size
        self.addresses = all(getattr(launch, "takes_addresses", False) for launch, _ in steps)

    def _view(self, arena: torch.Tensor, i: int) -> torch.Tensor:
        shape, dtype = self.buffers[i]
        start = self.offsets[i]
        return arena[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def __call__(self, tensors, stream: int | None = None) -> torch.Tensor:
        device = tensors[0].device
        shape, dtype = self.buffers[0]
        out = torch.empty(shape, dtype=dtype, device=device)
        arena = torch.empty(self.arena_bytes, dtype=torch.uint8, device=device) if len(self.buffers) > 1 else None
        if self.addresses:
            base = arena.data_ptr() if arena is not None else 0
            made = [out] + [base + off for off in self.offsets[1:]]
        else:
            made = [out] + [self._view(arena, i) for i in range(1, len(self.buffers))]
        if self.prepare is not None:
            self.prepare(lambda i: made[i] if isinstance(made[i], torch.Tensor) else self._view(arena, i))
        for launch, slots, sources in self.steps:
            launch.run(slots, [made[s.i] if isinstance(s, New) else tensors[s] for s in sources], stream)
        return out


def record_if_direct(record, steps, tensors, buffers, prepare=None) -> None:
    """Hand ``record`` the replay of ``steps`` ((launch, sources) pairs, ``LayoutReplay``) if every launch was
    recorded and every input slot got the op's tensor itself (the same address; otherwise the launch ran
    on a copy the replay would not make). ``buffers``: the launches' new buffers, in ``New`` order (their
    shapes and dtypes are kept)."""
    if record is None:
        return
    for launch, sources in steps:
        if launch is None or not launch.replayable:
            return
        for name, s in sources.items():
            if not isinstance(s, New) and _address(launch.args[launch.index[name]]) != tensors[s].data_ptr():
                return
    record(LayoutReplay(steps, [(tuple(b.shape), b.dtype) for b in buffers], prepare))


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
