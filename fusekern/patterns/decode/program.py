"""A decode program: how one element of a dequantized weight is computed from packed leaves.

The structural matcher (``analysis.py``) turns the user's decode code into this straight-line
program for one weight element ``W[b, k, n]`` (``b`` only for batched matmuls). Instructions are
scalar operations; addresses are sympy expressions in the index symbols ``b, k, n``. One program
drives three things, so they cannot disagree:

- ``evaluate`` (torch, every element at once): the CPU path and the reference for tests;
- the Triton code generator (``fusekern.kernels.decode_mm``): the weight-load stage of the GEMMs;
- format recognition (``formats.py``).

Value semantics are the generated kernel's, written down once here:
- integers live in an int32 container (int64 for int64 values); after each operation the result is
  wrapped to its dtype (uint8 ``& 255``, int8 sign-extended...), so integer results equal torch's;
- floats live in fp32 (fp64 for fp64 values) and are rounded only at explicit casts, as inductor
  does (eager rounds bf16/fp16 after every op: results agree within the dtype's tolerance).

The program serializes to a JSON string (``to_text`` / ``from_text``): that string is the custom op's
argument, so a graph loaded from inductor's FX cache carries its own decode.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

FORMAT_VERSION = 1

# Index symbols: batch, reduction (K) and output column (N) of the matmul's weight operand.
B, K, N = sympy.symbols("b k n", integer=True, nonnegative=True)
SYMBOLS = {"b": B, "k": K, "n": N}

UNARY = ("neg", "exp2", "abs", "not", "cast", "bitcast")
BINARY = ("add", "sub", "mul", "div", "and", "or", "xor", "shl", "shr", "eq", "ne", "lt", "le", "gt", "ge",
          "max", "min")
CMP = ("eq", "ne", "lt", "le", "gt", "ge")
OPS = ("load", "index", "const", "where", "select", *UNARY, *BINARY)

# Entries of a lookup table indexed by codes (E2M1 values, shift tables): such tables may travel inside the
# program and count as part of a format; larger gathered tensors (GPTQ act-order's scales) do neither.
MAX_TABLE = 256

INT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, *FP8_DTYPES)


@dataclass(frozen=True)
class Ref:
    """The value of instruction ``i``."""

    i: int


Arg = Union[Ref, int, float, bool, sympy.Expr]


@dataclass(frozen=True)
class Instr:
    """``op(*args)`` with result dtype ``dtype``.

    load: args = (leaf, *index) with one index per leaf dim, each a sympy expression in b/k/n or a Ref
          (a data-dependent index: a small-table lookup).
    index: args = (expr,): the value of an index expression (``torch.arange`` in the user's code).
    const: args = (value,).
    select: args = (condition, a, b): ``a`` where the sympy condition on b/k/n holds (from cat).
    where: args = (cond, a, b) with cond a Ref (data-dependent).
    """

    op: str
    args: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class Leaf:
    """A tensor the decode reads: packed codes, scales, zeros, tables.

    values: the contents of a small graph constant (a lookup or shift table the user's code builds with
    ``torch.tensor(...)``), carried in the program so the op owns the tensor (``constant_tensor``) and the
    graph does not pass it: inductor hands such a constant over as a fresh copy on every call, which
    defeats the per-leaf-set caches of the op (each call took the slow path: 200-600 µs on the H200's
    host for MXFP4). None for every tensor the op takes as an argument."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    values: tuple | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class DecodeProgram:
    """``W[b, k, n] = instrs[out]`` for ``b < batch, k < K, n < N`` (batch is 0 for a 2-D weight)."""

    leaves: list[Leaf]
    instrs: list[Instr]
    out: int
    K: int
    N: int
    batch: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.instrs[self.out].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.batch, self.K, self.N) if self.batch else (self.K, self.N)

    def uses(self) -> list[list[int]]:
        """For each instruction, the instructions that read it."""
        users: list[list[int]] = [[] for _ in self.instrs]
        for i, ins in enumerate(self.instrs):
            for a in ins.args:
                if isinstance(a, Ref):
                    users[a.i].append(i)
        return users

    # -- leaves the op takes, and constants it owns -------------------------------------------------
    @property
    def inputs(self) -> list[int]:
        """Indices of the leaves passed to the op (all but the embedded constants)."""
        return [i for i, l in enumerate(self.leaves) if l.values is None]

    def read_leaves(self) -> set[int]:
        """Indices of the leaves some instruction loads (pruning can leave a leaf unread)."""
        return {ins.args[0] for ins in self.instrs if ins.op == "load"}

    def lookups(self) -> set[int]:
        """Leaves read at an index computed from data (lookup tables: E2M1 values indexed by the codes)."""
        return {ins.args[0] for ins in self.instrs
                if ins.op == "load" and any(isinstance(a, Ref) for a in ins.args[1:])}

    def embedded_values(self) -> dict[int, torch.Tensor]:
        """The values of the leaves the program carries (``Leaf.values``), as CPU tensors by leaf index."""
        return {i: torch.tensor(leaf.values, dtype=torch.float64 if leaf.dtype.is_floating_point else torch.int64)
                .to(leaf.dtype).reshape(leaf.shape) for i, leaf in enumerate(self.leaves) if leaf.values is not None}

    def row_gathers(self) -> set[int]:
        """Leaves of more than one dim read at a data-dependent index (``scales[g_idx]``, ``w[:, order]``): rows
        or columns gathered by data, not a lookup table."""
        return {i for i in self.lookups() if sum(s != 1 for s in self.leaves[i].shape) > 1}

    def with_constants(self, constants: dict) -> "DecodeProgram":
        """This program with the leaves in ``constants`` (index -> a small contiguous CPU tensor of the
        leaf's dtype and shape) embedded by value."""
        leaves = list(self.leaves)
        for i, t in constants.items():
            leaf = leaves[i]
            if t.dtype != leaf.dtype or tuple(t.shape) != leaf.shape or not t.is_contiguous():
                raise ValueError(f"constant {i} is {t.dtype}{list(t.shape)}, the leaf {leaf}")
            leaves[i] = Leaf(leaf.dtype, leaf.shape, leaf.stride, tuple(t.reshape(-1).tolist()))
        return DecodeProgram(leaves, self.instrs, self.out, self.K, self.N, self.batch, dict(self.meta))

    def taken(self, count: int) -> list[int]:
        """Indices of the leaves that ``count`` tensors given to the op stand for: all leaves, or only
        ``inputs`` (the program holds the rest); any other count is a clear error."""
        if count == len(self.leaves):
            return list(range(count))
        inputs = self.inputs
        if count != len(inputs):
            raise ValueError(f"decode program reads {len(inputs)} leaves (and {len(self.leaves) - len(inputs)} "
                             f"constants it holds), got {count}")
        return inputs

    def bind(self, tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """Every leaf's tensor: ``tensors`` are either all leaves or only ``inputs`` (the embedded constants
        then come from ``constant_tensor``, one tensor per value set and device, kept for the process)."""
        taken = self.taken(len(tensors))
        if len(taken) == len(self.leaves):
            return list(tensors)
        out = [None] * len(self.leaves)
        for i, t in zip(taken, tensors):
            out[i] = t
        for i, leaf in enumerate(self.leaves):
            if leaf.values is not None:
                out[i] = constant_tensor(leaf, device)
        return out

    # -- text form (the op's argument) ---------------------------------------------------------------
    def to_text(self) -> str:
        doc = {
            "v": FORMAT_VERSION,
            "shape": [self.batch, self.K, self.N],
            "leaves": [[_dtype_name(l.dtype), list(l.shape), list(l.stride)]
                       + ([list(l.values)] if l.values is not None else []) for l in self.leaves],
            "instrs": [[ins.op, _dtype_name(ins.dtype), [_enc(a) for a in ins.args]] for ins in self.instrs],
            "out": self.out,
        }
        return json.dumps(doc, separators=(",", ":"))

    @staticmethod
    def from_text(text: str) -> "DecodeProgram":
        return _parse(text)

    def __str__(self) -> str:
        lines = [f"decode W[{'b, ' if self.batch else ''}k, n] of shape {list(self.shape)} -> %{self.out}"]
        for i, l in enumerate(self.leaves):
            lines.append(f"  L{i}: {_dtype_name(l.dtype)}{list(l.shape)} stride {list(l.stride)}")
        for i, ins in enumerate(self.instrs):
            args = ", ".join(f"%{a.i}" if isinstance(a, Ref) else str(a) for a in ins.args)
            lines.append(f"  %{i} = {ins.op}.{_dtype_name(ins.dtype)}({args})")
        return "\n".join(lines)

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self, leaves: Sequence[torch.Tensor], *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole decoded weight, computed with the kernel's semantics (see the module doc). ``leaves``: every
        leaf, or only ``inputs`` (the constants the program carries are added, as ``bind`` does)."""
        if len(leaves) != len(self.leaves) and len(leaves):
            leaves = self.bind(leaves, leaves[0].device)
        return evaluate(self, leaves, out_dtype=out_dtype)

    def evaluate_at(self, leaves: Sequence[torch.Tensor], out: int, window: dict) -> torch.Tensor:
        """Instruction ``out``'s values (in its container) on a window of indices, e.g.
        ``{"k": range(16), "n": [0], "b": 0}``: what format recognition probes."""
        return evaluate(self, leaves, out=out, window=window)


# ----------------------------------------------------------------------------- dtypes

def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return d


def is_int(d: torch.dtype) -> bool:
    return d in INT_DTYPES


def container(d: torch.dtype) -> torch.dtype:
    """The dtype a value of dtype ``d`` is held in while decoding."""
    if d in (torch.int64,):
        return torch.int64
    if is_int(d):
        return torch.int32
    if d == torch.float64:
        return torch.float64
    return torch.float32


# ----------------------------------------------------------------------------- (de)serialization

def _enc(a: Any):
    if isinstance(a, Ref):
        return {"t": a.i}
    if isinstance(a, bool):
        return {"b": a}
    if isinstance(a, int):
        return a
    if isinstance(a, float):
        return {"f": repr(a)}
    if isinstance(a, (sympy.Basic,)):
        return {"e": sympy.srepr(a)}
    raise TypeError(f"cannot encode {a!r}")


@functools.cache
def _sympy_locals() -> dict:
    return {"FloorDiv": FloorDiv, "ModularIndexing": ModularIndexing, **SYMBOLS,
            "Symbol": lambda name, **kw: SYMBOLS[name]}


def _dec(a: Any):
    if isinstance(a, int):
        return a
    if "t" in a:
        return Ref(a["t"])
    if "b" in a:
        return bool(a["b"])
    if "f" in a:
        return float(a["f"])
    return sympy.sympify(a["e"], locals=_sympy_locals())


@functools.lru_cache(maxsize=1024)
def _parse(text: str) -> DecodeProgram:
    try:
        doc = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a decode program's text ({type(e).__name__}: {e}): pass DecodeProgram.to_text()'s "
                         "output") from None
    if not isinstance(doc, dict):
        raise ValueError("not a decode program's text: pass DecodeProgram.to_text()'s output")
    if doc.get("v") != FORMAT_VERSION:
        raise ValueError(f"decode program version {doc.get('v')!r}, expected {FORMAT_VERSION}")
    batch, k, n = doc["shape"]
    leaves = [Leaf(dtype_of(d), tuple(s), tuple(st), tuple(rest[0]) if rest else None)
              for d, s, st, *rest in doc["leaves"]]
    instrs = [Instr(op, tuple(_dec(a) for a in args), dtype_of(d)) for op, d, args in doc["instrs"]]
    for ins in instrs:
        if ins.op not in OPS:
            raise ValueError(f"unknown decode op {ins.op!r}")
    return DecodeProgram(leaves, instrs, doc["out"], k, n, batch)


_CONSTANTS: dict = {}  # (dtype, shape, exact values, device) -> the tensor: a few tables per process


def _exact(values: tuple) -> tuple:
    """``values`` as a key that tells -0.0 from 0.0 and matches NaN with NaN (float equality does neither)."""
    return tuple(v.hex() if isinstance(v, float) else v for v in values)


def constant_tensor(leaf: Leaf, device) -> torch.Tensor:
    """The embedded constant ``leaf`` as a tensor on ``device``: the same tensor object on every call.

    Made on first use, which copies from the host, outside any CUDA graph memory pool (``lasting``): a
    program's first call must not be inside a CUDA graph capture (inductor's CUDA graphs warm up first, and
    the op's other per-shape work needs that too)."""
    from fusekern.kernels.lasting import lasting

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (leaf.dtype, leaf.shape, _exact(leaf.values), device)
    t = _CONSTANTS.get(key)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode program constants are made on a call before CUDA graph capture; "
                               "run the compiled function once before capturing it")
        host = torch.tensor(leaf.values, dtype=torch.float64 if leaf.dtype.is_floating_point else torch.int64)
        host = host.to(leaf.dtype).reshape(leaf.shape)
        t = _CONSTANTS[key] = lasting(lambda: host.to(device), device)
    return t


# ----------------------------------------------------------------------------- index expressions

def eval_index(expr: sympy.Basic, env: dict) -> Any:
    """Evaluate an index expression (or condition) on torch tensors / ints bound to b, k, n."""
    if isinstance(expr, sympy.Symbol):
        return env[expr.name]
    if isinstance(expr, (sympy.Integer, int)):
        return int(expr)
    if expr is sympy.true:
        return True
    if expr is sympy.false:
        return False
    args = [eval_index(a, env) for a in expr.args]
    if isinstance(expr, sympy.Add):
        return functools.reduce(lambda x, y: x + y, args)
    if isinstance(expr, sympy.Mul):
        return functools.reduce(lambda x, y: x * y, args)
    if isinstance(expr, FloorDiv):
        return args[0] // args[1]
    if isinstance(expr, ModularIndexing):
        return (args[0] // args[1]) % args[2]
    if isinstance(expr, sympy.Mod):
        return args[0] % args[1]
    if isinstance(expr, sympy.StrictLessThan):
        return args[0] < args[1]
    if isinstance(expr, sympy.LessThan):
        return args[0] <= args[1]
    if isinstance(expr, sympy.StrictGreaterThan):
        return args[0] > args[1]
    if isinstance(expr, sympy.GreaterThan):
        return args[0] >= args[1]
    if isinstance(expr, sympy.And):
        return functools.reduce(lambda x, y: x & y, args)
    raise NotImplementedError(f"index expression {expr} ({type(expr).__name__})")


# ----------------------------------------------------------------------------- the torch evaluator

def wrap_int(v: torch.Tensor, d: torch.dtype) -> torch.Tensor:
    """An integer result in its container, wrapped to dtype ``d`` as torch's ``d`` arithmetic wraps."""
    if d == torch.bool:
        return (v != 0).to(v.dtype)
    bits = {torch.uint8: 8, torch.int8: 8, torch.int16: 16}.get(d)
    if bits is None:
        return v
    if d == torch.uint8:
        return v & 255
    shift = 32 - bits
    return (v << shift) >> shift


def round_to(v: torch.Tensor, d: torch.dtype) -> torch.Tensor:
    """Convert a container value to dtype ``d`` and back: the rounding of an explicit cast."""
    c = container(d)
    if is_int(d):
        if v.is_floating_point() and d == torch.bool:  # torch: x != 0 (0.5 is True), not a truncation
            return (v != 0).to(c)
        if v.is_floating_point():
            v = v.trunc()
            return wrap_int(v.to(torch.int64).to(c), d)  # through a wider integer, then wrapped
        return wrap_int(v.to(c), d)
    if v.dtype == torch.bool:
        v = v.to(torch.int32)
    if d in (torch.float32, torch.float64):
        return v.to(d)
    return v.to(d).to(c)


def bitcast(v: torch.Tensor, src: torch.dtype, dst: torch.dtype) -> torch.Tensor:
    """Reinterpret a same-size value's bits (uint8 <-> fp8, int16 <-> bf16/fp16, int32 <-> fp32)."""
    if src.itemsize != dst.itemsize:
        raise ValueError(f"bitcast {src} -> {dst} changes the size")
    raw = v.to(src) if v.dtype != src else v
    out = raw.view(dst)
    return out.to(container(dst)) if dst not in (torch.int32, torch.int64, torch.float32, torch.float64) else out


def evaluate(prog: DecodeProgram, leaves: Sequence[torch.Tensor], *, out_dtype: torch.dtype | None = None,
             out: int | None = None, window: dict | None = None) -> torch.Tensor:
    if len(leaves) != len(prog.leaves):
        raise ValueError(f"decode program reads {len(prog.leaves)} leaves, got {len(leaves)}")
    device = leaves[0].device
    if window is None:
        names = ("b", "k", "n") if prog.batch else ("k", "n")
        ranges = [torch.arange(s, device=device) for s in prog.shape]
    else:
        names = ("k", "n")
        ranges = [torch.as_tensor(list(window[x]), device=device, dtype=torch.int64) for x in names]
    grids = torch.meshgrid(*ranges, indexing="ij")
    shape = grids[0].shape
    env = dict(zip(names, grids))
    env.setdefault("b", (window or {}).get("b", 0))
    vals: list[torch.Tensor] = []
    last = prog.out if out is None else out
    for ins in prog.instrs[: last + 1]:
        vals.append(_eval_instr(ins, prog.instrs, vals, leaves, env, device))
    result = torch.broadcast_to(vals[last], shape)
    if out is not None:
        return result
    return round_to(result, prog.dtype).to(out_dtype or prog.dtype)


def _as_tensor(x, device, dtype=None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x, device=device, dtype=dtype)


def _eval_instr(ins: Instr, instrs, vals, leaves, env, device) -> torch.Tensor:
    op, d = ins.op, ins.dtype
    c = container(d)

    def arg(a):
        if isinstance(a, Ref):
            return vals[a.i]
        if isinstance(a, sympy.Basic):
            return _as_tensor(eval_index(a, env), device)
        return a

    if op == "load":
        leaf = leaves[ins.args[0]]
        idx = []
        for dim, a in enumerate(ins.args[1:]):
            i = _as_tensor(arg(a), device).to(torch.int64)
            if isinstance(a, Ref):
                i = torch.where(i < 0, i + leaf.shape[dim], i)  # a table lookup with a negative code
            # Clamped, as the kernel does: a cat part's index is out of range where the part is not selected.
            idx.append(i.clamp(0, leaf.shape[dim] - 1))
        v = leaf[tuple(idx)] if idx else leaf.reshape(())
        return round_to(v.to(container(leaf.dtype)) if v.dtype not in FP8_DTYPES else v.float(), d) \
            if v.dtype != torch.bool else v.to(torch.int32)
    if op == "index":
        return _as_tensor(arg(ins.args[0]), device).to(c)
    if op == "const":
        return torch.tensor(ins.args[0], device=device).to(c)
    if op == "select":
        cond = _as_tensor(eval_index(ins.args[0], env), device)
        return torch.where(cond, arg(ins.args[1]).to(c), arg(ins.args[2]).to(c))
    if op == "where":
        cond, a, b = (arg(x) for x in ins.args)
        return torch.where(cond != 0, a.to(c), b.to(c))
    if op == "cast":
        return round_to(arg(ins.args[0]), d)
    if op == "bitcast":
        return bitcast(arg(ins.args[0]), instrs[ins.args[0].i].dtype, d)
    xs = [arg(a) for a in ins.args]
    if op in UNARY:
        (x,) = xs
        if op == "neg":
            r = -x
        elif op == "abs":
            r = x.abs()
        elif op == "not":
            r = ~x if is_int(d) and d != torch.bool else (x == 0)
        elif op == "exp2":
            r = torch.exp2(x.to(c))
        return wrap_int(r.to(c), d) if is_int(d) else r.to(c)
    x, y = xs
    if op in CMP:
        r = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}[op](x, y)
        return r.to(torch.int32)
    x, y = _as_tensor(x, device).to(c), _as_tensor(y, device).to(c)
    if op == "add":
        r = x + y
    elif op == "sub":
        r = x - y
    elif op == "mul":
        r = x * y
    elif op == "div":
        r = x / y
    elif op == "and":
        r = x & y
    elif op == "or":
        r = x | y
    elif op == "xor":
        r = x ^ y
    elif op == "shl":
        r = x << y
    elif op == "shr":
        r = x >> y
    elif op == "max":
        r = torch.maximum(x, y)
    elif op == "min":
        r = torch.minimum(x, y)
    else:
        raise NotImplementedError(op)
    return wrap_int(r, d) if is_int(d) else r
