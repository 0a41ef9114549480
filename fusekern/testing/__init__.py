"""Graph-equivalence harness (public).

- ``check_pattern(p)``: run a registered pattern's search and replacement on many random inputs drawn
  from its specs (odd sizes, every variant, contiguous / non-contiguous / misaligned) and compare with
  a float64 run of the search function, by relative error within per-dtype tolerances.
- ``assert_compiled(fn, args, fired={...}, gone=[...])``: compile with fusekern, assert which patterns
  fired and how often, that the replaced ops are gone from the final graph, and that outputs match eager.
- ``python -m fusekern check`` runs ``check_pattern`` for every registered pattern and prints a table.
"""
from fusekern.testing.equivalence import (
    CheckResult,
    CompiledCheck,
    GraphCapture,
    assert_compiled,
    check_pattern,
    rel_err,
)

__all__ = ["CheckResult", "CompiledCheck", "GraphCapture", "assert_compiled", "check_pattern", "rel_err"]
