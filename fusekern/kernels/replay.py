"""A Triton launch recorded on its first run and replayed without the per-call Python around it.

A decode op runs once per token with the same weights and shapes. On the H200's host its Python path
cost 100-300 µs per call (profile_e2e_host.py): the op re-checks the leaves, finds its tuned config,
derives the kernel arguments, and Triton's JIT binds and specializes 40+ arguments again, while the
kernel takes 5-30 µs; without a CUDA graph the compiled decode step was host-bound and slower than stock
inductor. Once a call has run, everything a launch needs is known except the activation and the fresh
outputs. ``Launch`` keeps the compiled kernel, the grid and the full argument list of its first run
(tensors as their addresses) and calls the kernel's launcher directly, with new values in named slots.

What may change between replays is the caller's business: the ops replay only for the same leaf tensors
(``LeafCache``: same objects, storage, strides, shape, dtype), the same activation shape, strides,
dtype, device and 16-byte alignment (the JIT specializes pointers on it), outside CUDA-graph capture
when recorded. Values that hold no weight: the recorded addresses stay valid only while the leaves do,
which the ``LeafCache`` check guarantees at every use.
"""
from __future__ import annotations

import copy

import torch
import triton
from triton import knobs

from fusekern.kernels.split_counters import stream_of


class _Address:
    """A tensor descriptor's base, reduced to what the launcher reads of it: its address."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def data_ptr(self) -> int:
        return self._ptr


def _frozen(v):
    """A recorded argument holding no tensor: tensors become addresses, descriptors get an address base."""
    if isinstance(v, torch.Tensor):
        return v.data_ptr()
    if hasattr(v, "block_shape") and isinstance(getattr(v, "base", None), torch.Tensor):  # TensorDescriptor
        d = copy.copy(v)
        object.__setattr__(d, "base", _Address(v.base.data_ptr()))
        return d
    return v


class Launch:
    """``jit_fn[grid](*args, **kwargs)``, run now through the JIT, and replayable by ``run``."""

    takes_addresses = True  # ``run`` takes a pointer argument as a tensor or as its address (an int)

    def __init__(self, jit_fn, grid, args: tuple, kwargs: dict):
        self.kernel = jit_fn[grid](*args, **kwargs)
        if not self.replayable:  # (the interpreter's function has no compiled kernel and no params)
            return
        params = jit_fn.params
        values = list(args) + [kwargs[p.name] if p.name in kwargs else p.default for p in params[len(args):]]
        self.args = [_frozen(v) for v in values]
        self.index = {p.name: i for i, p in enumerate(params)}
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else -1

    @property
    def replayable(self) -> bool:
        """False under the interpreter (nothing compiled to replay)."""
        return self.kernel is not None and hasattr(self.kernel, "packed_metadata")

    def slots(self, *names: str) -> tuple[int, ...]:
        return tuple(self.index[n] for n in names)

    def run(self, slots: tuple[int, ...], values, stream: int | None = None) -> None:
        """Launch again with ``values`` in ``slots`` (tensors or addresses), on ``stream`` (a raw handle: the
        current stream's, which the caller's key already read) or else the current stream."""
        args = self.args.copy()
        for i, v in zip(slots, values):
            args[i] = v
        k, (g0, g1, g2) = self.kernel, self.grid
        if stream is None:
            stream = _stream(self.device)
        enter = knobs.runtime.launch_enter_hook
        meta = k.launch_metadata(self.grid, stream, *args) if enter is not None else None
        k.run(g0, g1, g2, stream, k.function, k.packed_metadata, meta, enter, knobs.runtime.launch_exit_hook, *args)


X = "x"  # a replay slot that takes the activation


class Replay:
    """A recorded launch replayed into fresh buffers, then the recorded path's torch tail (a split-K sum,
    the cuBLAS matmul after a weight decode, a bias). ``slots``: kernel argument -> ``X`` or the index of
    a buffer; ``buffers``: (shape, dtype) allocated per call; ``tail(x, buffers, bias)`` gives the result
    (None: buffer 0). The tail must hold no tensor; the bias is the caller's, the same tensor as recorded
    (the ops check it with the leaves)."""

    def __init__(self, launch: Launch, slots: dict, buffers: list, tail=None):
        self.launch, self.buffers, self.tail = launch, buffers, tail
        self.slots = launch.slots(*slots)
        self.sources = tuple(slots.values())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, stream: int | None = None):
        """``stream``: the current stream's raw handle where the caller has it (``x_key``'s last entry)."""
        device = x.device
        bufs = [torch.empty(shape, device=device, dtype=dtype) for shape, dtype in self.buffers]
        self.launch.run(self.slots, [x if s == X else bufs[s] for s in self.sources], stream)
        return bufs[0] if self.tail is None else self.tail(x, bufs, bias)


def split_k_replay(launch: Launch, M: int, N: int, dtype: torch.dtype, split_k: int, bias_placeholder) -> Replay:
    """The replay of a kernel that writes one fresh ``[M, N]`` output and, split over K, sums fresh fp32
    partials ``[split_k, M, N]`` itself (with the recorded counters); unsplit, its partials' and counters'
    pointers are the output's. ``bias_placeholder``: what the bias pointer takes without a bias (``X`` or
    buffer 0, the output), None where there is a bias (its recorded address)."""
    slots = {"x_ptr": X, "out_ptr": 0, **({} if bias_placeholder is None else {"bias_ptr": bias_placeholder}),
             **({"ws_ptr": 1} if split_k > 1 else {"ws_ptr": 0, "cnt_ptr": 0})}
    return Replay(launch, slots, [((M, N), dtype)] + ([((split_k, M, N), torch.float32)] if split_k > 1 else []))


def recorder(cache, key, tensors):
    """Where an op's first call keeps its replay (``cache.put(key, tensors, replay)``), or None while a CUDA
    graph is captured: the tuner cannot measure then, so the config may be an untuned fallback."""
    if torch.cuda.is_current_stream_capturing():
        return None
    return lambda rep: cache.put(key, tensors, rep)


_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _stream(device: int):
    """The device's current stream, as Triton's launcher takes it."""
    return triton.runtime.driver.active.get_current_stream(device)


def launch(jit_fn, grid, args: tuple, kwargs: dict, record: bool) -> Launch | None:
    """``jit_fn[grid](*args, **kwargs)``; recorded (a ``Launch``) only when asked: recording costs more."""
    if record:
        return Launch(jit_fn, grid, args, kwargs)
    jit_fn[grid](*args, **kwargs)
    return None


def x_key(x: torch.Tensor) -> tuple:
    """What a recorded launch assumed of the activation (the JIT specializes on shape-derived ints,
    strides and 16-byte alignment; the address modulo 16 is kept whole, as ``layout_replay.call_key`` keeps
    it, so that a path that runs only at some offsets is never replayed at another), the device the kernel
    was loaded on, and the stream whose split-K counters it holds (``split_counters``: one buffer per stream,
    so that streams may run at once); the stream's raw handle comes last (``Replay`` launches on it). Read
    once per call of a decode op: each step here costs a C call from Python."""
    device = x.device
    return (x.shape, x.stride(), x.dtype, device, x.data_ptr() % 16, *device_key(device))


def device_key(device: torch.device) -> tuple[int, int]:
    """(the current device, the raw handle of ``device``'s current stream), (-1, 0) off CUDA: the end of every
    replay key (the kernel was loaded on that device; the split counters it holds are that stream's)."""
    if device.type != "cuda":
        return -1, 0
    return _current_device(), stream_of(device)
