"""Group the ``fusekern::decode_mm`` calls that read the same activation into ``decode_mm_group`` calls.

A decoder's q / k / v projections (and gate / up) multiply the same normalized rows by different
weights. After the structural rewrite they are separate ``decode_mm`` calls with the same ``x``; where
two or three of them also share K and the packed layout (and have no bias), they become one
``decode_mm_group`` call, whose kernel may run them as one launch (``fusekern.kernels.decode_mm_group``
decides by measurement, and otherwise runs them one by one: the results are the members' own either
way). Runs after the structural rewrite (registration order), in the post-grad graph.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from fusekern.kernels import decode_mm as kernel
from fusekern.kernels import decode_mm_group as group_kernel
from fusekern.kernels import packed_gemv_group as pg
from fusekern.kernels import layout_guard
from fusekern.patterns.decode.program import DecodeProgram

NAME = "decode_matmul_group"
aten = torch.ops.aten


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _same_values(x: Node):
    """A key equal for nodes holding the same values: each linear layer reshapes its [B, T, K] input to
    [B * T, K] with its own view node, so views of one tensor to one shape are one activation."""
    if x.op == "call_function" and x.target in _VIEWS and isinstance(x.args[0], Node):
        return ("view", _same_values(x.args[0]), tuple(x.args[1]))
    return x


def _key(node: Node):
    """What members of one group share: the activation, the layout, K (None: not groupable)."""
    x, leaves, text, bias, layout = (list(node.args) + [""])[:5]
    if bias is not None or not layout or layout_guard.is_guarded(layout) or not isinstance(x, Node):
        return None
    val = x.meta.get("val")
    if val is None or val.dim() != 2:
        return None
    prog = DecodeProgram.from_text(text)
    if prog.batch:
        return None
    return _same_values(x), layout, prog.K


def _ready_before(nodes: list[Node], order: dict) -> bool:
    """Everything the group call reads (the first member's activation, every member's leaves) is
    computed before the first member, where the call goes. A later member's leaf made from earlier nodes
    only (the rewrite lifts a constant table right before its matmul) is moved up to the first member."""
    first = nodes[0]
    for leaf in [leaf for n in nodes[1:] for leaf in n.args[1]]:
        if order[leaf] > order[first] and leaf.op == "call_function" and \
                all(order[a] < order[first] for a in leaf.all_input_nodes):
            first.prepend(leaf)
            order[leaf] = order[first] - 0.5
    inputs = [a for a in first.all_input_nodes] + [leaf for n in nodes[1:] for leaf in n.args[1]]
    return all(order[a] < order[first] for a in inputs)


def group_decode_matmuls(graph: Graph) -> int:
    """Replace groups of 2-3 ``decode_mm`` calls sharing x, layout and K; returns the number of groups."""
    from fusekern.compiler_pass.canonicalize import copy_meta
    from fusekern.compiler_pass.report import record_note, record_rejection

    buckets: dict = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target == kernel.decode_mm.default:
            key = _key(n)
            if key is not None:
                buckets.setdefault(key, []).append(n)
    fired = 0
    for nodes in buckets.values():
        for i in range(0, len(nodes) - 1, pg.MAX_MEMBERS):
            members = nodes[i:i + pg.MAX_MEMBERS]
            if len(members) < 2:
                continue
            order = {n: k for k, n in enumerate(graph.nodes)}  # (afresh: earlier groups added nodes)
            if not _ready_before(members, order):
                record_rejection(NAME, members[0], "a later member's leaves are computed after the "
                                                        "first member: the calls stay separate")
                continue
            x, layout = members[0].args[0], members[0].args[4]
            leaves = [leaf for m in members for leaf in m.args[1]]
            programs = [m.args[2] for m in members]
            with graph.inserting_before(members[0]):
                call = graph.call_function(group_kernel.decode_mm_group.default, (x, leaves, programs, layout))
                call.meta["val"] = [m.meta["val"] for m in members]
                copy_meta(members[0], call)
                for j, m in enumerate(members):
                    item = graph.call_function(operator.getitem, (call, j))
                    item.meta["val"] = m.meta["val"]
                    copy_meta(m, item)
                    m.replace_all_uses_with(item)
            for m in members:
                graph.erase_node(m)
            record_note(NAME, call.name, f"{len(members)} decode -> matmuls on {x.name} "
                                         f"(N = {' + '.join(str(DecodeProgram.from_text(t).N) for t in programs)})")
            fired += 1
    return fired
