"""Undo inductor's shape padding of matmuls before matching, and restore it where no pattern took the matmul.

On CUDA, inductor's joint-graph pass ``pad_mm`` pads a matmul's M, N or K with zeros up to an aligned size
when its benchmark finds the padded product faster (``torch/_inductor/fx_passes/pad_mm.py``):

    slice(slice(mm(constant_pad_nd(a, [0, pk, 0, pm]), constant_pad_nd(b, [0, pn, 0, pk])), 0, 0, -pm), 1, 0, -pn)

(``bmm`` with a leading batch dim, ``addmm`` with its input padded too). That pass runs before fusekern's,
and the padded spelling hides the matmul from every traced pattern: on an H200, ``F.linear(x, w.to(bf16))
* s`` with 36 rows lost its W8A16 kernel to the generic decode rewrite, depending on inductor's timing
cache. Zero rows, columns and K entries that are sliced off or add zero products are an exact identity,
so ``unpad`` gives the matmul back its operands as written; ``restore`` puts inductor's padded form back
around each such matmul that is still in the graph after the patterns ran (inductor measured it faster).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusekern.compiler_pass.canonicalize import copy_meta

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.bmm.default, aten.addmm.default)


@dataclass
class Unpadded:
    """One matmul rewritten without padding: enough to rebuild inductor's padded form around it."""
    node: torch.fx.Node  # the unpadded matmul
    pm: int
    pk: int
    pn: int


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _set_val(node: torch.fx.Node) -> None:
    """meta["val"] for a node built here, computed on the fake values of its inputs (left unset when an
    input has none)."""
    from torch._guards import detect_fake_mode

    vals = [_val(n) for n in node.all_input_nodes]
    fake_mode = detect_fake_mode(vals) if vals and all(v is not None for v in vals) else None
    if fake_mode is None:
        return
    args = torch.fx.node.map_arg(node.args, _val)
    kwargs = torch.fx.node.map_arg(node.kwargs, _val)
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)


def _pad_of(node, rank: int):
    """(source, pad list) if ``node`` is a right-side zero ``constant_pad_nd`` of a rank-``rank`` tensor
    over its last two dims only, else (node, None)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target == aten.constant_pad_nd.default):
        return node, None
    pad = list(node.args[1])
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if value != 0 or len(pad) > 2 * rank or len(pad) % 2 or not all(isinstance(p, int) for p in pad):
        return node, None
    pad += [0] * (4 - len(pad))
    if pad[0] or pad[2] or any(pad[4:]) or pad[1] < 0 or pad[3] < 0:
        return node, None
    return node.args[0], pad


def _slice_of(node: torch.fx.Node, dim: int, p: int):
    """The only user of ``node`` if it is ``node[..., :-p]`` along ``dim`` (end -p or the unpadded size)."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if user.op != "call_function" or user.target != aten.slice.Tensor:
        return None
    args = list(user.args) + [None] * (5 - len(user.args))
    _, d, start, end, step = args[:5]
    size = _val(node).shape[dim] if _val(node) is not None else None
    if d != dim or (start or 0) != 0 or (step or 1) != 1:
        return None
    if end == -p or (isinstance(size, int) and end == size - p):
        return user
    return None


def unpad(graph: torch.fx.Graph) -> list[Unpadded]:
    """Rewrite every padded matmul of ``graph`` to the matmul of its unpadded operands."""
    log: list[Unpadded] = []
    for mm in list(graph.nodes):
        if mm.op != "call_function" or mm.target not in _MATMULS:
            continue
        bmm = mm.target == aten.bmm.default
        rank = 3 if bmm else 2
        first = 1 if mm.target == aten.addmm.default else 0
        a, pad_a = _pad_of(mm.args[first], rank)
        b, pad_b = _pad_of(mm.args[first + 1], rank)
        pk_a, pm = (pad_a[1], pad_a[3]) if pad_a else (0, 0)
        pn, pk_b = (pad_b[1], pad_b[3]) if pad_b else (0, 0)
        if pk_a != pk_b or not (pm or pn or pk_a):
            continue
        out = mm
        if pm:
            out = _slice_of(out, rank - 2, pm)
        if out is not None and pn:
            out = _slice_of(out, rank - 1, pn)
        if out is None:
            continue
        new_args = [a, b]
        if first:  # addmm: only an input that broadcasts over the padded dims (pad_addmm pads others by cat)
            inp = mm.args[0]
            v = _val(inp) if isinstance(inp, torch.fx.Node) else None
            if (pm or pn) and (v is None or (pn and v.dim() >= 1 and v.shape[-1] != 1)
                               or (pm and v.dim() == 2 and v.shape[0] != 1)):
                continue
            new_args.insert(0, inp)
        with graph.inserting_before(mm):
            new = graph.call_function(mm.target, tuple(new_args) + tuple(mm.args[first + 2:]), dict(mm.kwargs))
        copy_meta(mm, new)
        _set_val(new)
        out.replace_all_uses_with(new)
        _erase_chain(graph, out)
        log.append(Unpadded(new, pm, pk_a, pn))
    return log


def _erase_chain(graph: torch.fx.Graph, out: torch.fx.Node) -> None:
    """Erase ``out`` and the nodes feeding it that are left without users (the padded matmul)."""
    stack = [out]
    while stack:
        node = stack.pop()
        if node.users or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        stack.extend(inputs)


def restore(graph: torch.fx.Graph, log: list[Unpadded]) -> int:
    """Put inductor's padding back around each unpadded matmul no pattern took; returns how many. One pad
    node per operand and padding, shared by the matmuls that had shared it."""
    restored = 0
    pads: dict = {}
    for r in log:
        mm = r.node
        if mm._erased or not mm.users:
            continue
        bmm = mm.target == aten.bmm.default
        extra = [0, 0] if bmm else []
        first = 1 if mm.target == aten.addmm.default else 0
        a, b = mm.args[first], mm.args[first + 1]
        built = []
        with graph.inserting_before(mm):
            def node(target, *args):
                n = graph.call_function(target, args)
                built.append(n)
                return n

            def pad(src, amounts):
                key = (src, tuple(amounts))
                if key not in pads:
                    pads[key] = node(aten.constant_pad_nd.default, src, amounts)
                return pads[key]

            if r.pk or r.pm:
                a = pad(a, [0, r.pk, 0, r.pm] + extra)
            if r.pk or r.pn:
                b = pad(b, [0, r.pn, 0, r.pk] + extra)
            args = [a, b]
            if first:
                args.insert(0, mm.args[0])
            res = graph.call_function(mm.target, tuple(args) + tuple(mm.args[first + 2:]), dict(mm.kwargs))
            built.append(res)
            rank = 3 if bmm else 2
            if r.pm:
                res = node(aten.slice.Tensor, res, rank - 2, 0, -r.pm)
            if r.pn:
                res = node(aten.slice.Tensor, res, rank - 1, 0, -r.pn)
        for n in built:
            copy_meta(mm, n)
            _set_val(n)
        mm.replace_all_uses_with(res)
        graph.erase_node(mm)
        restored += 1
    return restored
