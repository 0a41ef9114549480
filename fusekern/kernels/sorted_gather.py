"""GPTQ's ``g_idx`` on the hand-tuned kernels when it is sorted, checked once per set of leaves.

GPTQModel's and AutoGPTQ's torch paths dequantize with ``scales[g_idx] * (w - zeros[g_idx])`` whether or not
the checkpoint was quantized with act-order. Without act-order ``g_idx`` is ``arange(K) // G`` and the decode
is plain GPTQ, which the hand-tuned kernels read; with it each k's group is data, which only the generated
kernel (it gathers) computes. Which of the two a layer holds shows only in ``g_idx``'s values, and one compiled
graph serves every layer, so the rewrite passes the op both: the program as written (always right), and as its
layout argument a *guarded* layout: the program read with ``k // G``, that program's packed layout, and the
leaves that must equal ``arange(K) // G`` for it to hold. The op checks them on its first call with a set of
leaves (one comparison on the device and one host sync, remembered per leaf set like the op's launch replay)
and takes the hand-tuned path only where they hold. A g_idx changed in place after that first call is not
seen again (as with every per-leaf-set cache of the op).
"""
from __future__ import annotations

import functools
import json

import torch

from fusekern.kernels.leaf_cache import LeafCache
from fusekern.patterns.decode.program import DecodeProgram

PREFIX = "sorted_gather:"


def guarded_layout(program: str, layout: str, checks: dict[int, int]) -> str:
    """The op's layout argument: use ``program`` with ``layout`` where every leaf ``i`` of ``checks`` (by
    its index in the program's leaves) equals ``arange(K) // checks[i]``."""
    if not checks or not layout:
        raise ValueError("a guarded layout needs a packed layout and at least one checked leaf")
    return PREFIX + json.dumps({"program": program, "layout": layout, "checks": sorted(checks.items())},
                               separators=(",", ":"))


def is_guarded(layout: str) -> bool:
    return layout.startswith(PREFIX)


@functools.lru_cache(maxsize=256)
def _parse(layout: str) -> tuple[str, str, tuple[tuple[int, int], ...]]:
    doc = json.loads(layout[len(PREFIX):])
    return doc["program"], doc["layout"], tuple((int(i), int(g)) for i, g in doc["checks"])


def is_sorted(index: torch.Tensor, group: int) -> bool:
    """Is ``index`` (a [K] integer tensor) ``arange(K) // group``? One comparison where it lives."""
    flat = index.reshape(-1)
    want = torch.arange(flat.numel(), device=flat.device) // group
    return bool(torch.equal(flat.to(torch.int64), want))


_CHECKED = LeafCache()  # (guarded layout) per set of checked leaves -> whether they are sorted


def resolve(program: str, layout: str, leaves) -> tuple[str, str]:
    """(program, layout) for this call: the guarded pair where its leaves check, else the program as written
    with no layout (the generated kernels). Unguarded arguments come back as they are."""
    if not is_guarded(layout):
        return program, layout
    sorted_program, sorted_layout, checks = _parse(layout)
    taken = DecodeProgram.from_text(program).taken(len(leaves))
    if any(i not in taken for i, _ in checks):  # (the rewrite decides embedded leaves itself)
        return program, ""
    tensors = [leaves[taken.index(i)] for i, _ in checks]
    ok = _CHECKED.get(layout, tensors)
    if ok is None:
        if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
            return program, ""  # nothing may synchronize now; a call before capture decides for the graph
        ok = all(is_sorted(t, g) for t, (_, g) in zip(tensors, checks))
        _CHECKED.put(layout, tensors, ok)
    return (sorted_program, sorted_layout) if ok else (program, "")
