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

One compile per program and call variant (activation dtype and strides, one row or more, bias layout,
inference mode, device; ``_variant``; it runs detached, without grad or autocast), each from its own traced
graph, so Dynamo's per-function recompile limit is never reached (past it Dynamo would run the traced graph eagerly, materializing the
decode's index grids); the rows are dynamic within a variant, so a server's changing batch does not
recompile. Later calls of a variant run with Dynamo's ``fail_on_recompile`` stance: where a guard the key
does not cover fails (or ``torch._dynamo.reset()`` dropped the code), the variant is traced and compiled
anew, up to ``FRESH_COMPILES`` times, then left to the kernels. Inside a CUDA graph capture nothing is
compiled: ``StockUnavailable``, and the op runs a kernel.
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


class StockUnavailable(RuntimeError):
    """The stock computation cannot run for this call without compiling (the caller runs a kernel)."""


def enabled() -> bool:
    """Whether the tuner times the stock computation too, read when a shape is tuned (``FUSEKERN_STOCK_FALLBACK=0``:
    fusekern's kernels only, for benchmarks that measure them)."""
    return os.environ.get("FUSEKERN_STOCK_FALLBACK", "1") != "0"


_COMPILED: dict = {}  # (program, call variant) -> the compiled function
_FRESH: dict = {}  # (program, call variant) -> how often it was compiled again (its guards missed)
_MISSED: set = set()  # variants whose guards missed more than FRESH_COMPILES times: kernels run there
FRESH_COMPILES = 3


def _computation(prog: DecodeProgram, has_bias: bool):
    """``(x, *leaves[, bias]) -> x @ W (+ bias)``: the decode-once path's arithmetic (``decode_mm.add_bias``)
    with the weight from ``prog.evaluate``. ``mm`` / ``bmm``, not ``matmul``: traced, ``matmul`` reshapes
    with the traced row count, which the dynamic rows must not keep."""
    from fusekern.kernels.decode_mm import add_bias  # (decode_mm imports this module)

    n = len(prog.leaves)

    def run(x, *tensors):
        w = prog.evaluate(list(tensors[:n]), out_dtype=x.dtype)
        return add_bias(torch.bmm(x, w) if prog.batch else torch.mm(x, w), tensors[n] if has_bias else None)

    return run


def _variant(x: torch.Tensor, tensors) -> tuple:
    """What Dynamo guards on that may change between two calls of one program: each variant compiles its own
    traced graph (the row count is dynamic within one)."""
    return (x.dtype, x.is_contiguous() or x.stride(), min(x.shape[-2], 2), x.device, x.is_inference(),
            torch.is_inference_mode_enabled(), tuple((t.shape, t.stride(), t.dtype, t.is_inference()) for t in tensors))


def _compile(text: str, x: torch.Tensor, tensors, has_bias: bool):
    prog = DecodeProgram.from_text(text)
    # Traced on fake tensors: evaluate's index grids are [K, N] int64 tensors in eager (GBs at LLM sizes);
    # inductor computes them in the kernel. Each traced graph has its own code object, so Dynamo's
    # recompile limit counts per variant.
    gm = make_fx(_computation(prog, has_bias), tracing_mode="fake")(x, *tensors)
    # emulate_precision_casts: inductor otherwise keeps a fused decode's value in fp32 where the program
    # rounds it to the weight's dtype (seen: 1.5e-3 off the program's result with fp32 activations).
    return torch.compile(gm, dynamic=None, options={"emulate_precision_casts": True})


def stock_mm(text: str, x: torch.Tensor, leaves, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W + bias`` as stock inductor compiles the decode program (leaves bound: ``DecodeProgram.bind``).
    Compiles on a variant's first call. Raises ``StockUnavailable`` where it would compile inside a CUDA graph
    capture, and for a variant whose guards failed more than ``FRESH_COMPILES`` times."""
    # Detached, without grad or autocast: the op's result, as its kernels compute it, and fewer states for
    # Dynamo to guard on.
    tensors = [t.detach() for t in (*leaves, *([] if bias is None else [bias]))]
    with torch.autocast(x.device.type, enabled=False), torch.no_grad():
        return _run(text, x, tensors, bias is not None)


def _run(text: str, x: torch.Tensor, tensors, has_bias: bool) -> torch.Tensor:
    key = (text, _variant(x, tensors))
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    rows = x.detach()  # (Dynamo's dynamic mark goes on this alias, not on the caller's tensor)
    torch._dynamo.maybe_mark_dynamic(rows, x.dim() - 2)  # one graph for every row count above one
    fn = _COMPILED.get(key)
    if fn is not None:
        if key in _MISSED:
            raise StockUnavailable("decode_mm_stock: this call's variant missed its guards too often")
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return fn(rows, *tensors)
        except RuntimeError as e:
            if "fail_on_recompile" not in str(e):
                raise
        # A guard the variant key does not cover, or Dynamo's caches were reset (torch._dynamo.reset()).
        if capturing:
            raise StockUnavailable("decode_mm_stock: the compiled variant would compile again during a CUDA graph "
                                   "capture")
        _FRESH[key] = _FRESH.get(key, 0) + 1
        if _FRESH[key] > FRESH_COMPILES:  # a guard that flips between calls: kernels from now on
            _MISSED.add(key)
            raise StockUnavailable("decode_mm_stock: this call's variant missed its guards too often")
    elif capturing:
        raise StockUnavailable("decode_mm_stock: this call's variant was not run before the CUDA graph capture")
    fn = _COMPILED[key] = _compile(text, x, tensors, has_bias)
    return fn(rows, *tensors)
