"""The graph passes fusekern installs in inductor, one per stage.

- ``post_grad`` runs as ``post_grad_custom_pre_pass``: GEMM-family patterns must see the matmul
  before inductor's own weight-only-int8 rewrite (a custom *post* pass never sees it).
- ``joint`` runs as ``joint_custom_pre_pass``: sampling patterns must see ``exponential_``/``rand``
  before ``replace_random_passes`` turns them into ``inductor_random``.

Each pass is a ``CustomGraphPass`` whose ``uuid()`` hashes fusekern's code and the enabled patterns (their
code, the files defining it, specs and kernel versions), so inductor's FX graph cache stays valid and is
never bypassed. A pass the user
had already set in inductor's config is chained (run first), never dropped.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
from typing import Any, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from fusekern.compiler_pass.canonicalize import canonicalize
from fusekern.compiler_pass.options import FusekernOptions
from fusekern.compiler_pass.report import mark_superseded, graph_report
from fusekern.compiler_pass.unpad import restore, unpad
from fusekern.patterns.registry import Pattern

log = logging.getLogger("fusekern")

PASS_VERSION = "fusekern-pass-1"
STAGE_CONFIG_KEYS = {"post_grad": "post_grad_custom_pre_pass", "joint": "joint_custom_pre_pass"}


def _as_tuple(existing: Any) -> tuple:
    if existing is None:
        return ()
    if isinstance(existing, (list, tuple)):
        return tuple(existing)
    return (existing,)


def package_files() -> tuple[str, ...]:
    """Every Python file of the fusekern package, sorted."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for d, _, names in os.walk(root):
        found += [os.path.join(d, n) for n in names if n.endswith(".py")]
    return tuple(sorted(found))


@functools.cache
def _machinery_hash() -> str:
    """Hash of all of fusekern's code, not just the functions a pattern names: a check's helper, a matcher's
    analysis or a kernel whose launch a rewrite emits into inductor's code can change what a compiled graph
    holds, and a key that missed one would load a graph rewritten by the old code from inductor's FX-graph
    cache (an edit to a check's helper once did, in a test run). Any fusekern change recompiles."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files(package_files()).hex()


class FusekernGraphPass(CustomGraphPass):
    def __init__(self, stage: str, patterns: Sequence[Pattern], options: FusekernOptions, chained: Any = None):
        self.stage = stage
        self.patterns = list(patterns)
        self.options = options
        self.chained = _as_tuple(chained)
        # What of the example inputs' values the rewrites may read (example_inputs.digest): part of the FX
        # graph cache key, so a graph rewritten for a sorted g_idx is not loaded for an act-order one.
        self.example_digest = ""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for user_pass in self.chained:
            user_pass(graph)
        if self.stage == "post_grad":
            # Inductor removes no-op views/converts right after this pass; do it first so a no-op
            # `.to(same dtype)` in user code cannot hide a pattern (the patterns are traced without).
            from torch._inductor.fx_passes.post_grad import remove_noop_ops

            remove_noop_ops(graph)
            # Inductor may have padded a matmul to aligned sizes (CUDA, pad_mm), which hides it from the
            # patterns: match the unpadded matmul; the padding comes back where nothing took it.
            unpadded = unpad(graph)
        else:
            unpadded = []
        if any(isinstance(p, Pattern) for p in self.patterns):
            # Traced patterns were canonicalized the same way; structural rewrites (sampling) read the
            # graph as it is, so a stage with only those leaves the user's graph untouched.
            canonicalize(graph)
        with graph_report(self.stage) as report:
            if self.options.dumps():  # (as the patterns see it: unpadded, canonical; before a pattern can fail)
                self._dump(str(graph), "before", report.graph_id)
            report.nodes_before = len(graph.nodes)
            for p in self.patterns:
                try:
                    n = p.matcher_pass().apply(graph)
                except Exception as e:
                    # The graph may be half rewritten: no way to go on with it, but the error names the pattern
                    raise RuntimeError(
                        f"fusekern: pattern {p.name!r} ({p.family}) failed while rewriting a graph: "
                        f"{type(e).__name__}: {e}. Compile without it: options={{'fusekern.disable': "
                        f"[{p.name!r}]}}") from e
                if n:
                    report.fired[p.name] += n
            if report.fired:  # (before restore, which rebuilds the unpadded matmuls nothing took)
                mark_superseded(report, {n.name for n in graph.nodes})
            restore(graph, unpadded)
            if report.fired:
                graph.eliminate_dead_code()
            report.nodes_after = len(graph.nodes)
        if self.options.dumps():
            self._dump(str(graph), "after", report.graph_id)

    def uuid(self) -> str | None:
        parts = [PASS_VERSION, _machinery_hash(), self.stage, [(p.name, p.fingerprint) for p in self.patterns],
                 self.example_digest]
        for user_pass in self.chained:
            uid = user_pass.uuid() if hasattr(user_pass, "uuid") else None
            if uid is None:  # the user's pass opts out of caching: so do we
                return None
            parts.append(uid)
        return hashlib.sha256(repr(parts).encode()).hexdigest()

    def _dump(self, text: str, when: str, graph_id: int) -> None:
        """``<dump_dir>/<pid>-graph<id>-<stage>-<before|after>.txt``, the id the match report gives the graph."""
        out_dir = self.options.dump_dir or os.path.join(tempfile.gettempdir(), "fusekern-graphs")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{os.getpid()}-graph{graph_id}-{self.stage}-{when}.txt")
        with open(path, "w") as f:
            f.write(text)
        log.info("fusekern: dumped graph %d %s to %s", graph_id, when, path)


def make_stage_passes(patterns: Sequence[Pattern], options: FusekernOptions, config_patches: dict) -> dict:
    """Config patches installing one pass per stage that has enabled patterns, chaining what was set."""
    from torch._inductor import config as inductor_config

    patches = {}
    for stage, key in STAGE_CONFIG_KEYS.items():
        stage_patterns = [p for p in patterns if p.stage == stage]
        if not stage_patterns:
            continue
        existing = config_patches.get(key, getattr(inductor_config, key))
        patches[key] = FusekernGraphPass(stage, stage_patterns, options, chained=existing)
    return patches
