"""Sampling family: decode-step sampling chains -> one fused sampler (``fusekern::sample_top_k``).

Matched in the joint graph (before inductor turns ``rand`` into its own random ops), where the
chains are already decomposed. The rewrite starts at every ``argmax`` and ``multinomial`` and walks up:

    argmax(P / Q, dim=-1)                      the exponential race (gpt-fast, vLLM's ``probs.div_(q)``)
      Q: exponential noise                     ``empty_like(p).exponential_(l)`` or ``-log(rand)``
         (any rate l: scaling every q by one constant does not change the argmax)
    or multinomial(P, 1)                       Hugging Face's sampling step (same distribution)
      P: softmax(z, dim=-1)                    amax / sub / exp / sum / div, with or without fp32 casts
      z: where(x < pivot, -inf, x)             top-k mask, pivot = topk(x, k).values[..., -1:]
         (``torch.where`` and ``masked_fill`` forms), or z = x (no top-k)
      x: logits / T                            T a Python number, a one-element tensor, or one value
                                               per row ([B, 1]) of the logits' dtype; or absent (T = 1)

A candidate is declined (graph unchanged, reason in the match report) when a piece is missing or
different, when an intermediate (the probabilities, the mask) is used outside the chain (e.g. returned:
it would have to be computed anyway), when top-k is not a positive int, when the temperature promotes
the logits to another dtype, or when the logits are not bf16/fp16/fp32 on CPU/CUDA.
NaN or +inf logits: the original race's softmax is all NaN there and its argmax is token 0; the kernel
returns 0 for such rows too. ``torch.multinomial`` raises on such rows instead: after the rewrite they
give token 0 (a difference on invalid input only).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fusekern.kernels import sampler as kernel
from fusekern.patterns.registry import register_rewrite

aten = torch.ops.aten
prims = torch.ops.prims

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Decline(Exception):
    """A candidate that does not fit, with the reason for the match report."""


def _is(n, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _strip_casts(n, into: list | None = None):
    """The node under any dtype casts; the casts are appended to ``into`` (they belong to the chain)."""
    while _is(n, prims.convert_element_type.default):
        if into is not None:
            into.append(n)
        n = n.args[0]
    return n


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


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


@dataclass
class SamplerMatch:
    output: Node  # the argmax of the race, or the multinomial
    logits: Node
    temperature: float | Node  # a number, or a node holding one value (a tensorified Python float)
    top_k: int | Node | None  # a number, a SymInt node (dynamic top-k), or None: no mask
    chain: list[Node]  # nodes that must have no users outside the chain


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
        nodes += [inner.args[0], log]
    elif _is(inner, aten.log.default):
        u = inner.args[0]
        nodes.append(inner)
    else:
        raise Decline("the race divisor is not exponential noise (-log(u) or exponential_)")
    if not _is(u, aten.rand.default):
        raise Decline("exponential noise is not drawn from aten.rand")
    return [*nodes, u]


def _softmax_input(p: Node) -> tuple[Node, list[Node]]:
    """z for p = softmax(z, -1) decomposed (amax, sub, exp, sum, div; casts allowed); else Decline."""
    casts = []
    p = _strip_casts(p, casts)
    if not (_is(p, aten.div.Tensor) and _is(p.args[0], aten.exp.default) and _is(p.args[1], aten.sum.dim_IntList)):
        raise Decline("the race numerator is not softmax(...)")
    exp, total = p.args
    sub = exp.args[0]
    if total.args[0] is not exp or not _is(sub, aten.sub.Tensor) or not _is(sub.args[1], aten.amax.default):
        raise Decline("the race numerator is not softmax(...)")
    zc, amax = sub.args
    ndim = _val(zc).dim()
    if amax.args[0] is not zc or not _is_last_dim(amax.args[1], ndim) or not _is_last_dim(total.args[1], ndim):
        raise Decline("softmax is not over the last dim")
    return _strip_casts(zc, casts), [*casts, p, exp, total, sub, amax]


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


def _top_k_mask(z: Node) -> tuple[Node, int | None, list[Node]]:
    """(x, k, nodes) for z = where(x < topk(x, k).values[..., -1:], -inf, x); (z, None, []) without a mask."""
    if not _is(z, aten.where.self):
        return z, None, []
    cond, fill, x = z.args
    if _scalar_value(fill) != -math.inf:
        raise Decline("the mask does not fill with -inf")
    if not (_is(cond, aten.lt.Tensor) and cond.args[0] is x):
        raise Decline("the mask is not x < pivot")
    pivot = cond.args[1]
    ndim = _val(x).dim()
    values, pivot_nodes = _last_topk_value(pivot, ndim)
    if not (_is(values, operator.getitem) and values.args[1] == 0 and _is(values.args[0], aten.topk.default)):
        raise Decline("the pivot is not topk(x, k).values[..., -1:]")
    topk = values.args[0]
    args = list(topk.args) + [None] * 5
    k, dim = args[1], topk.kwargs.get("dim", args[2] if args[2] is not None else -1)
    largest = topk.kwargs.get("largest", args[3] if args[3] is not None else True)
    if topk.args[0] is not x:
        raise Decline("the top-k is taken of another tensor than the one masked")
    if not _is_last_dim(dim, ndim) or largest is not True:
        raise Decline("topk is not the largest values of x along the last dim")
    if isinstance(k, Node):
        if not isinstance(_val(k), torch.SymInt):
            raise Decline("top-k is not an int")
    elif not isinstance(k, int) or k < 1:
        raise Decline(f"top-k {k!r} is not a positive int")
    return x, k, [z, cond, fill, *pivot_nodes, values, topk]


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
    tv, lv = _val(t), _val(x.args[0])
    if not (isinstance(t, Node) and isinstance(tv, torch.Tensor) and tv.is_floating_point()):
        return x, 1.0
    one_value = tv.numel() == 1
    per_row = lv is not None and lv.dim() == 2 and tv.dim() == 2 and list(tv.shape) == [lv.shape[0], 1]
    if one_value or per_row:
        return x.args[0], t
    return x, 1.0


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


def match_sampler(output: Node) -> SamplerMatch:
    """Analyse the chain above one argmax race or multinomial; raises Decline with the reason it does not fit."""
    if _is(output, aten.multinomial.default):
        probs, race_nodes, rand = _multinomial(output), [], None
    else:
        probs, race_nodes, rand = _race(output)
    z, softmax_nodes = _softmax_input(probs)
    x, top_k, mask_nodes = _top_k_mask(z)
    logits, temperature = _temperature(x)
    lv = _val(logits)
    if lv is None or lv.dtype not in LOGIT_DTYPES:
        raise Decline(f"logits dtype {getattr(lv, 'dtype', None)} is not bf16/fp16/fp32")
    if _val(x).dtype != lv.dtype:
        raise Decline(f"logits / T is {_val(x).dtype}, the logits {lv.dtype} (a temperature of another dtype "
                      "promotes them): not supported yet")
    if lv.device.type not in ("cpu", "cuda"):
        raise Decline(f"logits on {lv.device}")
    if rand is not None and list(_val(rand).shape) != list(lv.shape):
        raise Decline("the noise is not drawn per token")
    return SamplerMatch(output, logits, temperature, top_k, [*race_nodes, *softmax_nodes, *mask_nodes])


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


def _replace(graph: Graph, m: SamplerMatch) -> None:
    lv = _val(m.logits)
    V = lv.shape[-1]
    top_k = m.top_k if m.top_k is not None else 2**31 - 1  # no mask: every token kept
    temp_t, temp_s = (m.temperature, 1.0) if isinstance(m.temperature, Node) else (None, m.temperature)
    with graph.inserting_before(m.output):
        flat = m.logits
        if lv.dim() != 2:
            flat = graph.call_function(aten.reshape.default, (m.logits, [-1, V]))
            flat.meta["val"] = _fake(lambda t: t.reshape(-1, V), m.logits)
        # The seed comes from torch's generator: manual_seed reproduces a run, CUDA-graph replays advance it.
        seed = graph.call_function(aten.randint.low, (0, 2**62, [1]), {"dtype": torch.int64, "device": lv.device})
        seed.meta["val"] = _fake(lambda t: torch.empty(1, dtype=torch.int64, device=t.device), m.logits)
        args = (flat, temp_t, temp_s, None, top_k, seed)
        tokens = graph.call_function(kernel.sample_top_k.default, args)
        tokens.meta["val"] = _fake(kernel.sample_top_k, *args)
        out = graph.call_function(aten.reshape.default, (tokens, list(_val(m.output).shape)))
        out.meta["val"] = _val(m.output)
    m.output.replace_all_uses_with(out)


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
                record_rejection("sample_top_k", node.name, str(why))
            continue
        _replace(graph, m)
        fired += 1
    return fired


register_rewrite(
    "sample_top_k", rewrite_samplers, family="sampling", stage="joint", kernel_version=kernel.KERNEL_VERSION,
    description="argmax(softmax(where(x < topk(x, k)[0][..., -1:], -inf, x)) / q) or multinomial(softmax(...), 1), "
                "x = logits / T",
)
