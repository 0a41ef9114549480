"""Scale folding inside attention: FP8 K/V with per-token K scales and per-head V scales, never dequantized.

Inductor turns both ``softmax((q @ k.transpose(-1, -2)) * c) @ v`` and ``F.scaled_dot_product_attention``
into one SDPA op before the post-grad passes, so the rewrite reads SDPA ops (flash, efficient, cuDNN, the
CPU flash op, or the composite): no mask, no dropout, not causal, a constant scale. Each of K and V is
walked back through a GQA expansion (``repeat_interleave`` over heads, or SDPA's ``enable_gqa``) and
through casts and multiplications by scales to an fp8 (e4m3) cache:

    k = k8.to(dt) * k_scale[..., None]     one value per (batch, KV head, token), or a scalar
    v = v8.to(dt) * v_scale                one value per (batch, KV head) or per KV head, or a scalar

Both scales are exact to move: the K scale multiplies the score columns (``q . (s k) = s (q . k)``, folded
into the fp32 scores), the V scale the output (``sum p (s v) = s sum p v`` for a head-constant s). The match
becomes one ``fusekern::fp8_kv_attention`` call: split-KV decode attention that reads the fp8 cache once.
A per-token V scale, or a K scale that varies along the head dim, cannot move: those graphs stay as written.
The products are never formed in the graph's dtype: where an fp16 graph's ``k8 * k_scale`` (or V's)
overflows to inf (|k8| * scale > 65504: a scale above 146 on e4m3's 448), eager's output is NaN and the
op's finite. Real KV scales are orders of magnitude smaller; the rewrite does not check the values.
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import Graph, Node

from fusekern.kernels import device_info
from fusekern.kernels import fp8_kv_attention as kernel
from fusekern.patterns.registry import register_rewrite
from fusekern.patterns.scale_folding import (
    RESHAPES, Decline, Factors, Peel, _Emitter, _erase_dead, _is, _known, _val,
)

aten = torch.ops.aten
prims = torch.ops.prims
NAME = "fp8_kv_attention"


def _sdpa_ops() -> tuple:
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "scaled_dot_product_attention")
    return tuple(getattr(aten, n).default for n in names if hasattr(aten, n))


SDPA_OPS = _sdpa_ops()


def _arguments(n: Node) -> dict:
    """The SDPA node's arguments by schema name (defaults filled in)."""
    schema = n.target._schema
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(n.args):
            out[arg.name] = n.args[i]
        elif arg.name in n.kwargs:
            out[arg.name] = n.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


def _output(n: Node) -> Node:
    """The node holding the attention output: the op itself, or its only getitem(0)."""
    if n.target == aten.scaled_dot_product_attention.default:
        return n
    users = list(n.users)
    if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0:
        raise Decline("the SDPA op's other outputs (log-sum-exp, ...) are used")
    return users[0]


def _strip_gqa(node: Node) -> tuple[Node, int, list]:
    """(the [B, Hkv, S, D] value, the group size, absorbed nodes) of k / v expanded for GQA."""
    if not _is(node, *RESHAPES):
        return node, 1, []
    nodes = [node]
    cur = node.args[0]
    if _is(cur, aten.clone.default):
        nodes.append(cur)
        cur = cur.args[0]
    if not _is(cur, aten.expand.default):
        raise Decline("k / v reshaped in a way that is not a GQA head expansion")
    nodes.append(cur)
    unsq = cur.args[0]
    if not (_is(unsq, aten.unsqueeze.default) and unsq.args[1] == 2):
        raise Decline("k / v expanded along a dim other than a new one after the KV heads (repeat, not "
                      "repeat_interleave)")
    nodes.append(unsq)
    x = unsq.args[0]
    group = _val(cur).shape[2]
    if not isinstance(group, int):
        raise Decline("a symbolic GQA group size")
    # [B, Hkv, S, D] -> [B, Hkv, 1, S, D] -> [B, Hkv, G, S, D] -> [B, Hkv * G, S, D], and nothing else.
    xs, es, rs = list(_val(x).shape), list(_val(cur).shape), list(_val(node).shape)
    want_e = [xs[0], xs[1], group, xs[2], xs[3]] if len(xs) == 4 else None
    want_r = [xs[0], xs[1] * group, xs[2], xs[3]] if len(xs) == 4 else None
    if want_e is None or len(es) != 5 or len(rs) != 4 or not all(_known(p == q) for p, q in zip(es, want_e)) \
            or not all(_known(p == q) for p, q in zip(rs, want_r)):
        raise Decline("k / v reshaped after the head expansion: not a GQA repeat of the cache")
    return x, int(group), nodes


CACHE_VIEWS = (aten.slice.Tensor, aten.permute.default, aten.transpose.int)


def _cache_views(cur: Node) -> tuple[Node, list[Node]]:
    """(the node under them, the views bottom-up) for views of a cast cache: ``k8[:, :, :n].to(dt)`` and
    ``k8h.transpose(1, 2).to(dt)`` reach the pass as views of the cast (canonicalize moves casts above
    views), which read the same fp8 values: the op reads the view of the fp8 cache instead. Only views that
    keep the head dim last and whole: the op loads it as 4-byte words."""
    views = []
    while _is(cur, *CACHE_VIEWS):
        v, src = _val(cur), _val(cur.args[0])
        if v is None or src is None or v.dim() != 4 or src.dim() != 4:
            break
        if _is(cur, aten.slice.Tensor):
            dim = cur.args[1] if len(cur.args) > 1 else 0
            if dim % 4 == 3 or (len(cur.args) > 4 and cur.args[4] != 1):
                break
        elif _is(cur, aten.permute.default):
            if list(cur.args[1])[-1] % 4 != 3:
                break
        elif {cur.args[1] % 4, cur.args[2] % 4} & {3} and cur.args[1] % 4 != cur.args[2] % 4:
            break
        views.append(cur)
        cur = cur.args[0]
    return cur, views


def _walk_cache(node: Node, what: str, vector_dims: set[int]) -> tuple[Node, list[Node], Factors, list]:
    """Back from k or v ([B, Hkv, S, D]) through casts and scale multiplications to the fp8 cache: (the
    cache, the views of it the op reads (bottom-up, to re-emit on the fp8 cache), factors, nodes)."""
    shape = list(_val(node).shape)
    peel, cur = Peel(), node
    while (above := peel.step(cur, shape, vector_dims)) is not None:
        cur = above
    if peel.not_a_scale is not None:
        raise Decline(f"{what}'s scale {peel.not_a_scale.name} is not constant along "
                      f"{'the head dim' if what == 'K' else 'the tokens and the head dim'}: it cannot move")
    cur, factors, nodes = peel.finish(cur), peel.factors, peel.nodes
    views = []
    under, found = _cache_views(cur)
    if found and _is(under, prims.convert_element_type.default) and _val(under.args[0]) is not None \
            and _val(under.args[0]).dtype == torch.float8_e4m3fn:
        cur, views = under.args[0], found
        nodes = [*nodes, *found, under]
    v = _val(cur)
    if v is None or v.dtype != torch.float8_e4m3fn:
        raise Decline(f"{what} is not read from a float8_e4m3fn cache (found {None if v is None else v.dtype})")
    return cur, views, factors, nodes


def _viewed(emit_or_mode, cache, views):
    """The views (bottom-up) applied again on ``cache``: fake values under a fake mode, nodes by an emitter."""
    for view in reversed(views):
        if isinstance(emit_or_mode, _Emitter):
            cache = emit_or_mode(view.target, cache, *view.args[1:], **view.kwargs)
        else:  # (a symbolic slice end is a node: its fake value, a SymInt, stands in)
            args, kwargs = torch.fx.node.map_arg((view.args[1:], view.kwargs), lambda a: a.meta["val"])
            with emit_or_mode:
                cache = view.target(cache, *args, **kwargs)
    return cache


ROUNDING_VIEWS = (aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default)


def _rounded_fp32(emit: _Emitter, factors: Factors) -> tuple[Node, torch.dtype] | None:
    """(the fp32 scale, the 16-bit dtype) when the only factor is an fp32 scale cast to bf16 / fp16
    (``k_scale[..., None].to(dt)``, possibly a view of the cast): the kernel rounds it in registers,
    as the cast did, instead of a separate kernel writing the rounded copy."""
    if factors.numbers or len(factors.rows) + len(factors.scalars) != 1:
        return None
    node = factors.rows[0][0] if factors.rows else factors.scalars[0]
    view = None
    if _is(node, *ROUNDING_VIEWS):
        view, node = node, node.args[0]
    if not (_is(node, prims.convert_element_type.default) and node.args[1] in (torch.bfloat16, torch.float16)):
        return None
    src = node.args[0]
    if _val(src) is None or _val(src).dtype != torch.float32:
        return None
    if view is not None:
        src = emit(view.target, src, *view.args[1:], **view.kwargs)
    return src, node.args[1]


def _scale_vector(emit: _Emitter, factors: Factors, shape: list, dims: set[int],
                  flat_shape: list) -> tuple[Node, torch.dtype | None]:
    """(the product of all factors as an fp32 tensor of ``flat_shape`` (the dims in ``dims``), the dtype
    the kernel rounds it to first, or None)."""
    round_to = None
    if (rounded := _rounded_fp32(emit, factors)) is not None:
        src, round_to = rounded
        factors = Factors(rows=[(src, factors.rows[0][1], factors.rows[0][2])]) if factors.rows \
            else Factors(scalars=[src])
    parts = []
    for s, sshape, _ in factors.rows:
        target = [d if i in dims else 1 for i, d in enumerate(sshape)]
        s = emit.fp32(s)
        if _val(s).dim() != len(target) or any(not _known(p == q) for p, q in zip(_val(s).shape, target)):
            s = emit(aten.expand.default, s, emit.dims(target))
        parts.append(emit(aten.reshape.default, s, emit.dims(flat_shape)))
    scalar = emit.product([emit(aten.reshape.default, emit.fp32(s), []) for s in factors.scalars])
    number = math.prod(factors.numbers) if factors.numbers else 1.0
    vec = emit.product(parts)
    if vec is None:
        base = scalar if scalar is not None else emit(aten.full.default, [], 1.0, dtype=torch.float32,
                                                      device=_val(emit.sources[0]).device)
        vec = emit(aten.expand.default, base, emit.dims(flat_shape))
        scalar = None
    if scalar is not None:
        vec = emit(aten.mul.Tensor, vec, scalar)
    if number != 1.0:
        vec = emit(aten.mul.Tensor, vec, float(number))
    return vec, round_to


def decode_sdpa(n: Node) -> tuple:
    """What both decode-attention rewrites read of an SDPA node: (its arguments, q, q's value, the scale,
    the output node, k and v under their GQA expansion, the group size, the expansion's nodes). Declines
    dropout, is_causal, a q that is not 4-D bf16 / fp16, a scale that is not a constant, and K and V
    expanded by different groups."""
    args = _arguments(n)
    q, k, v = args["query"], args["key"], args["value"]
    if args.get("dropout_p", 0.0) not in (0, 0.0):
        raise Decline("dropout")
    if args.get("is_causal", False):
        raise Decline("is_causal (top-left aligned): not a decode step over the whole cache")
    qv = _val(q)
    if qv is None or qv.dim() != 4 or qv.dtype not in kernel.Q_DTYPES:
        raise Decline(f"q is not a 4-D bf16 / fp16 tensor ({None if qv is None else (qv.dtype, qv.dim())})")
    scale = args.get("scale")
    D = qv.shape[-1]
    if scale is None:
        if not isinstance(D, int):
            raise Decline("a symbolic head dim")
        scale = 1.0 / math.sqrt(D)
    if not isinstance(scale, (int, float)):
        raise Decline("a scale that is not a constant")
    out = _output(n)
    k_x, k_group, k_gqa = _strip_gqa(k)
    v_x, v_group, v_gqa = _strip_gqa(v)
    if k_group != v_group:
        raise Decline(f"K and V expanded for GQA by {k_group} and {v_group}")
    return args, q, qv, float(scale), out, k_x, v_x, k_group, [*k_gqa, *v_gqa]


def plan_and_replace(graph: Graph, n: Node) -> str:
    args = _arguments(n)
    for name in ("attn_mask", "attn_bias"):
        if args.get(name) is not None:
            raise Decline("an attention mask / bias")
    args, q, qv, scale, out, k_x, v_x, k_group, gqa = decode_sdpa(n)
    k8, k_views, k_factors, k_nodes = _walk_cache(k_x, "K", {0, 1, 2})
    v8, v_views, v_factors, v_nodes = _walk_cache(v_x, "V", {0, 1})
    k8v, v8v = _viewed(qv.fake_mode, _val(k8), k_views), _viewed(qv.fake_mode, _val(v8), v_views)
    B, Hkv, S, _ = k8v.shape
    tensors = [q, k8, v8, *k_factors.scalars, *v_factors.scalars, *(r[0] for r in (*k_factors.rows, *v_factors.rows))]
    devices = {_val(t).device for t in tensors}
    if len(devices) != 1 or qv.device.type not in ("cpu", "cuda"):
        raise Decline(f"q, caches and scales on {sorted(map(str, devices))}")
    if (reason := device_info.unsupported(qv.device, fp8=True)) is not None:
        raise Decline(reason)
    if _val(out).dtype != qv.dtype:
        raise Decline(f"the attention output is {_val(out).dtype}, q is {qv.dtype}")
    with qv.fake_mode:
        ks_fake = torch.empty((B, Hkv, S), dtype=torch.float32, device=qv.device)
        try:
            kernel._check_inputs(qv, k8v, ks_fake, v8v)
        except ValueError as e:
            raise Decline(str(e).removeprefix("fp8_kv_decode_attention: ")) from None
    emit = _Emitter(graph, out, qv.fake_mode, [k8, v8, q])
    k8, v8 = _viewed(emit, k8, k_views), _viewed(emit, v8, v_views)
    emit.sources += [k8, v8]  # a symbolic slice's length is a size of the viewed cache only
    k_scale, k_round = _scale_vector(emit, k_factors, list(k8v.shape), {0, 1, 2}, [B, Hkv, S])
    v_scale, v_round = _scale_vector(emit, v_factors, list(v8v.shape), {0, 1}, [B, Hkv])
    fused = emit(kernel.fp8_kv_attention.default, q, k8, k_scale, v8, v_scale, scale,
                 k_scale_round=k_round, v_scale_round=v_round)
    out.replace_all_uses_with(fused)
    _erase_dead(graph, [out, n, *gqa, *k_nodes, *v_nodes])
    parts = ["fp8 K/V"]
    if k_factors.rows:
        parts.append("per-token K scales")
    if v_factors.rows:
        parts.append("per-head V scales")
    if k_group > 1 or Hkv != qv.shape[1]:
        parts.append(f"GQA {qv.shape[1] // Hkv}")
    return ", ".join(parts)


def rewrite_fp8_kv_attention(graph: Graph) -> int:
    from fusekern.compiler_pass.report import record_note, record_rejection

    fired = 0
    for n in [n for n in graph.nodes if _is(n, *SDPA_OPS)]:
        try:
            note = plan_and_replace(graph, n)
        except Decline as why:
            k = _arguments(n).get("key")
            if any(_val(a) is not None and _val(a).dtype.itemsize == 1 for a in _ancestors_limited(k)):
                record_rejection(NAME, n, str(why))
            continue
        record_note(NAME, n.name, note)
        fired += 1
    return fired


def _ancestors_limited(node, depth: int = 8) -> list:
    """A few levels above ``node``: enough to see an fp8 cache behind k (for the report's candidates)."""
    seen, frontier = [], [node] if isinstance(node, Node) else []
    for _ in range(depth):
        frontier = [a for f in frontier for a in f.all_input_nodes]
        seen.extend(frontier)
    return seen


register_rewrite(
    NAME, rewrite_fp8_kv_attention, family="scale_folding", stage="post_grad", kernel_version=kernel.KERNEL_VERSION,
    description="SDPA (or softmax(q k^T c) v, which inductor turns into SDPA) over k = k8.to(dt) * k_scale[..., None] "
                "and v = v8.to(dt) * v_scale with fp8 caches, per-token K and per-head V scales, GQA: "
                "split-KV decode attention that reads the fp8 cache once",
)
