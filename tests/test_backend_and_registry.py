"""The backend by name, its options, pass chaining and cache keys; the registry's validation; the CLI."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fusekern
from fusekern.compiler_pass.options import FusekernOptions
from fusekern.compiler_pass.pass_manager import FusekernGraphPass
from fusekern.patterns.registry import Pattern, all_patterns, get_pattern
from fusekern.testing import assert_compiled, check_pattern


def run_py(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # a cache hit would skip the passes we look at
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def test_backend_by_name_in_a_fresh_process():
    code = (
        "import torch, torch.nn.functional as F\n"
        "f = lambda x, w, s: F.linear(x, w.to(x.dtype)) * s\n"
        "x = torch.randn(3, 32, dtype=torch.bfloat16); w = torch.randint(-9, 9, (16, 32), dtype=torch.int8)\n"
        "out = torch.compile(f, backend='fusekern')(x, w, torch.rand(16))\n"
        "import fusekern; print(dict(fusekern.match_report().fired()))\n"
    )
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    assert "{'w8a16_linear_scale': 1}" in proc.stdout


def test_import_is_cheap_and_traces_nothing():
    code = (
        "import time, sys, torch\n"
        "t = time.perf_counter(); import fusekern; dt = time.perf_counter() - t\n"
        "print(dt, 'torch._inductor.pattern_matcher' in sys.modules, 'fusekern.patterns.dequant_matmul' in sys.modules)\n"
    )
    proc = run_py(code)
    dt, inductor, patterns = proc.stdout.split()
    assert float(dt) < 1.0 and inductor == "False" and patterns == "False", proc.stdout


def test_options_split_and_errors():
    opts = FusekernOptions.parse({"fusekern.disable": "sampling", "max_autotune": True})
    assert opts.disable == ("sampling",) and opts.inductor == {"max_autotune": True}
    with pytest.raises(ValueError, match="unknown option 'fusekern.nope'"):
        FusekernOptions.parse({"fusekern.nope": 1})
    x = torch.randn(2, 8)
    with pytest.raises(Exception, match="no pattern or family named 'nope'"):
        torch.compile(lambda x: x + 1, backend="fusekern", options={"fusekern.enable": ["nope"]})(x)


def test_mode_reaches_inductor(monkeypatch):
    import torch._inductor.compile_fx as cfx

    seen = {}
    real = cfx.compile_fx

    def spy(gm, example_inputs, config_patches=None, **kw):
        seen.update(config_patches or {})
        return real(gm, example_inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    torch.compile(lambda x: x * 2, backend="fusekern", mode="reduce-overhead")(torch.randn(4))
    assert seen.get("triton.cudagraphs") is True
    assert isinstance(seen.get("post_grad_custom_pre_pass"), FusekernGraphPass)


def test_user_pass_is_chained_not_dropped():
    calls = []

    class UserPass(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            calls.append(len(graph.nodes))

        def uuid(self):
            return "user-pass-1"

    x = torch.randn(3, 32, dtype=torch.bfloat16)
    w = torch.randint(-9, 9, (16, 32), dtype=torch.int8)
    with torch._inductor.config.patch(post_grad_custom_pre_pass=UserPass(), fx_graph_cache=False):
        assert_compiled(lambda x, w, s: F.linear(x, w.to(x.dtype)) * s, (x, w, torch.rand(16)),
                        fired={"w8a16_linear_scale": 1})
    assert calls, "the user's pass never ran"


def test_uuid_follows_enabled_patterns_and_user_passes():
    pats = all_patterns()
    opts = FusekernOptions()
    a = FusekernGraphPass("post_grad", pats, opts).uuid()
    assert a and a == FusekernGraphPass("post_grad", pats, opts).uuid()
    assert a != FusekernGraphPass("post_grad", pats[:-1], opts).uuid()
    assert FusekernGraphPass("post_grad", pats, opts, chained=lambda g: None).uuid() is None


def test_cache_key_covers_every_fusekern_file():
    """A check's helper, a matcher's analysis or a kernel emitted into inductor's code can change a compiled
    graph without changing the functions a pattern names (an edited helper once let a test load a graph
    rewritten by the old check from inductor's cache): the key hashes every file of the package."""
    import fusekern
    from fusekern.compiler_pass import pass_manager

    root = os.path.dirname(fusekern.__file__)
    on_disk = {os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns if n.endswith(".py")}
    assert set(pass_manager.package_files()) == on_disk
    assert os.path.join(root, "patterns", "dequant_matmul.py") in on_disk  # (the helper's file above)


def test_pattern_fingerprint_covers_the_file_of_its_check(tmp_path, monkeypatch):
    """A user's check that delegates to a helper: editing the helper alone changes the fingerprint."""
    import importlib

    def load(helper_body):
        (tmp_path / "user_pat.py").write_text(
            "def search(x):\n    return x * 2\n\n"
            "def replacement(x):\n    return x + x\n\n"
            f"def helper(v):\n    {helper_body}\n\n"
            "def check(v):\n    return helper(v)\n")
        sys.modules.pop("user_pat", None)
        importlib.invalidate_caches()
        mod = importlib.import_module("user_pat")
        return Pattern("user_pat", mod.search, mod.replacement, inputs={"x": fusekern.T("M", dtype=torch.float32)},
                       check=mod.check).fingerprint

    monkeypatch.syspath_prepend(str(tmp_path))
    a = load("return None")
    assert a == load("return None")
    assert a != load("return 'declined'")
    sys.modules.pop("user_pat", None)


# -- registry ----------------------------------------------------------------------------------

SPEC = dict(x=fusekern.T("M", "K", dtype=torch.float32), w=fusekern.T("N", "K", dtype=torch.float32))


def _mm(x, w):
    return x @ w.t()


def test_duplicate_name_rejected():
    with pytest.raises(fusekern.PatternError, match="'w8a16_linear_scale'.*already registered"):
        fusekern.register_pattern("w8a16_linear_scale", _mm, _mm, inputs=SPEC)


def test_wrong_output_shape_or_dtype_rejected():
    with pytest.raises(fusekern.PatternError, match="'bad_shape'.*replacement returns"):
        fusekern.register_pattern("bad_shape", _mm, lambda x, w: (x @ w.t())[:, :1], inputs=SPEC)
    with pytest.raises(fusekern.PatternError, match="'bad_dtype'.*replacement returns"):
        fusekern.register_pattern("bad_dtype", _mm, lambda x, w: (x @ w.t()).double(), inputs=SPEC)


def test_untraceable_search_rejected():
    def search(x, w):
        return torch.from_numpy((x @ w.t()).numpy())

    with pytest.raises(fusekern.PatternError, match="'untraceable'.*cannot be traced"):
        fusekern.register_pattern("untraceable", search, _mm, inputs=SPEC)


def test_user_pattern_end_to_end():
    name = "user_relu_scale"

    def search(x, w, s):
        return torch.relu(x @ w.t()) * s

    def replacement(x, w, s):
        return torch.clamp_min(torch.mm(x, w.t()), 0.0) * s

    p = fusekern.register_pattern(name, search, replacement,
                                  inputs=dict(SPEC, s=fusekern.T("N", dtype=torch.float32, positive=True)),
                                  check=lambda v: None if v["s"].is_contiguous() else "s must be contiguous")
    try:
        check_pattern(p).assert_ok()
        x, w, s = torch.randn(5, 12), torch.randn(7, 12), torch.rand(7)
        assert_compiled(search, (x, w, s), fired={name: 1}, options={"fusekern.enable": [name]},
                        gone=["aten.relu.default"], present=["aten.clamp_min.default"])
        assert_compiled(search, (x, w, torch.rand(14)[::2]), fired={}, options={"fusekern.enable": [name]})
        assert any("s must be contiguous" in r.reason for r in fusekern.match_report().rejections())
        assert_compiled(search, (x, w, torch.rand(1, 7)), fired={}, options={"fusekern.enable": [name]})
        assert any("s has 2 dims, the pattern's spec 1" in r.reason for r in fusekern.match_report().rejections())
    finally:
        fusekern.unregister_pattern(name)


@pytest.mark.usefixtures("no_compile_caches")
def test_user_pattern_keywords_it_lacks_decline_and_its_sizes_stay_free():
    """Inductor re-matches a search at the matched sizes and dtypes with its constants literal, but never
    compares a keyword the search's node lacks: ``cumsum(x, -1)`` took ``cumsum(x, -1, dtype=float64)`` and
    the replacement returned fp32. Declined with the reason; a float derived from a size still fires at
    every size (a check comparing against the example trace once declined it)."""
    spec = dict(x=fusekern.T("M", "K", dtype=torch.float32))
    try:
        fusekern.register_pattern("user_cumsum", lambda x: torch.cumsum(torch.relu(x), -1) * 2.0,
                                  lambda x: torch.cumsum(torch.clamp_min(x, 0.0), -1) * 2.0, inputs=spec)
        fusekern.register_pattern("user_rsqrt_k", lambda x: torch.relu(x) * x.shape[-1] ** -0.5,
                                  lambda x: torch.clamp_min(x, 0.0) * x.shape[-1] ** -0.5, inputs=spec)
        x = torch.randn(5, 12)
        only = {"fusekern.enable": ["user_cumsum", "user_rsqrt_k"]}
        assert_compiled(lambda x: torch.cumsum(torch.relu(x), -1) * 2.0, (x,), fired={"user_cumsum": 1}, options=only)
        assert_compiled(lambda x: torch.cumsum(torch.relu(x), -1, dtype=torch.float64) * 2.0, (x,), fired={},
                        options=only)
        reasons = [r.reason for r in fusekern.match_report().rejections()]
        assert any("dtype=torch.float64, which the pattern does not compute" in r for r in reasons), reasons
        for K in (5, 64):
            assert_compiled(lambda x: torch.relu(x) * x.shape[-1] ** -0.5, (torch.randn(3, K),),
                            fired={"user_rsqrt_k": 1}, options=only)
    finally:
        for name in ("user_cumsum", "user_rsqrt_k"):
            if name in [p.name for p in all_patterns()]:
                fusekern.unregister_pattern(name)


def test_unmatched_keyword_reads_the_schema_defaults():
    from fusekern.compiler_pass.canonicalize import trace
    from fusekern.patterns.constants import unmatched_keyword

    x, y = torch.randn(5, 12), torch.randn(5, 12)

    def nodes(fn):
        return [n for n in trace(fn, [x, y]).graph.nodes if n.op == "call_function"]

    plain = [trace(lambda x, y: torch.add(torch.relu(x), y), [x, y]).graph]
    assert unmatched_keyword(plain, nodes(lambda x, y: torch.add(torch.relu(x), y))) is None
    assert unmatched_keyword(plain, nodes(lambda x, y: torch.add(torch.relu(x), y, alpha=1.0))) is None  # the default
    assert "alpha=2" in unmatched_keyword(plain, nodes(lambda x, y: torch.add(torch.relu(x), y, alpha=2)))
    carried = [trace(lambda x, y: torch.add(torch.relu(x), y, alpha=2), [x, y]).graph]
    assert unmatched_keyword(carried, nodes(lambda x, y: torch.add(torch.relu(x), y, alpha=3))) is None  # inductor's


def test_entry_point_group_is_loaded(monkeypatch):
    import importlib.metadata as md

    import fusekern.patterns.registry as reg

    loaded = []

    class EP:
        name, value = "demo", "demo:register"

        def load(self):
            def register():  # a registration function that registers (it once recursed into load_patterns)
                loaded.append(True)
                fusekern.register_pattern("ep_demo", _mm, lambda x, w: torch.mm(x, w.t()), inputs=SPEC)
            return register

    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda group=None, **kw: [EP()] if group == reg.ENTRY_POINT_GROUP else real(group=group, **kw))
    monkeypatch.setattr(reg, "_loaded", False)
    try:
        reg.load_patterns()
        assert loaded == [True] and get_pattern("ep_demo").name == "ep_demo"
    finally:
        fusekern.unregister_pattern("ep_demo")


def test_an_entry_points_refused_pattern_is_left_out_not_every_compile(monkeypatch, caplog):
    """A package's pattern that registration refuses (registration grew stricter) is logged and left out; the
    package's other patterns and every compile still work."""
    import importlib.metadata as md

    import fusekern.patterns.registry as reg

    class EP:
        name, value = "strict", "strict:register"

        def load(self):
            def register():
                fusekern.register_pattern("ep_good", _mm, lambda x, w: torch.mm(x, w.t()), inputs=SPEC)
                fusekern.register_pattern("ep_in_place", lambda x, w: (x @ w.t()).mul_(2.0),
                                          lambda x, w: (x @ w.t()) * 2.0, inputs=SPEC)
            return register

    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda group=None, **kw: [EP()] if group == reg.ENTRY_POINT_GROUP else real(group=group, **kw))
    monkeypatch.setattr(reg, "_loaded", False)
    try:
        with caplog.at_level("ERROR", logger="fusekern"):
            reg.load_patterns()
        names = {p.name for p in all_patterns()}
        assert "ep_good" in names and "ep_in_place" not in names and reg._loaded
        assert any("'strict'" in r.getMessage() and "writes in place" in r.getMessage() for r in caplog.records)
    finally:
        fusekern.unregister_pattern("ep_good")


# -- harness -----------------------------------------------------------------------------------


MM_RELU = dict(x=fusekern.T("M", "K", dtype=torch.float32), w=fusekern.T("N", "K", dtype=torch.float32),
               s=fusekern.T("N", dtype=torch.float32))


@pytest.mark.parametrize("search,replacement,check,why", [
    (lambda x, w, s: torch.relu(x @ w.t()), lambda x, w, s: torch.clamp_min(x @ w.t(), 0.0), None,
     r"does not use input\(s\) \['s'\]"),
    (lambda x, w, s: torch.relu(x @ w.t()) * s.shape[0], lambda x, w, s: torch.clamp_min(x @ w.t(), 0.0) * s.shape[0],
     None, r"does not use input\(s\) \['s'\]"),
    (lambda x, w, s: (x @ w.t()) * s * torch.tensor([2.0, 3.0]).sum(), lambda x, w, s: (x @ w.t()) * s * 5.0, None,
     "search builds a tensor constant"),
    (lambda x, w, s: (x @ w.t()) * s, lambda x, w, s: (x @ w.t()) * s * torch.tensor([1.0, 0.0]).sum(), None,
     "replacement builds a tensor constant"),
    (lambda x, w, s: x, lambda x, w, s: x.clone(), None, "returns an input as it is"),
    (lambda x, w, s: (x @ w.t()).mul_(s), lambda x, w, s: (x @ w.t()) * s, None, r"writes in place \(aten.mul_"),
    (lambda x, w, s: (x @ w.t()) * s, lambda x, w, s: (x @ w.t()) * s * float(s.sum().item() != 0), None,
     "replacement cannot be traced on fake tensors.*DataDependent"),
    (lambda x, w, s: (x @ w.t()) * s, lambda x, w, s: torch.mm(x, w.t()) * s,
     lambda v: None if bool((v["s"] > 0).all()) else "s must be positive", "check reads a value"),
], ids=["unused_input", "shape_only_input", "tensor_constant_in_search", "tensor_constant_in_replacement",
        "identity", "in_place", "replacement_reads_a_value", "check_reads_values"])
def test_what_inductor_could_not_apply_is_refused_at_registration(search, replacement, check, why):
    """Each of these passed registration and the harness once, then failed in the compile (every later compile
    of the process, for the tensor constant) with errors that did not name the pattern, or never fired (the
    check). Now registration runs the pattern's pass on its own traced search, on fake tensors, and refuses
    them; an unrelated compile afterwards still works."""
    def s_(x, w, s):
        return search(x, w, s)

    def r_(x, w, s):
        return replacement(x, w, s)

    with pytest.raises(fusekern.PatternError, match="'refused'.*" + why):
        fusekern.register_pattern("refused", s_, r_, inputs=MM_RELU, check=check)
    assert "refused" not in {p.name for p in all_patterns()}
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    torch.testing.assert_close(torch.compile(lambda a, b: torch.relu(a @ b) * 2, backend="fusekern")(a, b),
                               torch.relu(a @ b) * 2)


def test_tensor_factories_in_search_and_replacement_register_and_fire():
    """torch.arange / torch.full inside the functions are traced as inductor traces them (the fake mode entered),
    not refused as constants (a review found them refused)."""
    def search(x, w, s):
        return torch.softmax((x @ w.t()) * s + torch.arange(s.shape[0], dtype=x.dtype), dim=-1)

    def replacement(x, w, s):
        y = torch.addcmul(torch.arange(s.shape[0], dtype=x.dtype), torch.mm(x, w.t()), s)
        return torch.softmax(y * torch.full((), 1.0, dtype=x.dtype), dim=-1)

    name = "user_factories"
    fusekern.register_pattern(name, search, replacement, inputs=MM_RELU)
    try:
        x, w, s = torch.randn(5, 12), torch.randn(7, 12), torch.rand(7)
        assert_compiled(search, (x, w, s), fired={name: 1}, options={"fusekern.enable": [name]})
    finally:
        fusekern.unregister_pattern(name)


def _builtin_searches() -> list[Pattern]:
    """The built-in search / replacement patterns (not the structural rewrites), at least the six W8A16 ones."""
    searches = [p for p in all_patterns() if isinstance(p, Pattern) and p.family != "user"]
    assert len(searches) >= 6
    return searches


def test_every_builtin_pattern_rewrites_its_own_search():
    """What registration tries for user patterns, for the built-ins (not run at import: it traces them all)."""
    from fusekern.patterns.registry import _rewrites_its_own_search

    for p in _builtin_searches():
        _rewrites_its_own_search(p)


def test_name_and_dims_are_checked():
    with pytest.raises(fusekern.PatternError, match="the name comes first and must be a string"):
        fusekern.register_pattern(_mm, _mm, inputs=SPEC)
    with pytest.raises(fusekern.PatternError, match=r"dims\['K'\] must be a fusekern.Dim"):
        fusekern.register_pattern("bad_dims", _mm, _mm, inputs=SPEC, dims={"K": 64})
    with pytest.raises(ValueError, match="allows no size"):
        fusekern.Dim(min=5, max=7, multiple_of=8)
    with pytest.raises(ValueError, match="trace size 9 is not an allowed size"):
        fusekern.Dim(max=8, trace=9)


def test_trace_sizes_keep_to_each_dims_bounds():
    """The trace size of a Dim with a small max once ran past it (N = 7 for Dim(max=4)), and a replacement that
    relied on the bound failed to register."""
    from fusekern.patterns.spec import trace_sizes

    spec = dict(x=fusekern.T("M", "K", dtype=torch.float32), w=fusekern.T("N", "K", dtype=torch.float32))
    dims = {"N": fusekern.Dim(max=4), "K": fusekern.Dim(min=8, multiple_of=8), "M": fusekern.Dim(max=6)}
    sizes = trace_sizes(spec, dims)
    assert all(dims[n].allows(sizes[n]) for n in dims), sizes
    assert len({sizes[n] for n in dims}) == 3  # distinct where the bounds allow


def test_user_pattern_fingerprint_follows_what_its_functions_compute():
    """The FX graph cache key of a user pattern follows its traced search and replacement, so values their
    source does not show count: a closure's constant (once, a compiled model kept the old factor from the
    cache), and the check's closure."""
    def make(c, limit):
        def replacement(x, w, s):
            return torch.clamp_min(torch.mm(x, w.t()), 0.0) * s * c

        def search(x, w, s):
            return torch.relu(x @ w.t()) * s * c
        return Pattern("fp", search, replacement, inputs=MM_RELU,
                       check=lambda v: None if v["x"].shape[0] < limit else "too many rows").fingerprint

    assert make(2.0, 8) == make(2.0, 8)
    assert make(2.0, 8) != make(3.0, 8)
    assert make(2.0, 8) != make(2.0, 9)


def test_user_pattern_fingerprint_follows_the_constants_its_check_reads(tmp_path, monkeypatch):
    """A check that reads a constant of another module (``limits.MAX_ROWS``) or a global of its own: editing
    the constant changes the key (the check is not traced, and only its own file was hashed)."""
    import importlib
    import types as pytypes

    limits = pytypes.ModuleType("user_limits")
    monkeypatch.setitem(sys.modules, "user_limits", limits)
    (tmp_path / "user_check_pat.py").write_text(
        "import user_limits\n"
        "OK_DTYPES = ('float32',)\n"
        "def check(v):\n"
        "    return None if v['x'].shape[0] <= user_limits.MAX_ROWS and str(v['x'].dtype)[6:] in OK_DTYPES else 'no'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    mod = importlib.import_module("user_check_pat")
    try:
        def key():
            return Pattern("fp", _mm, lambda x, w: torch.mm(x, w.t()), inputs=SPEC, check=mod.check).fingerprint

        limits.MAX_ROWS = 8
        a = key()
        assert a == key()
        limits.MAX_ROWS = 16
        assert key() != a
        limits.MAX_ROWS, mod.OK_DTYPES = 8, ("float32", "bfloat16")
        assert key() != a
    finally:
        sys.modules.pop("user_check_pat", None)


def _processes_sharing_a_cache(tmp_path, code: str, argvs) -> list[subprocess.CompletedProcess]:
    """``code`` run in one fresh process per argument list, one after another, with inductor's caches on and in
    ``tmp_path`` (each run must succeed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    runs = [subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=600)
            for argv in argvs]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr
    return runs


def test_a_graph_from_inductors_cache_reports_what_fired_when_compiled(tmp_path):
    """A second process loads the graph from inductor's FX graph cache, so the passes do not run; the report
    says so, once per graph (the AOTAutograd and FX caches both count the same graph), with what fired when
    it was compiled (the README's first example printed nothing of that on a second run)."""
    code = (
        "import torch, torch.nn.functional as F, fusekern\n"
        "f = lambda x, w, s: F.linear(x, w.to(x.dtype)) * s\n"
        "x = torch.randn(3, 32, dtype=torch.bfloat16); w = torch.randint(-9, 9, (16, 32), dtype=torch.int8)\n"
        "torch.compile(f, backend='fusekern')(x, w, torch.rand(16))\n"
        "r = fusekern.match_report()\n"
        "print('FIRED', dict(r.fired()), 'HITS', r.cache_hits, 'CACHED', dict(r.cached_fired))\n"
        "print(r)\n"
    )
    runs = _processes_sharing_a_cache(tmp_path, code, [(), ()])
    assert "FIRED {'w8a16_linear_scale': 1} HITS 0 CACHED {}" in runs[0].stdout
    assert "FIRED {} HITS 1 CACHED {'w8a16_linear_scale': 1}" in runs[1].stdout
    assert "w8a16_linear_scale                       x1 (when first compiled)" in runs[1].stdout


def test_harness_reports_worst_input_of_a_wrong_pattern():
    name = "wrong_on_purpose"
    p = fusekern.register_pattern(name, _mm, lambda x, w: x @ w.t() * 1.01, inputs=SPEC)
    try:
        r = check_pattern(p, draws=6)
        assert not r.passed
        with pytest.raises(AssertionError, match=r"FAIL wrong_on_purpose.*worst .*sizes=.*rel_err="):
            r.assert_ok()
    finally:
        fusekern.unregister_pattern(name)


def test_harness_reports_the_searchs_own_error_beside_the_replacements():
    """Each case carries the search function's own error against the float64 reference, so a report shows how
    far the graph being replaced already was: bf16 matmuls are off by about bf16's rounding, and a replacement
    that computes the same thing in the same dtypes is within a small factor of it."""
    name = "same_mm_bf16"
    spec = dict(x=fusekern.T("M", "K", dtype=torch.bfloat16), w=fusekern.T("N", "K", dtype=torch.bfloat16))
    p = fusekern.register_pattern(name, _mm, lambda x, w: torch.mm(x, w.t()), inputs=spec)
    try:
        r = check_pattern(p, draws=6)
        assert r.passed
        for c in r.cases:
            assert 1e-4 < c.search_err < 1e-2 and c.err <= 4 * c.search_err, (c.err, c.search_err)
        assert "the search's own" in r.worst.describe(p)
    finally:
        fusekern.unregister_pattern(name)


def test_every_builtin_pattern_is_equivalent():
    for p in _builtin_searches():
        check_pattern(p, draws=12).assert_ok()
    # Structural rewrites (random outputs) are proven by their family's tests; the harness says so.
    rewrite = get_pattern("sample")
    with pytest.raises(TypeError, match="structural rewrite"):
        check_pattern(rewrite)


def test_cli_check_prints_a_table():
    proc = subprocess.run([sys.executable, "-m", "fusekern", "check", "--device", "cpu", "--draws", "6"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "w8a16_linear_scale" in proc.stdout and " 0 failed" in proc.stdout


def test_cli_check_imports_the_users_patterns(tmp_path):
    """A script's patterns were out of the command's reach: ``--import`` registers them first (a wrong one is
    reported as failing, a missing module as exit code 2)."""
    (tmp_path / "my_patterns.py").write_text(
        "import torch, fusekern\n"
        "spec = dict(x=fusekern.T('M', 'K', dtype=torch.float32), w=fusekern.T('N', 'K', dtype=torch.float32))\n"
        "fusekern.register_pattern('my_relu_mm', lambda x, w: torch.relu(x @ w.t()),\n"
        "                          lambda x, w: torch.clamp_min(torch.mm(x, w.t()), 0.0), inputs=spec)\n"
        "fusekern.register_pattern('my_wrong_mm', lambda x, w: torch.relu(x @ w.t()),\n"
        "                          lambda x, w: torch.relu(x @ w.t()) * 1.01, inputs=spec)\n")
    base = [sys.executable, "-m", "fusekern", "check", "--device", "cpu", "--draws", "4"]
    proc = subprocess.run(base + ["--import", "my_patterns", "--pattern", "my_relu_mm", "--pattern", "my_wrong_mm"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("my_")}
    assert lines["my_relu_mm"].endswith("PASS") and lines["my_wrong_mm"].endswith("FAIL"), proc.stdout
    missing = subprocess.run(base + ["--import", "no_such_module"], capture_output=True, text=True, timeout=600,
                             cwd=tmp_path)
    assert missing.returncode == 2 and "no_such_module" in missing.stderr


def test_a_user_pattern_cannot_take_a_builtin_name_before_the_builtins_load():
    """The built-ins load lazily (at the first compile); registering one of their names first once succeeded
    and then broke every compile of the process."""
    code = (
        "import torch, fusekern\n"
        "spec = dict(x=fusekern.T('M', 'K', dtype=torch.float32), w=fusekern.T('N', 'K', dtype=torch.float32))\n"
        "mm = lambda x, w: x @ w.t()\n"
        "try:\n"
        "    fusekern.register_pattern('w8a16_linear_scale', lambda x, w: x @ w.t(), lambda x, w: x @ w.t(), inputs=spec)\n"
        "except fusekern.PatternError as e:\n"
        "    print('refused:', e)\n"
        "f = lambda x, w, s: torch.nn.functional.linear(x, w.to(x.dtype)) * s\n"
        "x = torch.randn(3, 32, dtype=torch.bfloat16); w = torch.randint(-9, 9, (16, 32), dtype=torch.int8)\n"
        "torch.compile(f, backend='fusekern')(x, w, torch.rand(16))\n"
        "print(dict(fusekern.match_report().fired()))\n"
    )
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    assert "refused: pattern 'w8a16_linear_scale': a pattern of that name is already registered" in proc.stdout
    assert "{'w8a16_linear_scale': 1}" in proc.stdout


def test_registration_arguments_are_checked():
    def bad(**kw):
        args = dict(inputs=SPEC) | kw
        return fusekern.register_pattern("bad_args", _mm, _mm, **args)

    with pytest.raises(fusekern.PatternError, match="'bad_args': check must be a function"):
        bad(check="s must be 1-D")
    with pytest.raises(fusekern.PatternError, match=r"'bad_args': dtypes\['act'\] must be a non-empty tuple"):
        bad(inputs=dict(x=fusekern.T("M", "K", dtype="act"), w=fusekern.T("N", "K", dtype=torch.float32)),
            dtypes={"act": ()})
    with pytest.raises(fusekern.PatternError, match="'bad_args': tolerance must map torch dtypes"):
        bad(tolerance={"float32": 1e-3})
    with pytest.raises(fusekern.PatternError, match="'bad_args': input 'w' must be a fusekern.T"):
        bad(inputs=dict(x=fusekern.T("M", "K", dtype=torch.float32), w=(3, 4)))
    with pytest.raises(fusekern.PatternError, match="'bad_args': inputs must be a dict"):
        bad(inputs=None)
    with pytest.raises(fusekern.PatternError, match="'bad_args': dims names 'Q', which no input's shape uses"):
        bad(dims={"Q": fusekern.Dim(1, 8)})
    with pytest.raises(TypeError, match="T: batch_dims must be a tuple"):
        fusekern.T("M", "K", dtype=torch.float32, batch_dims=1)
    assert "bad_args" not in {p.name for p in all_patterns()}


def test_a_check_that_raises_declines_with_the_reason(caplog):
    """A check that raises (other than by reading a value) is registered with a warning, since it may raise on
    the CPU examples only (a CUDA-only query); in a compile, where it raises, the match declines with the
    reason."""
    name = "user_broken_check"
    with caplog.at_level("WARNING", logger="fusekern"):
        fusekern.register_pattern(name, _mm, lambda x, w: torch.mm(x, w.t()), inputs=SPEC,
                                  check=lambda v: v["nope"])
    assert any("'user_broken_check': its check raised KeyError" in r.getMessage() for r in caplog.records)
    try:
        x, w = torch.randn(5, 12), torch.randn(7, 12)
        assert_compiled(_mm, (x, w), fired={}, options={"fusekern.enable": [name]})
        assert any("check raised KeyError" in r.reason for r in fusekern.match_report().rejections())
    finally:
        fusekern.unregister_pattern(name)


def test_option_values_are_checked():
    with pytest.raises(TypeError, match="fusekern.enable must be a list of names"):
        FusekernOptions.parse({"fusekern.enable": 5})
    with pytest.raises(TypeError, match="fusekern.debug must be True or False"):
        FusekernOptions.parse({"fusekern.debug": "false"})
    with pytest.raises(TypeError, match="fusekern.dump_dir must be a path"):
        FusekernOptions.parse({"fusekern.dump_dir": 3})
    # inductor's options as torch.compile's inductor wrapper takes them (from review)
    assert FusekernOptions.parse({"max-autotune": True}).inductor == {"max_autotune": True}
    with pytest.raises(TypeError, match="'triton.cudagraphs' takes a bool, got str 'yes'"):
        FusekernOptions.parse({"triton.cudagraphs": "yes"})
    with pytest.raises(TypeError, match="option names are strings"):
        FusekernOptions.parse({3: True})
    with pytest.raises(ValueError, match="unknown option 'disable'.*the prefix: 'fusekern.disable'"):
        FusekernOptions.parse({"disable": ["sampling"]})


def test_harness_arguments_cannot_make_a_check_vacuous():
    with pytest.raises(ValueError, match="layouts must be a non-empty list"):
        check_pattern("w8a16_linear_scale", layouts="contiguous")
    with pytest.raises(ValueError, match="layouts must be a non-empty list"):
        check_pattern("w8a16_linear_scale", layouts=[])
    with pytest.raises(TypeError, match="pass a pattern or its name"):
        check_pattern(5)
    x, w = torch.randn(5, 12), torch.randn(7, 12)
    with pytest.raises(ValueError, match="'aten.mm' is not an op overload name"):
        assert_compiled(_mm, (x, w), gone=["aten.mm"])


def test_assert_compiled_fails_on_nan_where_eager_has_a_number():
    from fusekern.testing import rel_err

    nan = float("nan")
    assert rel_err(torch.tensor([1.0, nan]), torch.tensor([1.0, nan])) == 0.0
    assert rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, nan])) == float("inf")
    assert rel_err(torch.tensor([0.0, nan]), torch.tensor([1.0, nan])) == 1.0
    name = "user_zeros"  # a wrong replacement: zeros, which eager's NaN used to hide (rel_err was NaN)
    fusekern.register_pattern(name, _mm, lambda x, w: torch.zeros_like(torch.mm(x, w.t())), inputs=SPEC)
    try:
        x, w = torch.randn(5, 12), torch.randn(7, 12)
        x[0, 0] = nan
        with pytest.raises(AssertionError, match="compiled output differs from eager"):
            assert_compiled(_mm, (x, w), options={"fusekern.enable": [name]})
    finally:
        fusekern.unregister_pattern(name)


def test_pass_order_does_not_depend_on_import_order():
    """Scale folding must run before the structural decode rewrite (it takes W8A8 forms the decode would read as
    weight-only); importing dequant_matmul first (as a test module once did) registered it first."""
    code = (
        "import fusekern.patterns.dequant_matmul, fusekern.patterns.sampling\n"
        "from fusekern.patterns.registry import all_patterns, BUILTIN_MODULES\n"
        "import torch, fusekern\n"
        "fusekern.register_pattern('user_mm', lambda x, w: x @ w.t(), lambda x, w: torch.mm(x, w.t()),\n"
        "    inputs=dict(x=fusekern.T('M', 'K', dtype=torch.float32), w=fusekern.T('N', 'K', dtype=torch.float32)))\n"
        "print(' '.join(p.name for p in all_patterns()))\n"
    )
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    names = proc.stdout.split()
    assert names.index("scale_folding") < names.index("fp8_kv_attention") < names.index("decode_attention") \
        < names.index("w8a16_linear_scale_bias") < names.index("decode_matmul") < names.index("sample") \
        < names.index("greedy_mask") < names.index("user_mm") == len(names) - 1, names


def test_report_lists_a_decline_once_and_groups_those_at_nodes_another_pattern_took():
    """The demo's report once listed every decline twice (one per traced variant of a pattern) and 14 lines of
    scale_folding declines at matmuls decode_matmul then took; those now take one line per reason."""
    from fusekern.compiler_pass import report as R

    R.reset_match_report()
    with R.graph_report("post_grad") as g:
        for _ in range(2):  # (two variants of one pattern reach the same node)
            R.record_rejection("w8a16", "mm_1", "weight dtype torch.float8_e4m3fn is not int8")
        for i in range(3):
            R.record_rejection("scale_folding", f"mm_{i + 2}", "no scale to fold")
        g.fired["decode_matmul"] += 3
        R.mark_superseded(g, alive={"mm_1", "x", "out"})
    text = str(R.match_report())
    assert text.count("weight dtype torch.float8_e4m3fn is not int8") == 1
    assert "declined w8a16" in text and " at mm_1:" in text
    assert "scale_folding                            x3, nodes another pattern then took: no scale to fold" in text
    assert "at mm_2" not in text
    assert len(R.match_report().rejections()) == 4  # (every decline stays in the data)
    R.reset_match_report()


def test_graph_dumps_are_named_by_the_reports_graph_id(tmp_path):
    """Dumps (a dump_dir alone bypasses inductor's cache, which would skip the passes) carry the graph id the
    match report prints, before and after the passes."""
    fusekern.reset_match_report()
    f = lambda x, w, s: F.linear(x, w.to(x.dtype)) * s  # noqa: E731
    x, w = torch.randn(3, 32, dtype=torch.bfloat16), torch.randint(-9, 9, (16, 32), dtype=torch.int8)
    torch.compile(f, backend="fusekern", options={"fusekern.dump_dir": str(tmp_path)})(x, w, torch.rand(16))
    fired = [g for g in fusekern.match_report().graphs if g.fired]
    assert len(fired) == 1
    names = {p.name.split("-", 1)[1] for p in tmp_path.iterdir()}
    assert {f"graph{fired[0].graph_id}-post_grad-before.txt", f"graph{fired[0].graph_id}-post_grad-after.txt"} <= names
    after = (tmp_path / next(p.name for p in tmp_path.iterdir() if p.name.endswith(
        f"graph{fired[0].graph_id}-post_grad-after.txt"))).read_text()
    assert "w8a16_linear" in after


def test_a_pattern_that_fails_in_a_compile_is_named(monkeypatch):
    """What registration cannot foresee (a failure on one graph's shapes) stops the compile with the pattern's
    name and the option that leaves it out, not an inductor error that names no pattern."""
    name = "user_fails_late"
    fusekern.register_pattern(name, _mm, lambda x, w: torch.mm(x, w.t()), inputs=SPEC)
    try:
        def boom(graph):
            raise NotImplementedError("a shape the pattern did not foresee")

        monkeypatch.setattr(get_pattern(name).matcher_pass(), "apply", boom)
        with pytest.raises(Exception, match=r"pattern 'user_fails_late' \(user\) failed while rewriting a graph: "
                                            r"NotImplementedError.*'fusekern.disable': \['user_fails_late'\]"):
            torch.compile(_mm, backend="fusekern", options={"fusekern.enable": [name]})(
                torch.randn(5, 12), torch.randn(7, 12))
    finally:
        fusekern.unregister_pattern(name)


def test_user_pattern_fingerprint_is_the_same_in_every_process(tmp_path):
    """A key that changed from one process to the next (a nested lambda's code object, an object in a closure
    printed with its address, a set's order) would make inductor's cache miss for that pattern every time."""
    (tmp_path / "user_fp.py").write_text(
        "import torch, fusekern\n"
        "from fusekern.patterns.registry import Pattern\n"
        "class Limit:\n    pass\n"
        "LIMIT = Limit()\n"
        "def make(limit):\n"
        "    ok = {torch.float16, torch.bfloat16, torch.float32}\n"
        "    def check(v):\n"
        "        rows = lambda t: t.shape[0]\n"
        "        if v['x'].device.type not in {'cpu', 'cuda', 'xpu', 'mps'} or v['x'].dtype not in ok:\n"
        "            return 'no'\n"
        "        return None if limit is not None and rows(v['x']) > 0 else 'no'\n"
        "    return check\n"
        "spec = dict(x=fusekern.T('M', 'K', dtype=torch.float32), w=fusekern.T('N', 'K', dtype=torch.float32))\n"
        "p = Pattern('fp', lambda x, w: torch.relu(x @ w.t()), lambda x, w: torch.clamp_min(x @ w.t(), 0.0),\n"
        "            inputs=spec, check=make(LIMIT))\n"
        "print('FP', p.fingerprint)\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import user_fp"
    prints = []
    for seed in ("1", "2"):  # (a set's order follows the hash seed; a dtype's hash changes per process anyway)
        os.environ["PYTHONHASHSEED"], was = seed, os.environ.get("PYTHONHASHSEED")
        try:
            prints.append(run_py(code))
        finally:
            if was is None:
                del os.environ["PYTHONHASHSEED"]
            else:
                os.environ["PYTHONHASHSEED"] = was
    for proc in prints:
        assert proc.returncode == 0, proc.stderr
    fps = [line for proc in prints for line in proc.stdout.splitlines() if line.startswith("FP ")]
    assert len(fps) == 2 and fps[0] == fps[1]


def test_a_decline_says_which_line_of_the_users_code_made_the_node():
    fusekern.reset_match_report()
    f = lambda x, w, s: F.linear(x, w.to(x.dtype)) * s  # noqa: E731  (fp32 x: the W8A16 patterns decline)
    torch.compile(f, backend="fusekern", options={"fusekern.debug": True})(
        torch.randn(3, 32), torch.randint(-9, 9, (16, 32), dtype=torch.int8), torch.rand(16))
    mine = [r for r in fusekern.match_report().rejections() if r.pattern == "w8a16_linear_scale"]
    line = test_a_decline_says_which_line_of_the_users_code_made_the_node.__code__.co_firstlineno + 2
    assert mine and all(r.where == f"test_backend_and_registry.py:{line}" for r in mine), mine
    assert f"(test_backend_and_registry.py:{line}): activation dtype" in str(fusekern.match_report())



@pytest.mark.usefixtures("no_compile_caches")
def test_a_match_outside_the_declared_specs_is_declined():
    """Inductor's matcher compares ops, not dtypes or sizes: a pattern traced for fp32 2-D inputs whose N is a
    multiple of 8 fired on bf16, on 3-D inputs and at N = 12, where the harness never tested it (and this
    replacement is wrong). Each is declined with the reason; inside the specs it fires."""
    def search(x, s):
        return (x * s).sum(-1)

    def every_eighth(x, s):  # right only where N is a multiple of 8
        n = x.shape[-1] // 8 * 8
        return (x[..., :n] * s[:n]).sum(-1)

    name = "user_mul8_sum"
    fusekern.register_pattern(name, search, every_eighth,
                              inputs=dict(x=fusekern.T("M", "N", dtype=torch.float32), s=fusekern.T("N", dtype=torch.float32)),
                              dims={"N": fusekern.Dim(min=8, max=64, multiple_of=8)})
    only = {"fusekern.enable": [name]}
    try:
        check_pattern(name).assert_ok()
        fn = lambda x, s: search(x, s) + 1  # noqa: E731
        assert_compiled(fn, (torch.randn(4, 16), torch.randn(16)), fired={name: 1}, options=only)
        for args, why in [((torch.randn(4, 12), torch.randn(12)), "N = 12 is not known to be a multiple of 8"),
                          ((torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)),
                           "x is torch.bfloat16, the pattern's spec torch.float32"),
                          ((torch.randn(2, 4, 16), torch.randn(16)), "x has 3 dims, the pattern's spec 2")]:
            assert_compiled(fn, args, fired={}, options=only)
            reasons = [r.reason for r in fusekern.match_report().rejections()]
            assert any(why in r for r in reasons), reasons
        # a dynamic N is not known to be a multiple of 8: declined, and right at every size
        assert_compiled(fn, (torch.randn(4, 16), torch.randn(16)), fired={}, options=only, dynamic=True,
                        extra_args=[(torch.randn(4, 12), torch.randn(12))])
    finally:
        fusekern.unregister_pattern(name)


def test_a_replacement_that_writes_in_place_is_refused():
    """Where it fired, ``x.relu_()`` changed the user's x, which the rest of the graph read again; the harness had
    passed it (the replacement and the reference shared the inputs)."""
    with pytest.raises(fusekern.PatternError, match=r"'user_relu_inplace'.*replacement writes in place \(aten.relu_"):
        fusekern.register_pattern("user_relu_inplace", lambda x, w: torch.relu(x) * w, lambda x, w: x.relu_() * w,
                                  inputs=dict(x=fusekern.T("M", "N", dtype=torch.float32),
                                              w=fusekern.T("M", "N", dtype=torch.float32)))
    assert "user_relu_inplace" not in {p.name for p in all_patterns()}
    # writes into tensors the replacement made itself change nothing the graph reads: registered
    spec = dict(x=fusekern.T("M", "N", dtype=torch.float32), w=fusekern.T("M", "N", dtype=torch.float32))

    def out_form(x, w):
        out = torch.empty_like(x)
        torch.mul(torch.relu(x), w, out=out)
        return out

    for name, replacement in (("user_out_form", out_form),
                              ("user_fresh_in_place", lambda x, w: torch.zeros_like(x).add_(torch.relu(x) * w))):
        fusekern.register_pattern(name, lambda x, w: torch.relu(x) * w, replacement, inputs=spec)
        fusekern.unregister_pattern(name)


def test_harness_runs_each_function_on_its_own_inputs():
    """A pattern object made by hand (registration refuses in-place replacements) whose replacement clobbers its
    input: the search's reference must not see the clobbered values."""
    def writes(x, w):
        out = torch.relu(x) * w
        x.zero_()
        return out

    p = Pattern("hand_made_clobber", lambda x, w: torch.relu(x) * w, writes,
                inputs=dict(x=fusekern.T("M", "N", dtype=torch.float32), w=fusekern.T("M", "N", dtype=torch.float32)))
    assert check_pattern(p).passed  # (each run drew its own copy: the same values, the right answer)


def test_assert_compiled_compares_inputs_nested_outputs_and_integers_exactly():
    def fn(x):
        return {"y": x * 2, "idx": (x > 0).sum(-1)}, x.shape[0]

    x = torch.randn(4, 8)
    r = assert_compiled(fn, (x,), fired={})
    assert r.errors == [0.0]

    def clobbers(x):  # eager also writes into x: the compiled call must write the same
        x.mul_(2)
        return x + 1

    assert_compiled(clobbers, (torch.randn(4, 8),), fired={})
    with pytest.raises(AssertionError, match=r"argument 0 after the call differs from eager"):
        from fusekern.testing.equivalence import _compare
        _compare("argument 0 after the call", torch.ones(3), torch.zeros(3), 1e-4)
    with pytest.raises(AssertionError, match="int64 values must be equal"):
        from fusekern.testing.equivalence import _compare
        _compare("output", torch.tensor([2**40 + 1]), torch.tensor([2**40]), 1e-4)


def test_harness_fails_integer_outputs_that_differ_at_all():
    """Truncating instead of flooring division: a relative error of 5e-10 over the whole tensor passed the fp32
    tolerance; an integer output must be equal."""
    name = "user_int_div"
    fusekern.register_pattern(name, lambda x: torch.div(x, 3, rounding_mode="floor") * 2,
                              lambda x: torch.div(x, 3, rounding_mode="trunc") * 2,
                              inputs=dict(x=fusekern.T("M", "N", dtype=torch.int64)))
    try:
        r = check_pattern(name)
        assert not r.passed and "must be equal" in r.worst.note
    finally:
        fusekern.unregister_pattern(name)


def test_harness_draws_every_layout_of_every_variant():
    """With 24 draws and 24 variants every draw was contiguous: a replacement that assumes contiguity passed."""
    def assumes_contiguous(x, w):
        return torch.as_strided(x, x.shape, (x.shape[-1], 1)) * w

    name = "user_assumes_contiguous"
    fusekern.register_pattern(name, lambda x, w: x * w, assumes_contiguous,
                              inputs=dict(x=fusekern.T("M", "N", dtype="d0"), w=fusekern.T("M", "N", dtype="d1")),
                              dtypes={"d0": (torch.float32, torch.float64), "d1": (torch.float32, torch.float64)})
    try:
        r = check_pattern(name, draws=2)  # 4 variants x 3 layouts: 12 draws at least
        assert len(r.cases) == 12
        assert {c.layout for c in r.cases} == {"contiguous", "noncontiguous", "misaligned"}
        assert not r.passed
    finally:
        fusekern.unregister_pattern(name)


@pytest.mark.usefixtures("no_compile_caches")
def test_checks_may_return_numpy_bools_and_dynamic_comparisons():
    import numpy as np

    spec = dict(x=fusekern.T("M", "N", dtype=torch.float32))
    fusekern.register_pattern("user_np_check", lambda x: torch.relu(x) * 3.0, lambda x: torch.clamp_min(x, 0.0) * 3.0,
                              inputs=spec, check=lambda v: np.bool_(v["x"].dim() == 2))
    fusekern.register_pattern("user_sym_check", lambda x: torch.relu(x) * 5.0, lambda x: torch.clamp_min(x, 0.0) * 5.0,
                              inputs=spec, check=lambda v: v["x"].shape[-1] % 8 == 0)
    only = {"fusekern.enable": ["user_np_check", "user_sym_check"]}
    try:
        fn = lambda x: torch.relu(x) * 3.0 + torch.relu(x * 2) * 5.0  # noqa: E731
        assert_compiled(fn, (torch.randn(4, 16),), fired={"user_np_check": 1, "user_sym_check": 1}, options=only)
        assert_compiled(fn, (torch.randn(4, 16),), fired={"user_np_check": 1}, options=only, dynamic=True)
        reasons = [r.reason for r in fusekern.match_report().rejections()]
        assert any("is not known to hold for every size" in r for r in reasons), reasons
    finally:
        fusekern.unregister_pattern("user_np_check")
        fusekern.unregister_pattern("user_sym_check")


def test_unregister_names_what_it_cannot_find():
    with pytest.raises(KeyError, match="no pattern named 'no_such_pattern'"):
        fusekern.unregister_pattern("no_such_pattern")
    with pytest.raises(TypeError, match="pass the pattern's name"):
        fusekern.unregister_pattern(42)


def test_registration_argument_types_are_checked():
    def bad(**kw):
        return fusekern.register_pattern("bad_types", _mm, _mm, **(dict(inputs=SPEC) | kw))

    for kw, why in [(dict(tolerance=1e-3), "tolerance must be a dict"), (dict(dtypes=[torch.float32]), "dtypes must be a dict"),
                    (dict(dims=["K"]), "dims must be a dict"), (dict(tolerance={torch.float32: float("inf")}), "positive numbers"),
                    (dict(tolerance={torch.float32: True}), "positive numbers"), (dict(description=5), "description must be a string"),
                    (dict(kernel_version=None), "kernel_version must be a string"), (dict(bind_specs="yes"), "bind_specs must be"),
                    (dict(inputs=dict(x=fusekern.T("M", "K", dtype="a"), w=fusekern.T("N", "K", dtype="a")),
                          dtypes={"a": (torch.float32,), "unused": (torch.float16,)}), "dtypes names \\['unused'\\]")]:
        with pytest.raises(fusekern.PatternError, match=why):
            bad(**kw)
    with pytest.raises(TypeError, match="positive must be True or False"):
        fusekern.T("N", dtype=torch.float32, positive="no")
    with pytest.raises(TypeError, match="max must be an int"):
        fusekern.Dim(max=40.5)
    assert "bad_types" not in {p.name for p in all_patterns()}


def test_rewrite_fingerprint_follows_its_closure_and_code_without_a_file():
    """A rewrite built by a factory (``make(k)``) or written where there is no file (``python -c``, a notebook): its
    fingerprint, part of the FX cache key, did not change with k or with the code, and a later process loaded the
    old rewrite's graph (found in review)."""
    from fusekern.patterns.registry import GraphRewrite

    def make(k):
        def rewrite(graph):
            return int(k)
        return rewrite

    assert GraphRewrite("r", make(2.0)).fingerprint != GraphRewrite("r", make(5.0)).fingerprint
    assert GraphRewrite("r", make(2.0)).fingerprint == GraphRewrite("r", make(2.0)).fingerprint
    fns = {}
    for body in ("return 1", "return 2"):
        exec(f"def rewrite(graph):\n    {body}\n", fns)  # no file behind it
        fns[body] = GraphRewrite("r", fns["rewrite"]).fingerprint
    assert fns["return 1"] != fns["return 2"]


def test_cache_hits_report_dynamic_graphs_and_joint_passes_once(tmp_path):
    """Two report bugs of a second process loading graphs from inductor's FX cache (found in review): a graph
    with a dynamic size was keyed by the first call's size, so another size found "no record of what fired"; and
    where AOTAutograd's cache is bypassed (an ``allow_in_graph`` helper), the joint passes run again before the FX
    lookup, and the sampler counted twice."""
    code = (
        "import torch, torch.nn.functional as F, fusekern, sys\n"
        "@torch._dynamo.allow_in_graph\n"
        "def scale(x):\n    return x / 0.7\n"
        "def sample(logits):\n"
        "    probs = torch.softmax(scale(logits), dim=-1)\n"
        "    return torch.argmax(probs / torch.empty_like(probs).exponential_(1.0), dim=-1)\n"
        "torch.compile(sample, backend='fusekern')(torch.randn(4, 64))\n"
        "r = fusekern.match_report()\n"
        "print('SAMPLE', dict(r.fired()), dict(r.cached_fired))\n"
        "fusekern.reset_match_report()\n"
        "f = torch.compile(lambda x, w, s: F.linear(x, w.to(x.dtype)) * s, backend='fusekern')\n"
        "w = torch.randint(-9, 9, (16, 32), dtype=torch.int8); s = torch.rand(16)\n"
        "for m in map(int, sys.argv[1:]):\n"
        "    f(torch.randn(m, 32, dtype=torch.bfloat16), w, s)\n"
        "r = fusekern.match_report()\n"
        "print('LINEAR', dict(r.fired()), dict(r.cached_fired), 'unknown', r.cached_unknown)\n"
    )
    runs = _processes_sharing_a_cache(tmp_path, code, [("3", "5"), ("3", "6")])
    assert "SAMPLE {'sample': 1} {}" in runs[0].stdout
    assert "SAMPLE {} {'sample': 1}" in runs[1].stdout
    assert "LINEAR {'w8a16_linear_scale': 2} {} unknown 0" in runs[0].stdout  # (M = 5: recompiled, M dynamic)
    assert "LINEAR {} {'w8a16_linear_scale': 2} unknown 0" in runs[1].stdout


def test_assert_compiled_keeps_the_arguments_aliasing_for_eager():
    def fn(x, row):  # writes x, reads its view
        x.mul_(2)
        return row + 1

    x = torch.randn(4, 8)
    assert_compiled(fn, (x, x[0]), fired={})


def test_a_compile_with_no_pattern_leaves_stock_inductors_cache_alone(tmp_path):
    """With no pattern selected fusekern adds no pass, so its FX cache key is stock inductor's: a direct call
    written then was loaded by a later stock compile, which could not find it (found in review)."""
    code = (
        "import sys, torch, fusekern\n"
        "import fusekern.kernels.w8a16_linear\n"
        "def f(x, w, s):\n"
        "    return torch.ops.fusekern.w8a16_linear(x, w, s, None, torch.bfloat16) * 2\n"
        "x = torch.randn(3, 32, dtype=torch.bfloat16); w = torch.randint(-9, 9, (16, 32), dtype=torch.int8)\n"
        "s = torch.rand(16, dtype=torch.bfloat16)\n"
        "opts = {'fusekern.enable': []} if sys.argv[1] == 'fusekern' else None\n"
        "out = torch.compile(f, backend=sys.argv[1], options=opts)(x, w, s)\n"
        "print('OK', torch.allclose(out.float(), f(x, w, s).float()))\n"
    )
    runs = _processes_sharing_a_cache(tmp_path, code, [("fusekern",), ("inductor",)])
    assert all("OK True" in r.stdout for r in runs)


def test_a_decline_names_the_variant_each_reason_comes_from():
    """A pattern traced for fp32 and bf16: a 3-D fp32 input is declined by both variants for different reasons;
    unnamed, "x is torch.float32, the pattern's spec torch.bfloat16" read as if fp32 were not allowed."""
    name = "user_scaled_relu_two_dtypes"
    fusekern.register_pattern(name, lambda x, s: torch.relu(x) * s, lambda x, s: torch.clamp_min(x, 0.0) * s,
                              inputs=dict(x=fusekern.T("M", "N", dtype="act"), s=fusekern.T("N", dtype="act")),
                              dtypes={"act": (torch.float32, torch.bfloat16)})
    try:
        fn = lambda x, s: torch.relu(x) * s + 1  # noqa: E731
        assert_compiled(fn, (torch.randn(2, 4, 16), torch.randn(16)), fired={}, options={"fusekern.enable": [name]})
        reasons = [r.reason for r in fusekern.match_report().rejections() if r.pattern == name]
        assert any("[act=float32,batch=0] x has 3 dims" in r and "[act=bfloat16,batch=0] x is torch.float32" in r
                   for r in reasons), reasons
    finally:
        fusekern.unregister_pattern(name)


def test_fired_with_cached_adds_what_cache_loaded_graphs_fired_when_compiled():
    from fusekern.compiler_pass.report import GraphReport, MatchReport

    g = GraphReport(graph_id=1, stage="post_grad")
    g.fired["w8a16_linear_scale"] += 1
    r = MatchReport(graphs=[g], cache_hits=1)
    r.cached_fired["w8a16_linear_scale"] += 2
    r.cached_fired["sample"] += 1
    assert r.fired() == {"w8a16_linear_scale": 1}
    assert r.fired(cached=True) == {"w8a16_linear_scale": 3, "sample": 1}
