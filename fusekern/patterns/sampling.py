"""Sampling family: decode-step sampling chains -> one fused sampler (``fusekern::sample``).

Matched in the joint graph (before inductor turns ``rand`` into its own random ops), where the
chains are already decomposed. The rewrite starts at every ``argmax`` and ``multinomial`` and walks up:

    argmax(P / Q, dim=-1)                      the exponential race (gpt-fast, vLLM's ``probs.div_(q)``)
      Q: exponential noise                     ``empty_like(p).exponential_(l)`` or ``-log(rand)``
         (any rate l: scaling every q by one constant does not change the argmax)
    or multinomial(P, 1)                       Hugging Face's sampling step (same distribution)
      P: softmax(z, dim=-1)                    amax / sub / exp / sum / div, with or without fp32 casts
      z: the filters, each optional and applied once, top-k before top-p; min-p after top-p (Hugging Face's
         order) or before it (vLLM's v1 sampler: then top-p's softmax is over what min-p keeps too):
         top-k   where(x < topk(x, k).values[..., -1:], -inf, x)      gpt-fast, HF TopKLogitsWarper
         top-p   HF TopPLogitsWarper: sort ascending, cumsum(softmax) <= 1 - p, keep the last,
                 scatter the mask back, masked_fill -inf
         min-p   HF MinPLogitsWarper: probs = softmax(x), probs < min_p * amax(probs) (or max) masked
                 -inf, with or without its keep-the-top step (topk(probs, 1) scatter False; or argsort
                 descending, gather, [..., :1] = False, scatter): a no-op for a constant min_p <= 1;
                 or vLLM's MinPLogitsProcessor: the same mask written as ``x[mask] = -inf`` (index_put)
         or vLLM's apply_top_k_top_p in the sorted domain: sort ascending, top-k as
                 sorted < sorted.gather(1, V - k), top-p as above, then sorted.scatter(-1, idx, sorted)
      x: logits / T                            T a Python number, a one-element tensor, or one value
                                               per row ([B, 1]) of the logits' dtype; or absent (T = 1)
    k, p, min_p: Python numbers (k may be a SymInt), one-element tensors (a tensorified Python float) or
    one value per row ([B, 1] for p and min_p; vLLM's int k [B] through its gather index [B, 1]).

Whatever lies above x (e.g. Hugging Face's repetition penalty, a gather / where / scatter) is the
logits: it stays in the graph for inductor and the sampler starts from its output. So does a -inf mask
that does not look like any filter above.
A candidate is declined (graph unchanged, reason in the match report) when a piece is missing or
different, when top-p comes before top-k (that keeps another set), when an intermediate (the probabilities,
a mask) is used outside the chain (e.g. returned:
it would have to be computed anyway), when top-k is not a positive int, when top-p compares
``cumsum < 1 - p`` (it keeps a token whose cumsum equals 1 - p, the kernel drops it as HF and vLLM do),
sorts descending, or keeps more than one token (min_tokens_to_keep > 1), when a constant top-p is <= 0
(Hugging Face keeps exactly one token there, the last of its sort; the op keeps the whole top tie group),
when min-p's probabilities are not the softmax of the tensor it masks, when min-p's keep-the-top step
comes with a min_p that is not a constant <= 1 (only then is it provably a no-op), when the
temperature promotes the logits to another dtype, or when the logits are not bf16/fp16/fp32 on CPU/CUDA.
The kernel sums the top-p mass in fp32: a bf16/fp16 chain's rounded cumsum may drop or keep the one
token at the boundary differently (Hugging Face and vLLM sample from fp32 logits). A min-p over 16-bit
probabilities is declined: their rounding moves the bound by whole tie groups of tokens.
NaN or +inf logits: the original race's softmax is all NaN there and its argmax is token 0; the kernel
returns 0 for such rows too. ``torch.multinomial`` raises on such rows instead: after the rewrite they
give token 0 (a difference on invalid input only).
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusekern.kernels import device_info
from fusekern.kernels import sampler as kernel
from fusekern.patterns.casts import exact_cast
from fusekern.patterns.registry import register_rewrite

aten = torch.ops.aten
prims = torch.ops.prims

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ORDER = ("top-k", "top-p", "min-p")  # the kernel's order of the filters


class Decline(Exception):
    """A candidate that does not fit, with the reason for the match report."""


# ----------------------------------------------------------------------------- node helpers


def _is(n, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def _strip_casts(n, into: list | None = None):
    """The node under any dtype casts; the casts are appended to ``into`` (they belong to the chain)."""
    while _is(n, prims.convert_element_type.default):
        if into is not None:
            into.append(n)
        n = n.args[0]
    return n


def _strip_lossless_casts(n, into: list | None = None):
    """The node under the dtype casts that keep every value (widening ones: bf16 to fp32); the casts are
    appended to ``into``. A rounding cast (fp32 to bf16) stays: its rounded value is what follows reads."""
    while _is(n, prims.convert_element_type.default):
        inner = _val(n.args[0])
        if not isinstance(inner, torch.Tensor) or not exact_cast(inner.dtype, n.args[1]):
            break
        if into is not None:
            into.append(n)
        n = n.args[0]
    return n


def _strip_same_kind_casts(n):
    """n under casts that keep its kind (float to float, int to int): the value the chain means.
    A float to int cast truncates: it stays."""
    while _is(n, prims.convert_element_type.default):
        inner = _val(n.args[0])
        if not isinstance(inner, torch.Tensor) or inner.is_floating_point() != n.args[1].is_floating_point:
            break
        n = n.args[0]
    return n


def _arg(n: Node, i: int, name: str, default=None):
    """Argument ``i`` / ``name`` of a call, positional or keyword."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _is_last_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _scalar_value(n):
    """A Python number, or the value of an ``aten.scalar_tensor`` / ``aten.full([], v)`` node."""
    if isinstance(n, (int, float)):
        return float(n)
    if _is(n, aten.scalar_tensor.default):
        return float(n.args[0])
    if _is(n, aten.full.default) and list(n.args[0]) in ([], [1]):
        return float(n.args[1])
    return None


def _constant_value(n) -> float | None:
    """_scalar_value, or the value of a one-element lifted tensor constant (``mask[..., -1:] = 0`` and
    ``logits[mask] = -inf`` copy one in)."""
    if _scalar_value(n) is not None:
        return _scalar_value(n)
    if _is(n, aten.lift_fresh_copy.default):
        n = n.args[0]
    if not (isinstance(n, Node) and n.op == "get_attr" and n.graph.owning_module is not None):
        return None
    const = functools.reduce(lambda o, a: getattr(o, a, None), n.target.split("."), n.graph.owning_module)
    if not isinstance(const, torch.Tensor) or isinstance(const, FakeTensor) or const.numel() != 1:
        return None
    with unset_fake_temporarily():  # the joint pass runs under fake mode; the constant is a real tensor
        return float(const.reshape(()))


def _is_zero(n) -> bool:
    """n is the constant 0 / False: a number, a scalar_tensor / full, or a lifted tensor constant."""
    return _constant_value(n) == 0


def _same_int(a, b) -> bool:
    """a == b for sizes, symbolic ones compared by expression (no guard)."""
    a = _val(a) if isinstance(a, Node) else a
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr
    return isinstance(a, int) and a == b


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b have the same sizes, symbolic ones proved equal without a guard."""
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _one_per_row_or_one(t, like) -> bool:
    """t (a node) holds one value, or one per row of ``like`` ([B, V]) as [B, 1]: it broadcasts row by row."""
    tv, lv = _val(t), _val(like)
    if not isinstance(tv, torch.Tensor):
        return False
    if tv.numel() == 1:
        return True
    return lv.dim() == 2 and tv.dim() == 2 and list(tv.shape) == [lv.shape[0], 1]


def _tensor_param(t: Node, like: Node, what: str) -> Node:
    """A parameter given as a tensor: one value or one per row (float-to-float casts dropped: the kernel
    reads it as fp32)."""
    t = _strip_same_kind_casts(t)
    if not _one_per_row_or_one(t, like):
        raise Decline(f"{what} {tuple(_val(t).shape)} is neither one value nor one per row ([B, 1])")
    return t


# ----------------------------------------------------------------------------- pieces of a chain


def _softmax_input(p: Node, what: str = "the race numerator") -> tuple[Node, list[Node]]:
    """z for p = softmax(z, -1) decomposed (amax, sub, exp, sum, div; casts allowed); else Decline."""
    casts = []
    p = _strip_casts(p, casts)
    if not (_is(p, aten.div.Tensor) and _is(p.args[0], aten.exp.default) and _is(p.args[1], aten.sum.dim_IntList)):
        raise Decline(f"{what} is not softmax(...)")
    exp, total = p.args
    sub = exp.args[0]
    if total.args[0] is not exp or not _is(sub, aten.sub.Tensor) or not _is(sub.args[1], aten.amax.default):
        raise Decline(f"{what} is not softmax(...)")
    zc, amax = sub.args
    ndim = _val(zc).dim()
    if amax.args[0] is not zc or not _is_last_dim(amax.args[1], ndim) or not _is_last_dim(total.args[1], ndim):
        raise Decline("softmax is not over the last dim")
    if _val(amax).dim() != ndim or _val(total).dim() != ndim:
        # without keepdim the max / sum broadcast along the last dim: another function than softmax
        raise Decline("the softmax's max or sum drops the reduced dim (no keepdim)")
    # the logits: under widening casts only (inductor's fp32 upcast of a bf16 softmax); a rounding cast
    # before the softmax (softmax(x.to(bf16)) of fp32 x) is part of what is sampled from and stays
    return _strip_lossless_casts(zc, casts), [*casts, p, exp, total, sub, amax]


def _is_softmax(n) -> bool:
    try:
        _softmax_input(n)
        return True
    except Decline:
        return False


def _sort_output(n, which: int):
    """(sort, its input, descending) when n is output ``which`` (0: values, 1: indices) of a sort; else None."""
    if not (_is(n, operator.getitem) and n.args[1] == which and _is(n.args[0], aten.sort.default, aten.sort.stable)):
        return None
    sort = n.args[0]
    stable = sort.target == aten.sort.stable  # sort.stable takes dim and descending as keywords only
    dim = sort.kwargs.get("dim", -1) if stable else _arg(sort, 1, "dim", -1)
    descending = sort.kwargs.get("descending", False) if stable else _arg(sort, 2, "descending", False)
    if not _is_last_dim(dim, _val(sort.args[0]).dim()):
        raise Decline("the sort is not along the last dim")
    return sort, sort.args[0], bool(descending)


def _unsort(z):
    """((sort, x, descending), s) for z = s.scatter(-1, sort(x).indices, s): s put back in x's order; else None.
    (A scatter of other values or indices, e.g. a repetition penalty's, is not one.)"""
    if not _is(z, aten.scatter.src):
        return None
    s, dim, idx, src = z.args
    found = _sort_output(idx, 1)
    if found is None or src is not s or not _is_last_dim(dim, _val(s).dim()):
        return None
    return found, s


def _whole_range(n: Node, first: int) -> bool:
    """The slice arguments of n from position ``first`` (dim, start, end, step) cover the whole dim."""
    start, end, step = _arg(n, first + 1, "start"), _arg(n, first + 2, "end"), _arg(n, first + 3, "step", 1)
    return start in (0, None) and (end is None or end >= 2**62) and step == 1


def _unsliced(v, nodes: list):
    """v under whole-range slices (``m[:, ...]`` with a symbolic size writes ``m[0:2**63-1]``)."""
    while _is(v, aten.slice.Tensor) and _whole_range(v, 1):
        nodes.append(v)
        v = v.args[0]
    return v


def _kept_positions(mask: Node) -> tuple[Node, tuple | None, list[Node]]:
    """(m, (start, end), nodes) for mask = m with m[..., start:end] set to False, as the functional graph
    writes ``m[..., -1:] = 0`` / ``m[:, -1] = False`` (slice_scatter / select_scatter of a copy or fill of
    the view; end None: to the end); (mask, None, []) when mask is no such step."""
    nodes = []
    while _is(mask, aten.slice_scatter.default) and _whole_range(mask, 2):  # writes all of m: it is its src
        nodes.append(mask)
        mask = mask.args[1]
    if _is(mask, aten.slice_scatter.default):
        where = (_arg(mask, 2, "dim", 0), _arg(mask, 3, "start"), _arg(mask, 4, "end"))
        view_of = lambda v: (_is(v, aten.slice.Tensor) and _arg(v, 4, "step", 1) == 1
                             and (_arg(v, 1, "dim", 0), _arg(v, 2, "start"), _arg(v, 3, "end")) == where)
        dim, start, end = where
        if _arg(mask, 5, "step", 1) != 1:
            return mask, None, []
    elif _is(mask, aten.select_scatter.default):
        dim, index = mask.args[2:4]
        view_of = lambda v: _is(v, aten.select.int) and tuple(v.args[1:3]) == (dim, index)
        start, end = index, (None if index == -1 else index + 1)
    else:
        return mask, None, []
    m, src = mask.args[:2]
    if not _is_last_dim(dim, _val(m).dim()):
        return mask, None, []
    base = _unsliced(m, nodes)
    view = src.args[0] if _is(src, aten.copy.default, aten.fill.Scalar) else None
    if not (view_of(view) and _unsliced(view.args[0], nodes) is base and _is_zero(src.args[1])):
        raise Decline("the mask's keep step does not set its slice to False")
    nodes += [mask, src, view, *[n for n in src.args[1:2] if isinstance(n, Node)]]
    return base, (start or 0, None if end is None or end >= 2**62 else end), nodes


def _keeps_last_one(kept) -> None:
    """Declines unless ``kept`` (from _kept_positions) is the last position only (min_tokens_to_keep = 1)."""
    if kept is None:
        raise Decline("top-p does not keep its last sorted token (mask[..., -1:] = False)")
    start, end = kept
    if end is None and start < -1:
        raise Decline(f"top-p keeps the {-start} most likely tokens (min_tokens_to_keep > 1): the kernel keeps 1")
    if (start, end) != (-1, None):
        raise Decline("top-p's keep step is not the last sorted position")


def _one_minus(t: Node) -> tuple[Node, list[Node]]:
    """P for t = 1 - P: ``sub(1, P)``, or ``add(1, mul(-1, P))`` as Dynamo writes it for a tensorified float."""
    if _is(t, aten.sub.Tensor) and _scalar_value(t.args[0]) == 1 and t.kwargs.get("alpha", 1) == 1:
        return t.args[1], [t]
    if (_is(t, aten.add.Tensor) and _scalar_value(t.args[0]) == 1 and t.kwargs.get("alpha", 1) == 1
            and _is(t.args[1], aten.mul.Tensor) and _scalar_value(t.args[1].args[0]) == -1):
        return t.args[1].args[1], [t, t.args[1]]
    raise Decline("the top-p threshold is not 1 - p")


def _top_p_threshold(m: Node) -> tuple[float | Node, list[Node], Node]:
    """(p, nodes, s) for m = cumsum(softmax(s), -1) <= 1 - p."""
    if _is(m, aten.lt.Scalar, aten.lt.Tensor):
        raise Decline("top-p drops cumsum < 1 - p: it keeps a token whose cumsum equals 1 - p, which Hugging "
                      "Face's and vLLM's cumsum <= 1 - p (and the kernel) drop")
    if not (_is(m, aten.le.Scalar, aten.le.Tensor) and _is(m.args[0], aten.cumsum.default)):
        raise Decline("the top-p mask is not cumsum(softmax(sorted)) <= 1 - p")
    cumsum = m.args[0]
    if not _is_last_dim(_arg(cumsum, 1, "dim"), _val(cumsum).dim()):
        raise Decline("top-p's cumsum is not over the last dim")
    s, softmax_nodes = _softmax_input(cumsum.args[0], "top-p's cumsum input")
    nodes = [m, cumsum, *softmax_nodes]
    threshold = m.args[1]
    if isinstance(threshold, (int, float)):
        p = 1.0 - threshold
        if not p > 0:  # keeps one token, the last of the sort: the op would keep the whole top tie group
            raise Decline(f"top-p {p} is not > 0")
        return p, nodes, s
    p, minus_nodes = _one_minus(threshold)
    return _tensor_param(p, cumsum, "top-p"), [*nodes, *minus_nodes], s


# ----------------------------------------------------------------------------- the filters


@dataclass
class Filter:
    kind: str  # one of ORDER
    value: int | float | Node  # k, p or min_p: a number, a SymInt node or a tensor node


def _last_topk_value(pivot: Node, ndim: int) -> tuple[Node, list[Node]]:
    """(values, nodes) for pivot = values[..., -1:] written as select + unsqueeze or as a slice."""
    if _is(pivot, aten.unsqueeze.default) and _is(pivot.args[0], aten.select.int):
        select = pivot.args[0]
        if _is_last_dim(pivot.args[1], ndim) and _is_last_dim(select.args[1], ndim) and select.args[2] == -1:
            return select.args[0], [pivot, select]
    if _is(pivot, aten.slice.Tensor):
        args = list(pivot.args) + [None] * 4
        dim, start, end, step = args[1], args[2], args[3], args[4]
        if _is_last_dim(dim, ndim) and start == -1 and (end is None or end >= 2**62) and step in (None, 1):
            return pivot.args[0], [pivot]
    raise Decline("the pivot is not topk(x, k).values[..., -1:]")


def _top_k(cond: Node, x: Node) -> tuple[int | Node, list[Node]]:
    """k for cond = x < topk(x, k).values[..., -1:] (gpt-fast, Hugging Face)."""
    ndim = _val(x).dim()
    values, pivot_nodes = _last_topk_value(cond.args[1], ndim)
    if not (_is(values, operator.getitem) and values.args[1] == 0 and _is(values.args[0], aten.topk.default)):
        raise Decline("the pivot is not topk(x, k).values[..., -1:]")
    topk = values.args[0]
    k, dim, largest = topk.args[1], _arg(topk, 2, "dim", -1), _arg(topk, 3, "largest", True)
    if topk.args[0] is not x:
        raise Decline("the top-k is taken of another tensor than the one masked")
    if not _is_last_dim(dim, ndim) or largest is not True:
        raise Decline("topk is not the largest values of x along the last dim")
    if _arg(topk, 4, "sorted", True) is not True:  # (the CUDA order is arbitrary: the last value is any of the k)
        raise Decline("topk(sorted=False): its last value is not the k-th largest")
    if isinstance(k, Node):
        if not isinstance(_val(k), torch.SymInt):
            raise Decline("top-k is not an int")
    elif not isinstance(k, int) or k < 1:
        raise Decline(f"top-k {k!r} is not a positive int")
    return k, [cond, *pivot_nodes, values, topk]


def _hf_top_p(cond: Node, y: Node) -> tuple[float | Node, list[Node]]:
    """p for Hugging Face's top-p mask of y: sort y ascending, cumsum(softmax) <= 1 - p, keep the last,
    scatter back to y's order."""
    (sort, x, descending), m = _unsort(cond)
    if x is not y:
        raise Decline("top-p sorts another tensor than the one masked")
    if descending:
        raise Decline("top-p sorts descending: matched is the ascending sort with cumsum <= 1 - p")
    m, kept, keep_nodes = _kept_positions(m)
    _keeps_last_one(kept)
    p, nodes, s = _top_p_threshold(m)
    if _sort_output(s, 0) is None or s.args[0] is not sort:
        raise Decline("top-p's softmax is not of the sorted values")
    return p, [cond, cond.args[2], *keep_nodes, *nodes, s, sort]


def _is_max_of(top, probs) -> bool:
    """top = probs.amax(-1, keepdim=True) or probs.max(-1, keepdim=True).values."""
    if _is(top, aten.amax.default):
        return top.args[0] is probs and _is_last_dim(top.args[1], _val(probs).dim()) and _arg(top, 2, "keepdim", False)
    if _is(top, operator.getitem) and top.args[1] == 0 and _is(top.args[0], aten.max.dim):
        mx = top.args[0]
        return mx.args[0] is probs and _is_last_dim(mx.args[1], _val(probs).dim()) and _arg(mx, 2, "keepdim", False)
    return False


def _min_p_keep_step(cond: Node) -> tuple[Node, Node | None, int | None, list[Node]]:
    """(mask, sorted tensor, n, nodes) for HF's "keep the n most likely tokens" step over min-p's mask:
    ``mask.scatter_(-1, topk(probs, n).indices, False)`` (transformers today) or argsort descending, gather,
    ``[..., :n] = False``, scatter back (older; no slice step when n = 1). (cond, None, None, []) without one."""
    if _is(cond, aten.scatter.value):
        mask, dim, idx, value = cond.args
        topk = idx.args[0] if _is(idx, operator.getitem) and idx.args[1] == 1 else None
        if not (_is(topk, aten.topk.default) and _is_zero(value) and _is_last_dim(dim, _val(mask).dim())
                and _is_last_dim(_arg(topk, 2, "dim", -1), _val(mask).dim()) and _arg(topk, 3, "largest", True)):
            raise Decline("min-p's keep step is not mask.scatter(-1, topk(probs, n).indices, False)")
        return mask, topk.args[0], topk.args[1], [cond, idx, topk]
    unsorted = _unsort(cond)
    if unsorted is None:
        return cond, None, None, []
    (sort, x, descending), g = unsorted
    g, kept, nodes = _kept_positions(g)
    if not (_is(g, aten.gather.default) and g.args[2] is cond.args[2] and _is_last_dim(g.args[1], _val(g).dim())):
        raise Decline("min-p's keep step is not mask.gather(-1, idx) ... scatter(-1, idx, ...)")
    if not descending:
        raise Decline("min-p's keep step sorts ascending: it does not keep the most likely tokens")
    if kept is not None and kept[0] != 0:
        raise Decline("min-p's keep step does not keep the first sorted tokens")
    n = 1 if kept is None else kept[1]
    return g.args[0], x, n, [cond, cond.args[2], sort, *nodes, g]


def _min_p(cond: Node, y: Node) -> tuple[float | Node, list[Node]]:
    """min_p for Hugging Face's min-p mask of y: probs = softmax(y), probs < min_p * max(probs)."""
    mask, keep_sorted, n_keep, keep_nodes = _min_p_keep_step(cond)
    if not _is(mask, aten.lt.Tensor):
        raise Decline("the min-p mask is not probs < min_p * max(probs)")
    probs, scaled = mask.args
    pv = _val(probs)
    if isinstance(pv, torch.Tensor) and pv.dtype not in (torch.float32, torch.float64):
        # Rounded to 8 / 11 bits, probs < min_p * max flips whole tie groups of 16-bit logits near the bound
        # against the kernel's fp32 exp(x - max) >= min_p (16 of 64 random bf16 rows of 32000 differed).
        raise Decline(f"min-p compares {pv.dtype} probabilities, whose rounding keeps other tokens near the bound "
                      "than the kernel's fp32 test (Hugging Face and vLLM sample from fp32 logits)")
    z, softmax_nodes = _softmax_input(probs, "min-p's probabilities")
    if z is not y:
        raise Decline("min-p's probabilities are computed from another tensor than the one masked")
    if not _is(scaled, aten.mul.Tensor):
        raise Decline("the min-p bound is not min_p * max(probs)")
    top, min_p = scaled.args if _is_max_of(scaled.args[0], probs) else scaled.args[::-1]
    if not _is_max_of(top, probs):
        raise Decline("the min-p bound is not min_p * max(probs)")
    if _scalar_value(min_p) is not None:
        min_p = _scalar_value(min_p)
    elif isinstance(min_p, Node):
        min_p = _tensor_param(min_p, y, "min-p")
    else:
        raise Decline(f"min-p {min_p!r} is not a number or a tensor")
    if keep_sorted is not None:
        # Keeping the most likely token is a no-op only when min_p <= 1: probs < min_p * top is then false at
        # the top (rounding a product <= top gives <= top). Sorting y or probs puts that token first.
        if keep_sorted is not y and keep_sorted is not probs:
            raise Decline("min-p's keep step ranks another tensor than the one masked")
        if n_keep != 1:
            raise Decline(f"min-p keeps the {n_keep} most likely tokens (min_tokens_to_keep > 1): the kernel keeps 1")
        if not (isinstance(min_p, float) and min_p <= 1):
            raise Decline("min-p's keep step is a no-op only for a constant min_p <= 1; this min_p is a tensor or > 1")
    top_nodes = [top, top.args[0]] if _is(top, operator.getitem) else [top]
    return min_p, [cond, *keep_nodes, mask, *softmax_nodes, scaled, *top_nodes]


def _mask_kind(cond: Node, y: Node) -> str | None:
    """Which filter a mask over y looks like (its pieces are checked later); None: no filter."""
    if _is(cond, aten.lt.Tensor):
        if cond.args[0] is y:
            return "top-k"
        return "min-p" if _is_softmax(cond.args[0]) else None
    if _is(cond, aten.scatter.value):
        return "min-p"
    unsorted = _unsort(cond)
    if unsorted is not None:
        return "min-p" if _is(_kept_positions(unsorted[1])[0], aten.gather.default) else "top-p"
    return None


def _masked(z: Node):
    """(cond, fill, y) for z = where(cond, fill, y), or for vLLM's in-place ``y[cond] = fill`` (a boolean
    index_put whose result only the chain reads: where the caller's tensor is written back, the index_put
    stays in the graph as part of the logits); else None."""
    if _is(z, aten.where.self):
        return z.args
    if _is(z, aten.index_put.default) and len(z.users) == 1 and not (z.args[3:] and z.args[3]) \
            and not z.kwargs.get("accumulate", False):
        y, indices, fill = z.args[:3]
        if len(indices) == 1 and isinstance(indices[0], Node):
            cv, yv = _val(indices[0]), _val(y)
            if isinstance(cv, torch.Tensor) and cv.dtype == torch.bool and _same_shape(cv, yv):
                return indices[0], fill, y
    return None


def _unsorted_filter(z: Node):
    """(y, [filter], nodes) for z = where(mask, -inf, y) (or y[mask] = -inf), mask a top-k, top-p or
    min-p mask of y; None if z is no such mask (then z is the logits, or logits / T)."""
    masked = _masked(z)
    if masked is None:
        return None
    cond, fill, y = masked
    kind = _mask_kind(cond, y)
    if kind is None:
        return None
    if _constant_value(fill) != -math.inf:
        raise Decline("the mask does not fill with -inf")
    value, nodes = {"top-k": _top_k, "top-p": _hf_top_p, "min-p": _min_p}[kind](cond, y)
    return y, [Filter(kind, value)], [z, fill, *nodes]


def _sorted_top_k(cond: Node, s: Node) -> tuple[Node, list[Node]]:
    """k for vLLM's cond = s < s.gather(1, (V - k).unsqueeze(1)), s sorted ascending, k [B] ints."""
    pivot = cond.args[1]
    if not (_is(pivot, aten.gather.default) and pivot.args[0] is s and _is_last_dim(pivot.args[1], _val(s).dim())):
        raise Decline("the sorted top-k pivot is not sorted.gather(-1, (V - k)[:, None])")
    index = pivot.args[2]
    if not (_is(index, aten.unsqueeze.default) and index.args[1] in (1, -1) and _is(index.args[0], aten.sub.Tensor)):
        raise Decline("the sorted top-k pivot is not sorted.gather(-1, (V - k)[:, None])")
    sub = index.args[0]
    if not _same_int(sub.args[0], _val(s).shape[-1]) or sub.kwargs.get("alpha", 1) != 1:
        raise Decline("the sorted top-k index is not V - k")
    k = _strip_same_kind_casts(sub.args[1])
    kv, iv = _val(k), _val(index)
    if not (isinstance(kv, torch.Tensor) and not kv.is_floating_point() and kv.dtype != torch.bool):
        raise Decline("the sorted top-k's k is not an int tensor")
    if list(iv.shape) != [_val(s).shape[0], 1]:
        raise Decline("the sorted top-k's k is not one value per row")
    return k, [cond, pivot, index, sub]


def _sorted_top_p(cond: Node, s: Node) -> tuple[float | Node, list[Node]]:
    """p for vLLM's cond = cumsum(softmax(s)) <= 1 - p with its last position set to False, s sorted."""
    m, kept, keep_nodes = _kept_positions(cond)
    _keeps_last_one(kept)
    p, nodes, z = _top_p_threshold(m)
    if z is not s:
        raise Decline("top-p's softmax is not of the sorted tensor it masks")
    return p, [*keep_nodes, *nodes]


def _sorted_filters(z: Node):
    """(x, filters bottom-up, nodes) for vLLM's z = s.scatter(-1, idx, s), s = x sorted ascending with
    top-k / top-p masks applied in the sorted order; None if z is not that."""
    unsorted = _unsort(z)
    if unsorted is None:
        return None
    (sort, x, descending), s = unsorted
    if descending:
        raise Decline("the sorted filters sort descending: matched is vLLM's ascending sort")
    filters, nodes = [], [z, z.args[2], sort]
    while not (_sort_output(s, 0) is not None and s.args[0] is sort):
        if not _is(s, aten.where.self):
            raise Decline("between the sort and the scatter back: not a -inf mask")
        cond, fill, s_in = s.args
        if _scalar_value(fill) != -math.inf:
            raise Decline("the mask does not fill with -inf")
        if _is(cond, aten.lt.Tensor) and cond.args[0] is s_in:
            kind, (value, found) = "top-k", _sorted_top_k(cond, s_in)
        else:
            kind, (value, found) = "top-p", _sorted_top_p(cond, s_in)
        filters.append(Filter(kind, value))
        nodes += [s, fill, *found]
        s = s_in
    return x, filters, [*nodes, s]


def _filters(z: Node) -> tuple[Node, list[Filter], list[Node], bool]:
    """(x, filters in the order applied, their nodes, min-p before top-p): walks up from the softmax input
    through the masks. Top-k and min-p commute (each keeps the largest x down to a bound), so only two
    orders keep different sets: min-p after top-p (Hugging Face's, the kernel's default) or before it
    (vLLM's: top-p's softmax is then over what min-p keeps too; the op's ``min_p_first``)."""
    filters, nodes = [], []
    while (step := _unsorted_filter(z) or _sorted_filters(z)) is not None:
        z, found, found_nodes = step
        filters += found
        nodes += found_nodes
    filters.reverse()
    kinds = [f.kind for f in filters]
    if len(set(kinds)) != len(kinds) or ("top-p" in kinds and "top-k" in kinds
                                         and kinds.index("top-p") < kinds.index("top-k")):
        raise Decline(f"the filters are applied as {' -> '.join(kinds)}: the kernel applies each once, top-k "
                      "before top-p (top-p first keeps another set)")
    min_p_first = "min-p" in kinds and "top-p" in kinds and kinds.index("min-p") < kinds.index("top-p")
    filters.sort(key=lambda f: ORDER.index(f.kind))
    return z, filters, [n for n in nodes if isinstance(n, Node)], min_p_first


def _temperature(x: Node) -> tuple[Node, float | Node]:
    """(logits, T) for x = logits / T: T a Python number, a one-element tensor (a Python float that
    Dynamo made an input: the value may change without a recompile) or one value per row ([B, 1], e.g.
    ``temperature[:, None]``). Anything else: T = 1, x is the logits."""
    if not _is(x, aten.div.Tensor):
        return x, 1.0
    t = x.args[1]
    if isinstance(t, (int, float)):
        if not t > 0 or math.isinf(t):
            raise Decline(f"temperature {t} is not a positive finite number")
        return x.args[0], float(t)
    tv = _val(t)
    if isinstance(t, Node) and isinstance(tv, torch.Tensor) and tv.is_floating_point() and _one_per_row_or_one(t, x):
        return x.args[0], t
    return x, 1.0


# ----------------------------------------------------------------------------- the sampling step


def _exponential_noise(q: Node) -> list[Node]:
    """The nodes of ``exponential_(l)`` / ``-log(rand)`` decomposed, ending at the rand; else Decline."""
    nodes = []
    q = _strip_casts(q, nodes)
    nodes.append(q)
    if _is(q, aten.mul.Tensor) and isinstance(q.args[1], (int, float)) and q.args[1] < 0:
        inner = q.args[0]  # exponential_(l): -where(u >= 1 - eps/2, -eps/2, log(u)) / l
    elif _is(q, aten.neg.default):
        inner = q.args[0]
    else:
        raise Decline("the race divisor is not exponential noise (-log(u) or exponential_)")
    nodes.append(inner)
    if _is(inner, aten.where.self) and _is(inner.args[2], aten.log.default) and _is(inner.args[0], aten.ge.Scalar):
        log, u = inner.args[2], inner.args[2].args[0]
        if inner.args[0].args[0] is not u:
            raise Decline("exponential noise: the clamp tests another tensor than the log")
        # exponential_'s own clamp: u >= 1 - eps/2 gives -eps/2 instead of log(u) (the draws it touches
        # have probability eps/2). Another clamp is another distribution.
        if _val(u) is None or not _val(u).dtype.is_floating_point:
            raise Decline("exponential noise: log of a non-float tensor")
        eps = torch.finfo(_val(u).dtype).eps
        bound, value = inner.args[0].args[1], _scalar_value(inner.args[1])
        if not (isinstance(bound, (int, float)) and 1 - eps <= bound <= 1 and value is not None and -eps <= value < 0):
            raise Decline(f"the noise clamps log(u) to {value} where u >= {bound}: not exponential_'s clamp "
                          "(-eps/2 where u >= 1 - eps/2)")
        nodes += [inner.args[0], log]
    elif _is(inner, aten.log.default):
        u = inner.args[0]
        nodes.append(inner)
    else:
        raise Decline("the race divisor is not exponential noise (-log(u) or exponential_)")
    if not _is(u, aten.rand.default):
        raise Decline("exponential noise is not drawn from aten.rand")
    return [*nodes, u]


def _race(argmax: Node) -> tuple[Node, list[Node], Node]:
    """(probs, race nodes, rand) for argmax(probs / q, -1) with q exponential noise."""
    ndim = _val(argmax.args[0]).dim()
    dim = argmax.args[1] if len(argmax.args) > 1 else argmax.kwargs.get("dim")
    if dim is None or not _is_last_dim(dim, ndim):
        raise Decline("argmax is not over the last dim")
    casts = []
    ratio = _strip_casts(argmax.args[0], casts)
    if not _is(ratio, aten.div.Tensor) or not all(isinstance(a, Node) for a in ratio.args):
        raise Decline("argmax input is not probs / q")
    noise = _exponential_noise(ratio.args[1])
    return ratio.args[0], [*casts, ratio, *noise], noise[-1]


def _multinomial(node: Node) -> Node:
    """probs for torch.multinomial(probs, 1) drawing from torch's default generator."""
    args = list(node.args) + [None] * 3
    num_samples = node.kwargs.get("num_samples", args[1])
    if num_samples != 1:
        raise Decline(f"multinomial draws {num_samples} samples, not 1")
    if node.kwargs.get("generator") is not None or args[3] is not None:
        raise Decline("multinomial uses its own generator")
    return node.args[0]


# ----------------------------------------------------------------------------- match and replace


@dataclass
class SamplerMatch:
    output: Node  # the argmax of the race, or the multinomial
    logits: Node
    temperature: float | Node  # a number, or a node holding one value or one per row
    top_k: int | Node | None  # a number, a SymInt node (dynamic top-k), a tensor node, or None: no top-k
    top_p: float | Node | None
    min_p: float | Node | None
    chain: list[Node]  # nodes that must have no users outside the chain
    min_p_first: bool = False  # min-p before top-p (vLLM's order)


def match_sampler(output: Node) -> SamplerMatch:
    """Analyse the chain above one argmax race or multinomial; raises Decline with the reason it does not fit."""
    if _is(output, aten.multinomial.default):
        probs, race_nodes, rand = _multinomial(output), [], None
    else:
        probs, race_nodes, rand = _race(output)
    z, softmax_nodes = _softmax_input(probs)
    x, filters, filter_nodes, min_p_first = _filters(z)
    logits, temperature = _temperature(x)
    lv = _val(logits)
    if lv is None or lv.dtype not in LOGIT_DTYPES:
        raise Decline(f"logits dtype {getattr(lv, 'dtype', None)} is not bf16/fp16/fp32")
    xv = _val(x)
    if not _same_shape(lv, xv):
        # one row of logits at B temperatures: the op draws one token per row of its logits
        raise Decline(f"the temperature broadcasts the logits {tuple(lv.shape)} to {tuple(xv.shape)}")
    if _val(x).dtype != lv.dtype:
        raise Decline(f"logits / T is {_val(x).dtype}, the logits {lv.dtype} (a temperature of another dtype "
                      "promotes them): not supported yet")
    if lv.device.type not in ("cpu", "cuda"):
        raise Decline(f"logits on {lv.device}")
    if (reason := device_info.unsupported(lv.device)) is not None:
        raise Decline(reason)
    if rand is not None and list(_val(rand).shape) != list(lv.shape):
        raise Decline("the noise is not drawn per token")
    params = {f.kind: f.value for f in filters}
    return SamplerMatch(output, logits, temperature, params.get("top-k"), params.get("top-p"), params.get("min-p"),
                        [*race_nodes, *softmax_nodes, *filter_nodes], min_p_first)


def _users_outside(match: SamplerMatch) -> str | None:
    inside = set(match.chain) | {match.output}
    for n in match.chain:
        for user in n.users:
            if user not in inside:
                return f"{n.name} is also used by {user.name} (e.g. returned): the chain must be computed anyway"
    return None


def _fake(fn, *args):
    """meta['val'] for a new node: run ``fn`` on the fake values of its arguments."""
    vals = [_val(a) if isinstance(a, Node) else a for a in args]
    mode = next(v.fake_mode for v in vals if isinstance(v, torch.Tensor))
    with mode:
        return fn(*vals)


def _tensor_or_scalar(value, off):
    """The op's (tensor, scalar) pair for one parameter: a tensor node, else a number / SymInt (None: off)."""
    if isinstance(value, Node) and isinstance(_val(value), torch.Tensor):
        return value, off
    return None, off if value is None else value


def _int32_cast_of(output: Node) -> Node | None:
    """The output's only user where that user only casts it to int32 (gpt-fast's ``.to(torch.int)``): the
    op then writes int32 itself, and the cast's launch goes."""
    if len(output.users) != 1:
        return None
    (user,) = output.users
    if _is(user, prims.convert_element_type.default) and user.args[1] == torch.int32 and not user.kwargs:
        return user
    return None


def _replace(graph: Graph, m: SamplerMatch) -> None:
    lv = _val(m.logits)
    V = lv.shape[-1]
    cast = _int32_cast_of(m.output)
    result = cast if cast is not None else m.output  # the node whose value the op's output takes
    with graph.inserting_before(m.output):
        flat = m.logits
        if lv.dim() != 2:
            flat = graph.call_function(aten.reshape.default, (m.logits, [-1, V]))
            flat.meta["val"] = _fake(lambda t: t.reshape(-1, V), m.logits)
        # seed None: the op draws it from torch's generator (manual_seed reproduces a run, CUDA-graph replays
        # advance it), on CUDA while its first step runs; a randint node here cost inductor two launches
        args = (flat, *_tensor_or_scalar(m.temperature, 1.0), *_tensor_or_scalar(m.top_k, kernel.NO_TOP_K),
                *_tensor_or_scalar(m.top_p, 1.0), *_tensor_or_scalar(m.min_p, 0.0), None,
                _val(result).dtype, m.min_p_first)
        tokens = graph.call_function(kernel.sample.default, args)
        tokens.meta["val"] = _fake(kernel.sample, *args)
        out = graph.call_function(aten.reshape.default, (tokens, list(_val(result).shape)))
        out.meta["val"] = _val(result)
    result.replace_all_uses_with(out)


def rewrite_samplers(graph: Graph) -> int:
    from fusekern.compiler_pass.report import record_rejection

    fired = 0
    for node in [n for n in graph.nodes if _is(n, aten.argmax.default, aten.multinomial.default)]:
        try:
            m = match_sampler(node)
            reason = _users_outside(m)
            if reason:
                raise Decline(reason)
        except Decline as why:
            # Say why not, for what looked like a sampler: a race (argmax of a ratio) or a multinomial.
            if _is(node, aten.multinomial.default) or _is(_strip_casts(node.args[0]), aten.div.Tensor):
                record_rejection("sample", node, str(why))
            continue
        _replace(graph, m)
        fired += 1
    return fired


register_rewrite(
    "sample", rewrite_samplers, family="sampling", stage="joint", kernel_version=kernel.KERNEL_VERSION,
    description="argmax(softmax(z) / q) or multinomial(softmax(z), 1), z = logits / T through top-k "
                "(topk pivot or vLLM's sorted gather), top-p (HF / vLLM sort + cumsum) and min-p (HF) masks",
)
