"""The pattern registry: what a pattern is, how it is registered, validated and turned into a pass.

A pattern is a search function written in plain PyTorch, a replacement with the same signature, and
specs of its inputs. ``register_pattern`` validates it (runs both on example inputs of every variant
and traces the search function) and stores it; the inductor pattern pass for it is built lazily, the
first time a compile needs it, once per process.

Built-in pattern modules register on first use of the registry (never at ``import fusekern``), then
third-party packages through the ``fusekern.patterns`` entry-point group.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import itertools
import logging
import math
import os
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from fusekern.patterns.spec import (Dim, TensorSpec, Variant, known, make_inputs, spec_mismatch, trace_sizes,
                                   variants)

log = logging.getLogger("fusekern")

FAMILIES = ("dequant_matmul", "scale_folding", "sampling", "user")
STAGES = ("post_grad", "joint")
# Order is priority within a stage (``all_patterns``, whatever order the modules were imported in). Scale
# folding comes first: it declines weight-only forms (16-bit activation, 8-bit or decoded weight) so the
# dequant family still sees them, and it must take W8A8 forms before the structural decode rewrite would
# read them as weight-only.
BUILTIN_MODULES = ("fusekern.patterns.scale_folding", "fusekern.patterns.scale_folding_attention",
                   "fusekern.patterns.decode_attention",  # after fp8_kv_attention, whose fp8 caches these are
                   "fusekern.patterns.dequant_matmul",
                   "fusekern.patterns.sampling", "fusekern.patterns.sampling_greedy")
ENTRY_POINT_GROUP = "fusekern.patterns"

# Relative-error tolerances (||out - ref|| / ||ref||) by the least precise float dtype a computation
# touches: bf16 activations with an fp32 scale still multiply in bf16.
DEFAULT_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The least precise floating dtype among ``tensors`` (float32 if none is floating)."""
    floats = [t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return min(floats, key=lambda d: (torch.finfo(d).eps * -1), default=torch.float32)

# Why a check turned a candidate down: a string. None (or True) lets the pattern fire.
CheckFn = Callable[[Mapping[str, Any]], "str | bool | None"]


class PatternError(ValueError):
    """A pattern failed validation at registration."""


@dataclass(eq=False)
class Pattern:
    """One rewrite: ``search`` -> ``replacement``.

    inputs: specs keyed by the search function's parameter names, in order.
    dtypes: values of the dtype variables the specs use, e.g. ``{"act": (torch.bfloat16, torch.float16)}``.
    dims: size constraints for symbolic dims (group sizes, packing multiples).
    check: gets the matched inputs' fake tensors by name; returns a reason string to refuse.
    stage: ``post_grad`` (GEMM families, before inductor's own weight-only-int8 rewrite) or ``joint``
    (sees random ops before inductor replaces them: sampling).
    kernel_version: changes whenever the replacement's kernels change (part of the cache key).
    bind_specs: the compile rewrites only matches whose inputs fit the specs (``spec.spec_mismatch``: a
    variant's dtypes and ranks, fixed sizes, each Dim's min and multiple_of), what registration traced and
    the harness tests; False leaves that to ``check`` (the built-in W8A16 patterns, whose checks and tests
    cover wider forms: [1, N] scales, fp16 scales).
    """

    name: str
    search: Callable
    replacement: Callable
    inputs: Mapping[str, TensorSpec]
    dtypes: Mapping[str, tuple[torch.dtype, ...]] = field(default_factory=dict)
    dims: Mapping[str, Dim] = field(default_factory=dict)
    check: CheckFn | None = None
    family: str = "user"
    stage: str = "post_grad"
    kernel_version: str = ""
    tolerance: Mapping[torch.dtype, float] = field(default_factory=dict)
    description: str = ""
    bind_specs: bool = True

    def __post_init__(self):
        self._pass = None
        self._lock = threading.Lock()

    # -- identity ------------------------------------------------------------------------------
    @functools.cached_property
    def fingerprint(self) -> str:
        """Changes when the pattern's code, specs or kernels change: feeds the FX-cache uuid."""
        h = hashlib.sha256()
        fns = (self.search, self.replacement, self.check)
        for fn in fns:
            h.update(_source_of(fn).encode())
        for path in sorted({_file_of(fn) for fn in fns} - {None}):  # the helpers they call, each file once
            with open(path, "rb") as f:
                h.update(f.read())
        h.update(repr((self.name, sorted(self.inputs.items()), sorted(self.dtypes.items(), key=str),
                       sorted(self.dims.items()), self.stage, self.kernel_version, self.bind_specs)).encode())
        h.update(_closure_of(self.check).encode())
        if not all(_in_package(fn) for fn in fns if fn is not None):
            # What the pass puts in a graph: the traced search and replacement of every variant, with the
            # values their sources do not show (a closure's constant, a helper module's global, a function
            # defined by exec). fusekern's own code is in the pass's key already (every file of the package).
            h.update(self._traced_code().encode())
        return h.hexdigest()[:16]

    def _traced_code(self) -> str:
        from fusekern.compiler_pass.canonicalize import trace

        parts = []
        for _, mode, fake in _fake_examples(self):
            with _in_fake_mode(mode):
                for fn in (self.search, self.replacement):
                    try:
                        parts.append(trace(fn, fake).code)
                    except Exception as e:  # noqa: BLE001 - (registration refuses these; a Pattern made by hand)
                        parts.append(f"untraceable: {type(e).__name__}")
        return "\n".join(parts)

    def tol(self, dtype: torch.dtype) -> float:
        return self.tolerance.get(dtype, DEFAULT_TOLERANCE.get(dtype, 1e-2))

    def variants(self) -> list[Variant]:
        return list(variants(self.inputs, self.dtypes))

    def example_inputs(self, variant: Variant, device="cpu") -> dict[str, torch.Tensor]:
        return make_inputs(self.inputs, variant, trace_sizes(self.inputs, self.dims), device=device)

    # -- the inductor pass ------------------------------------------------------------------------
    def matcher_pass(self):
        """The PatternMatcherPass holding this pattern's traced variants (built once, lazily)."""
        if self._pass is None:
            with self._lock:
                if self._pass is None:
                    self._pass = _build_matcher_pass(self)
        return self._pass

    def run_check(self, values: Mapping[str, Any]) -> str | None:
        """None when the pattern may fire on these (fake) inputs, else the reason it may not."""
        if self.check is None:
            return None
        try:
            verdict = self.check(values)
        except Exception as e:  # noqa: BLE001 - a broken check declines (the graph stays), with the reason
            log.warning("fusekern: the check of pattern %r raised %s: %s", self.name, type(e).__name__, e)
            return f"the pattern's check raised {type(e).__name__}: {e}"
        if isinstance(verdict, torch.SymBool):  # (a comparison of dynamic sizes): fires only where it always holds
            return None if known(verdict) else f"check's condition {verdict} is not known to hold for every size " \
                                               "this compile allows"
        if type(verdict).__module__ == "numpy" and type(verdict).__name__ in ("bool", "bool_"):  # numpy's bool
            verdict = bool(verdict)
        if verdict is None or verdict is True:
            return None
        if verdict is False:
            return "check returned False"
        if not isinstance(verdict, str):
            log.warning("fusekern: the check of pattern %r returned %r, not None, a bool or a reason string: declined",
                        self.name, verdict)
            return f"the pattern's check returned {type(verdict).__name__} {verdict!r}, not None, a bool or a reason"
        return verdict


@dataclass(eq=False)
class GraphRewrite:
    """A structural rewrite: a function that finds its subgraphs in an FX graph and replaces them.

    For forms one traced search function cannot express: sampling chains hold random ops (their
    outputs cannot be compared elementwise) and Python constants (temperature, top-k) that must match
    any value. ``rewrite(graph)`` applies every match, records refusals with
    ``fusekern.compiler_pass.report.record_rejection`` and returns how many it replaced. Its
    equivalence is proven by the family's own tests (exact with injected noise, and statistical).
    """

    name: str
    rewrite: Callable[[torch.fx.Graph], int]
    family: str = "user"
    stage: str = "joint"
    kernel_version: str = ""
    description: str = ""

    @functools.cached_property
    def fingerprint(self) -> str:
        """The code of the rewrite's whole module (its matchers and replacement builders), the values its source
        does not show (a closure's cells, its constants, the plain globals it reads: ``_closure_of``) and identity.
        Without a module file (a REPL, a notebook, ``python -c``) the function's bytecode and constants stand for
        its source: a module's repr never changes, and a cached graph of the old rewrite was reused."""
        h = hashlib.sha256()
        module = inspect.getmodule(self.rewrite)
        if module is not None and _file_of(self.rewrite) is not None:
            h.update(_source_of(module).encode())
        else:
            h.update(_stable_repr(getattr(self.rewrite, "__code__", None) or self.rewrite).encode())
        h.update(_closure_of(self.rewrite).encode())
        h.update(repr((self.name, self.stage, self.kernel_version)).encode())
        return h.hexdigest()[:16]

    def matcher_pass(self):
        return self

    def apply(self, graph: torch.fx.Graph) -> int:
        return self.rewrite(graph)


def register_rewrite(name: str, rewrite: Callable[[torch.fx.Graph], int], *, family: str = "user",
                     stage: str = "joint", kernel_version: str = "", description: str = "") -> GraphRewrite:
    """Register a structural rewrite (see GraphRewrite); names share one namespace with patterns."""
    r = GraphRewrite(name, rewrite, family, stage, kernel_version, description)
    if r.family not in FAMILIES:
        raise PatternError(f"rewrite {name!r}: family must be one of {FAMILIES}, got {family!r}")
    if r.stage not in STAGES:
        raise PatternError(f"rewrite {name!r}: stage must be one of {STAGES}, got {stage!r}")
    _add("rewrite", r)
    return r


def _file_of(fn) -> str | None:
    """The file defining ``fn`` (None when there is none: a REPL, a notebook cell, no function)."""
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        return None
    return path if path and os.path.isfile(path) else None


def _in_package(fn) -> bool:
    """Whether ``fn`` is defined in fusekern's own package (whose every file the pass's cache key hashes)."""
    path = _file_of(fn)
    return path is not None and os.path.abspath(path).startswith(_PACKAGE_DIR + os.sep)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _closure_of(fn, seen: set | None = None) -> str:
    """The values ``fn``'s source does not show: its constants and its closure cells (functions in them, in turn)."""
    code = getattr(fn, "__code__", None)
    seen = set() if seen is None else seen
    if code is None or id(fn) in seen:
        return ""
    seen.add(id(fn))
    parts = [_stable_repr(code.co_consts), _globals_read(fn, code)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # (an empty cell)
            continue
        parts.append(_closure_of(value, seen) if callable(value) else _stable_repr(value))
    return "|".join(parts)


_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)


def _globals_read(fn, code) -> str:
    """The plain values (numbers, strings, dtypes, tuples of them) of the globals ``fn`` names, and of the
    attributes it names on global modules (``limits.MAX_ROWS``): a check that reads another module's constant."""
    names, stack = set(), [code]
    while stack:  # (nested functions' names too)
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    g = getattr(fn, "__globals__", {})
    plain = lambda v: isinstance(v, _PLAIN) or isinstance(v, (tuple, frozenset)) and all(  # noqa: E731
        isinstance(x, _PLAIN) for x in v)
    found = []
    for name in sorted(names & g.keys()):
        value = g[name]
        if plain(value):
            found.append(f"{name}={_stable_repr(value)}")
        elif isinstance(value, types.ModuleType):
            for attr in sorted(names):
                try:
                    v = getattr(value, attr)
                except Exception:  # noqa: BLE001 - (not an attribute of this module, or a lazy one that fails)
                    continue
                if plain(v):
                    found.append(f"{name}.{attr}={_stable_repr(v)}")
    return ",".join(found)


def _stable_repr(value) -> str:
    """``repr`` without what changes from one process to the next (a cache key must not): a code object (a
    nested function's, in ``co_consts``) by its bytecode and constants, an object whose repr is its address
    by its type."""
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_stable_repr(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):  # (their order follows the hash seed, dtypes' hashes per process)
        return "{" + ", ".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{_stable_repr(k)}: {_stable_repr(v)}" for k, v in value.items())) + "}"
    if isinstance(value, types.CodeType):
        return f"code({value.co_code!r}, {_stable_repr(value.co_consts)}, {value.co_names!r})"
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def _source_of(fn) -> str:
    if fn is None:
        return ""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        return repr(code.co_code) if code is not None else repr(fn)


# ----------------------------------------------------------------------------- registry state

_patterns: dict[str, "Pattern | GraphRewrite"] = {}
_registry_lock = threading.RLock()
_loaded = False
_loading = False  # inside load_patterns: registrations it triggers must not start it again
# name -> (rank of the registering module in BUILTIN_MODULES, or after them all for user code; registration
# number): the order passes run in, whatever order test or user code imported the built-in modules
_order: dict[str, tuple[int, int]] = {}
_numbers = itertools.count()


def _registering_module() -> str:
    """The module whose code called ``register_*`` (the first frame outside this module)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def _rank(module: str) -> tuple[int, int]:
    rank = BUILTIN_MODULES.index(module) if module in BUILTIN_MODULES else len(BUILTIN_MODULES)
    return rank, next(_numbers)


def _add(what: str, p: "Pattern | GraphRewrite", validate_fn: Callable | None = None) -> None:
    """Put a pattern or rewrite in the registry. The built-ins load first (a user pattern must not take one of
    their names); its place in the pass order comes from the module whose code registered it."""
    origin = _registering_module()
    if origin not in BUILTIN_MODULES and not _loading:
        load_patterns()
    with _registry_lock:
        if p.name in _patterns:
            raise PatternError(f"{what} {p.name!r}: a pattern of that name is already registered (re-running a "
                               f"registration: fusekern.unregister_pattern({p.name!r}) first)")
        if validate_fn is not None:
            validate_fn(p)
        _patterns[p.name] = p
        _order[p.name] = _rank(origin)


def register_pattern(
    name: str | None = None,
    search: Callable | None = None,
    replacement: Callable | None = None,
    *,
    inputs: Mapping[str, TensorSpec],
    dtypes: Mapping[str, tuple[torch.dtype, ...]] | None = None,
    dims: Mapping[str, Dim] | None = None,
    check: CheckFn | None = None,
    family: str = "user",
    stage: str = "post_grad",
    kernel_version: str = "",
    tolerance: Mapping[torch.dtype, float] | None = None,
    description: str = "",
    bind_specs: bool = True,
):
    """Register a rewrite. Use directly, or as a decorator on the search function::

        @fusekern.register_pattern("my_scale", replacement=fused, inputs={...})
        def my_scale(x, w, s):
            return torch.nn.functional.linear(x, w) * s

    Raises PatternError (naming the pattern) on a duplicate name, a search function that cannot be
    traced, or a replacement whose output shape or dtype differs on any example variant.
    """
    if name is not None and not isinstance(name, str):
        raise PatternError(f"register_pattern(name, search, replacement, inputs=...): the name comes first and "
                           f"must be a string, got {name!r}")
    if search is None:
        def decorator(fn):
            register_pattern(name or fn.__name__, fn, replacement, inputs=inputs, dtypes=dtypes, dims=dims,
                             check=check, family=family, stage=stage, kernel_version=kernel_version,
                             tolerance=tolerance, description=description, bind_specs=bind_specs)
            return fn
        return decorator
    label = name or getattr(search, '__name__', search)
    if not isinstance(inputs, Mapping):
        raise PatternError(f"pattern {label!r}: inputs must be a dict of "
                           f"parameter name -> fusekern.T(...), got {type(inputs).__name__}")
    for what, value, kind in (("dtypes", dtypes, "dtype variable -> tuple of torch dtypes"),
                              ("dims", dims, "dim name -> fusekern.Dim(...)"),
                              ("tolerance", tolerance, "torch dtype -> relative error")):
        if value is not None and not isinstance(value, Mapping):
            raise PatternError(f"pattern {label!r}: {what} must be a dict of {kind}, got {type(value).__name__}")
    for what, value in (("description", description), ("kernel_version", kernel_version)):
        if not isinstance(value, str):
            raise PatternError(f"pattern {label!r}: {what} must be a string, got {type(value).__name__}")
    if not isinstance(bind_specs, bool):
        raise PatternError(f"pattern {label!r}: bind_specs must be True or False, got {bind_specs!r}")
    pattern = Pattern(
        name=name or search.__name__, search=search, replacement=replacement, inputs=dict(inputs),
        dtypes=dict(dtypes or {}), dims=dict(dims or {}), check=check, family=family, stage=stage,
        kernel_version=kernel_version, tolerance=dict(tolerance or {}), description=description,
        bind_specs=bind_specs,
    )
    # The built-ins' own tests run them through inductor's pass (tests/test_backend_and_registry.py), and
    # importing fusekern should not trace them twice; user patterns are tried at registration.
    builtin = _registering_module() in BUILTIN_MODULES
    _add("pattern", pattern, validate if builtin else _validate_and_try)
    log.debug("registered pattern %s (%s, %s)", pattern.name, pattern.family, pattern.stage)
    return pattern


def unregister_pattern(name: str) -> None:
    """Remove a pattern (tests and interactive use). KeyError for a name no pattern has: a misspelt name would
    otherwise leave the pattern firing. The built-ins load first, so that removing one lasts."""
    if not isinstance(name, str):
        raise TypeError(f"unregister_pattern: pass the pattern's name (a string), got {type(name).__name__}")
    load_patterns()
    with _registry_lock:
        if name not in _patterns:
            raise KeyError(f"fusekern: no pattern named {name!r}; known: {sorted(_patterns)}")
        _patterns.pop(name)
        _order.pop(name, None)


def validate(p: Pattern) -> None:
    """Registration-time checks; every failure names the pattern and the variant."""
    if p.replacement is None or not callable(p.search) or not callable(p.replacement):
        raise PatternError(f"pattern {p.name!r}: search and replacement must be callables")
    if p.check is not None and not callable(p.check):
        raise PatternError(f"pattern {p.name!r}: check must be a function of the matched inputs (returning None "
                           f"or a reason), got {type(p.check).__name__}")
    for name, spec in p.inputs.items():
        if not isinstance(spec, TensorSpec):
            raise PatternError(f"pattern {p.name!r}: input {name!r} must be a fusekern.T(...) spec, got "
                               f"{type(spec).__name__}")
    for key, values in p.dtypes.items():
        if isinstance(values, (str, torch.dtype)) or not values or \
                not all(isinstance(d, torch.dtype) for d in values):
            raise PatternError(f"pattern {p.name!r}: dtypes[{key!r}] must be a non-empty tuple of torch dtypes, "
                               f"got {values!r}")
    named = {d for spec in p.inputs.values() for d in spec.shape if isinstance(d, str)}
    for dim, value in p.dims.items():
        if not isinstance(value, Dim):
            raise PatternError(f"pattern {p.name!r}: dims[{dim!r}] must be a fusekern.Dim(min=, max=, multiple_of=, "
                               f"trace=), got {value!r}")
        if dim not in named:
            raise PatternError(f"pattern {p.name!r}: dims names {dim!r}, which no input's shape uses ({sorted(named)})")
    for dtype, tol in p.tolerance.items():
        if not isinstance(dtype, torch.dtype) or isinstance(tol, bool) or not isinstance(tol, (int, float)) \
                or not 0 < tol < math.inf:
            raise PatternError(f"pattern {p.name!r}: tolerance must map torch dtypes to positive numbers, got "
                               f"{dtype!r}: {tol!r}")
    if p.family not in FAMILIES:
        raise PatternError(f"pattern {p.name!r}: family must be one of {FAMILIES}, got {p.family!r}")
    if p.stage not in STAGES:
        raise PatternError(f"pattern {p.name!r}: stage must be one of {STAGES}, got {p.stage!r}")
    params = list(inspect.signature(p.search).parameters)
    if params != list(p.inputs):
        raise PatternError(f"pattern {p.name!r}: inputs {list(p.inputs)} must name the search "
                           f"function's parameters in order {params}")
    if list(inspect.signature(p.replacement).parameters) != params:
        raise PatternError(f"pattern {p.name!r}: replacement must take the same parameters {params}")
    for spec in p.inputs.values():
        if isinstance(spec.dtype, str) and spec.dtype not in p.dtypes:
            raise PatternError(f"pattern {p.name!r}: dtype variable {spec.dtype!r} has no values in dtypes=")
    unused = sorted(set(p.dtypes) - {spec.dtype for spec in p.inputs.values() if isinstance(spec.dtype, str)})
    if unused:
        raise PatternError(f"pattern {p.name!r}: dtypes names {unused}, which no input's dtype uses")
    from torch._inductor.pattern_matcher import fwd_only

    for variant in p.variants():
        args = p.example_inputs(variant)
        try:
            want = p.search(**args)
        except Exception as e:
            raise PatternError(f"pattern {p.name!r} [{variant.label()}]: search function failed on its "
                               f"example inputs: {type(e).__name__}: {e}") from e
        try:
            got = p.replacement(**args)
        except Exception as e:
            raise PatternError(f"pattern {p.name!r} [{variant.label()}]: replacement failed on the example "
                               f"inputs (CPU tensors: a replacement that launches a GPU kernel needs a CPU path, "
                               f"e.g. a PyTorch branch, or TRITON_INTERPRET=1 for Triton): "
                               f"{type(e).__name__}: {e}") from e
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
            raise PatternError(f"pattern {p.name!r}: search and replacement must each return one tensor")
        if want.shape != got.shape or want.dtype != got.dtype:
            raise PatternError(
                f"pattern {p.name!r} [{variant.label()}]: replacement returns {tuple(got.shape)} {got.dtype}, "
                f"search returns {tuple(want.shape)} {want.dtype}")
        try:
            gm = fwd_only(p.search, list(args.values()))
        except Exception as e:
            raise PatternError(f"pattern {p.name!r} [{variant.label()}]: search function cannot be traced "
                               f"to an ATen graph: {type(e).__name__}: {e}") from e
        if not _output_depends_on_inputs(gm.graph):
            raise PatternError(f"pattern {p.name!r} [{variant.label()}]: search function cannot be traced: its "
                               "traced output does not depend on its inputs (Python-side work such as .numpy(), "
                               ".item() or .tolist() was baked in as a constant)")


def _validate_and_try(p: Pattern) -> None:
    validate(p)
    _rewrites_its_own_search(p)


def _rewrites_its_own_search(p: Pattern) -> None:
    """Run the pattern's inductor pass on each variant's traced search, on fake tensors as a compile does:
    it must rewrite it, without error. A pattern that passed the other checks could still fail there (an
    input the traced graph does not use, a tensor constant built inside the search, a replacement that reads
    a tensor's value), and then it would fail every later compile through fusekern, its own or not, with an
    error that does not name it."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    from fusekern.compiler_pass.canonicalize import trace

    searches = []
    for variant, mode, fake in _fake_examples(p):
        where = f"pattern {p.name!r} [{variant.label()}]"
        with _in_fake_mode(mode):
            try:
                search = trace(p.search, fake).graph
            except Exception as e:
                raise PatternError(f"{where}: the search cannot be traced on fake tensors, as a compile traces "
                                   f"the user's graph (a tensor built inside from Python values, torch.tensor(...), "
                                   f"cannot be matched: make it an input): {type(e).__name__}: {e}") from e
            _check_traced_search(where, search, list(p.inputs))
            try:
                replacement = trace(p.replacement, fake).graph
            except Exception as e:
                raise PatternError(f"{where}: the replacement cannot be traced on fake tensors, as inductor "
                                   f"traces it where the pattern matches (no .item(), .tolist(), .numpy(), control "
                                   f"flow on values, or torch.tensor(...) of Python values): {type(e).__name__}: "
                                   f"{e}") from e
        mutating = _writes_to_inputs(replacement)
        if mutating:
            raise PatternError(f"{where}: the replacement writes in place ({', '.join(mutating)}): where it fires it "
                               "would change a tensor the rest of the user's graph still reads; write it out of place")
        if any(n.op == "get_attr" for n in replacement.nodes):
            raise PatternError(f"{where}: the replacement builds a tensor constant (torch.tensor(...) of Python "
                               "values); make it an input or a Python scalar")
        if p.check is not None:
            try:
                with _in_fake_mode(mode):
                    p.check(dict(zip(p.inputs, fake)))
            except (DataDependentOutputException, DynamicOutputShapeException) as e:
                raise PatternError(f"{where}: the check reads a value, and a compile gives it fake tensors (shapes, "
                                   f"strides, dtypes and devices; no values): {type(e).__name__}: {e}") from e
            except Exception as e:  # noqa: BLE001 - it may raise on these CPU examples only (a CUDA-only query);
                # in a compile, run_check declines the match where it raises
                log.warning("fusekern: pattern %r: its check raised %s on the CPU example inputs (%s); where it "
                            "raises in a compile, the match is declined with the reason", p.name,
                            type(e).__name__, e)
        searches.append((where, mode, search))
    try:
        mpass = _build_matcher_pass(p)
    except Exception as e:
        raise PatternError(f"pattern {p.name!r}: inductor cannot build its pass: {type(e).__name__}: {e}") from e
    for where, mode, search in searches:
        try:
            with _in_fake_mode(mode):
                fired = mpass.apply(search)
        except Exception as e:
            raise PatternError(f"{where}: inductor's pass fails on the pattern's own traced search, as it would "
                               f"in every compile: {type(e).__name__}: {e}") from e
        if not fired and p.check is None:  # (a check may decline the example inputs)
            raise PatternError(f"{where}: the pattern does not match its own traced search")


def _fake_examples(p: Pattern):
    """(variant, a fake mode, the variant's example inputs as fake tensors of that mode), per variant."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for variant in p.variants():
        mode = FakeTensorMode()
        yield variant, mode, [mode.from_tensor(t) for t in p.example_inputs(variant).values()]


@contextlib.contextmanager
def _in_fake_mode(mode):
    """``mode`` entered and set as inductor's, as inductor traces a pattern (a factory such as torch.arange in
    the function then makes fake tensors too)."""
    from torch._inductor.virtualized import V

    with V.set_fake_mode(mode), mode:
        yield


def _check_traced_search(where: str, graph: torch.fx.Graph, names: list[str]) -> None:
    """What inductor's matcher cannot bind or replace in a traced search, said in the pattern's terms."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    if any(a.op == "placeholder" for a in output.all_input_nodes):
        raise PatternError(f"{where}: the search returns an input as it is: there is nothing to rewrite")
    unused = [name for name, n in zip(names, placeholders) if not n.users]
    if unused:
        raise PatternError(f"{where}: the search's traced graph does not use input(s) {unused} (an input read "
                           "only for its shape, or not at all, cannot be bound by the matcher): drop them, or "
                           "take the size from another input")
    mutating = [str(n.target) for n in graph.nodes
                if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]
    if mutating:
        raise PatternError(f"{where}: the search writes in place ({', '.join(mutating)}); the graphs a compile "
                           "rewrites are functional (y.mul_(s) there is y * s), so write it out of place")
    if any(n.op == "get_attr" for n in graph.nodes):
        raise PatternError(f"{where}: the search builds a tensor constant (torch.tensor(...) of Python values), "
                           "which inductor's matcher cannot match; make it an input of the pattern")


def _writes_to_inputs(graph: torch.fx.Graph) -> list[str]:
    """The ops of a traced replacement that write into one of its inputs (through views of it): ``x.relu_()``.
    Writes into a tensor the replacement made itself (``torch.empty_like(x)`` as an ``out=``, a custom op's
    output buffer, ``.exponential_()`` of a fresh tensor) change nothing the user's graph reads."""
    def reaches_input(node) -> bool:
        while isinstance(node, torch.fx.Node) and node.op == "call_function":
            target = node.target
            returns = target._schema.returns if isinstance(target, torch._ops.OpOverload) else ()
            if not (returns and returns[0].alias_info is not None and node.args):  # not a view: a new tensor
                return False
            node = node.args[0]
        return isinstance(node, torch.fx.Node) and node.op == "placeholder"

    found = []
    for n in graph.nodes:
        if not (isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable):
            continue
        for i, arg in enumerate(n.target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
            if any(reaches_input(v) for v in (value if isinstance(value, (list, tuple)) else [value])):
                found.append(str(n.target))
                break
    return found


def _output_depends_on_inputs(graph: torch.fx.Graph) -> bool:
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    seen, stack = set(), list(output.all_input_nodes)
    while stack:
        n = stack.pop()
        if n.op == "placeholder":
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


# ----------------------------------------------------------------------------- lookup


def load_patterns() -> None:
    """Import the built-in pattern modules, then entry points of group ``fusekern.patterns`` (once)."""
    global _loaded, _loading
    if _loaded:
        return
    with _registry_lock:
        if _loaded or _loading:
            return
        _loading = True
        try:
            for mod in BUILTIN_MODULES:
                importlib.import_module(mod)
            from importlib.metadata import entry_points

            for ep in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    obj = ep.load()
                    if callable(obj) and not inspect.ismodule(obj):
                        obj()  # a registration function
                except PatternError as e:
                    # A package's pattern that registration refuses is left out, not every compile: the
                    # others (the built-ins, other packages) still run
                    log.error("fusekern: entry point %r (%s) registered a pattern that was refused, left out: %s",
                              ep.name, ep.value, e)
                except Exception as e:
                    raise ImportError(f"fusekern: entry point {ep.name!r} ({ep.value}) of group "
                                      f"{ENTRY_POINT_GROUP!r} failed to load: {e}") from e
            _loaded = True
        finally:
            _loading = False


def all_patterns() -> list[Pattern]:
    """Every registered pattern and rewrite, in the order the passes run them: the built-in modules in
    BUILTIN_MODULES' order (each in its registration order), then user patterns in theirs."""
    load_patterns()
    with _registry_lock:
        return sorted(_patterns.values(), key=lambda p: _order[p.name])


def get_pattern(name: str) -> Pattern:
    load_patterns()
    try:
        return _patterns[name]
    except KeyError:
        raise KeyError(f"fusekern: no pattern named {name!r}; known: {sorted(_patterns)}") from None


# ----------------------------------------------------------------------------- inductor pass


def _build_matcher_pass(p: Pattern):
    """Trace every variant of ``p`` into one PatternMatcherPass; the check records refusals."""
    from torch._inductor.pattern_matcher import PatternMatcherPass, register_replacement

    from fusekern.compiler_pass.canonicalize import trace
    from fusekern.compiler_pass.report import record_rejection

    argnames = list(p.inputs)
    searches: list = []  # the traced search of each variant, traced when a first match needs them

    def extra_check(match) -> bool:
        from fusekern.patterns.constants import unmatched_keyword

        if not searches:
            searches.extend(trace(p.search, list(p.example_inputs(v).values())).graph for v in p.variants())
        why = unmatched_keyword(searches, match.nodes)
        if why is not None:
            record_rejection(p.name, match.output_nodes()[0], why)
            return False
        values = {}
        for arg in argnames:
            node = match.kwargs.get(arg)
            values[arg] = node.meta.get("val") if isinstance(node, torch.fx.Node) else node
        reason = (spec_mismatch(p.inputs, p.dtypes, p.dims, values) if p.bind_specs else None) or p.run_check(values)
        if reason is not None:
            record_rejection(p.name, match.output_nodes()[0], reason)
            return False
        return True

    mpass = PatternMatcherPass(pass_name=f"fusekern:{p.name}")
    # torch 2.11's register_replacement has no pattern_name; newer versions use it in logs.
    named = {"pattern_name": p.name} if "pattern_name" in inspect.signature(register_replacement).parameters else {}
    for variant in p.variants():
        args = list(p.example_inputs(variant).values())
        register_replacement(
            p.search, p.replacement, args, trace, mpass,
            extra_check=extra_check, skip_duplicates=True, **named,
        )
    return mpass
