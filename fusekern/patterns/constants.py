"""Keywords a matched node has and its pattern lacks: what inductor's matcher does not check.

On a match, ``register_replacement`` re-traces the search at the matched shapes and dtypes and matches
again with its constants literal (ints, floats, dtypes and the keywords the search's nodes carry). A
keyword the search's node does not carry is never compared: a search for ``addmm(b, x, w)`` matches
``addmm(b, x, w, beta=0.5)``, ``add(a, b)`` matches ``add(a, b, alpha=2)``, ``cumsum(x, -1)`` matches
``cumsum(x, -1, dtype=torch.float64)``, and the replacement would drop the keyword's effect.

``unmatched_keyword`` finds a matched node with a keyword away from its schema default that no node of
the same op in the traced search carries with that value.
"""
from __future__ import annotations

from torch.fx import Graph, Node

_NO_DEFAULT = object()


def _default(target, key: str):
    schema = getattr(target, "_schema", None)
    for arg in getattr(schema, "arguments", ()):
        if arg.name == key:
            return arg.default_value if arg.has_default_value() else _NO_DEFAULT
    return _NO_DEFAULT


def _same(a, b) -> bool:
    """a == b for keyword values: numbers by value (alpha=1.0 is the default 1), anything else by type and value."""
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare: not the same
        return False


def unmatched_keyword(searches: list[Graph], nodes: list[Node]) -> str | None:
    """Why one of the matched ``nodes`` computes something its pattern does not, or None. ``searches``: the
    traced search of each of the pattern's variants."""
    carried = {(n.target, k) for g in searches for n in g.nodes for k in n.kwargs}
    for n in nodes:
        if n.op != "call_function":
            continue
        for key, value in n.kwargs.items():
            if (n.target, key) in carried:
                continue  # a keyword the search carries: inductor's re-match compares its value
            default = _default(n.target, key)
            if default is not _NO_DEFAULT and not isinstance(value, Node) and _same(value, default):
                continue
            return f"{n.name} has {key}={value!r}, which the pattern does not compute"
    return None
