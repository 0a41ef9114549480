"""fusekern: fused kernels for quantized LLM inference, found by torch.compile graph passes.

    torch.compile(model, backend="fusekern")

Importing fusekern is cheap: no pattern is traced and inductor is not imported until a compile
(or a registry call) needs it.
"""
from __future__ import annotations

from fusekern.compiler_pass.report import MatchReport, match_report, reset_match_report
from fusekern.patterns.registry import Pattern, PatternError, all_patterns, get_pattern, register_pattern, unregister_pattern
from fusekern.patterns.spec import Dim, T, TensorSpec

__version__ = "0.1.0"

__all__ = [
    "Dim", "MatchReport", "Pattern", "PatternError", "T", "TensorSpec", "all_patterns", "backend",
    "get_pattern", "match_report", "register_pattern", "reset_match_report", "unregister_pattern",
]


def backend(gm, example_inputs, mode=None, options=None):
    """The dynamo backend (also reachable as ``backend="fusekern"`` via the entry point)."""
    from fusekern.compiler_pass.backend import fusekern_backend

    return fusekern_backend(gm, example_inputs, mode=mode, options=options)
