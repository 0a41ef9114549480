"""Scale folding family: scales multiplied into a matmul's operands or output move into one GEMM's epilogue.

One structural rewrite over every ``mm`` / ``addmm`` of the post-grad graph. It reads three parts:

- each operand, walked back through casts and multiplications by scales. A scale is a Python number, a
  one-element tensor (a "legacy" scalar scale), a vector along the operand's row axis (per token for the
  activation, per output channel for the weight: ``[M, 1]``, ``[N, 1]``, ``s[:, None]``), or a block
  scale written as ``(x.view(M, K // g, g) * s[..., None]).view(M, K)`` (1 x g activation blocks) or
  ``(w.view(N // gn, gn, K // g, g) * s[:, None, :, None]).view(N, K)`` (gn x g weight blocks). What is
  left is the operand the kernel reads: fp8, int8, bf16 or fp16. Casts are dropped only where they are
  exact (int8 / fp8 -> any 16- or 32-bit float, 16-bit -> fp32) or round an already scaled value (the
  kernel keeps that value in fp32 instead);
- the output, walked forward through a reshape back to the activation's batch dims, casts,
  multiplications by scalars, per-row or per-column vectors, then a bias (per column) and a residual
  (same shape) and a final cast;
- the algebra: ``(r[m] a[m, k]) (c[n] b[n, k])`` summed over k is ``r[m] c[n] sum_k a b``, so every row
  factor becomes one ``row`` vector, every column factor one ``col`` vector, the numbers and scalars join
  one of them. Scales along K cannot move out of the sum: those graphs stay as written.

The match becomes one ``fusekern::scaled_mm`` call: an FP8 / int8 / 16-bit tensor-core GEMM with the
scales, bias, residual and cast in its epilogue. It fires when the activation is 8-bit (W8A8, A8W16), or
when both operands are 16-bit and at least one scale folds. A 16-bit activation with an 8-bit weight is
weight-only quantization: that belongs to the dequant family (hand-tuned decode GEMVs), as does any
16-bit operand decoded from integer codes; the rewrite declines both so that family sees them.
"""
from __future__ import annotations

import functools
import logging
import math
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from fusekern.kernels import cute_dispatch, device_info
from fusekern.kernels import scaled_mm as kernel
from fusekern.patterns.casts import exact_cast
from fusekern.patterns.decode.analysis import CODE_DTYPES, ancestors
from fusekern.patterns.registry import register_rewrite
from fusekern.patterns.spec import known as _known

aten = torch.ops.aten
prims = torch.ops.prims
log = logging.getLogger("fusekern")

NAME = "scale_folding"
MATMULS = (aten.mm.default, aten.addmm.default)
BOUNDARIES = (*MATMULS, aten.bmm.default, aten.baddbmm.default, aten.convolution.default)
RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class Decline(Exception):
    """This matmul is not rewritten; the message says why (shown in the match report)."""


class NotOurs(Decline):
    """Another family's form (weight-only quantization): not rewritten, and not reported as a refusal."""


def _val(n):
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is(n, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _cast_target(n: Node):
    """The dtype a cast node converts to, or None when ``n`` is not a plain dtype cast."""
    if _is(n, prims.convert_element_type.default):
        return n.args[1]
    if _is(n, aten._to_copy.default) and set(n.kwargs) <= {"dtype"} and len(n.args) == 1:
        return n.kwargs.get("dtype")
    return None


# ----------------------------------------------------------------------------- scale classification


@dataclass
class Factors:
    """Multiplicative factors found on one side of the product."""

    numbers: list = field(default_factory=list)  # Python numbers
    scalars: list = field(default_factory=list)  # one-element tensor nodes
    rows: list = field(default_factory=list)  # (node, broadcast shape): one value per row of this side
    cols: list = field(default_factory=list)  # (node, broadcast shape): one value per output column

    def __bool__(self) -> bool:
        return bool(self.numbers or self.scalars or self.rows or self.cols)


def _classify(s, shape, vector_dims: set[int]):
    """How a factor ``s`` broadcasts against a value of ``shape``.

    Returns ("number", s), ("scalar", node), ("vector", node) for one value per index of
    ``vector_dims`` (constant along every other dim), or None when it is none of those.
    """
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return ("number", s)
    sv = _val(s)
    if sv is None or not sv.dtype.is_floating_point or sv.dtype.itemsize == 1 or sv.dtype == torch.float64:
        return None
    if sv.dim() > len(shape):
        return None
    padded = [1] * (len(shape) - sv.dim()) + list(sv.shape)
    if all(_known(d == 1) for d in padded):
        return ("scalar", s)
    for i, (d, full) in enumerate(zip(padded, shape)):
        if _known(d == 1):
            continue
        if i in vector_dims and _known(d == full):
            continue
        return None
    return ("vector", s)


def _scale_operand(mul: Node, cur_shape) -> tuple[Node, object] | None:
    """(the value, the factor) of ``mul`` when one argument has the product's shape and the other is a factor."""
    a, b = mul.args[0], mul.args[1]
    for x, s in ((a, b), (b, a)):
        xv = _val(x)
        if xv is not None and len(xv.shape) == len(cur_shape) and all(_known(p == q) for p, q in zip(xv.shape, cur_shape)):
            if not (isinstance(s, Node) and s is x):
                return x, s
    return None


# ----------------------------------------------------------------------------- operands


@dataclass
class Peel:
    """Walks back from a matmul operand through casts and scale multiplications, one step at a time.

    A cast that rounds (fp32 -> bf16, bf16 -> fp16) may only be dropped where it rounds a scaled value,
    which the kernel keeps in fp32. Walking back, such a cast must have a scale multiplication further up;
    if the walk ends first, the cast rounded the operand itself and ``finish`` makes the kernel read the
    cast's result instead.
    """

    factors: Factors = field(default_factory=Factors)
    nodes: list = field(default_factory=list)  # absorbed nodes
    rounding_cast: tuple | None = None  # (cast node, len(nodes) before it) awaiting a scale above it
    not_a_scale: Node | None = None  # the multiplication the walk stopped at, if any

    def step(self, cur: Node, shape, vector_dims: set[int]) -> Node | None:
        """The node above one cast or scale multiplication at ``cur``, recording it; None if neither."""
        dst = _cast_target(cur)
        if dst is not None:
            src = _val(cur.args[0]).dtype if _val(cur.args[0]) is not None else None
            if src is None or dst not in FLOATS:
                return None
            if not exact_cast(src, dst) and self.rounding_cast is None:
                self.rounding_cast = (cur, len(self.nodes))
            self.nodes.append(cur)
            return cur.args[0]
        if not _is(cur, aten.mul.Tensor) or not _val(cur).dtype.is_floating_point:
            return None  # (integer arithmetic wraps: never a scale)
        found = _scale_operand(cur, shape)
        kind = _classify(found[1], shape, vector_dims) if found else None
        if kind is None:
            self.not_a_scale = cur
            return None
        what, factor = kind
        if what == "number":
            self.factors.numbers.append(factor)
        elif what == "scalar":
            self.factors.scalars.append(factor)
        else:
            self.factors.rows.append((factor, tuple(shape), frozenset(vector_dims)))
        self.nodes.append(cur)
        self.rounding_cast = None
        return found[0]

    def scaled(self) -> None:
        """A scale was absorbed by other means (a block view): casts below it round scaled values."""
        self.rounding_cast = None

    def finish(self, cur: Node) -> Node:
        """The node the kernel reads: ``cur``, or a rounding cast of the unscaled operand."""
        if self.rounding_cast is None:
            return cur
        node, n = self.rounding_cast
        del self.nodes[n:]
        return node


@dataclass
class Operand:
    """What one side of the product reads: ``base`` (``[rows..., K]`` or ``[K, rows]``) and its factors."""

    base: Node
    factors: Factors
    nodes: list  # absorbed nodes
    lead: tuple | None = None  # the activation's batch dims when the matmul read a flattened view
    transposed: bool = False  # the weight: base is [N, K] read through permute
    block: tuple | None = None  # (scale node, its [rows, groups] shape, group_rows, group_k)
    stop: str | None = None  # why the walk stopped at a multiplication (for the report)


def _block_view(view: Node, rows, K):
    """``view`` = reshape(mul(reshape(X, [R, G, g]) or [R/gr, gr, G, g], S), [R, K]): (X, S2, gr, g) or None."""
    mul = view.args[0]
    if not _is(mul, aten.mul.Tensor) or len(mul.users) != 1:
        return None
    mv = _val(mul)
    if mv is None or mv.dim() not in (3, 4):
        return None
    found = _scale_operand(mul, mv.shape)
    if found is None:
        return None
    inner, s = found
    if not _is(inner, *RESHAPES) or len(inner.users) != 1:
        return None
    x = inner.args[0]
    xv, sv = _val(x), _val(s) if isinstance(s, Node) else None
    if xv is None or sv is None or xv.dim() != 2 or not sv.dtype.is_floating_point or sv.dtype.itemsize == 1:
        return None
    if not (_known(xv.shape[0] == rows) and _known(xv.shape[1] == K)):
        return None  # the view regroups another tensor's elements: not a block-scaled [rows, K] operand
    shape = list(mv.shape)
    try:
        g = int(shape[-1])
        groups = int(shape[-2])
    except Exception:  # symbolic group sizes: not a block scale we can compile
        return None
    if g * groups != K and not _known(g * groups == K):
        return None
    padded = [1] * (len(shape) - sv.dim()) + list(sv.shape)
    if len(shape) == 3:  # [R, G, g], scale [R, G, 1]: 1 x g blocks
        if not (_known(shape[0] == rows) and _known(padded[0] == rows) and _known(padded[1] == groups)
                and _known(padded[2] == 1)):
            return None
        return x, s, 1, g, (rows, groups)
    # [R / gr, gr, G, g], scale [R / gr, 1, G, 1]: gr x g blocks
    try:
        gr = int(shape[1])
    except Exception:
        return None
    if not (_known(shape[0] * gr == rows) and _known(padded[0] == shape[0]) and _known(padded[1] == 1)
            and _known(padded[2] == groups) and _known(padded[3] == 1)):
        return None
    return x, s, gr, g, (shape[0], groups)


def walk_operand(node: Node, role: str) -> Operand:
    """Walk an mm operand back to the tensor the kernel reads. role: "a" ([M, K]) or "b" ([K, N])."""
    nodes = []
    transposed = False
    if role == "b" and _is(node, aten.permute.default) and list(node.args[1]) == [1, 0]:
        nodes.append(node)
        node, transposed = node.args[0], True
    elif role == "b" and _is(node, aten.t.default):
        nodes.append(node)
        node, transposed = node.args[0], True
    v = _val(node)
    if v is None or v.dim() != 2:
        raise Decline(f"operand {node} has no 2-D tensor metadata")
    rows_first = role == "a" or transposed  # [R, K] (else [K, R])
    K = v.shape[1] if rows_first else v.shape[0]
    R = v.shape[0] if rows_first else v.shape[1]
    shape = list(v.shape)
    vector_dims = {0} if rows_first else {1}
    peel = Peel(nodes=nodes)
    block, lead = None, None
    cur = node
    while True:
        above = peel.step(cur, shape, vector_dims)
        if above is not None:
            cur = above
            continue
        if peel.not_a_scale is not None:
            break
        if _is(cur, *RESHAPES) and rows_first and block is None and lead is None:
            found = _block_view(cur, R, K)
            if found is not None:
                x, s, gr, g, sshape = found
                if role == "a" and gr != 1:
                    # activation blocks span one row (1 x g); a taller block is not one a_block row. The
                    # walk stops at the scaled view (block stays unset: set, the kernel scaled it again)
                    break
                block = (s, sshape, gr, g)
                mul = cur.args[0]
                inner = next(a for a in mul.args if isinstance(a, Node) and _is(a, *RESHAPES))
                peel.nodes.extend([cur, mul, inner])
                peel.scaled()
                cur = x
                continue
            if role == "a":  # [M, K] = reshape([*lead, K]): the activation's batch dims, flattened
                xv = _val(cur.args[0])
                if xv is not None and xv.dim() >= 3 and _known(xv.shape[-1] == K) and \
                        _known(functools.reduce(operator.mul, xv.shape[:-1], 1) == R):
                    peel.nodes.append(cur)
                    cur = cur.args[0]
                    shape = list(xv.shape)
                    lead = tuple(xv.shape[:-1])
                    vector_dims = set(range(len(shape) - 1))
                    continue
        break
    stop = None
    if peel.not_a_scale is not None:
        stop = f"{peel.not_a_scale.name}'s factor varies along K (or is not a scale): it cannot leave the sum"
    return Operand(peel.finish(cur), peel.factors, peel.nodes, lead, transposed, block, stop)


# ----------------------------------------------------------------------------- output


@dataclass
class Output:
    last: Node  # the node the fused call replaces
    factors: Factors
    bias: tuple | None = None  # (node, broadcast shape)
    residual: tuple | None = None
    lead: tuple | None = None  # the output's batch dims when the mm's result was reshaped back
    nodes: list = field(default_factory=list)


def walk_output(mm: Node, has_bias: bool) -> Output:
    """Walk forward from the matmul through what its epilogue can do, in the order it does it."""
    mv = _val(mm)
    M, N = mv.shape
    out = Output(mm, Factors())
    shape = [M, N]
    cur = mm
    row_dims, col_dim = {0}, 1
    added = has_bias  # after an add, a product would scale the added term too: stop there
    bias_taken = has_bias  # addmm's bias: a later per-column add becomes a (broadcast) residual
    while len(cur.users) == 1:
        u = next(iter(cur.users))
        uv = _val(u)
        if uv is None:
            break
        if _is(u, *RESHAPES) and out.lead is None and u.args[0] is cur and uv.dim() >= 3 \
                and _known(uv.shape[-1] == N) and _known(functools.reduce(operator.mul, uv.shape[:-1], 1) == M):
            out.lead = tuple(uv.shape[:-1])
            shape = list(uv.shape)
            row_dims, col_dim = set(range(len(shape) - 1)), len(shape) - 1
        elif _cast_target(u) is not None:
            if _cast_target(u) not in FLOATS or u.args[0] is not cur:
                break
        elif _is(u, aten.mul.Tensor) and not added and uv.dtype.is_floating_point:
            found = _scale_operand(u, shape)
            if found is None or found[0] is not cur:
                break
            s = found[1]
            kind = _classify(s, shape, row_dims)
            if kind is not None and kind[0] == "vector":
                out.factors.rows.append((s, tuple(shape), frozenset(row_dims)))
            elif kind is not None:
                (out.factors.numbers if kind[0] == "number" else out.factors.scalars).append(s)
            else:
                kind = _classify(s, shape, {col_dim})
                if kind is None:
                    break
                out.factors.cols.append((s, tuple(shape), frozenset({col_dim})))
        elif _is(u, aten.add.Tensor) and not u.kwargs.get("alpha", 1) != 1:
            found = _scale_operand(u, shape)
            if found is None or found[0] is not cur or not isinstance(found[1], Node):
                break
            t = found[1]
            col = _classify(t, shape, {col_dim})
            if col is not None and not bias_taken and col[0] != "number":
                out.bias = (t, tuple(shape))
            elif out.residual is None and _classify(t, shape, set(range(len(shape)))) is not None:
                out.residual = (t, tuple(shape))
            else:
                break
            added = True
            bias_taken = bias_taken or out.bias is not None
        else:
            break
        out.nodes.append(u)
        cur = u
    out.last = cur
    return out


# ----------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    mm: Node
    a: Operand
    b: Operand
    out: Output
    bias: Node | None  # addmm's bias
    out_dtype: torch.dtype


def _decoded_from_codes(node: Node) -> bool:
    """The node is computed from integer / fp8 graph inputs by elementwise work (a dequantized weight: the
    dequant family's). The walk stops at matmuls and fused ops: a 16-bit activation that came out of an
    earlier quantized layer is not a decoded weight."""
    if node.op != "call_function":
        return False

    def boundary(n: Node) -> bool:
        return n.op != "call_function" or _is(n, *BOUNDARIES) or "fusekern" in str(n.target) \
            or "triton_kernel_wrapper" in str(n.target)

    return any(n.op in ("placeholder", "get_attr") and _val(n) is not None and _val(n).dtype in CODE_DTYPES
               for n in ancestors(node, stop=boundary))


def plan(mm: Node) -> Plan:
    if mm.target == aten.addmm.default:
        if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1:
            raise Decline("addmm with alpha or beta")
        bias, a_node, b_node = mm.args[0], mm.args[1], mm.args[2]
    else:
        bias, a_node, b_node = None, mm.args[0], mm.args[1]
    mv = _val(mm)
    if mv is None or mv.dim() != 2:
        raise Decline("the matmul has no 2-D tensor metadata")
    if not mv.dtype.is_floating_point:
        raise Decline(f"an integer matmul ({mv.dtype}): its wrap-around is not the kernel's exact sum")
    # Eager raises on a matmul (or addmm bias) of mixed dtypes, and FakeTensor's meta kernels do not check
    # it, so such a graph reaches the backend: folding would return a result where the user's code fails.
    mixed = {str(_val(n).dtype) for n in (bias, a_node, b_node) if isinstance(n, Node) and _val(n) is not None}
    if len(mixed) > 1:
        raise Decline(f"the matmul mixes {' and '.join(sorted(mixed))} (eager raises)")
    a, b = walk_operand(a_node, "a"), walk_operand(b_node, "b")
    out = walk_output(mm, bias is not None)
    av, bv = _val(a.base), _val(b.base)
    scales = any((a.factors, b.factors, out.factors, a.block, b.block))
    if av.dtype in kernel.SIXTEEN_BIT_DTYPES and bv.dtype in kernel.EIGHT_BIT_DTYPES:
        raise NotOurs(f"a {av.dtype} activation with a {bv.dtype} weight is weight-only quantization")
    if kernel.compute_dtype(av.dtype, bv.dtype) is None:
        raise Decline(f"operands {av.dtype} x {bv.dtype}: no exact tensor-core type (fp8 / int8 / bf16 / fp16 only)")
    if av.dtype in kernel.SIXTEEN_BIT_DTYPES:
        if not scales:
            why = a.stop or b.stop or "no scale multiplies an operand or the output"
            raise Decline(f"16-bit operands and nothing to fold: {why}")
        for side, op in (("activation", a), ("weight", b)):
            if _decoded_from_codes(op.base):
                raise NotOurs(f"the {side} is decoded from integer / fp8 codes")
    if a.block is not None and b.block is not None and a.block[3] != b.block[3]:
        raise Decline(f"activation and weight block scales group K by {a.block[3]} and {b.block[3]}")
    cd = kernel.compute_dtype(_val(a.base).dtype, _val(b.base).dtype)
    for op in (a, b):
        if op.block is not None and (op.block[3] < 16 or op.block[3] & (op.block[3] - 1)):
            raise Decline(f"block scales group K by {op.block[3]} (a power of two >= 16 only)")
        if op.block is not None and cd is not None and cd.itemsize == 1 and op.block[3] < kernel.MIN_GROUP_K_8BIT:
            # (the kernel's K tile must sit inside one group, and its 8-bit dot takes K >= 32: it would not compile)
            raise Decline(f"block scales group K by {op.block[3]}: 8-bit operands need groups of "
                          f"{kernel.MIN_GROUP_K_8BIT} or more")
    out_dtype = _val(out.last).dtype
    if out_dtype not in kernel.OUT_DTYPES:
        raise Decline(f"the result is {out_dtype}")
    if (a.block is not None) != (b.block is not None) and not isinstance(mv.shape[1], int):
        raise Decline("block scales on one side only and a symbolic N")
    tensors = [a.base, b.base, bias, *_all_factor_nodes(a, b, out)]
    devices = {_val(n).device for n in tensors if isinstance(n, Node) and _val(n) is not None}
    if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
        raise Decline(f"operands and scales on {sorted(map(str, devices))}")
    device = next(iter(devices))
    if (reason := device_info.unsupported(device, fp8=av.dtype in FP8 or bv.dtype in FP8)) is not None:
        raise Decline(reason)
    return Plan(mm, a, b, out, bias, out_dtype)


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _all_factor_nodes(a: Operand, b: Operand, out: Output) -> list:
    """Every tensor the replacement will read besides the operands: scales, block scales, bias, residual."""
    found = []
    for f in (a.factors, b.factors, out.factors):
        found += [*f.scalars, *(r[0] for r in f.rows), *(c[0] for c in f.cols)]
    for op in (a, b):
        if op.block is not None:
            found.append(op.block[0])
    for t in (out.bias, out.residual):
        if t is not None:
            found.append(t[0])
    return found


# ----------------------------------------------------------------------------- the replacement


class _Emitter:
    """Adds nodes before ``at``, each with its fake value (inductor lowers from meta['val'])."""

    def __init__(self, graph: Graph, at: Node, fake_mode, sources: list[Node]):
        self.graph, self.at, self.mode = graph, at, fake_mode
        self.sources = sources  # inputs that stay in the graph: symbolic sizes are read from them
        self._sym_nodes: dict = {}

    def __call__(self, target, *args, **kwargs) -> Node:
        with self.graph.inserting_before(self.at):
            n = self.graph.call_function(target, args, kwargs)
        vals = torch.fx.map_arg((args, kwargs), lambda a: a.meta["val"])
        try:
            with self.mode:
                n.meta["val"] = target(*vals[0], **vals[1])
        except (ValueError, RuntimeError, TypeError) as e:
            # A backstop: plan() should have declined this; never let it break the user's compile.
            self.graph.erase_node(n)
            raise Decline(f"{getattr(target, '__name__', target)} does not take these arguments: {e}") from None
        return n

    def dims(self, shape) -> list:
        """A shape argument: ints stay ints, a symbolic size becomes a sym_size node of an input holding it."""
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        out = []
        for d in shape:
            if isinstance(d, int) or is_concrete_int(d):
                out.append(int(d))
                continue
            key = str(d.node.expr)
            if key not in self._sym_nodes:
                for src in self.sources:
                    for i, sd in enumerate(_val(src).shape):
                        if not is_concrete_int(sd) and str(sd.node.expr) == key:
                            self._sym_nodes[key] = (src, i)
                            break
                    if key in self._sym_nodes:
                        break
                else:
                    raise Decline(f"the symbolic size {d} is not a size of the operands")
            src, i = self._sym_nodes[key]
            out.append(self(aten.sym_size.int, src, i))
        return out

    def inline(self, fn, *args) -> Node | None:
        """Trace ``fn`` on the fake values of ``args`` (Nodes and constants) and copy its graph here.

        None (and nothing copied) when the trace writes or clones an input: Triton launches whose
        kernel inductor cannot analyse are assumed to write every pointer (a clone of the weight per call).
        """
        from torch._inductor.pattern_matcher import fwd_only

        nodes = [a for a in args if isinstance(a, Node)]

        def on_tensors(*tensors):
            it = iter(tensors)
            return fn(*(next(it) if isinstance(a, Node) else a for a in args))

        try:
            with self.mode:
                gm = fwd_only(on_tensors, [n.meta["val"] for n in nodes])
        except Exception as e:  # noqa: BLE001 - the registered op computes the same; say why in the log
            log.info("fusekern: inlining %s failed (%s: %s); using the registered op", fn.__name__, type(e).__name__, e)
            return None
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            if getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable:
                return None
            if set(n.kwargs.get("tensors_to_clone", ())) - {"out_ptr"}:
                return None
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        with self.graph.inserting_before(self.at):
            out = self.graph.graph_copy(gm.graph, dict(zip(placeholders, nodes)))
        return out[0] if isinstance(out, (tuple, list)) else out

    def fp32(self, n: Node) -> Node:
        return n if _val(n).dtype == torch.float32 else self(prims.convert_element_type.default, n, torch.float32)

    def vector(self, s: Node, shape: tuple, dims: set[int]) -> Node:
        """``s`` (broadcasting over ``shape``, varying only along ``dims``) as a flat vector."""
        target = [d if i in dims else 1 for i, d in enumerate(shape)]
        s = self.fp32(s)
        if _val(s).dim() != len(target) or any(not _known(p == q) for p, q in zip(_val(s).shape, target)):
            s = self(aten.expand.default, s, self.dims(target))
        return self(aten.reshape.default, s, [-1])

    def product(self, nodes: list[Node]) -> Node | None:
        acc = None
        for n in nodes:
            acc = n if acc is None else self(aten.mul.Tensor, acc, n)
        return acc


def _replace(graph: Graph, p: Plan) -> str:
    mv = _val(p.mm)
    M, N = mv.shape
    a, b, out = p.a, p.b, p.out
    emit = _Emitter(graph, p.out.last, mv.fake_mode, [a.base, b.base])
    # Sizes first: a symbolic size the operands do not hold declines the match before anything is emitted.
    out_shape = emit.dims([*out.lead, N]) if out.lead is not None else None
    n_arg = emit.dims([N])

    a_in = a.base
    if a.lead is not None:
        a_in = emit(aten.reshape.default, a.base, [-1, *emit.dims([_val(a.base).shape[-1]])])
    b_in = b.base if b.transposed else emit(aten.permute.default, b.base, [1, 0])

    # Each factor carries the dims it varies along, recorded where it was found (before or after a reshape).
    rows = [emit.vector(s, shape, dims) for s, shape, dims in (*a.factors.rows, *out.factors.rows)]
    cols = [emit.vector(s, shape, dims) for s, shape, dims in (*b.factors.rows, *out.factors.cols)]
    numbers = [*a.factors.numbers, *b.factors.numbers, *out.factors.numbers]
    scalars = [emit(aten.reshape.default, emit.fp32(s), []) for s in
               (*a.factors.scalars, *b.factors.scalars, *out.factors.scalars)]
    number = math.prod(numbers) if numbers else None
    row, col = emit.product(rows), emit.product(cols)
    scalar = emit.product(scalars)
    if number is not None and scalar is not None:
        scalar = emit(aten.mul.Tensor, scalar, number)
    factor = scalar if scalar is not None else number
    if factor is not None:
        if col is not None:
            col = emit(aten.mul.Tensor, col, factor)
        elif row is not None:
            row = emit(aten.mul.Tensor, row, factor)
        elif scalar is not None:
            col = emit(aten.expand.default, scalar, n_arg)
        else:
            col = emit(aten.full.default, n_arg, float(number), dtype=torch.float32, device=mv.device)

    bias = None
    if p.bias is not None or out.bias is not None:
        t, shape = (p.bias, (M, N)) if p.bias is not None else out.bias
        tv = _val(t)
        if _classify(t, shape, {len(shape) - 1}) is None:
            raise Decline(f"bias of shape {tuple(tv.shape)} is not one value per output column")
        if tv.numel() == 1:
            bias = emit(aten.expand.default, emit(aten.reshape.default, t, []), n_arg)
        elif tv.dim() == 1:
            bias = t
        else:
            bias = emit(aten.reshape.default, t, [-1])
    residual = None
    if out.residual is not None:
        t, shape = out.residual
        tv = _val(t)
        if tv.dim() != len(shape) or any(not _known(p_ == q) for p_, q in zip(tv.shape, shape)):
            t = emit(aten.expand.default, t, emit.dims(shape))
        residual = t if len(shape) == 2 else emit(aten.reshape.default, t, [-1, *n_arg])

    a_block = b_block = None
    group_n = group_k = 0
    if a.block is not None or b.block is not None:
        g = (a.block or b.block)[3]
        groups = int((a.block or b.block)[1][1])
        group_k = g
        ones = dict(dtype=torch.float32, device=mv.device)
        # A side without block scales gets one row of ones (the op broadcasts a one-row a_block over M).
        a_block = emit(aten.reshape.default, a.block[0], [-1, groups]) if a.block is not None else \
            emit(aten.full.default, [1, groups], 1.0, **ones)
        if b.block is not None:
            b_block = emit(aten.reshape.default, b.block[0], [-1, groups])
            group_n = b.block[2]
        else:
            b_block = emit(aten.full.default, [1, groups], 1.0, **ones)
            group_n = int(N)  # static: plan() declines a symbolic N here
    args = (a_in, b_in, row, col, bias, residual, a_block, b_block, group_n, group_k, p.out_dtype)
    if mv.device.type == "cuda" and isinstance(M, int) and not cute_dispatch.prefers_cute(
            _val(a_in), _val(b_in), a_block is not None, (group_n, group_k)):
        # M is fixed in this graph and the Triton kernel takes it: inductor emits the launch itself.
        fused = emit.inline(kernel.traced_for_inductor, *args)
    else:
        fused = None
    if fused is None:  # symbolic M (the op picks the kernel per call), the CuTe kernel, or CPU: the registered op
        fused = emit(kernel.scaled_mm.default, *args)
    result = fused if out_shape is None else emit(aten.reshape.default, fused, out_shape)
    for key in ("stack_trace", "nn_module_stack"):
        if key in p.mm.meta:
            fused.meta[key] = p.mm.meta[key]
    p.out.last.replace_all_uses_with(result)
    _erase_dead(graph, [*reversed(p.out.nodes), p.mm, *p.a.nodes, *p.b.nodes])
    return describe(p)


def _erase_dead(graph: Graph, nodes: list[Node]) -> None:
    """Erase the replaced nodes now (not at the pass's end) so later rewrites never see the dead matmul."""
    for n in nodes:
        if not n._erased and not n.users:
            graph.erase_node(n)


def describe(p: Plan) -> str:
    parts = [f"{_val(p.a.base).dtype} x {_val(p.b.base).dtype}".replace("torch.", "")]
    f = [p.a.factors, p.b.factors, p.out.factors]
    if any(x.rows for x in f) or any(x.cols for x in f):
        parts.append("row/column scales")
    if any(x.numbers or x.scalars for x in f):
        parts.append("scalar scales")
    if p.a.block is not None or p.b.block is not None:
        parts.append(f"block scales (K groups of {(p.a.block or p.b.block)[3]})")
    if p.bias is not None or p.out.bias is not None:
        parts.append("bias")
    if p.out.residual is not None:
        parts.append("residual")
    return ", ".join(parts) + f" -> {str(p.out_dtype).removeprefix('torch.')}"


def _is_candidate(mm: Node) -> bool:
    """Worth a line in the report: a scale multiplies an operand or the output, or an operand is 8-bit."""
    for user in mm.users:
        if _is(user, aten.mul.Tensor):
            return True
    for operand in mm.args[-2:]:
        while _is(operand, aten.permute.default, aten.t.default, *RESHAPES):
            operand = operand.args[0]
        if _is(operand, aten.mul.Tensor):
            return True
        if _cast_target(operand) is not None and _val(operand.args[0]) is not None and \
                _val(operand.args[0]).dtype in kernel.EIGHT_BIT_DTYPES:
            return True
    return False


def rewrite_scaled_matmuls(graph: Graph) -> int:
    from fusekern.compiler_pass.report import record_note, record_rejection

    fired = 0
    for mm in [n for n in graph.nodes if _is(n, *MATMULS)]:
        try:
            p = plan(mm)
            note = _replace(graph, p)
        except Decline as why:
            if not isinstance(why, NotOurs) and _is_candidate(mm):
                record_rejection(NAME, mm, str(why))
            continue
        record_note(NAME, mm.name, note)
        fired += 1
    return fired


register_rewrite(
    NAME, rewrite_scaled_matmuls, family="scale_folding", stage="post_grad", kernel_version=kernel.KERNEL_VERSION,
    description="mm / addmm whose operands are multiplied by per-row / per-column / scalar / block scales "
                "(fp8 / int8 / 16-bit), and whose output is scaled, biased, added to a residual and cast: "
                "one GEMM with the scales in its epilogue",
)
