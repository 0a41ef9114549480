"""The computation a ``decode_mm`` rewrite replaced, compiled by stock inductor: the dispatcher's fallback.

Issue 4: a replacement must never lose to the graph it replaces. ``decode_mm``'s tuner times its kernels on
a shape's first call; ``StockConfig`` joins them as one more candidate, the decode program's torch
semantics (``DecodeProgram.evaluate``: the weight decoded, then ``matmul`` and the bias) traced to an aten
graph and compiled by plain ``torch.compile`` (inductor's default mode, none of fusekern's passes). Where it
is the fastest for a shape and device, the op runs it from then on.

It is the same decode as the user's graph but not the user's graph itself (the op carries the program's
text, not the nodes it came from): inductor sees the decode as loads at computed indices, where it saw
shifts and views, and may tile it differently. The tuner measures what it would run, so the choice is
right for the code it picks.

One compile per program, activation dtype, bias dtype and device; the rows are dynamic (one graph serves
every M above 1), so a server's changing batch does not recompile. A CUDA graph capture (nothing may be
compiled or timed then) runs it only for an activation shape and layout already run outside a capture.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fusekern.patterns.decode.program import DecodeProgram


@dataclass(frozen=True)
class StockConfig:
    """Decode then matmul, compiled by stock inductor (``decode_mm_stock``)."""


def enabled() -> bool:
    """Whether the tuner times the stock computation too (``FUSEKERN_STOCK_FALLBACK=0``: fusekern's kernels
    only, for benchmarks that measure them)."""
    return os.environ.get("FUSEKERN_STOCK_FALLBACK", "1") != "0"


_COMPILED: dict = {}  # (program, activation dtype, bias dtype, device) -> the compiled function
_RAN: set = set()  # activation signatures run outside a capture, per compiled function


def _computation(prog: DecodeProgram, has_bias: bool):
    """``(x, *leaves[, bias]) -> x @ W (+ bias)``: the decode-once path's arithmetic (``decode_mm._dequant_tail``)
    with the weight from ``prog.evaluate``. ``mm`` / ``bmm``, not ``matmul``: traced, ``matmul`` reshapes
    with the traced row count, which the dynamic rows must not keep."""
    n = len(prog.leaves)

    def run(x, *tensors):
        w = prog.evaluate(list(tensors[:n]), out_dtype=x.dtype)
        out = torch.bmm(x, w) if prog.batch else torch.mm(x, w)
        if has_bias:
            bias = tensors[n]
            out = (out.float() + bias.float()).to(x.dtype) if bias.dtype != x.dtype else out + bias
        return out

    return run


def _key(text: str, x: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return text, x.dtype, None if bias is None else bias.dtype, x.device


def _signature(fn, x: torch.Tensor) -> tuple:
    return id(fn), tuple(x.shape), tuple(x.stride()), x.data_ptr() % 16


def compiled(text: str, x: torch.Tensor, leaves, bias: torch.Tensor | None):
    """The compiled stock function for ``text`` (leaves bound: ``DecodeProgram.bind``), made on first use."""
    key = _key(text, x, bias)
    fn = _COMPILED.get(key)
    if fn is None:
        prog = DecodeProgram.from_text(text)
        tensors = [*leaves, *([] if bias is None else [bias])]
        # Traced on fake tensors: evaluate's index grids are [K, N] int64 tensors in eager (GBs at LLM sizes);
        # inductor computes them in the kernel.
        gm = make_fx(_computation(prog, bias is not None), tracing_mode="fake")(x, *tensors)
        # Each traced graph has its own code object, so Dynamo's per-code recompile limit counts per program.
        # emulate_precision_casts: inductor otherwise keeps a fused decode's value in fp32 where the program
        # rounds it to the weight's dtype (seen: 1.5e-3 off the program's result with fp32 activations).
        fn = _COMPILED[key] = torch.compile(gm, dynamic=None, options={"emulate_precision_casts": True})
    return fn


def stock_mm(text: str, x: torch.Tensor, leaves, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W + bias`` as stock inductor compiles the decode program. During a CUDA graph capture only an
    activation signature run before (else RuntimeError: the caller picks a kernel that needs no compile)."""
    fn = compiled(text, x, leaves, bias)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    sig = _signature(fn, x)
    if capturing and sig not in _RAN:
        raise RuntimeError("decode_mm_stock: this activation shape was not run before the CUDA graph capture")
    torch._dynamo.maybe_mark_dynamic(x, x.dim() - 2)  # the rows: one graph for every M > 1
    out = fn(x, *leaves, *([] if bias is None else [bias]))
    if not capturing:
        _RAN.add(sig)
    return out


def ready(text: str, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``stock_mm`` may run now: always outside a CUDA graph capture, during one only for an activation
    signature it ran before."""
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return True
    fn = _COMPILED.get(_key(text, x, bias))
    return fn is not None and _signature(fn, x) in _RAN
