"""Implementation of the equivalence harness; see fusekern.testing for the overview."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from fusekern.patterns.registry import GraphRewrite, Pattern, compute_dtype, get_pattern
from fusekern.patterns.spec import make_inputs, random_sizes

LAYOUTS = ("contiguous", "noncontiguous", "misaligned")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 over the finite elements of ``ref``; inf on a shape mismatch or
    where NaN / +-inf do not sit at the same places (with the same sign) in both; 0 for two empty tensors."""
    if out.shape != ref.shape:
        return float("inf")
    out64, ref64 = out.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    finite = torch.isfinite(ref64)
    if not finite.all():  # non-finite values must agree exactly: NaN with NaN, inf with inf of the same sign
        if not torch.equal(torch.isnan(out64), torch.isnan(ref64)) or \
                not torch.equal(out64[torch.isinf(ref64)], ref64[torch.isinf(ref64)]):
            return float("inf")
        out64, ref64 = out64[finite], ref64[finite]
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


def _upcast(args: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.double() if v.is_floating_point() else v) for k, v in args.items()}


# ----------------------------------------------------------------------------- (a) one pattern


@dataclass
class Case:
    variant: str
    sizes: dict
    layout: str
    err: float
    tol: float
    note: str = ""
    # the search function's own error in its dtypes against the same float64 reference (NaN where there is no
    # separate reference): how far the graph being replaced already is, beside the replacement's ``err``
    search_err: float = float("nan")

    @property
    def ok(self) -> bool:
        return self.err <= self.tol

    def describe(self, pattern: Pattern) -> str:
        dims = {k: v for k, v in self.sizes.items() if not k.startswith("B") or k == "B0"}
        own = "" if self.search_err != self.search_err else f", the search's own {self.search_err:.3g}"
        return (f"[{self.variant}] sizes={dims} layout={self.layout}: rel_err={self.err:.3g} "
                f"(tolerance {self.tol:.3g}{own}){' ' + self.note if self.note else ''}")


@dataclass
class CheckResult:
    pattern: str
    device: str
    cases: list[Case] = field(default_factory=list)
    declined: int = 0  # draws the pattern's check refused (not compared)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.ok for c in self.cases)

    @property
    def worst(self) -> Case | None:
        return max(self.cases, key=lambda c: c.err / c.tol if c.tol else c.err, default=None)

    def __str__(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        worst = self.worst
        tail = f"; worst {worst.describe(get_pattern(self.pattern))}" if worst else "; no case ran"
        return f"{status} {self.pattern} on {self.device}: {len(self.cases)} cases, {self.declined} declined{tail}"

    def assert_ok(self) -> None:
        if not self.passed:
            bad = [c for c in self.cases if not c.ok]
            p = get_pattern(self.pattern)
            lines = [str(self)] + [f"  failing {c.describe(p)}" for c in bad[:5]]
            raise AssertionError("\n".join(lines))


def check_pattern(
    pattern: Pattern | str,
    *,
    device: str = "cpu",
    draws: int = 24,
    seed: int = 0,
    layouts: Sequence[str] = LAYOUTS,
) -> CheckResult:
    """Compare replacement against a float64 run of the search function on random inputs."""
    if not isinstance(pattern, (str, Pattern, GraphRewrite)):
        raise TypeError(f"check_pattern: pass a pattern or its name, got {type(pattern).__name__}")
    if isinstance(layouts, str) or not layouts or any(lay not in LAYOUTS for lay in layouts):
        raise ValueError(f"check_pattern: layouts must be a non-empty list of {LAYOUTS}, got {layouts!r}")
    p = get_pattern(pattern) if isinstance(pattern, str) else pattern
    if not isinstance(p, Pattern):
        raise TypeError(f"check_pattern: {p.name!r} is a structural rewrite, not a search/replacement pattern; "
                        "its equivalence is proven by its family's tests")
    rng = random.Random(seed)
    variants = p.variants()
    result = CheckResult(p.name, device)
    # at least one draw per (variant, layout): with many variants, fewer draws left layouts untested
    for i in range(max(draws, len(variants) * len(layouts))):
        variant = variants[i % len(variants)]
        layout = layouts[(i // len(variants)) % len(layouts)]
        sizes = random_sizes(p.inputs, p.dims, rng)

        def draw():  # the same values and layout for each run: one that writes into its inputs spoils no other's
            return make_inputs(p.inputs, variant, sizes, device=device, seed=seed * 1000 + i, layout=layout)

        args = draw()
        if p.run_check(_as_compiled_sees(args)) is not None:
            result.declined += 1
            continue
        want = p.search(**args)
        got = p.replacement(**draw())
        try:
            ref = p.search(**_upcast(draw()))
            note = ""
        except Exception:  # search code that only runs in the low-precision dtypes
            ref, note = want, "(reference: search in its own dtypes)"
        tol = p.tol(compute_dtype(want, *args.values()))
        search_err = float("nan")
        if isinstance(want, torch.Tensor) and not (want.is_floating_point() or want.is_complex()):
            err = 0.0 if got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu()) else float("inf")
            note = note or "(integer / bool output: must be equal)"
        else:
            err = rel_err(got, ref)
            if ref is not want:
                search_err = rel_err(want, ref)
        if got.dtype != want.dtype or got.shape != want.shape:
            err, note = float("inf"), f"replacement gave {tuple(got.shape)} {got.dtype}, search {tuple(want.shape)} {want.dtype}"
        result.cases.append(Case(variant.label(), sizes, layout, err, tol, note, search_err))
    return result


def _as_compiled_sees(args: dict) -> dict:
    """The inputs as a pattern's check sees them in a compile: fake tensors (shape, strides, dtype and device,
    no values), so that a check reading values declines here as it would there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    return {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


# ----------------------------------------------------------------------------- (b) a compiled function


class GraphCapture(CustomGraphPass):
    """An inductor post-grad pass that only records the final graph (after every rewrite)."""

    def __init__(self):
        self.graphs: list[str] = []
        self.targets: list[set[str]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append(str(graph))
        self.targets.append({str(n.target) for n in graph.nodes if n.op == "call_function"})

    def uuid(self):
        return None  # never cached: the point is to see the graph


@dataclass
class CompiledCheck:
    fired: dict
    graphs: list[str]
    targets: set[str]
    errors: list[float]


def assert_compiled(
    fn: Callable,
    args: Sequence[Any],
    *,
    fired: Mapping[str, int] | None = None,
    gone: Iterable[str] = (),
    present: Iterable[str] = (),
    tol: float | None = None,
    dynamic: bool | None = None,
    options: Mapping[str, Any] | None = None,
    extra_args: Sequence[Sequence[Any]] = (),
) -> CompiledCheck:
    """Compile ``fn`` with fusekern and check it against eager.

    fired: exact match counts per pattern (patterns not named must not fire); ``{}`` = nothing fires.
    gone / present: op names (as ``str(node.target)``, e.g. ``"aten.mm.default"``) that must be absent
    from / present in the final post-grad graph. extra_args: more argument tuples run through the same
    compiled function (dynamic shapes).
    """
    import fusekern

    for op in (*gone, *present):
        _check_op_name(op)
    capture = GraphCapture()
    opts = dict(options or {})
    opts["post_grad_custom_post_pass"] = capture
    torch._dynamo.reset()
    fusekern.reset_match_report()
    compiled = torch.compile(fn, backend="fusekern", dynamic=dynamic, options=opts)
    errors = []
    for call_args in (tuple(args), *map(tuple, extra_args)):
        # eager runs on copies taken before the compiled call: where either writes into its inputs, both must
        # write the same (a rewrite that clobbers an input the user reads again is caught here)
        eager_args = _copies(call_args)
        got = compiled(*call_args)
        want = fn(*eager_args)
        t = tol if tol is not None else _default_tol(*tree_leaves(want), *tree_leaves(call_args))
        err = _compare("output", got, want, t)
        for i, (a, b) in enumerate(zip(call_args, eager_args)):
            _compare(f"argument {i} after the call", a, b, t)
        errors.append(err)
    report = fusekern.match_report()
    counts = dict(report.fired())
    if report.cache_hits:
        raise AssertionError("graph came from a cache; the passes did not run (GraphCapture should prevent this)")
    if fired is not None and counts != dict(fired):
        raise AssertionError(f"fired {counts}, expected {dict(fired)}\n{report}")
    targets = set().union(*capture.targets) if capture.targets else set()
    for op in gone:
        if op in targets:
            raise AssertionError(f"{op} is still in the compiled graph:\n" + "\n".join(capture.graphs))
    for op in present:
        if op not in targets:
            raise AssertionError(f"{op} is not in the compiled graph:\n" + "\n".join(capture.graphs))
    return CompiledCheck(counts, capture.graphs, targets, errors)


def _copies(args):
    """``args`` with every tensor copied, the copies sharing storage where the originals do (``fn(x, x[0])``
    that writes one and reads the other must see the same aliasing in eager)."""
    storages: dict = {}

    def copy(t):
        if not isinstance(t, torch.Tensor):
            return t
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.device)
        if key not in storages:
            storages[key] = storage.clone()
        out = torch.empty(0, dtype=t.dtype, device=t.device).set_(storages[key], t.storage_offset(), t.shape,
                                                                   t.stride())
        return out.requires_grad_() if t.requires_grad else out

    return tree_map(copy, args)


def _compare(what: str, got, want, tol: float) -> float:
    """The largest relative error over the tensors of ``got`` and ``want`` (nested outputs compared leaf by
    leaf; integer and bool tensors and non-tensor leaves must be equal); AssertionError where they differ."""
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    if got_spec != want_spec:
        raise AssertionError(f"compiled {what} has another structure than eager's: {got_spec} vs {want_spec}")
    worst = 0.0
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        where = what if len(want_leaves) == 1 else f"{what} [{i}]"
        if not isinstance(w, torch.Tensor) or not isinstance(g, torch.Tensor):
            if type(g) is not type(w) or not g == w:
                raise AssertionError(f"compiled {where} differs from eager: {g!r} vs {w!r}")
            continue
        if g.dtype != w.dtype or g.shape != w.shape:
            raise AssertionError(f"compiled {where} differs from eager: dtype {g.dtype} vs {w.dtype}, shapes "
                                 f"{tuple(g.shape)} vs {tuple(w.shape)}")
        if not (w.is_floating_point() or w.is_complex()):
            if not torch.equal(g.cpu(), w.cpu()):
                raise AssertionError(f"compiled {where} differs from eager: {w.dtype} values must be equal")
            continue
        err = rel_err(g, w)
        if not err <= tol:  # (NaN fails)
            raise AssertionError(f"compiled {where} differs from eager: rel_err={err:.3g} (tolerance {tol:.3g}), "
                                 f"dtype {g.dtype}, shape {tuple(g.shape)}")
        worst = max(worst, err)
    return worst


def _check_op_name(name: str) -> None:
    """ValueError unless ``name`` is an op overload as the graph names it (``"aten.mm.default"``): a misspelt or
    partial name would never be in the graph, and ``gone=`` would pass whatever the compile did."""
    parts = name.split(".") if isinstance(name, str) else []
    try:
        if len(parts) != 3:
            raise AttributeError
        getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        raise ValueError(f"assert_compiled: {name!r} is not an op overload name such as 'aten.mm.default'") from None


def _default_tol(*tensors) -> float:
    from fusekern.patterns.registry import DEFAULT_TOLERANCE

    return DEFAULT_TOLERANCE.get(compute_dtype(*tensors), 1e-2)
