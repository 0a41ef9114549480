"""From a recognized format to the hand-tuned kernels' packed layout, proven on the program itself.

``formats.recognize`` says *what* a decode is (GPTQ, NVFP4, ...). The hand-tuned kernels
(``fusekern.kernels.packed_mm``) need *where* everything lives: which leaf dim runs along n and which
along k, the field order inside a word, the zero point's encoding. ``derive_layout`` proposes every
layout the format allows (a square leaf can be read either way round) and keeps the first one that
computes the same weight as the program on random leaf values (``verify``): the program stays the
single source of truth, and a layout that does not reproduce it is never used.

The layout computes ``W[k, n] = (value(code field) - zero) * scale * global`` in fp32; the program may
round at its casts (bf16 after each op, say), so equality is checked within two roundings of the
weight's dtype.
"""
from __future__ import annotations

import functools
import itertools
import json
from dataclasses import asdict, dataclass

import torch

from fusekern.patterns.decode.formats import GENERIC, Format
from fusekern.patterns.decode.program import FP8_DTYPES, DecodeProgram

LAYOUT_VERSION = 1


@dataclass(frozen=True)
class PackedLayout:
    """Where the packed kernels find each piece of a known format (leaf dims labelled "n", "k", "1")."""

    code: int                  # leaf index of the code words
    code_dims: tuple           # label per code leaf dim; the "k" (or "n") dim counts words when packed
    bits: int                  # bits per value
    per_word: int              # values per code word (1: unpacked)
    pack_axis: str             # "K" | "N" | "" (unpacked)
    order: tuple               # field index of each position in the word
    value: str                 # uint | int (signed 8-bit) | fp8 | e2m1
    scale: int = -1            # leaf index, -1: none
    scale_dims: tuple = ()
    scale_enc: str = ""        # float | fp8 | e8m0
    group_k: int = 1           # weights along K (and N) sharing one scale
    group_n: int = 1
    zero: str = ""             # "" | const | int | packed | float
    zero_leaf: int = -1
    zero_dims: tuple = ()
    zero_per_word: int = 1     # zero points per word along N (packed)
    zero_order: tuple = ()
    zero_value: float = 0.0    # the constant zero (const), or a constant added to a loaded zero
    glob: int = -1             # leaf index of a one-element global scale, -1: none

    def to_text(self) -> str:
        return json.dumps({"v": LAYOUT_VERSION, **asdict(self)}, separators=(",", ":"))

    @staticmethod
    def from_text(text: str) -> "PackedLayout | None":
        return _parse_layout(text)

    # -- the reference: what the kernels compute, in float64 ------------------------------------------
    def weight_at(self, leaves, ks: torch.Tensor, ns: torch.Tensor) -> torch.Tensor:
        """``W[ks[:, None], ns[None, :]]`` in float64 (the kernels' math, exact)."""
        k, n = ks[:, None], ns[None, :]
        if self.pack_axis == "K":
            word = _gather(leaves[self.code], self.code_dims, k // self.per_word, n)
            pos = k % self.per_word
        elif self.pack_axis == "N":
            word = _gather(leaves[self.code], self.code_dims, k, n // self.per_word)
            pos = n % self.per_word
        else:
            word, pos = _gather(leaves[self.code], self.code_dims, k, n), None
        w = _value(word, pos, self)
        if self.zero == "const":
            w = w - self.zero_value
        elif self.zero:
            zk = k // self.group_k
            if self.zero == "packed":
                zw = _gather(leaves[self.zero_leaf], self.zero_dims, zk, n // (self.group_n * self.zero_per_word))
                shift = torch.tensor(self.zero_order, dtype=torch.int64)[(n // self.group_n) % self.zero_per_word] * self.bits
                z = ((zw.to(torch.int64) & 0xFFFFFFFF) >> shift) & ((1 << self.bits) - 1)
            else:
                z = _gather(leaves[self.zero_leaf], self.zero_dims, zk, n // self.group_n)
            w = w - (z.to(torch.float64) + self.zero_value)
        if self.scale >= 0:
            s = _gather(leaves[self.scale], self.scale_dims, k // self.group_k, n // self.group_n)
            w = w * _scale_value(s, self.scale_enc)
        if self.glob >= 0:
            w = w * leaves[self.glob].reshape(-1)[0].to(torch.float64)
        return w


@functools.lru_cache(maxsize=1024)
def _parse_layout(text: str) -> PackedLayout | None:
    """Parsed once per text: the op passes the layout's text on every call."""
    if not text:
        return None
    try:
        doc = json.loads(text)
        if doc.pop("v", None) != LAYOUT_VERSION:
            return None
        return PackedLayout(**{k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()})
    except (ValueError, TypeError, AttributeError) as e:  # (json's errors are ValueErrors)
        raise ValueError(f"not a packed layout's text: {text[:80]!r} ({e})") from None


def leaf_strides(t: torch.Tensor | None, dims: tuple) -> tuple[int, int]:
    """A leaf's strides along its dims labelled k and n (0 where it has none, or no leaf): what the kernels
    index it with, ``[k // group_k, n // group_n]``."""
    if t is None:
        return 0, 0
    sk = sum(t.stride(d) for d, lab in enumerate(dims) if lab == "k")
    sn = sum(t.stride(d) for d, lab in enumerate(dims) if lab == "n")
    return sk, sn


def _gather(t: torch.Tensor, dims: tuple, k: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    k, n = torch.broadcast_tensors(k, n)
    idx = tuple({"k": k, "n": n}.get(d, torch.zeros_like(k)) for d in dims)
    return t[idx] if dims else t.reshape(()).expand(k.shape)


def _value(word: torch.Tensor, pos, lay: PackedLayout) -> torch.Tensor:
    if lay.value == "fp8":
        return word.to(torch.float64)
    w = word.to(torch.int64)
    if lay.per_word > 1:
        shift = torch.tensor(lay.order, dtype=torch.int64)[pos] * lay.bits
        f = ((w & ((1 << (word.dtype.itemsize * 8)) - 1)) >> shift) & ((1 << lay.bits) - 1)
    else:
        f = w
    if lay.value == "e2m1":
        mag = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)[f & 7]
        return torch.where((f & 8) != 0, -mag, mag)
    return f.to(torch.float64)


def _scale_value(s: torch.Tensor, enc: str) -> torch.Tensor:
    if enc == "e8m0":
        return torch.exp2(s.to(torch.float64) - 127)
    return s.to(torch.float64)


# ----------------------------------------------------------------------------- derivation


def derive_layout(prog: DecodeProgram, fmt: Format, leaf_values: dict | None = None) -> PackedLayout | None:
    """The packed layout the hand-tuned kernels use for ``prog``, or None (the generated kernel then)."""
    leaf_values = {**prog.embedded_values(), **(leaf_values or {})}
    if fmt is GENERIC or fmt.name in ("generic", "lut", "lut4") or prog.batch:
        return None
    if fmt.pack_axis not in (None, "K", "N") or fmt.bits is None:
        return None
    roles = fmt.roles
    code = roles.get("code")
    cl = prog.leaves[code]
    word_bits = cl.dtype.itemsize * 8
    per_word = word_bits // fmt.bits if fmt.pack_axis else 1
    if fmt.pack_axis and fmt.pack_order is None:
        return None
    if per_word > 8:  # the kernels encode a word's field order in 4 bits per field, 8 fields at most
        return None
    if "table" in roles:
        if fmt.name not in ("mxfp4", "nvfp4", "fp4_e2m1") or roles["table"] not in leaf_values:
            return None  # a table the kernel cannot hard-code (not a known constant E2M1 table)
        value = "e2m1"
        if fmt.zero:  # the kernels carry E2M1 values scaled by 2**-14; a zero point is not modelled
            return None
    elif cl.dtype in FP8_DTYPES:
        if cl.dtype != torch.float8_e4m3fn:
            return None
        value = "fp8"
    elif fmt.pack_axis:
        value = "uint"
    elif cl.dtype == torch.int8:
        value = "int"
    elif cl.dtype == torch.uint8:
        value = "uint"
    else:
        return None
    used = {code} | {roles[r] for r in ("scale", "zero", "global", "table") if r in roles}
    if any(i not in used and i not in leaf_values for i in prog.read_leaves()):  # (unread leaves cannot matter)
        return None  # the program reads data the layout does not model
    gk, gn = (fmt.group_k or 1), (fmt.group_n or 1)
    if fmt.scale == "channel":
        gk = prog.K
    elif fmt.scale == "tensor":
        gk, gn = prog.K, prog.N
    elif fmt.scale is None:
        gk = gn = 1
    kext = prog.K // per_word if fmt.pack_axis == "K" else prog.K
    next_ = prog.N // per_word if fmt.pack_axis == "N" else prog.N
    if fmt.pack_axis and (kext * (per_word if fmt.pack_axis == "K" else 1) != prog.K
                          or next_ * (per_word if fmt.pack_axis == "N" else 1) != prog.N):
        return None
    code_opts = _labelings(cl.shape, kext, next_)
    scale_opts = [()] if "scale" not in roles else \
        _labelings(prog.leaves[roles["scale"]].shape, -(-prog.K // gk), -(-prog.N // gn))
    zero_opts: list[dict] = [{}]
    if fmt.zero == "const":
        zero_opts = [dict(zero="const", zero_value=v) for v in _constants(prog)]
    elif fmt.zero in ("int", "float", "packed"):
        zl = roles["zero"]
        zshape = prog.leaves[zl].shape
        zero_opts = []
        zpw = prog.leaves[zl].dtype.itemsize * 8 // fmt.bits if fmt.zero == "packed" else 1
        gz = gn * zpw
        orders = [tuple(range(zpw))]
        if fmt.zero == "packed" and fmt.pack_order and len(fmt.pack_order) == zpw and fmt.pack_order != orders[0]:
            orders.insert(0, tuple(fmt.pack_order))
        for dims in _labelings(zshape, -(-prog.K // gk), -(-prog.N // gz)):
            for zo in orders if fmt.zero == "packed" else [()]:
                for off in ((0.0, 1.0) if fmt.zero != "float" else (0.0,)):
                    zero_opts.append(dict(zero=fmt.zero, zero_leaf=zl, zero_dims=dims, zero_per_word=zpw,
                                          zero_order=zo, zero_value=off))
    if not code_opts or not scale_opts or not zero_opts:
        return None
    enc = fmt.scale_encoding or ""
    if "scale" in roles and enc not in ("float", "fp8", "e8m0"):
        return None
    for cdims, sdims, z in itertools.product(code_opts, scale_opts, zero_opts):
        lay = PackedLayout(
            code=code, code_dims=cdims, bits=fmt.bits, per_word=per_word, pack_axis=fmt.pack_axis or "",
            order=tuple(fmt.pack_order or (0,)), value=value,
            scale=roles.get("scale", -1), scale_dims=sdims, scale_enc=enc if "scale" in roles else "",
            group_k=gk, group_n=gn, glob=roles.get("global", -1), **z)
        if verify(prog, lay, leaf_values):
            return lay
    return None


def _labelings(shape: tuple, kext: int, next_: int) -> list[tuple]:
    """Every way to read a leaf of ``shape`` as a [k-extent, n-extent] grid (size-1 dims are "1")."""
    big = [i for i, s in enumerate(shape) if s != 1]
    out = []
    if not big:  # one value for the whole grid (a per-tensor scale): broadcast, labels "1"
        return [tuple("1" for _ in shape)]
    if len(big) == 1:
        (i,) = big
        for lab, ext in (("n", next_), ("k", kext)):
            if shape[i] == ext:
                out.append(tuple(lab if j == i else "1" for j in range(len(shape))))
        return out
    if len(big) == 2:
        i, j = big
        for li, lj in (("k", "n"), ("n", "k")):
            ext = {"k": kext, "n": next_}
            if shape[i] == ext[li] and shape[j] == ext[lj]:
                out.append(tuple(li if d == i else lj if d == j else "1" for d in range(len(shape))))
    return out


def _constants(prog: DecodeProgram) -> list[float]:
    vals = []
    for ins in prog.instrs:
        if ins.op == "const" and isinstance(ins.args[0], (int, float)) and not isinstance(ins.args[0], bool):
            v = float(ins.args[0])
            if v not in vals:
                vals.append(v)
    return vals or [0.0]


def random_leaves(prog: DecodeProgram, lay: PackedLayout, leaf_values: dict, g: torch.Generator):
    out = []
    for i, leaf in enumerate(prog.leaves):
        if i in leaf_values:
            out.append(leaf_values[i].reshape(leaf.shape))
            continue
        d, shape = leaf.dtype, leaf.shape
        if i == lay.scale and lay.scale_enc == "e8m0":  # exponents that keep the weight finite
            t = torch.randint(110, 140, shape, generator=g, dtype=torch.int64).to(d)
        elif d in FP8_DTYPES:
            t = (torch.randn(shape, generator=g) * 2).to(d)
        elif d.is_floating_point:
            t = (torch.rand(shape, generator=g) * 0.5 + 0.01).to(d)
        elif d == torch.uint8:
            t = torch.randint(0, 256, shape, generator=g, dtype=torch.int64).to(d)
        elif d == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        else:
            info = torch.iinfo(d)
            t = torch.randint(max(info.min, -2**31), min(info.max, 2**31 - 1), shape, generator=g,
                              dtype=torch.int64).to(d)
        e8m0 = i == lay.scale and lay.scale_enc == "e8m0"
        if not d.is_floating_point and d != torch.bool and d not in FP8_DTYPES and t.numel() > 1 and not e8m0:
            # A quarter of the values at the type's edges, where wrap-around and sign handling differ.
            info = torch.iinfo(d)
            edges = torch.tensor([info.min, info.min + 1, -1 if info.min < 0 else 1, 0, info.max - 1, info.max],
                                 dtype=torch.int64)
            pick = edges[torch.randint(0, len(edges), shape, generator=g)].to(d)
            t = torch.where(torch.rand(shape, generator=g) < 0.25, pick, t)
        out.append(t)
    return out


def edge_window(size: int, head: int, tail: int) -> list[int]:
    return sorted({*range(min(size, head)), *range(max(size - tail, 0), size)})


def verify(prog: DecodeProgram, lay: PackedLayout, leaf_values: dict | None = None) -> bool:
    """Does ``lay`` compute the program's weight? Checked on two draws of random leaves (a quarter of
    the integers at their type's edges) over the first and last rows and columns (every group, word
    position and zero-point field occurs there): each element within two roundings of the weight's
    dtype, and no systematic relative bias (a missing constant factor hides inside the rounding)."""
    return all(_verify_once(prog, lay, leaf_values, seed) for seed in (0, 1))


def _verify_once(prog: DecodeProgram, lay: PackedLayout, leaf_values: dict | None, seed: int) -> bool:
    g = torch.Generator().manual_seed(seed)
    leaves = random_leaves(prog, lay, leaf_values or {}, g)
    ks, ns = edge_window(prog.K, 512, 64), edge_window(prog.N, 64, 32)
    try:
        want = prog.evaluate_at(leaves, prog.out, {"k": ks, "n": ns, "b": 0}).to(torch.float64)
        got = lay.weight_at(leaves, torch.tensor(ks), torch.tensor(ns))
    except (IndexError, RuntimeError, ValueError):
        return False
    want = want.to(prog.dtype).to(torch.float64)
    if not torch.isfinite(want).all():
        return False
    eps = torch.finfo(prog.dtype).eps if prog.dtype.is_floating_point else 0.0
    tol = 2 * eps * got.abs() + 1e-30
    if not bool(((got - want).abs() <= tol).all()):
        return False
    nz = got != 0
    bias = ((got - want)[nz] / got[nz].abs()).mean().abs().item() if bool(nz.any()) else 0.0
    return bias <= max(eps / 16, 1e-9)
