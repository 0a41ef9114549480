"""GPTQ's ``g_idx`` on the hand-tuned kernels when it is sorted, checked once per set of leaves.

GPTQModel's and AutoGPTQ's torch paths dequantize with ``scales[g_idx] * (w - zeros[g_idx])`` whether or not
the checkpoint was quantized with act-order. Without act-order ``g_idx`` is ``arange(K) // G`` and the decode
is plain GPTQ, which the hand-tuned kernels read; with it each k's group is data, which only the generated
kernel (it gathers) computes. Which of the two a layer holds shows only in ``g_idx``'s values, and one compiled
graph serves every layer, so the rewrite passes the op both: the program as written (always right), and as its
layout argument a *guarded* layout: the program read with ``k // G``, that program's packed layout, and the
leaves that must equal ``arange(K) // G`` for it to hold. The op checks them on its first call with a set of
leaves (one comparison on the device and one host sync, remembered per leaf set like the op's launch replay)
and takes the hand-tuned path only where they hold. The verdict is kept per leaf set and each leaf's version
counter, so a g_idx written in place (``load_state_dict`` of an act-order checkpoint into a module that ran
before) is checked again; a CUDA graph captured before such a write keeps replaying what it captured, and
writes that count no version are not seen: through ``t.data`` (``t.data.copy_(...)``, a view that has its own
counter) or into inference-mode tensors. Load such leaves with ``t.copy_(...)`` outside inference mode, or
assign a new tensor (a new leaf set: checked on its first call).

The same check covers small shift tables held in buffers or module attributes (GPTQModel's ``wf``,
``arange(0, 32, 4)``): the graph passes them like weights, so their values too are known only at run time.
A check is ``(leaf, "groups", G)``: the leaf is ``arange(K) // G``; or ``(leaf, "values", [...])``: the
leaf holds these values (flattened).
"""
from __future__ import annotations

import functools
import json

import torch

from fusekern.kernels.leaf_cache import LeafCache
from fusekern.patterns.decode.program import DecodeProgram

PREFIX = "layout_guard:"


def guarded(program: str, layout: str, checks: dict) -> str:
    """The op's layout argument: use ``program`` with ``layout`` where every leaf ``i`` of ``checks`` (by its
    index in the program's leaves) passes ``checks[i]``: ``("groups", G)`` or ``("values", [ints])``."""
    if not checks or not layout:
        raise ValueError("a guarded layout needs a packed layout and at least one checked leaf")
    for kind, param in checks.values():
        if kind not in ("groups", "values"):
            raise ValueError(f"unknown check {kind!r}")
    return PREFIX + json.dumps({"program": program, "layout": layout,
                                "checks": [[i, kind, param] for i, (kind, param) in sorted(checks.items())]},
                               separators=(",", ":"))


def is_guarded(layout: str) -> bool:
    return layout.startswith(PREFIX)


@functools.lru_cache(maxsize=256)
def _parse(layout: str) -> tuple[str, str, tuple]:
    doc = json.loads(layout[len(PREFIX):])
    checks = tuple((int(i), kind, tuple(param) if isinstance(param, list) else int(param))
                   for i, kind, param in doc["checks"])
    return doc["program"], doc["layout"], checks


def expected(kind: str, param, numel: int, device="cpu") -> torch.Tensor:
    """What a check asks a leaf of ``numel`` entries to hold, flattened, as int64: ``arange(numel) // G`` for
    ``("groups", G)``, the listed values for ``("values", [...])``."""
    if kind == "groups":
        return torch.arange(numel, device=device) // param
    return torch.tensor(param, dtype=torch.int64, device=device)


def holds(t: torch.Tensor, kind: str, param) -> bool:
    """Does ``t`` pass the check? One comparison where it lives."""
    flat = t.reshape(-1)
    want = expected(kind, param, flat.numel(), flat.device)
    return flat.numel() == want.numel() and bool(torch.equal(flat.to(torch.int64), want))


_CHECKED = LeafCache()  # (guarded layout, versions) per set of checked leaves -> whether they pass


def _version(t: torch.Tensor) -> int:
    """t's in-place write counter (-1 for inference-mode tensors, which keep none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


@functools.lru_cache(maxsize=256)
def _plan(program: str, layout: str, n_leaves: int) -> tuple[str, str, tuple, tuple[int, ...]]:
    """A guarded layout's program, layout, checks, and the positions in the op's leaves of the leaves they
    check."""
    guarded_program, guarded_layout_text, checks = _parse(layout)
    taken = DecodeProgram.from_text(program).taken(n_leaves)
    return guarded_program, guarded_layout_text, checks, tuple(taken.index(i) for i, _, _ in checks)


def versions(program: str, layout: str, leaves) -> tuple:
    """The write counters of the leaves a guarded layout checks (() for any other layout). ``resolve``'s
    answer for a set of leaves holds while these do: the op keys its launch replay by them and skips
    ``resolve`` on a hit (its lookup costs about 7 µs per call on a 2-core AMD EPYC, GPTQ's g_idx layout)."""
    if not is_guarded(layout):
        return ()
    return tuple(_version(leaves[j]) for j in _plan(program, layout, len(leaves))[3])


def resolve(program: str, layout: str, leaves) -> tuple[str, str]:
    """(program, layout) for this call: the guarded pair where its leaves check, else the program as written
    with no layout (the generated kernels). Unguarded arguments come back as they are."""
    if not is_guarded(layout):
        return program, layout
    guarded_program, guarded_layout_text, checks, positions = _plan(program, layout, len(leaves))
    tensors = [leaves[j] for j in positions]
    key = (layout, tuple(map(_version, tensors)))
    ok = _CHECKED.get(key, tensors)
    if ok is None:
        if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
            return program, ""  # nothing may synchronize now; a call before capture decides for the graph
        ok = all(holds(t, kind, param) for t, (_, kind, param) in zip(tensors, checks))
        _CHECKED.put(key, tensors, ok)
    return (guarded_program, guarded_layout_text) if ok else (program, "")
