"""Do a match's constants agree with its pattern's? (what inductor's matcher does not check)

``register_replacement`` turns every int, float, list, dtype and device argument of a traced search into a
wildcard (so one trace matches any size), and compares only the arguments a pattern node has, not keywords
it lacks. Left there, a search ``x * 0.5`` matches ``x * 0.7``, ``w.to(torch.bfloat16)`` matches
``w.to(torch.float16)``, a search for ``addmm(b, x, w)`` matches ``addmm(b, x, w, beta=0.5)``, and the
replacement computes the pattern's values instead of the graph's.

``disagreement`` walks the matched subgraph beside the traced search (from the outputs up to the
placeholders) and compares the constants that do not describe sizes: floats, bools, dtypes, devices,
and the scaling keywords alpha / beta (a missing one is 1). Ints and lists of constants stay wildcards:
they are the example's sizes.
"""
from __future__ import annotations

import math

import torch
from torch.fx import Graph, Node

SCALING_KWARGS = ("alpha", "beta")  # addmm / baddbmm / add / sub keywords that scale an operand
COMPARED = (float, bool, torch.dtype, torch.device)


def _differ(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is not type(b) or a != b
    if isinstance(a, float) and isinstance(b, (int, float)):
        return not (a == b or (math.isnan(a) and math.isnan(float(b))))
    if isinstance(a, COMPARED):
        return a != b
    return False


def _walk(p, g, seen: dict) -> str | None:
    """The first constant of g that differs from p's; "" when the two do not line up."""
    if isinstance(p, Node):
        if p.op == "placeholder":
            return None
        if not isinstance(g, Node) or g.op != p.op or g.target != p.target:
            return ""
        if seen.get(p) is g:
            return None
        seen[p] = g
        if len(p.args) != len(g.args):
            return ""
        for pa, ga in zip(p.args, g.args):
            if (why := _walk(pa, ga, seen)) is not None:
                return why
        for key in set(p.kwargs) | set(g.kwargs):
            default = 1 if key in SCALING_KWARGS else None
            pv, gv = p.kwargs.get(key, default), g.kwargs.get(key, default)
            if key in SCALING_KWARGS and pv != gv:
                return f"{g.name} has {key}={gv}, the pattern {key}={pv}"
            if key in p.kwargs and key in g.kwargs and (why := _walk(pv, gv, seen)) is not None:
                return why
        return None
    if isinstance(p, (list, tuple)):
        if not any(isinstance(a, Node) for a in p):
            return None  # a size list (a view's shape, a permutation): a wildcard, as inductor's matcher has it
        if not isinstance(g, (list, tuple)) or len(p) != len(g):
            return ""
        for pa, ga in zip(p, g):
            if (why := _walk(pa, ga, seen)) is not None:
                return why
        return None
    if _differ(p, g):
        return f"a constant {g!r} where the pattern has {p!r}"
    return None


def _outputs(graph: Graph) -> list:
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def disagreement(searches: list[Graph], outputs: list[Node]) -> str | None:
    """None when the matched subgraph ending at ``outputs`` has the constants of one of the traced
    ``searches`` (one per dtype variant); else why not."""
    reasons = []
    for graph in searches:
        pouts = _outputs(graph)
        if len(pouts) != len(outputs):
            continue
        seen: dict = {}
        why = None
        for p, g in zip(pouts, outputs):
            why = _walk(p, g, seen)
            if why is not None:
                break
        if why is None:
            return None
        reasons.append(why)
    found = [r for r in reasons if r]
    return found[0] if found else "the matched nodes do not line up with the traced search (constants unchecked)"
