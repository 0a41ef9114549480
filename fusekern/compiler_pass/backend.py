"""The ``fusekern`` dynamo backend: TorchInductor plus fusekern's graph passes.

``torch.compile(model, backend="fusekern", mode=..., options=...)`` finds this function through the
``torch_dynamo_backends`` entry point. ``mode`` means what it means for inductor (reduce-overhead
gives CUDA graphs); ``options`` holds fusekern's keys (see options.py) and inductor config patches.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Mapping, Sequence

import torch

from fusekern.compiler_pass import direct_calls
from fusekern.compiler_pass.example_inputs import digest as example_digest
from fusekern.compiler_pass.example_inputs import provided as example_inputs_for_passes
from fusekern.compiler_pass.options import FusekernOptions
from fusekern.compiler_pass.pass_manager import make_stage_passes
from fusekern.compiler_pass.report import (add_cache_hits, cached_fired, compiled_key, discard_since, graphs_so_far,
                                           record_compiled)
from fusekern.patterns.registry import FAMILIES, Pattern, all_patterns

log = logging.getLogger("fusekern")


def select_patterns(options: FusekernOptions) -> list[Pattern]:
    """Registered patterns filtered by ``fusekern.enable`` / ``fusekern.disable`` (family or pattern names)."""
    patterns = all_patterns()
    known = set(FAMILIES) | {p.name for p in patterns}
    for name in (*(options.enable or ()), *options.disable):
        if name not in known:
            raise ValueError(f"fusekern: no pattern or family named {name!r}; known: {sorted(known)}")

    def named(p: Pattern, names) -> bool:
        return p.name in names or p.family in names

    if options.enable is not None:
        patterns = [p for p in patterns if named(p, options.enable)]
    return [p for p in patterns if not named(p, options.disable)]


def _layout(t) -> tuple | str:
    """What of an example input a compiled graph depends on, for the match record's key: its placeholder's
    example value where Dynamo left one (a dynamic size as its symbol, not the first call's size, which a
    later process calling with another size would not find)."""
    if isinstance(t, torch.Tensor):
        def dims(sizes):
            return tuple(s if isinstance(s, int) else str(s) for s in sizes)
        return (dims(t.shape), dims(t.stride()), t.dtype, t.device.type)
    return repr(t) if isinstance(t, (int, float, bool, str, type(None))) else str(t)


def _layouts(gm, example_inputs) -> list:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return [_layout(t) for t in example_inputs]
    values = [n.meta.get("example_value", t) for n, t in zip(placeholders, example_inputs)]
    return [_layout(v) for v in values]


def fusekern_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
):
    from torch._dynamo.utils import counters
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    opts = FusekernOptions.parse(options)
    direct_calls.install()
    config_patches: dict[str, Any] = dict(list_mode_options(mode)) if mode else {}
    config_patches.update(opts.inductor)
    passes = make_stage_passes(select_patterns(opts), opts, config_patches)
    digest = example_digest(example_inputs)
    for p in passes.values():
        if hasattr(p, "example_digest"):
            p.example_digest = digest
    config_patches.update(passes)
    # Debug and graph dumps ask to see the passes run, and a cache hit would skip them.
    no_cache = contextlib.nullcontext()
    if opts.dumps():
        config_patches["fx_graph_cache"] = False
        no_cache = torch._functorch.config.patch(enable_autograd_cache=False)

    # A graph AOTAutograd's cache returns also counts a hit of inductor's FX graph cache (the entry it loads):
    # one graph, so the larger count, not the sum.
    fx_before, aot_before = counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"]
    mark = graphs_so_far()
    # The direct calls only where fusekern's passes are in the config: their uuids put them in inductor's cache
    # key, which with no pattern selected is stock inductor's, whose cached code must not name them.
    direct = direct_calls.active() if passes else contextlib.nullcontext()
    with no_cache, example_inputs_for_passes(example_inputs), direct:
        compiled = compile_fx(gm, example_inputs, config_patches=config_patches)
    hits = max(counters["inductor"]["fxgraph_cache_hit"] - fx_before,
               counters["aot_autograd"]["autograd_cache_hit"] - aot_before)
    # What fired, kept beside inductor's cache so that a later process that loads this graph can say it
    # (advisory: no failure of it fails the compile)
    try:
        key = compiled_key(gm.code, _layouts(gm, example_inputs), mode,
                           sorted((k, repr(v)) for k, v in config_patches.items() if not hasattr(v, "uuid")),
                           [p.uuid() for p in passes.values()])
    except Exception as e:  # noqa: BLE001
        log.debug("fusekern: no match record for this graph: %s", e)
        key = None
    if hits:
        discard_since(mark)  # (joint passes that ran again before the FX lookup: the record counts them)
        add_cache_hits(hits, cached_fired(key) if key is not None else None)
    elif key is not None:
        record_compiled(key, mark)
    if opts.debug:
        from fusekern.compiler_pass.report import match_report

        log.warning("%s", match_report())
    return compiled
