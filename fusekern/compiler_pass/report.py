"""What fired where, and why candidates were turned down.

Every graph the fusekern passes see gets a ``GraphReport``; ``match_report()`` returns all of them
since the last ``reset_match_report()``. Graphs that inductor loaded from its FX graph cache never
reach the passes: they are counted as cache hits, with the patterns as they were when first compiled.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger("fusekern")


@dataclass
class Rejection:
    pattern: str
    node: str
    reason: str


@dataclass
class GraphReport:
    graph_id: int
    stage: str
    fired: collections.Counter = field(default_factory=collections.Counter)
    rejected: list[Rejection] = field(default_factory=list)
    notes: list[Rejection] = field(default_factory=list)  # what a rewrite says about a match it made
    nodes_before: int = 0
    nodes_after: int = 0


@dataclass
class MatchReport:
    graphs: list[GraphReport] = field(default_factory=list)
    cache_hits: int = 0  # graphs inductor took from its FX graph cache (passes did not run)

    def fired(self) -> collections.Counter:
        """Matches per pattern, summed over graphs."""
        total: collections.Counter = collections.Counter()
        for g in self.graphs:
            total.update(g.fired)
        return total

    def notes(self) -> list[Rejection]:
        return [r for g in self.graphs for r in g.notes]

    def rejections(self) -> list[Rejection]:
        return [r for g in self.graphs for r in g.rejected]

    def __str__(self) -> str:
        lines = ["fusekern match report"]
        if not self.graphs and not self.cache_hits:
            lines.append("  (no graph compiled since the last reset)")
        for g in self.graphs:
            if not g.fired and not g.rejected:
                continue
            lines.append(f"  graph {g.graph_id} [{g.stage}] nodes {g.nodes_before} -> {g.nodes_after}")
            for name, n in sorted(g.fired.items()):
                lines.append(f"    fired    {name:<40} x{n}")
            for r in g.notes:
                lines.append(f"      {r.pattern} at {r.node}: {r.reason}")
            for r in g.rejected:
                lines.append(f"    declined {r.pattern:<40} at {r.node}: {r.reason}")
        quiet = sum(1 for g in self.graphs if not g.fired and not g.rejected)
        if quiet:
            lines.append(f"  {quiet} graph pass(es) with no candidate")
        if self.cache_hits:
            lines.append(f"  {self.cache_hits} graph(s) loaded from inductor's FX graph cache "
                         "(rewritten when first compiled; not re-examined)")
        return "\n".join(lines)


_lock = threading.Lock()
_report = MatchReport()
_current = threading.local()
_next_graph_id = 0


def match_report() -> MatchReport:
    """The report of every graph compiled through fusekern since the last reset."""
    return _report


def reset_match_report() -> None:
    global _report
    with _lock:
        _report = MatchReport()


def add_cache_hits(n: int) -> None:
    with _lock:
        _report.cache_hits += n


@contextlib.contextmanager
def graph_report(stage: str):
    """Collects what the passes do to one graph; rejections recorded inside land here."""
    global _next_graph_id
    with _lock:
        _next_graph_id += 1
        g = GraphReport(graph_id=_next_graph_id, stage=stage)
        _report.graphs.append(g)
    prev = getattr(_current, "graph", None)
    _current.graph = g
    try:
        yield g
    finally:
        _current.graph = prev
        if g.fired or g.rejected:
            log.info("graph %d [%s]: fired %s; declined %d", g.graph_id, stage, dict(g.fired), len(g.rejected))
        for r in g.rejected:
            log.info("  %s declined at %s: %s", r.pattern, r.node, r.reason)


def record_rejection(pattern: str, node: str, reason: str) -> None:
    g = getattr(_current, "graph", None)
    if g is not None:
        g.rejected.append(Rejection(pattern, node, reason))


def record_note(pattern: str, node: str, text: str) -> None:
    """What a rewrite found about a match it made (e.g. the weight format it recognized)."""
    g = getattr(_current, "graph", None)
    if g is not None:
        g.notes.append(Rejection(pattern, node, text))
