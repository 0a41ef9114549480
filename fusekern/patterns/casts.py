"""Which dtype casts round nothing: a rewrite may read a value through such a cast (the value under it is the
value after it), but must keep a cast that rounds."""
from __future__ import annotations

import torch

from fusekern.patterns.decode.program import FP8_DTYPES

_EIGHT_BIT = (*FP8_DTYPES, torch.int8)
_EXACT_INTO = {torch.bfloat16: (torch.float32, torch.float64), torch.float16: (torch.float32, torch.float64),
               torch.float32: (torch.float64,)}


def exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every value of ``src`` is a value of ``dst``: int8 / fp8 into any float of 16 bits or more, 16-bit floats
    into fp32 / fp64, fp32 into fp64 (not fp16 into bf16 or back: each has values the other rounds)."""
    if src == dst:
        return True
    if src in _EIGHT_BIT:
        return dst.is_floating_point and dst.itemsize >= 2
    return dst in _EXACT_INTO.get(src, ())
