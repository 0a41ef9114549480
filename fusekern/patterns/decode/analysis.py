"""From FX to a decode program: find the weight's decode cone and express it per element.

``find_cone(matmul)`` walks back from the matmul's weight operand through the ops a weight decode
is written with (elementwise math and bit twiddling, casts, views, cat, small-table lookups, gathers by an
index tensor such as GPTQ's ``scales[g_idx]``) to graph inputs and constants. ``analyse(cone)`` then evaluates the cone symbolically for one weight element
``W[b, k, n]``: views turn into floor-div / mod index expressions (sympy, simplified with the index
ranges), expand drops dims, cat becomes a selection on the index, and each op becomes one scalar
instruction of a ``DecodeProgram``.

Anything outside that language raises ``Unsupported`` with the reason the match report shows.
"""
from __future__ import annotations

import functools
import operator
import types
from dataclasses import dataclass, field

import sympy
import torch
from torch.fx import Node

from fusekern.patterns.decode.program import (
    B, FLOAT_DTYPES, INT_DTYPES, K, MAX_TABLE, N, DecodeProgram, Instr, Leaf, Ref, is_int,
)
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

aten = torch.ops.aten
prims = torch.ops.prims

INT32_MAX = 2**31 - 1
# dtypes of packed codes: a cone must read at least one leaf of these (else there is nothing to fuse).
CODE_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)


class Unsupported(Exception):
    """The cone cannot be expressed as a decode program; the message says why."""


# ----------------------------------------------------------------------------- op tables

BINARY = {
    aten.add.Tensor: "add", aten.add.Scalar: "add", aten.sub.Tensor: "sub", aten.sub.Scalar: "sub",
    aten.mul.Tensor: "mul", aten.mul.Scalar: "mul", aten.div.Tensor: "div", aten.div.Scalar: "div",
    aten.bitwise_and.Tensor: "and", aten.bitwise_and.Scalar: "and",
    aten.bitwise_or.Tensor: "or", aten.bitwise_or.Scalar: "or",
    aten.bitwise_xor.Tensor: "xor", aten.bitwise_xor.Scalar: "xor",
    aten.__rshift__.Scalar: "shr", aten.__rshift__.Tensor: "shr",
    aten.bitwise_right_shift.Tensor: "shr", aten.bitwise_right_shift.Tensor_Scalar: "shr",
    aten.bitwise_right_shift.Scalar_Tensor: "shr",
    aten.__lshift__.Scalar: "shl", aten.__lshift__.Tensor: "shl",
    aten.bitwise_left_shift.Tensor: "shl", aten.bitwise_left_shift.Tensor_Scalar: "shl",
    aten.bitwise_left_shift.Scalar_Tensor: "shl",
    aten.eq.Tensor: "eq", aten.eq.Scalar: "eq", aten.ne.Tensor: "ne", aten.ne.Scalar: "ne",
    aten.lt.Tensor: "lt", aten.lt.Scalar: "lt", aten.le.Tensor: "le", aten.le.Scalar: "le",
    aten.gt.Tensor: "gt", aten.gt.Scalar: "gt", aten.ge.Tensor: "ge", aten.ge.Scalar: "ge",
    aten.maximum.default: "max", aten.minimum.default: "min",
}
UNARY = {aten.neg.default: "neg", aten.exp2.default: "exp2", aten.abs.default: "abs",
         aten.bitwise_not.default: "not"}
IDENTITY = {aten.clone.default, aten.lift_fresh_copy.default, aten.alias.default}
VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.permute.default,
         aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
         aten.squeeze.dims, aten.expand.default, aten.slice.Tensor, aten.select.int}
OTHER = {prims.convert_element_type.default, aten._to_copy.default, aten.where.self, aten.cat.default, prims.iota.default,
         aten.full.default, aten.scalar_tensor.default, aten.view.dtype, aten.index.Tensor,
         aten.pow.Scalar, aten.pow.Tensor_Scalar, aten.ldexp.Tensor}
SUPPORTED = set(BINARY) | set(UNARY) | IDENTITY | VIEWS | OTHER
CMP = {"eq", "ne", "lt", "le", "gt", "ge"}


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _fixed_sizes(v: torch.Tensor) -> tuple[int, ...] | None:
    """v's sizes as ints, None if one is symbolic. (``int()`` of a SymInt would specialize it: a guard on the
    user's dynamic dim, and a compile error where it was marked dynamic.)"""
    sizes = tuple(s.node.maybe_as_int() if isinstance(s, torch.SymInt) else int(s) for s in v.shape)
    return None if None in sizes else sizes


def _static_shape(v: torch.Tensor, what: str) -> tuple[int, ...]:
    sizes = _fixed_sizes(v)
    if sizes is None:
        raise Unsupported(f"{what} has a symbolic shape {tuple(v.shape)}")
    return sizes


def graph_constant(node: Node) -> torch.Tensor | None:
    """The tensor a ``get_attr`` leaf names in its graph's module (a constant of the graph), else None."""
    gm = node.graph.owning_module
    if node.op != "get_attr" or gm is None:
        return None
    v = getattr(gm, node.target, None)
    return v if isinstance(v, torch.Tensor) else None


# ----------------------------------------------------------------------------- the cone

@dataclass
class Cone:
    """The weight operand ``root`` of ``matmul``, the nodes computing it, and the leaves they read."""

    matmul: Node
    root: Node
    nodes: list[Node]           # computed nodes, in graph order
    leaves: list[Node]          # graph inputs / constants read, in first-use order
    tables: set[Node] = field(default_factory=set)  # leaves used only as lookup tables


def weight_operand(mm: Node) -> tuple[Node, Node]:
    """(activation, weight) operands of an mm / addmm / bmm node."""
    if mm.target in (aten.mm.default, aten.bmm.default):
        return mm.args[0], mm.args[1]
    if mm.target == aten.addmm.default:
        if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1:
            raise Unsupported("addmm with alpha or beta")
        return mm.args[1], mm.args[2]
    raise Unsupported(f"{mm.target} is not mm / addmm / bmm")


def ancestors(node: Node, stop=None) -> set[Node]:
    """``node`` and every node it is computed from; ``stop(n)`` true keeps n but not what it is computed from."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if stop is None or n is node or not stop(n):
            stack.extend(a for a in n.all_input_nodes)
    return seen


def find_cone(mm: Node) -> Cone:
    act, root = weight_operand(mm)
    if not isinstance(root, Node):
        raise Unsupported("the weight operand is not a graph value")
    rv = _val(root)
    if rv is not None and _fixed_sizes(rv) is None:
        # said first: the cone's size arithmetic (e.g. K / 8 * 8) would otherwise be the reason given
        raise Unsupported(f"the weight has a symbolic shape {tuple(rv.shape)} (torch marks a weight passed as an "
                          "argument dynamic once its shape changes between calls; parameters and buffers stay static)")
    nodes, leaves, tables, seen = [], [], set(), set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            leaves.append(n)
            continue
        if n.op != "call_function" or n.target not in SUPPORTED:
            raise Unsupported(f"{getattr(n.target, '__name__', n.target)} ({n.name}) in the weight's computation")
        if n.target == aten.index.Tensor:
            table = _lookup_table(n)
            if table is not None:
                tables.add(table)
        nodes.append(n)
        stack.extend(n.all_input_nodes)
    if not nodes:
        raise Unsupported("the weight is a graph input: nothing to decode")
    inside = set(nodes) | {mm}
    for n in nodes:
        outside = [u.name for u in n.users if u not in inside]
        if outside:
            raise Unsupported(f"{n.name} is also used by {outside[0]}: the dequantized value is needed anyway")
    act_side = ancestors(act) if isinstance(act, Node) else set()
    for leaf in leaves:
        if leaf in act_side:
            raise Unsupported(f"{leaf.name} feeds the activation too: activations cannot be decode leaves")
    order = {n: i for i, n in enumerate(mm.graph.nodes)}
    nodes.sort(key=order.__getitem__)
    leaves.sort(key=order.__getitem__)
    codes = [l for l in leaves if l not in tables and _val(l) is not None and _val(l).dtype in CODE_DTYPES]
    if not codes:
        raise Unsupported("no leaf holds integer or fp8 codes: not a quantized weight")
    return Cone(mm, root, nodes, leaves, tables)


def _gather_index(n: Node) -> tuple[int, Node]:
    """(dim, index tensor) of ``table[..., idx, ...]``: one integer index tensor, the other dims whole.

    A GPTQ act-order decode reads ``scales[g_idx]`` and ``zeros[g_idx]`` (the group of each k from a table
    of K entries). Boolean and uint8 indices are masks in torch (a data-dependent shape): not gathers."""
    indices = n.args[1]
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(given) != 1:
        raise Unsupported(f"{n.name}: indexing with {len(given)} index tensors (one gather index is supported)")
    dim, index = given[0]
    iv = _val(index)
    if iv is None or iv.dtype not in (torch.int32, torch.int64):
        raise Unsupported(f"{n.name}: an index of dtype {None if iv is None else iv.dtype} (int32 / int64 gathers)")
    return dim, index


def _lookup_table(n: Node) -> Node | None:
    """The leaf of a small-table lookup ``table[codes]`` (a 1-D constant or input of at most MAX_TABLE entries,
    e.g. the E2M1 values), None for any other gather (``scales[g_idx]``, a computed table)."""
    table, indices = n.args[0], n.args[1]
    while isinstance(table, Node) and table.op == "call_function" and table.target in IDENTITY:
        table = table.args[0]
    if len(indices) == 1 and indices[0] is not None and isinstance(table, Node) \
            and table.op in ("placeholder", "get_attr") and _val(table) is not None \
            and _val(table).dim() == 1 and _val(table).numel() <= MAX_TABLE:
        return table
    _gather_index(n)  # anything else must be a gather the analysis can follow
    return None


# ----------------------------------------------------------------------------- the analysis

@functools.cache
def _sizevars():
    from torch._inductor.sizevars import SizeVarAllocator

    return SizeVarAllocator()


def _reshape_indexer(old: tuple[int, ...], new: tuple[int, ...]):
    """new index -> old index, with inductor's view indexer (floor-div / modular indexing per dim group)."""
    from torch._inductor.ir import View
    from torch._inductor.virtualized import V

    with V.set_graph_handler(types.SimpleNamespace(sizevars=_sizevars())):
        return View.dynamic_reshape_indexer(list(old), list(new))


class _Builder:
    def __init__(self, cone: Cone, ranges: dict, sorted_gathers: bool = False):
        self.cone = cone
        self.ranges = ranges
        # sorted_gathers: read ``table[g_idx]`` as ``table[k // G]`` where g_idx is a [K] leaf read at k and the
        # table has K / G rows (GPTQ without act-order); ``sorted_leaves`` then maps each such leaf to its G.
        self.sorted_gathers = sorted_gathers
        self.sorted_leaves: dict[int, int] = {}
        self.extra_leaves: list[Leaf] = []  # small constants the analysis made (folded reorders), carried by value
        self.instrs: list[Instr] = []
        self.index_of: dict[Instr, int] = {}
        self.leaf_id = {n: i for i, n in enumerate(cone.leaves)}
        self.memo: dict = {}
        self.gathered: dict[sympy.Symbol, Ref] = {}  # index symbols standing for gathered values (``g_idx[k]``)

    # -- instructions ---------------------------------------------------------------------------------
    def emit(self, op: str, args: tuple, dtype: torch.dtype) -> Ref:
        ins = Instr(op, args, dtype)
        i = self.index_of.get(ins)
        if i is None:
            i = self.index_of[ins] = len(self.instrs)
            self.instrs.append(ins)
        return Ref(i)

    def dtype(self, r: Ref) -> torch.dtype:
        return self.instrs[r.i].dtype

    def cast(self, r: Ref, dtype: torch.dtype) -> Ref:
        return r if self.dtype(r) == dtype else self.emit("cast", (r,), dtype)

    def simplify(self, e):
        if not isinstance(e, sympy.Basic) or e.is_Integer:
            return e
        try:
            e = _sizevars().simplify_with_ranges(e, self.ranges)
        except Exception:  # simplification is an optimization: the unsimplified form is still exact
            pass
        return int(e) if e.is_Integer else e

    def resolve(self, e, node: Node):
        """An index argument: a sympy expression in b / k / n, or a Ref where it involves gathered values
        (``scales[g_idx]``: row ``g_idx[k]``; AutoAWQ's column reorder ``w[:, order]`` of a packed weight: word
        ``order[n] // 8``, field ``order[n] % 8``), computed by instructions."""
        e = self.simplify(e)
        if not isinstance(e, sympy.Basic) or not (e.free_symbols & set(self.gathered)):
            return e
        return self._lower(e, node)

    def _lower(self, e, node: Node) -> Ref:
        """Instructions computing the integer index expression ``e`` (int32: every index is below a leaf's
        element count, which analyse keeps under 2**31). Division and modulo by powers of two only, as shifts
        and masks (floor semantics, as sympy's FloorDiv / ModularIndexing)."""
        i32 = torch.int32

        def pow2(c) -> int:
            if not (isinstance(c, sympy.Integer) and c > 0 and (int(c) & (int(c) - 1)) == 0):
                raise Unsupported(f"{node.name} is read at {e}: division of a gathered index by {c}")
            return int(c).bit_length() - 1

        if e in self.gathered:
            return self.cast(self.gathered[e], i32)
        if isinstance(e, sympy.Integer):
            return self.emit("const", (int(e),), i32)
        if not (e.free_symbols & set(self.gathered)):
            return self.emit("index", (e,), i32)
        if isinstance(e, (sympy.Add, sympy.Mul)):
            op = "add" if isinstance(e, sympy.Add) else "mul"
            args = [self._lower(a, node) for a in e.args]
            out = args[0]
            for a in args[1:]:
                out = self.emit(op, (out, a), i32)
            return out
        if isinstance(e, FloorDiv):
            base, div = e.args
            return self.emit("shr", (self._lower(base, node), self.emit("const", (pow2(div),), i32)), i32)
        if isinstance(e, ModularIndexing):
            base, div, mod = e.args
            shifted = self.emit("shr", (self._lower(base, node), self.emit("const", (pow2(div),), i32)), i32)
            return self.emit("and", (shifted, self.emit("const", ((1 << pow2(mod)) - 1,), i32)), i32)
        if isinstance(e, sympy.Mod):
            base, mod = e.args
            return self.emit("and", (self._lower(base, node), self.emit("const", ((1 << pow2(mod)) - 1,), i32)), i32)
        raise Unsupported(f"{node.name} is read at {e}: arithmetic on a gathered index")

    def _gather(self, node: Node, idx: tuple) -> Ref:
        """``table[..., index, ...]``: the index tensor's value at this element becomes an index symbol of the
        table, in its range (negative indices wrap, as in torch; out-of-range ones are clamped where eager
        raises), and the table is followed at that index like any other value."""
        dim, index = _gather_index(node)
        table = node.args[0]
        tshape = _static_shape(_val(table), table.name)
        ishape = _static_shape(_val(index), index.name)
        size = tshape[dim]
        r = self.value(index, idx[dim:dim + len(ishape)])
        if self.sorted_gathers:
            leaf = self._leaf_read_at_k(r, size)
            if leaf is not None and self.ranges[K] % size == 0:
                group = self.ranges[K] // size
                if self.sorted_leaves.setdefault(leaf, group) != group:
                    raise Unsupported(f"{node.name}: one index leaf read as groups of two sizes")
                return self.value(table, idx[:dim] + (FloorDiv(K, group),) + idx[dim + len(ishape):])
        pos = idx[dim:dim + len(ishape)]
        folded = self._periodic_constant(r, pos[0], size) if len(pos) == 1 else None
        if folded is not None:  # a constant reorder (AutoAWQ's columns): no data-dependent index left
            return self.value(table, idx[:dim] + (folded,) + idx[dim + len(ishape):])
        d = self.dtype(r)
        zero, last = self.emit("const", (0,), d), self.emit("const", (size - 1,), d)
        wrapped = self.emit("where", (self.emit("lt", (r, zero), torch.bool),
                                      self.emit("add", (r, self.emit("const", (size,), d)), d), r), d)
        r = self.emit("max", (self.emit("min", (wrapped, last), d), zero), d)
        sym = sympy.Symbol(f"g{r.i}", integer=True, nonnegative=True)
        self.gathered[sym] = r
        self.ranges[sym] = size
        return self.value(table, idx[:dim] + (sym,) + idx[dim + len(ishape):])

    def _periodic_constant(self, r: Ref, at, size: int):
        """``r`` as ``P * (at // P) + T[at % P]`` (an index expression with a small embedded table T), where r is
        computed from constants only, ``at`` is k or n, and its values over that whole range take that form
        with 0 <= T < P for a power of two P <= 64 (AutoAWQ's column reorder: P = 8). None otherwise.

        Folding the constant keeps the loads at plain index expressions, so a reordered packing reads as the
        format it is (AWQ's interleaved fields) and takes its packed layout."""
        if at not in (K, N) or at not in self.ranges:
            return None
        extent = self.ranges[at]
        known = self._known_leaves
        cone, stack = set(), [r.i]
        while stack:  # r may read constants, index expressions in ``at`` and arithmetic only
            i = stack.pop()
            if i in cone:
                continue
            cone.add(i)
            ins = self.instrs[i]
            args = ins.args[1:] if ins.op == "load" else ins.args
            if ins.op == "load" and ins.args[0] not in known:
                return None
            for a in args:
                if isinstance(a, Ref):
                    stack.append(a.i)
                elif isinstance(a, sympy.Basic) and not a.free_symbols <= {at}:
                    return None
        from fusekern.patterns.decode.program import evaluate

        leaves = [Leaf(v.dtype, tuple(v.shape), tuple(v.stride())) for v in (_val(n) for n in self.cone.leaves)]
        # (leaves the walk does not read are never loaded: a zero-strided stand-in, not a copy of their size)
        tensors = [known[i] if i in known else torch.zeros((), dtype=leaf.dtype).expand(leaf.shape)
                   for i, leaf in enumerate(leaves)]
        window = {"k": range(extent) if at == K else [0], "n": range(extent) if at == N else [0], "b": 0}
        try:
            values = evaluate(DecodeProgram(leaves, list(self.instrs), r.i, self.ranges[K], self.ranges[N]), tensors,
                              out=r.i, window=window).reshape(-1).to(torch.int64)
        except (IndexError, RuntimeError, ValueError):
            return None
        values = torch.where(values < 0, values + size, values)
        if bool(((values < 0) | (values >= size)).any()):
            return None  # eager raises there: keep the clamped gather
        pos = torch.arange(extent)
        for period in (2, 4, 8, 16, 32, 64):
            if extent % period:
                break
            table = values[:period]
            if bool((table < period).all()) and torch.equal(values, period * (pos // period) + table[pos % period]):
                if torch.equal(table, torch.arange(period)):
                    return at  # the identity order: nothing to carry
                leaf = self._embed(table.to(torch.int32))
                t = self.emit("load", (leaf, self.simplify(sympy.Mod(at, period))), torch.int32)
                sym = sympy.Symbol(f"g{t.i}", integer=True, nonnegative=True)
                self.gathered[sym] = t
                self.ranges[sym] = period
                return period * FloorDiv(at, period) + sym
        return None

    @functools.cached_property
    def _known_leaves(self) -> dict[int, torch.Tensor]:
        """Values of the cone's leaves that are constants of the graph (get_attr), by leaf index. Parameters that
        inductor's freezing made constants are left out: its FX graph cache keys them by metadata, so a program
        folded from their values could be loaded for a model whose values differ."""
        out = {}
        for i, n in enumerate(self.cone.leaves):
            v = graph_constant(n)
            if v is not None and v.numel() <= 1 << 16 and not getattr(v, "_is_frozen_param", False):
                out[i] = v.detach().cpu()
        return out

    def _embed(self, table: torch.Tensor) -> int:
        """A leaf index for ``table`` (a small constant the program carries: an extra leaf past the cone's)."""
        leaf = Leaf(table.dtype, tuple(table.shape), (1,), tuple(table.tolist()))
        if leaf not in self.extra_leaves:
            self.extra_leaves.append(leaf)
        return len(self.cone.leaves) + self.extra_leaves.index(leaf)

    def _leaf_read_at_k(self, r: Ref, rows: int) -> int | None:
        """The leaf whose element k ``r`` is, if a 1-D integer leaf of K entries read through casts that keep
        every row index below ``rows`` as it is (the check reads the leaf's own values: a narrowing cast,
        ``g.bool()`` or ``g.to(torch.uint8)`` with more rows, would make them another index)."""
        ins = self.instrs[r.i]
        while ins.op == "cast":
            if not is_int(ins.dtype) or ins.dtype == torch.bool or torch.iinfo(ins.dtype).max < rows - 1:
                return None
            ins = self.instrs[ins.args[0].i]
        if ins.op != "load" or tuple(ins.args[1:]) != (K,):
            return None
        v = _val(self.cone.leaves[ins.args[0]])
        if v is None or v.dtype == torch.bool or not is_int(v.dtype) or v.dim() != 1 or v.shape[0] != self.ranges[K]:
            return None
        return ins.args[0]

    # -- values ---------------------------------------------------------------------------------------
    def value(self, node, idx: tuple, dtype: torch.dtype | None = None) -> Ref:
        """Instruction computing ``node[idx]`` (a Python number: a constant of ``dtype``)."""
        if not isinstance(node, Node):
            if isinstance(node, (bool, int, float)):
                return self.emit("const", (node,), dtype or (torch.float32 if isinstance(node, float) else torch.int64))
            raise Unsupported(f"argument {node!r}")
        key = (node, idx)
        if key not in self.memo:
            self.memo[key] = self._value(node, idx)
        return self.memo[key]

    def _value(self, node: Node, idx: tuple) -> Ref:
        v = _val(node)
        if v is None:
            raise Unsupported(f"{node.name} has no tensor metadata")
        shape = _static_shape(v, node.name)
        if len(idx) != len(shape):
            raise AssertionError(f"{node.name}: index {idx} for shape {shape}")
        if node in self.leaf_id:
            return self.emit("load", (self.leaf_id[node], *(self.resolve(i, node) for i in idx)), v.dtype)
        t = node.target
        a = node.args
        if t in IDENTITY:
            return self.value(a[0], idx)
        if t in VIEWS:
            return self._view(node, t, shape, idx)
        if t == prims.convert_element_type.default:
            return self.cast(self.value(a[0], idx), a[1])
        if t == aten._to_copy.default:  # .to(dtype) in graphs traced without decompositions
            extra = set(node.kwargs) - {"dtype", "layout", "memory_format"}
            if extra or _val(a[0]).device != v.device:
                raise Unsupported(f"{node.name}: _to_copy with {sorted(extra) or 'a device change'}")
            return self.cast(self.value(a[0], idx), v.dtype)
        if t == aten.view.dtype:
            src = self.value(a[0], idx)
            if self.dtype(src).itemsize != v.dtype.itemsize:
                raise Unsupported(f"{node.name}: view as {v.dtype} changes the element size")
            return self.emit("bitcast", (src,), v.dtype)
        if t == prims.iota.default:
            start, step = node.kwargs.get("start", 0), node.kwargs.get("step", 1)
            i = self.resolve(start + step * idx[0], node)
            return self.cast(i, v.dtype) if isinstance(i, Ref) else self.emit("index", (i,), v.dtype)
        if t in (aten.full.default, aten.scalar_tensor.default):
            fill = a[1] if t == aten.full.default else a[0]
            return self.emit("const", (fill,), v.dtype)
        if t == aten.cat.default:
            return self._cat(node, shape, idx)
        if t == aten.index.Tensor:
            table = _lookup_table(node)
            if table is not None:
                code = self.value(node.args[1][0], idx)
                return self.emit("load", (self.leaf_id[table], code), v.dtype)
            return self._gather(node, idx)
        if t == aten.where.self:
            cond = self._operand(a[0], shape, idx, None)
            x = self._operand(a[1], shape, idx, v.dtype)
            y = self._operand(a[2], shape, idx, v.dtype)
            return self.emit("where", (cond, self.cast(x, v.dtype), self.cast(y, v.dtype)), v.dtype)
        if t == aten.pow.Scalar:  # base ** tensor: only 2 ** e
            if a[0] != 2:
                raise Unsupported(f"{node.name}: pow with base {a[0]} (only 2 ** e)")
            if not v.dtype.is_floating_point:  # integer powers (0 for e < 0) are not exp2
                raise Unsupported(f"{node.name}: an integer power 2 ** e ({v.dtype}; only floating ones)")
            e = self.cast(self._operand(a[1], shape, idx, v.dtype), v.dtype)
            return self.emit("exp2", (e,), v.dtype)
        if t == aten.ldexp.Tensor:  # x * 2 ** e
            x = self.cast(self._operand(a[0], shape, idx, v.dtype), v.dtype)
            e = self.cast(self._operand(a[1], shape, idx, v.dtype), v.dtype)
            return self.emit("mul", (x, self.emit("exp2", (e,), v.dtype)), v.dtype)
        if t == aten.pow.Tensor_Scalar:  # x ** 2
            if a[1] != 2:
                raise Unsupported(f"{node.name}: pow with exponent {a[1]} (only x ** 2)")
            x = self.cast(self._operand(a[0], shape, idx, v.dtype), v.dtype)
            return self.emit("mul", (x, x), v.dtype)
        if t in UNARY:
            x = self.cast(self._operand(a[0], shape, idx, v.dtype), v.dtype)
            return self.emit(UNARY[t], (x,), v.dtype)
        if t in BINARY:
            op = BINARY[t]
            if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
                raise Unsupported(f"{node.name}: {t} with alpha or rounding_mode")
            x = self._operand(a[0], shape, idx, v.dtype)
            y = self._operand(a[1], shape, idx, v.dtype)
            if op in CMP:
                common = torch.promote_types(self.dtype(x), self.dtype(y))
                return self.emit(op, (self.cast(x, common), self.cast(y, common)), v.dtype)
            return self.emit(op, (self.cast(x, v.dtype), self.cast(y, v.dtype)), v.dtype)
        raise Unsupported(f"{node.name}: {t}")

    def _operand(self, arg, out_shape: tuple[int, ...], idx: tuple, dtype) -> Ref:
        """An elementwise operand at the (broadcast) output index."""
        if not isinstance(arg, Node):
            if dtype is None or (isinstance(arg, float) and not dtype.is_floating_point):
                dtype = torch.float32 if isinstance(arg, float) else torch.int64
            return self.value(arg, (), dtype)
        shape = _static_shape(_val(arg), arg.name)
        lead = len(out_shape) - len(shape)
        sub = tuple(0 if s == 1 and out_shape[lead + j] != 1 else idx[lead + j] for j, s in enumerate(shape))
        return self.value(arg, sub)

    def _view(self, node: Node, t, shape: tuple[int, ...], idx: tuple) -> Ref:
        src = node.args[0]
        in_shape = _static_shape(_val(src), src.name)
        a = node.args
        if t in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
            if in_shape == shape:
                return self.value(src, idx)
            return self.value(src, tuple(_reshape_indexer(in_shape, shape)(list(idx))))
        if t in (aten.permute.default, aten.transpose.int, aten.t.default):
            if t == aten.permute.default:
                perm = [p % len(shape) for p in a[1]]
            else:
                d0, d1 = (0, 1) if t == aten.t.default else (a[1] % len(shape), a[2] % len(shape))
                perm = list(range(len(shape)))
                perm[d0], perm[d1] = perm[d1], perm[d0]
            src_idx = [None] * len(shape)
            for j, p in enumerate(perm):
                src_idx[p] = idx[j]
            return self.value(src, tuple(src_idx))
        if t == aten.unsqueeze.default:
            d = a[1] % len(shape)
            return self.value(src, idx[:d] + idx[d + 1:])
        if t in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims):
            out, j = [], 0
            for s in in_shape:
                if j < len(shape) and (s != 1 or (shape[j] == 1 and len(shape) - j == len(in_shape) - len(out))):
                    out.append(idx[j])
                    j += 1
                else:
                    out.append(0)
            if j != len(shape):
                raise Unsupported(f"{node.name}: cannot follow the squeeze")
            return self.value(src, tuple(out))
        if t == aten.expand.default:
            lead = len(shape) - len(in_shape)
            return self.value(src, tuple(0 if s == 1 and shape[lead + j] != 1 else idx[lead + j]
                                         for j, s in enumerate(in_shape)))
        if t == aten.slice.Tensor:
            dim = (a[1] if len(a) > 1 else 0) % len(shape)
            start = a[2] if len(a) > 2 and a[2] is not None else 0
            step = a[4] if len(a) > 4 else 1
            if not all(isinstance(x, int) for x in (start, step)):
                raise Unsupported(f"{node.name}: slice with symbolic bounds")
            if start < 0:
                start += in_shape[dim]
            start = max(0, min(start, in_shape[dim]))
            return self.value(src, idx[:dim] + (start + step * idx[dim],) + idx[dim + 1:])
        if t == aten.select.int:
            dim, i = a[1] % len(in_shape), a[2]
            if i < 0:
                i += in_shape[dim]
            return self.value(src, idx[:dim] + (i,) + idx[dim:])
        raise Unsupported(f"{node.name}: {t}")

    def _cat(self, node: Node, shape: tuple[int, ...], idx: tuple) -> Ref:
        parts = [p for p in node.args[0] if _static_shape(_val(p), p.name) != (0,)]
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape)
        dtype = _val(node).dtype
        offsets, off = [], 0
        for p in parts:
            offsets.append(off)
            off += _static_shape(_val(p), p.name)[dim]
        i = idx[dim]
        # Built from the last part backwards: select(i < off_last, <earlier parts>, last part).
        result = None
        for p, start in reversed(list(zip(parts, offsets))):
            local = self.simplify(i - start)
            r = self.cast(self.value(p, idx[:dim] + (local,) + idx[dim + 1:]), dtype)
            if result is None:
                result = r
                continue
            cond = sympy.Lt(self.simplify(i), start + _static_shape(_val(p), p.name)[dim])
            if not isinstance(cond, sympy.logic.boolalg.BooleanAtom) and cond.free_symbols & set(self.gathered):
                raise Unsupported(f"{node.name}: cat along a dimension indexed by gathered data")
            if cond is sympy.true or cond is sympy.false:
                result = r if cond is sympy.true else result
            else:
                result = self.emit("select", (cond, r, result), dtype)
        return result


def analyse(cone: Cone) -> DecodeProgram:
    """The cone as a decode program for ``W[(b,) k, n]`` (the matmul's weight operand)."""
    return _analyse(cone)[0]


def analyse_sorted(cone: Cone) -> tuple[DecodeProgram, dict[int, int]] | None:
    """The program the cone computes if every gather by a [K] index leaf read at k is ``k // G`` (GPTQ's g_idx
    without act-order), and {leaf: G} for those leaves; None when there is no such gather. Only valid for
    leaves whose values are checked to be ``arange(K) // G``."""
    prog, assumed = _analyse(cone, sorted_gathers=True)
    return (prog, assumed) if assumed else None


def _analyse(cone: Cone, sorted_gathers: bool = False) -> tuple[DecodeProgram, dict[int, int]]:
    rv = _val(cone.root)
    shape = _static_shape(rv, cone.root.name)
    if len(shape) not in (2, 3):
        raise Unsupported(f"weight operand of shape {shape}")
    for n in (*cone.nodes, *cone.leaves):
        v = _val(n)
        if v is None:
            raise Unsupported(f"{n.name} has no tensor metadata")
        if v.dtype not in (*INT_DTYPES, *FLOAT_DTYPES):
            raise Unsupported(f"{n.name} has dtype {v.dtype}")
        numel = functools.reduce(operator.mul, _static_shape(v, n.name), 1)
        if numel > INT32_MAX:
            raise Unsupported(f"{n.name} has {numel} elements: index math would overflow int32")
    leaves = []
    for n in cone.leaves:
        v = _val(n)
        extent = sum((s - 1) * st for s, st in zip(_static_shape(v, n.name), v.stride())) + 1
        if extent > INT32_MAX:
            raise Unsupported(f"{n.name} spans {extent} elements: offsets would overflow int32")
        if any(st < 0 for st in v.stride()):
            raise Unsupported(f"{n.name} has a negative stride")
        leaves.append(Leaf(v.dtype, _static_shape(v, n.name), tuple(int(s) for s in v.stride())))
    batch = shape[0] if len(shape) == 3 else 0
    Kdim, Ndim = shape[-2], shape[-1]
    ranges = {K: Kdim, N: Ndim, **({B: batch} if batch else {})}
    b = _Builder(cone, ranges, sorted_gathers)
    idx = (B, K, N) if batch else (K, N)
    out = b.value(cone.root, idx)
    for ins in b.instrs:  # gathered index symbols must all have become Refs (resolve / _cat see to it)
        for a in ins.args:
            if isinstance(a, sympy.Basic) and not a.free_symbols <= {B, K, N}:
                raise Unsupported(f"a {ins.op} at {a}: arithmetic on a gathered index")
    prog = DecodeProgram(leaves + b.extra_leaves, b.instrs, out.i, Kdim, Ndim, batch)
    return _prune(prog), b.sorted_leaves


def _prune(prog: DecodeProgram) -> DecodeProgram:
    """Drop instructions the output does not read, renumbering the rest."""
    live, stack = set(), [prog.out]
    while stack:
        i = stack.pop()
        if i in live:
            continue
        live.add(i)
        stack.extend(a.i for a in prog.instrs[i].args if isinstance(a, Ref))
    new_index = {old: new for new, old in enumerate(sorted(live))}

    def remap(a):
        return Ref(new_index[a.i]) if isinstance(a, Ref) else a

    instrs = [Instr(ins.op, tuple(remap(a) for a in ins.args), ins.dtype)
              for i, ins in enumerate(prog.instrs) if i in live]
    return DecodeProgram(prog.leaves, instrs, new_index[prog.out], prog.K, prog.N, prog.batch)
