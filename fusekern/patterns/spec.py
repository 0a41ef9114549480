"""Declarative input specs for patterns: what to trace with and what the equivalence harness draws.

A pattern names its inputs' shapes with symbolic dims shared across inputs (``"M"``, ``"K"``...) and
their dtypes either directly or through a dtype variable (``"act"``) whose values the pattern lists.
From one spec fusekern derives the example inputs for tracing (every rank and dtype variant) and the
random inputs of the harness (odd sizes, non-contiguous and misaligned views).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch


@dataclass(frozen=True)
class Dim:
    """Allowed sizes of a symbolic dim. ``trace`` is the size used when tracing the pattern."""

    min: int = 1
    max: int = 96
    multiple_of: int = 1
    trace: int | None = None

    def __post_init__(self):
        for name in ("min", "max", "multiple_of", "trace"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool)) and not (name == "trace" and value is None):
                raise TypeError(f"Dim: {name} must be an int, got {value!r}")
        if self.min < 1 or self.max < self.min or self.multiple_of < 1:
            raise ValueError(f"bad Dim {self}")
        lo, hi = self._multiples()
        if hi < lo:
            raise ValueError(f"Dim {self} allows no size: no multiple of {self.multiple_of} in "
                             f"[{self.min}, {self.max}]")
        if self.trace is not None and not self.allows(self.trace):
            raise ValueError(f"Dim {self}: its trace size {self.trace} is not an allowed size")

    def _multiples(self) -> tuple[int, int]:
        """The first and last allowed size, in multiples of ``multiple_of``."""
        return -(-self.min // self.multiple_of), self.max // self.multiple_of

    def allows(self, size: int) -> bool:
        return self.min <= size <= self.max and size % self.multiple_of == 0

    def sample(self, rng: random.Random) -> int:
        return rng.randint(*self._multiples()) * self.multiple_of


@dataclass(frozen=True)
class TensorSpec:
    """One tensor input.

    shape: symbolic dim names or fixed ints. dtype: a torch dtype or the name of a dtype variable.
    batch_dims: how many extra leading dims the input may carry (``(0, 1)``: 2-D and 3-D for
    activations); one trace per choice. positive: values drawn > 0 (scales).
    """

    shape: tuple[str | int, ...]
    dtype: torch.dtype | str
    batch_dims: tuple[int, ...] = (0,)
    positive: bool = False


def T(*shape: str | int, dtype: torch.dtype | str, batch_dims: tuple[int, ...] = (0,), positive: bool = False) -> TensorSpec:
    """Shorthand: ``T("M", "K", dtype="act", batch_dims=(0, 1))``."""
    if not all(isinstance(d, (str, int)) and not isinstance(d, bool) for d in shape):
        raise TypeError(f"T: dims must be names or ints, got {shape!r}")
    if not isinstance(dtype, (torch.dtype, str)):
        raise TypeError(f"T: dtype must be a torch dtype or a dtype variable's name, got {dtype!r}")
    if not isinstance(batch_dims, (tuple, list)) or not batch_dims or \
            not all(isinstance(b, int) and b >= 0 for b in batch_dims):
        raise TypeError(f"T: batch_dims must be a tuple of counts of extra leading dims (e.g. (0, 1)), got "
                        f"{batch_dims!r}")
    if not isinstance(positive, bool):
        raise TypeError(f"T: positive must be True or False, got {positive!r}")
    return TensorSpec(tuple(shape), dtype, tuple(batch_dims), positive)


@dataclass(frozen=True)
class Variant:
    """One concrete choice of dtype variables and batch rank."""

    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    batch: int = 0

    def label(self) -> str:
        parts = [f"{k}={str(v).removeprefix('torch.')}" for k, v in sorted(self.dtypes.items())]
        return ",".join(parts + [f"batch={self.batch}"])


def variants(inputs: Mapping[str, TensorSpec], dtypes: Mapping[str, tuple[torch.dtype, ...]]) -> Iterator[Variant]:
    """Every combination of dtype-variable values and batch ranks the inputs allow."""
    names = sorted(dtypes)
    batches = sorted({b for spec in inputs.values() for b in spec.batch_dims})
    for combo in itertools.product(*(dtypes[n] for n in names)):
        for b in batches:
            yield Variant(dict(zip(names, combo)), b)


def resolve_dtype(spec: TensorSpec, variant: Variant) -> torch.dtype:
    if isinstance(spec.dtype, torch.dtype):
        return spec.dtype
    try:
        return variant.dtypes[spec.dtype]
    except KeyError:
        raise KeyError(f"dtype variable {spec.dtype!r} has no values") from None


def known(cond) -> bool:
    """True only where ``cond`` (a bool, or a SymBool of dynamic sizes) holds for every size the compile allows:
    never adds a guard (a match is declined rather than guarded: post-grad, new guards would be ignored)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(cond)


def _variant_mismatch(inputs: Mapping[str, TensorSpec], variant: Variant, values: Mapping) -> str | None:
    for name, spec in inputs.items():
        t = values[name]
        want = resolve_dtype(spec, variant)
        if t.dtype != want:
            return f"{name} is {t.dtype}, the pattern's spec {want}"
        rank = len(spec.shape) + (variant.batch if variant.batch in spec.batch_dims else 0)
        if t.dim() != rank:
            return f"{name} has {t.dim()} dims, the pattern's spec {rank}"
    return None


def spec_mismatch(inputs: Mapping[str, TensorSpec], dtypes: Mapping[str, tuple[torch.dtype, ...]],
                  dims: Mapping[str, Dim], values: Mapping) -> str | None:
    """Why a match's inputs (fake tensors, by name) lie outside what the pattern declared, or None. The compile
    rewrites only what registration traced and the harness tested: the dtypes and ranks of one variant, the
    fixed sizes, one size per named dim (and per leading batch dim), and each named dim's ``Dim.min`` and
    ``multiple_of`` (``Dim.max`` bounds only the harness's draws: model sizes run far above them). Inductor's
    matcher compares ops, not these, so without this a pattern traced for fp32 2-D inputs fired on bf16 3-D ones."""
    for name in inputs:
        if not isinstance(values.get(name), torch.Tensor):
            return f"{name} is not a tensor with known shape and dtype"
    reasons = []
    for variant in variants(inputs, dtypes):
        why = _variant_mismatch(inputs, variant, values)
        if why is None:
            break
        reasons.append(f"[{variant.label()}] {why}")  # (named: one variant's reason alone reads as the only rule)
    else:
        return "no traced variant fits: " + "; ".join(reasons)
    sizes: dict = {}
    for name, spec in inputs.items():
        t = values[name]
        lead = t.dim() - len(spec.shape)
        named = [f"B{i}" for i in range(lead)] + list(spec.shape)
        for i, (d, size) in enumerate(zip(named, t.shape)):
            if isinstance(d, int):
                if not known(size == d):
                    return f"{name}'s dim {i} is {size}, the pattern's spec fixes {d}"
            elif d in sizes and not known(sizes[d] == size):
                return f"{name}'s dim {i} ({d}) is {size}, another input's {d} is {sizes[d]}"
            else:
                sizes.setdefault(d, size)
    for d, size in sizes.items():
        dim = dims.get(d)
        if dim is not None and not (known(size >= dim.min) and known(size % dim.multiple_of == 0)):
            return (f"{d} = {size} is not known to be a multiple of {dim.multiple_of} and at least {dim.min} "
                    f"(the pattern's Dim)")
    return None


def _values(shape, dtype: torch.dtype, positive: bool, gen: torch.Generator, device) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool().to(device)
    if dtype.is_floating_point and dtype.itemsize == 1:  # fp8: draw in fp32, then cast
        t = torch.randn(shape, generator=gen)
        return (t.abs() if positive else t).to(device=device, dtype=dtype)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        if positive:
            t = t.abs() * 0.05 + 0.01  # scale-like magnitudes, never zero
        return t.to(device=device, dtype=dtype)
    info = torch.iinfo(dtype)
    lo, hi = (1 if positive else max(info.min, -(2**31))), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64).to(device=device, dtype=dtype)


def make_inputs(
    inputs: Mapping[str, TensorSpec],
    variant: Variant,
    sizes: Mapping[str, int],
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    layout: str = "contiguous",
) -> dict[str, torch.Tensor]:
    """Concrete tensors for one variant. ``sizes`` maps dim names (and ``B0``, ``B1``... for batch dims).

    layout: ``contiguous``, ``noncontiguous`` (a strided view into a larger buffer: every input with
    two or more dims gets a row stride larger than its row) or ``misaligned`` (storage offset of one
    element, so data pointers are not 16-byte aligned).
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, spec in inputs.items():
        lead = [sizes[f"B{i}"] for i in range(variant.batch if variant.batch in spec.batch_dims else 0)]
        shape = lead + [d if isinstance(d, int) else sizes[d] for d in spec.shape]
        dtype = resolve_dtype(spec, variant)
        if layout == "noncontiguous" and len(shape) >= 2:
            wide = shape[:-1] + [shape[-1] * 2 + 1]
            t = _values(wide, dtype, spec.positive, gen, device)[..., : shape[-1]]
        elif layout == "misaligned":
            n = 1
            for s in shape:
                n *= s
            t = _values([n + 1], dtype, spec.positive, gen, device)[1:].view(shape)
        else:
            t = _values(shape, dtype, spec.positive, gen, device)
        out[name] = t
    return out


def trace_sizes(inputs: Mapping[str, TensorSpec], dims: Mapping[str, Dim]) -> dict[str, int]:
    """Distinct, small sizes for tracing: distinct so that views of different dims never coincide."""
    names = sorted({d for spec in inputs.values() for d in spec.shape if isinstance(d, str)})
    sizes: dict[str, int] = {}
    used: set[int] = set()
    candidate = 5
    for name in names:
        dim = dims.get(name, Dim())
        if dim.trace is not None:
            size = dim.trace
        else:  # the smallest allowed size above the last one, else the largest unused one below it
            step = dim.multiple_of
            first, last = dim._multiples()
            k = max(-(-candidate // step), first)
            while k * step in used and k <= last:
                k += 1
            if k > last:
                k = last
                while k * step in used and k > first:
                    k -= 1
            size = k * step
        sizes[name] = size
        used.add(size)
        candidate = size + 1
    for i in range(4):
        sizes.setdefault(f"B{i}", 2 + i)
    return sizes


def random_sizes(inputs: Mapping[str, TensorSpec], dims: Mapping[str, Dim], rng: random.Random) -> dict[str, int]:
    names = sorted({d for spec in inputs.values() for d in spec.shape if isinstance(d, str)})
    sizes = {name: dims.get(name, Dim()).sample(rng) for name in names}
    for i in range(4):
        sizes[f"B{i}"] = rng.randint(1, 4)
    return sizes
