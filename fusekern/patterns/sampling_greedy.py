"""Sampling family, greedy with a token mask: ``argmax`` of ``logits / T`` with banned tokens at ``-inf``
-> one ``fusekern::masked_argmax`` (issue 5, pattern 4).

Matched in the joint graph, from every ``argmax`` over the last dim, walking up:

    argmax(y, dim=-1[, keepdim])
      y: one mask, written onto a copy of x:
         scatter(x, -1, ids, -inf)            ids [B, n]: banned / draft tokens per row
         index_put(x, [None, ids], -inf)      ``x[:, ids] = float("-inf")`` (after functionalization), ids [n]
         where(mask, -inf, x)                 ``x.masked_fill(mask, float("-inf"))``, mask bool [B, V] or [V]
      x: logits / T  (T a Python number, a one-element tensor or one value per row [B, 1], in a float dtype
         that keeps the logits'), or the logits (a ``clone`` in between is fine). A division the op does not
         take (T a Python number Dynamo made dynamic, an integer tensor, a wider float, B values over one row
         of logits) stays ahead of the op: its quotient is the logits.

Declined (graph unchanged, reason in the match report): other dims, a fill value other than -inf,
ids with fewer rows than the logits (scatter would mask only those rows), intermediates used outside the
chain, logits not bf16 / fp16 / fp32 on CPU / CUDA.
Plain ``argmax(logits / T)`` without a mask is left to inductor (nothing to fuse).
"""
from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Graph, Node

from fusekern.kernels import device_info
from fusekern.kernels import masked_argmax as kernel
from fusekern.patterns.registry import register_rewrite
from fusekern.patterns.sampling import Decline, _fake, _is, _same_shape, _val  # the sampling family's node helpers

aten = torch.ops.aten
NAME = "greedy_mask"


def _neg_inf(v, graph: Graph) -> bool:
    """Is ``v`` -inf: a number, a scalar_tensor / full node, or a graph constant (lifted)?"""
    if isinstance(v, (int, float)):
        return v == -math.inf
    if _is(v, aten.scalar_tensor.default):
        return v.args[0] == -math.inf
    if _is(v, aten.full.default):
        return v.args[1] == -math.inf
    if _is(v, aten.lift_fresh_copy.default):
        v = v.args[0]
    if isinstance(v, Node) and v.op == "get_attr" and graph.owning_module is not None:
        t = getattr(graph.owning_module, v.target, None)
        if not isinstance(t, torch.Tensor) or t.numel() != 1:
            return False
        with unset_fake_temporarily():  # the pass runs under the graph's fake mode; this is a real constant
            return float(t.reshape(())) == -math.inf
    return False


def _op_temperature(div: Node) -> bool:
    """Does the op take ``div`` = logits / T: T a Python number, or a float tensor of one value or one per row
    ([B, 1]) that keeps the logits' dtype and shape? Not a SymInt / SymFloat (a Python number that Dynamo made
    dynamic), an integer tensor, a wider float (the quotient rounds in another dtype) or B temperatures over
    one row of logits: such a division stays in the graph ahead of the op, whose logits are its quotient."""
    logits, t = div.args
    lv, qv = _val(logits), _val(div)
    if not isinstance(lv, torch.Tensor) or qv is None or qv.dtype != lv.dtype or not _same_shape(lv, qv):
        return False
    B = qv.shape[0]
    if isinstance(t, (int, float)):
        return True
    tv = _val(t)
    return isinstance(t, Node) and isinstance(tv, torch.Tensor) and tv.is_floating_point() and \
        (tv.numel() == 1 or tuple(tv.shape) == (B, 1))


def _last_dim(dim, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def match(argmax: Node, graph: Graph) -> dict:
    """The pieces of one greedy-with-mask chain; raises Decline with the reason it does not fit."""
    y = argmax.args[0]
    yv = _val(y)
    dim = argmax.args[1] if len(argmax.args) > 1 else argmax.kwargs.get("dim")
    if yv is None or not _last_dim(dim, yv.dim()):
        raise Decline("argmax is not over the last dim")
    chain, banned, mask = [y], None, None
    if _is(y, aten.scatter.value):
        x, d, ids, fill = y.args
        if not _last_dim(d, yv.dim()) or not _neg_inf(fill, graph):
            raise Decline("scatter is not -inf along the last dim")
        iv = _val(ids)
        if yv.dim() != 2 or iv.shape[0] != yv.shape[0]:
            raise Decline("scatter ids do not cover every row ([B, n] on [B, V] logits)")
        banned = ids
    elif _is(y, aten.index_put.default):
        x, indices, fill = y.args[:3]
        accumulate = y.args[3] if len(y.args) > 3 else y.kwargs.get("accumulate", False)
        if accumulate or not _neg_inf(fill, graph) or yv.dim() != 2 or len(indices) != 2 or indices[0] is not None \
                or not isinstance(indices[1], Node) or _val(indices[1]).dim() != 1 \
                or _val(indices[1]).dtype not in (torch.int64, torch.int32):
            raise Decline("index_put is not x[:, ids] = -inf with 1-D integer ids")
        banned = indices[1]
    elif _is(y, aten.where.self):
        cond, fill, x = y.args
        cv = _val(cond)
        if cv is None or cv.dtype != torch.bool or not _neg_inf(fill, graph):
            raise Decline("where is not masked_fill(mask, -inf)")
        if yv.dim() != 2 or cv.dim() not in (1, 2) or cv.shape[-1] != yv.shape[-1] \
                or (cv.dim() == 2 and cv.shape[0] != yv.shape[0]):
            raise Decline("the mask is not [B, V] or [V]")
        mask = cond
        if _is(fill, aten.scalar_tensor.default, aten.full.default):
            chain.append(fill)
    else:
        raise Decline("no -inf mask above the argmax")
    if _is(x, aten.clone.default):
        chain.append(x)
        x = x.args[0]
    temperature = None
    if _is(x, aten.div.Tensor) and _op_temperature(x):
        chain.append(x)
        logits, temperature = x.args
    else:  # no division, or one the op does not take: it stays in the graph, its quotient is the logits
        logits = x
    lv = _val(logits)
    if lv is None or lv.dtype not in kernel.LOGIT_DTYPES or lv.dim() != 2:
        raise Decline(f"logits are not 2-D bf16 / fp16 / fp32 ({getattr(lv, 'dtype', None)})")
    if yv.dtype != lv.dtype:
        raise Decline(f"the masked logits are {yv.dtype}, the logits {lv.dtype}")
    if not _same_shape(lv, yv):
        # e.g. one row of logits under B masks: the op takes one token per logits row
        raise Decline(f"the mask broadcasts the logits {tuple(lv.shape)} to {tuple(yv.shape)}")
    if lv.device.type not in ("cpu", "cuda"):
        raise Decline(f"logits on {lv.device}")
    if (reason := device_info.unsupported(lv.device)) is not None:
        raise Decline(reason)
    inside = set(chain) | {argmax}
    for n in chain:
        if any(u not in inside for u in n.users):
            raise Decline(f"{n.name} is also used outside the chain")
    return dict(logits=logits, temperature=temperature, banned=banned, mask=mask)


def rewrite_greedy(graph: Graph) -> int:
    from fusekern.compiler_pass.report import record_rejection

    fired = 0
    for node in [n for n in graph.nodes if _is(n, aten.argmax.default)]:
        try:
            m = match(node, graph)
        except Decline as why:
            y = node.args[0]
            if _is(y, aten.scatter.value, aten.index_put.default, aten.where.self):
                record_rejection(NAME, node, str(why))
            continue
        t = m["temperature"]
        t_node = t if isinstance(t, Node) else None
        t_scalar = 1.0 if t is None or t_node is not None else float(t)
        with graph.inserting_before(node):
            args = (m["logits"], t_node, t_scalar, m["banned"], m["mask"])
            tokens = graph.call_function(kernel.masked_argmax.default, args)
            tokens.meta["val"] = _fake(kernel.masked_argmax, *args)
            out = graph.call_function(aten.reshape.default, (tokens, list(_val(node).shape)))
            out.meta["val"] = _val(node)
        node.replace_all_uses_with(out)
        fired += 1
    return fired


register_rewrite(
    NAME, rewrite_greedy, family="sampling", stage="joint", kernel_version=kernel.KERNEL_VERSION,
    description="argmax over the last dim of logits / T with -inf written onto banned tokens (scatter, "
                "x[:, ids] = -inf, masked_fill): one fused masked argmax",
)
