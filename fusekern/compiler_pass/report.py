"""What fired where, and why candidates were turned down.

Every graph the fusekern passes see gets a ``GraphReport``; ``match_report()`` returns all of them
since the last ``reset_match_report()``. Graphs that inductor loaded from its FX graph cache never
reach the passes: they are counted as cache hits, with what fired in them when they were first compiled
(``record_compiled`` writes that beside inductor's cache, ``cached_fired`` reads it back).
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field

log = logging.getLogger("fusekern")


@dataclass
class Rejection:
    pattern: str
    node: str
    reason: str
    superseded: bool = False  # the node was then rewritten by another pattern
    where: str = ""  # the user's source line that made the node ("model.py:42"), where the graph knows it

    def at(self) -> str:
        return f"{self.node} ({self.where})" if self.where else self.node


@dataclass
class GraphReport:
    graph_id: int
    stage: str
    fired: collections.Counter = field(default_factory=collections.Counter)
    rejected: list[Rejection] = field(default_factory=list)
    notes: list[Rejection] = field(default_factory=list)  # what a rewrite says about a match it made
    seen: set = field(default_factory=set, repr=False)  # (pattern, node, reason) recorded, for the dedupe
    nodes_before: int = 0
    nodes_after: int = 0


@dataclass
class MatchReport:
    graphs: list[GraphReport] = field(default_factory=list)
    cache_hits: int = 0  # graphs inductor took from its FX graph cache (passes did not run)
    cached_fired: collections.Counter = field(default_factory=collections.Counter)  # in them, when compiled
    cached_unknown: int = 0  # cache hits with no record of what fired (compiled before fusekern kept one)

    def fired(self, cached: bool = False) -> collections.Counter:
        """Matches per pattern, summed over graphs; ``cached``: with what the graphs loaded from inductor's FX
        graph cache fired when they were compiled (a rerun of a script takes its graphs from there)."""
        total: collections.Counter = collections.Counter()
        for g in self.graphs:
            total.update(g.fired)
        if cached:
            total.update(self.cached_fired)
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
                if not r.superseded:
                    lines.append(f"    declined {r.pattern:<40} at {r.at()}: {r.reason}")
            # Declines at nodes another pattern then rewrote: one line per pattern and reason
            taken = collections.Counter((r.pattern, r.reason) for r in g.rejected if r.superseded)
            for (pattern, reason), n in sorted(taken.items()):
                lines.append(f"    declined {pattern:<40} x{n}, nodes another pattern then took: {reason}")
        quiet = sum(1 for g in self.graphs if not g.fired and not g.rejected)
        if quiet:
            lines.append(f"  {quiet} graph pass(es) with no candidate")
        if self.cache_hits:
            lines.append(f"  {self.cache_hits} graph(s) loaded from inductor's FX graph cache "
                         "(rewritten when first compiled; not re-examined)")
            for name, n in sorted(self.cached_fired.items()):
                lines.append(f"    fired    {name:<40} x{n} (when first compiled)")
            if self.cached_unknown:
                lines.append(f"    ({self.cached_unknown} of them with no record of what fired)")
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


def add_cache_hits(n: int, fired: collections.Counter | None = None) -> None:
    """``n`` graphs loaded from inductor's cache; ``fired``: what fired in them when compiled, if recorded."""
    with _lock:
        _report.cache_hits += n
        if fired is None:
            _report.cached_unknown += n
        else:
            _report.cached_fired.update(fired)


def discard_since(mark: tuple) -> None:
    """Drop the graph reports made since ``mark``: on a hit of inductor's FX graph cache the joint-graph passes
    had run again before the lookup (AOTAutograd's cache missed), and the hit's record already counts what they
    fired when the graph was first compiled."""
    report, start = mark
    with _lock:
        if report is _report:
            del report.graphs[start:]


def graphs_so_far() -> tuple:
    """A mark of the graph reports there are now (``record_compiled`` takes those after it)."""
    with _lock:
        return _report, len(_report.graphs)


def _record_path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "fusekern_reports", key + ".json")


def compiled_key(*parts) -> str:
    """A key for one compile's record: the graph's code, its inputs' layouts and the passes' cache keys."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def record_compiled(key: str, mark: tuple) -> None:
    """Keep what fired in the graphs reported since ``mark`` (one compile's: a forward graph's; a training
    graph's backward compiles later), for when inductor's cache hits. Advisory: a cache directory that cannot
    be written only loses the record."""
    report, start = mark
    fired: collections.Counter = collections.Counter()
    with _lock:
        for g in report.graphs[start:]:
            fired.update(g.fired)
    try:
        path = _record_path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(fired), f)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("fusekern: could not keep the match record for %s: %s", key, e)


def cached_fired(key: str) -> collections.Counter | None:
    """What ``record_compiled`` kept for ``key``, or None."""
    try:
        with open(_record_path(key)) as f:
            return collections.Counter({str(k): int(v) for k, v in json.load(f).items()})
    except Exception:  # noqa: BLE001 - advisory: no record
        return None


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


def record_rejection(pattern: str, node, reason: str) -> None:
    """Why ``pattern`` did not fire at ``node`` (an FX node, or its name); once per (pattern, node, reason) and
    graph (inductor's matcher tries each traced variant of a pattern, and each may come to the same node)."""
    g = getattr(_current, "graph", None)
    if g is not None:
        name = getattr(node, "name", None) or str(node)
        if (pattern, name, reason) not in g.seen:
            g.seen.add((pattern, name, reason))
            g.rejected.append(Rejection(pattern, name, reason,
                                        where=user_line(getattr(node, "meta", {}).get("stack_trace"))))


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def user_line(stack_trace: str | None) -> str:
    """"file.py:42" of the innermost frame of a node's stack trace (dynamo keeps the user's frames only)."""
    frames = _FRAME.findall(stack_trace or "")
    if not frames:
        return ""
    path, line = frames[-1]
    return f"{os.path.basename(path)}:{line}"


def mark_superseded(g: GraphReport, alive: set[str]) -> None:
    """Declines at nodes no longer in the graph (another pattern rewrote them): the report groups them."""
    for r in g.rejected:
        r.superseded = r.node not in alive


def record_note(pattern: str, node: str, text: str) -> None:
    """What a rewrite found about a match it made (e.g. the weight format it recognized)."""
    g = getattr(_current, "graph", None)
    if g is not None:
        g.notes.append(Rejection(pattern, node, text))
