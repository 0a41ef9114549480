"""Recognize known weight formats from a decode program (its math, not the graph's shape).

``recognize(prog)`` reads the program two ways:
- **structure**: the weight is a product of factors (through ``mul`` and casts); the factor that reads
  the packed codes is ``(q - zero)`` or ``q``, where ``q`` is a bit field of the codes or a table
  lookup; the other factors are scales (a float / fp8 load, or ``exp2(e8m0 - 127)``), one of them
  possibly a single global value;
- **probes**: it runs the program's own evaluator on small index windows to measure what the structure
  does not spell out: how many values share a code word and along which axis, which bits each
  position takes (sequential or AWQ's interleaved order), and how many weights share a scale.

So ``torch.stack`` vs ``cat``, shifts by a tensor vs by ints, and cast placement all give the same
``Format``. Part 2 (hand-tuned kernels) dispatches on it; ``generic`` formats use the generated kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusekern.patterns.decode.program import FP8_DTYPES, MAX_TABLE, DecodeProgram, Ref, is_int

# AWQ's packing: field j of a 32-bit word (the j-th of 8 consecutive columns) sits at bits [4 AWQ_ORDER[j], +4)
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Format:
    """What a decode program computes, in the terms quantization libraries use."""

    name: str                         # int8 | int4 | gptq | awq | hqq | fp8 | mxfp4 | nvfp4 | lut4 | generic
    bits: int | None = None           # bits per weight in the code leaf
    code_dtype: torch.dtype | None = None
    pack_axis: str | None = None      # "K" / "N": several values per code word along that axis
    pack_order: tuple[int, ...] | None = None  # field index of each position in the word
    scale: str | None = None          # tensor | channel | group | block | None
    group_k: int | None = None        # weights along K sharing one scale
    group_n: int | None = None
    scale_encoding: str | None = None  # float | fp8 | e8m0
    zero: str | None = None           # None | const | int | packed | float
    global_scale: bool = False
    roles: dict = field(default_factory=dict, compare=False)  # code / scale / zero / table / global -> leaf

    @property
    def symmetric(self) -> bool:
        return self.zero in (None, "const")

    def describe(self) -> str:
        if self.name == "generic":
            return "generic decode (no known format)"
        parts = [self.name]
        if self.bits:
            code = str(self.code_dtype).removeprefix("torch.")
            per_word = self.code_dtype.itemsize * 8 // self.bits
            if self.pack_axis in ("K", "N"):
                order = "" if self.pack_order in (None, tuple(range(per_word))) else f" in order {list(self.pack_order)}"
                parts.append(f"{self.bits}-bit, {per_word} per {code} along {self.pack_axis}{order}")
            elif self.pack_axis:
                parts.append(f"{self.bits}-bit, {per_word} per {code}")
            else:
                parts.append(f"{self.bits}-bit {code}")
        if self.scale:
            g = {"tensor": "per tensor", "channel": "per channel",
                 "group": f"groups of {self.group_k} along K", "block": f"{self.group_k}x{self.group_n} blocks"}[self.scale]
            parts.append(f"{self.scale_encoding} scales {g}" + (" + global scale" if self.global_scale else ""))
        parts.append("symmetric" if self.symmetric else f"{self.zero} zero points")
        return ", ".join(parts)


GENERIC = Format("generic")


class _NotRecognized(Exception):
    pass


def recognize(prog: DecodeProgram, leaf_values: dict | None = None) -> Format:
    """The format of ``prog`` (``GENERIC`` when it is not a known one).

    leaf_values: known values of constant leaves by index (lookup tables captured as constants), used
    to confirm an E2M1 table; without them a 16-entry table is taken at its word."""
    try:
        return _Recognizer(prog, {**prog.embedded_values(), **(leaf_values or {})}).run()
    except _NotRecognized:
        return GENERIC


class _Recognizer:
    def __init__(self, prog: DecodeProgram, leaf_values: dict):
        self.p = prog
        self.values = leaf_values
        self.ins = prog.instrs
        self.tables = {a.args[0] for a in self.ins if a.op == "load" and any(isinstance(x, Ref) for x in a.args[1:])}
        # Only small 1-D tables indexed by codes (E2M1 values, AWQ shifts) are part of a known format. Rows
        # gathered by data (GPTQ act-order's ``scales[g_idx]``) are not: the hand-tuned kernels read a group's
        # scale at k // G, so such programs stay generic whatever the index's values look like in a probe.
        for i in self.tables:
            leaf = prog.leaves[i]
            if len(leaf.shape) != 1 or leaf.numel > MAX_TABLE:
                raise _NotRecognized

    # -- program helpers -----------------------------------------------------------------------------
    def strip(self, i: int) -> int:
        while self.ins[i].op == "cast":
            i = self.ins[i].args[0].i
        return i

    def deps(self, i: int) -> set[int]:
        """Leaves instruction i reads."""
        out, stack, seen = set(), [i], set()
        while stack:
            j = stack.pop()
            if j in seen:
                continue
            seen.add(j)
            ins = self.ins[j]
            if ins.op == "load":
                out.add(ins.args[0])
            stack.extend(a.i for a in ins.args if isinstance(a, Ref))
        return out

    def data_deps(self, i: int) -> set[int]:
        """Leaves instruction i reads, other than constants captured in the graph (shift tables...)."""
        return self.deps(i) - set(self.values)

    def factors(self, i: int) -> list[int]:
        i = self.strip(i)
        if self.ins[i].op == "mul":
            a, b = self.ins[i].args
            return self.factors(a.i) + self.factors(b.i)
        return [i]

    def window(self, k, n) -> dict:
        return {"k": list(k), "n": list(n), "b": 0}

    def leaves_like(self, fill: dict) -> list[torch.Tensor]:
        """Synthetic leaves: what ``fill`` gives by leaf index, else known constants, else ones (floats)
        and zeros (ints)."""
        out = []
        for i, leaf in enumerate(self.p.leaves):
            if i in fill:
                out.append(fill[i])
            elif i in self.values:
                out.append(self.values[i])
            elif leaf.dtype.is_floating_point:
                out.append(torch.ones(leaf.shape, dtype=leaf.dtype))
            else:
                out.append(torch.zeros(leaf.shape, dtype=leaf.dtype))
        return out

    def marked(self, leaf: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(neutral, marked) values for ``leaf``: equal except at element [0, ..., 0]."""
        ld = self.p.leaves[leaf]
        if ld.dtype.is_floating_point:
            base = torch.ones(ld.shape, dtype=torch.float32)
            mark = base.clone()
            mark[(0,) * len(ld.shape)] = 2.0
        else:
            base = torch.zeros(ld.shape, dtype=torch.int64)
            mark = base.clone()
            mark[(0,) * len(ld.shape)] = 255 if ld.dtype == torch.uint8 else -1
        return base.to(ld.dtype), mark.to(ld.dtype)

    def extent(self, leaf: int, instr: int, axis: str) -> int:
        """How many consecutive weights along ``axis`` from the origin read element [0, ..., 0] of ``leaf``
        (measured: mark that element and see which values of instruction ``instr`` change)."""
        size = self.p.K if axis == "K" else self.p.N
        win = self.window(range(size), [0]) if axis == "K" else self.window([0], range(size))
        base, mark = self.marked(leaf)
        v0 = self.p.evaluate_at(self.leaves_like({leaf: base}), instr, win).reshape(-1)
        v1 = self.p.evaluate_at(self.leaves_like({leaf: mark}), instr, win).reshape(-1)
        changed = (v0 != v1) & ~(v0.isnan() & v1.isnan()) if v0.is_floating_point() else v0 != v1
        if not bool(changed[0]):
            raise _NotRecognized
        rest = (~changed).nonzero()
        run = size if rest.numel() == 0 else int(rest[0])
        if bool(changed[run:].any()):  # the leaf's first element feeds weights that are not adjacent
            raise _NotRecognized
        return run

    # -- recognition ---------------------------------------------------------------------------------
    def run(self) -> Format:
        p = self.p
        if p.batch:
            raise _NotRecognized
        candidates = [i for i, l in enumerate(p.leaves)
                      if i not in self.tables and (is_int(l.dtype) or l.dtype in FP8_DTYPES) and l.dtype != torch.bool]
        if not candidates:
            raise _NotRecognized
        code = max(candidates, key=lambda i: p.leaves[i].numel * p.leaves[i].dtype.itemsize)
        cl = p.leaves[code]
        word_bits = cl.dtype.itemsize * 8
        total_bits = word_bits * cl.numel
        if total_bits % (p.K * p.N):
            raise _NotRecognized
        bits = total_bits // (p.K * p.N)
        if bits not in (2, 3, 4, 8) or (cl.dtype in FP8_DTYPES and bits != 8):
            raise _NotRecognized
        roles = {"code": code}

        # Factors: exactly one reads the codes; the others are scales.
        factors = self.factors(p.out)
        q_factors = [f for f in factors if code in self.deps(f)]
        if len(q_factors) != 1:
            raise _NotRecognized
        scale_info = self.scales([f for f in factors if f not in q_factors], roles)
        q, zero = self.split_zero(q_factors[0], code, roles)
        pack_axis, order, table = self.packing(q, code, bits, word_bits, roles)

        name = self.name(cl.dtype, bits, pack_axis, order, table, zero, scale_info)
        return Format(
            name=name, bits=bits, code_dtype=cl.dtype, pack_axis=pack_axis, pack_order=order,
            scale=scale_info[0], group_k=scale_info[1], group_n=scale_info[2], scale_encoding=scale_info[3],
            zero=zero, global_scale=scale_info[4], roles=roles)

    def scales(self, factors: list[int], roles: dict):
        """(kind, group_k, group_n, encoding, has_global) of the scale factors."""
        main, has_global = None, False
        for f in factors:
            ins = self.ins[f]
            if ins.op == "const":
                continue
            leaves = self.data_deps(f)
            if len(leaves) != 1:
                raise _NotRecognized
            (leaf,) = leaves
            ld = self.p.leaves[leaf]
            if ld.numel == 1:
                if has_global:
                    raise _NotRecognized
                has_global = True
                roles["global"] = leaf
                continue
            if ins.op == "exp2":
                encoding = "e8m0" if ld.dtype in (torch.uint8,) or "e8m0" in str(ld.dtype) else None
            elif ins.op == "load":
                encoding = "fp8" if ld.dtype in FP8_DTYPES else ("float" if ld.dtype.is_floating_point else None)
            else:
                encoding = None
            if encoding is None or main is not None:
                raise _NotRecognized
            roles["scale"] = leaf
            gk, gn = self.extent(leaf, f, "K"), self.extent(leaf, f, "N")
            if gk >= self.p.K and gn >= self.p.N:
                kind = "tensor"
            elif gk >= self.p.K and gn == 1:
                kind = "channel"
            elif gn == 1:
                kind = "group"
            else:
                kind = "block"
            main = (kind, gk, gn, encoding)
        if main is None and has_global:  # one value for the whole weight: a per-tensor scale
            leaf = roles.pop("global")
            roles["scale"] = leaf
            enc = "fp8" if self.p.leaves[leaf].dtype in FP8_DTYPES else "float"
            return ("tensor", self.p.K, self.p.N, enc, False)
        if main is None:
            main = (None, None, None, None)
        return (*main, has_global)

    def split_zero(self, q: int, code: int, roles: dict) -> tuple[int, str | None]:
        """(the code-reading value, zero-point kind) of ``q - zero`` / ``q + c`` / ``q``."""
        q = self.strip(q)
        ins = self.ins[q]
        if ins.op not in ("sub", "add"):
            return q, None
        a, b = (x.i for x in ins.args)
        if code in self.deps(b) and ins.op == "add":
            a, b = b, a
        if code not in self.deps(a) or code in self.deps(b):
            raise _NotRecognized
        zb = self.strip(b)
        if self.ins[zb].op == "const":
            return a, "const"
        zl = self.data_deps(zb)
        if len(zl) != 1:
            raise _NotRecognized
        (zleaf,) = zl
        roles["zero"] = zleaf
        zd = self.p.leaves[zleaf].dtype
        if zd.is_floating_point:
            return a, "float"
        packed = any(self.ins[j].op in ("shr", "and") for j in self._tree(zb))
        return a, "packed" if packed else "int"

    def _tree(self, i: int) -> set[int]:
        out, stack = set(), [i]
        while stack:
            j = stack.pop()
            if j not in out:
                out.add(j)
                stack.extend(a.i for a in self.ins[j].args if isinstance(a, Ref))
        return out

    def packing(self, q: int, code: int, bits: int, word_bits: int, roles: dict):
        """(pack axis, field order, table leaf) of the code-reading value ``q``."""
        q = self.strip(q)
        tables = self.deps(q) & self.tables
        if len(tables) > 1:
            raise _NotRecognized
        table = next(iter(tables), None)
        fill = {}
        if table is not None:
            roles["table"] = table
            # Probe through an identity table: the looked-up value is then the integer field itself.
            fill[table] = torch.arange(self.p.leaves[table].numel).to(self.p.leaves[table].dtype)
        if word_bits == bits:
            return None, None, table
        per_word = word_bits // bits
        try:
            gk, gn = self.extent(code, q, "K"), self.extent(code, q, "N")
        except _NotRecognized:
            return "other", None, table
        if gk == per_word and gn == 1:
            axis, win = "K", self.window(range(per_word), [0])
        elif gn == per_word and gk == 1:
            axis, win = "N", self.window([0], range(per_word))
        else:
            return "other", None, table
        # Which bits does each position take? Set one bit in every code word and see who reads it.
        cl = self.p.leaves[code]
        base = self.p.evaluate_at(self.leaves_like(dict(fill)), q, win).reshape(-1)
        first = [None] * per_word
        for bit in range(word_bits):
            word = torch.full(cl.shape, (1 << bit) - (1 << word_bits if bit == word_bits - 1 and cl.dtype != torch.uint8 else 0),
                              dtype=torch.int64)
            v = self.p.evaluate_at(self.leaves_like({**fill, code: word.to(cl.dtype)}), q, win).reshape(-1)
            for pos in range(per_word):
                if v[pos] != base[pos] and first[pos] is None:
                    first[pos] = bit
        if any(f is None or f % bits for f in first):
            return axis, None, table
        order = tuple(f // bits for f in first)
        if sorted(order) != list(range(per_word)):
            return axis, None, table
        return axis, order, table

    def name(self, code_dtype, bits, axis, order, table, zero, scale_info) -> str:
        kind, gk, gn, enc, has_global = scale_info
        if table is not None:
            if bits != 4 or self.p.leaves[table].numel != 16:
                return "lut"
            known = self.values.get(table)
            if known is not None and tuple(float(v) for v in known.float().tolist()) != E2M1_VALUES:
                return "lut4"
            if enc == "e8m0" and gk == 32 and gn == 1 and not has_global:
                return "mxfp4"
            if enc == "fp8" and gk == 16 and gn == 1:
                return "nvfp4"
            return "fp4_e2m1"
        if code_dtype in FP8_DTYPES:
            return "fp8"
        if zero == "float":
            return "hqq"
        if bits == 4 and code_dtype == torch.int32 and axis == "K" and zero in ("packed", None, "const"):
            return "gptq"
        if bits == 4 and code_dtype == torch.int32 and axis == "N" and order not in (None, tuple(range(8))):
            return "awq"
        return f"int{bits}"
