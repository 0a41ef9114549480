"""One canonical spelling for the graph and for the traced patterns, so equivalent user code matches.

Applied to every traced search function (``trace``) and to the live graph before matching:
- ``view`` / ``_unsafe_view`` become ``reshape`` (inductor's post-grad graph spells views as
  reshape; a trace spells them as view).
- a dtype cast of a view-like op's only result is hoisted above it: ``w.t().to(dt)`` and
  ``w.to(dt).t()``, or ``s[:, None].to(dt)`` and ``s.to(dt)[:, None]``, become one graph.
Both rewrites compute the same values; inductor would fuse either order the same way.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
prims = torch.ops.prims

_TO_RESHAPE = (aten.view.default, aten._unsafe_view.default)
_VIEW_LIKE = {
    aten.reshape.default, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.default, aten.expand.default, aten.transpose.int, aten.t.default, aten.slice.Tensor,
}
_CAST = prims.convert_element_type.default


def canonicalize(graph: torch.fx.Graph) -> bool:
    """Rewrite ``graph`` in place; True if anything changed."""
    changed = False
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _TO_RESHAPE:
            node.target = aten.reshape.default
            changed = True
    moved = True
    while moved:
        moved = False
        for cast in list(graph.nodes):
            if cast.op != "call_function" or cast.target != _CAST:
                continue
            view = cast.args[0]
            if not (isinstance(view, torch.fx.Node) and view.op == "call_function"
                    and view.target in _VIEW_LIKE and len(view.users) == 1):
                continue
            _hoist(graph, cast, view)
            moved = changed = True
    return changed


def _hoist(graph: torch.fx.Graph, cast: torch.fx.Node, view: torch.fx.Node) -> None:
    src = view.args[0]
    with graph.inserting_before(view):
        new_cast = graph.call_function(_CAST, (src, *cast.args[1:]), dict(cast.kwargs))
        new_view = graph.call_function(view.target, (new_cast, *view.args[1:]), dict(view.kwargs))
    copy_meta(cast, new_cast)
    copy_meta(cast, new_view)
    if isinstance(src, torch.fx.Node) and "val" in src.meta and "val" in cast.meta:
        from torch._guards import detect_fake_mode

        fake_mode = detect_fake_mode([src.meta["val"]])
        with fake_mode if fake_mode is not None else torch.no_grad():
            new_cast.meta["val"] = _CAST(src.meta["val"], *cast.args[1:], **cast.kwargs)
            args = torch.fx.map_arg(view.args[1:], lambda a: a.meta["val"])
            new_view.meta["val"] = view.target(new_cast.meta["val"], *args, **view.kwargs)
    cast.replace_all_uses_with(new_view)
    graph.erase_node(cast)
    graph.erase_node(view)


def copy_meta(src: torch.fx.Node, dst: torch.fx.Node) -> None:
    """Give a node built to replace ``src`` its source location (for inductor's provenance and errors)."""
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def trace(fn, args, **kwargs) -> torch.fx.GraphModule:
    """``fwd_only`` followed by ``canonicalize``: the trace function for every fusekern pattern."""
    from torch._inductor.pattern_matcher import fwd_only

    gm = fwd_only(fn, args, **kwargs)
    if canonicalize(gm.graph):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm
