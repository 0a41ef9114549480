"""Operands past 2**31 elements: the Triton GEMMs of the exact W8A16 patterns and of scale folding compute their
offsets in 64 bits there (``I64``, chosen by ``intmath.needs_i64``); in 32 bits a weight row's offset
``n * stride`` wrapped from 2**31 elements on (an LM head of 256000 x 12288 int8) and read other memory.

Each weight here is a narrow view with a 4M-element row stride, so rows from 512 on lie past 2**31 elements
while the interpreter runs few tiles. It sits 4 GiB into a CPU buffer (pages never written cost nothing) whose
first 4 GiB, where a wrapped offset would land, hold other values."""
from __future__ import annotations

import pytest
import torch

from fusekern.kernels import w8a16_linear as wl
from fusekern.kernels.intmath import needs_i64
from fusekern.kernels.scaled_mm import scaled_mm_triton

N, ROW, K = 1024, 2**22, 64
WRAPS_FROM = 2**31 // ROW  # the first row whose offset passes 2**31 - 1


def far_weight(dtype):
    """An [N, K] view (row stride ROW) of ones, 4 GiB into a buffer whose first 4 GiB hold threes where a
    32-bit row offset would wrap to."""
    buf = torch.empty(2**32 + N * ROW, dtype=dtype)
    w = buf.as_strided((N, K), (ROW, 1), 2**32)
    w.fill_(1)
    buf.as_strided((N, K), (ROW, 1), 0)[WRAPS_FROM:].fill_(3)
    return w


def test_needs_i64_measures_the_farthest_element():
    assert not needs_i64(None, torch.empty(4, 8))
    w = far_weight(torch.int8)
    assert needs_i64(w) and not needs_i64(w[:WRAPS_FROM]) and needs_i64(w[:WRAPS_FROM + 1])
    assert not needs_i64(torch.empty(0, 3).as_strided((0, 3), (2**40, 1)))  # (empty: nothing to reach)


@pytest.mark.parametrize("config", [wl.SplitKConfig(64, 64, 4, 1), wl.SplitKConfig(64, 32, 4, 1, SPLIT_K=2, remat="full"),
                                    wl.GemmConfig(16, 64, 64, 8, 4, 1), wl.GemmConfig(16, 64, 32, 8, 4, 1, remat="full"),
                                    wl.DequantConfig(32, 64)], ids=["splitk", "splitk2_remat", "gemm", "gemm_remat",
                                                                     "dequant"])
def test_w8a16_weight_rows_past_2_31_elements(config):
    w = far_weight(torch.int8)
    x = torch.ones(3, K, dtype=torch.float16)  # (fp16: the interpreter multiplies bf16 dot operands as integers)
    scale = torch.full((N,), 0.5)
    out = wl.w8a16_linear_triton(x, w, scale, config=config)
    assert torch.equal(out.float(), torch.full((3, N), K * 0.5))


def test_scaled_mm_weight_rows_past_2_31_elements():
    b = far_weight(torch.int8)
    a = torch.ones(2, K, dtype=torch.int8)
    col = torch.full((N,), 0.25)
    out = scaled_mm_triton(a, b, col=col, out_dtype=torch.float32)
    assert torch.equal(out, torch.full((2, N), K * 0.25))


I64_BUILDS = """
import dataclasses
from fusekern.kernels import scaled_mm, w8a16_linear
from fusekern.kernels.aot import resources
seen = set()
for b in scaled_mm.aot_builds() + w8a16_linear.aot_builds():
    if b.kernel in seen or "I64" not in b.fn.arg_names:
        continue
    seen.add(b.kernel)
    r = resources(dataclasses.replace(b, constexprs={**b.constexprs, "I64": True}).compile())
    print(b.kernel, r.registers, r.spills)
"""


def test_the_64_bit_builds_compile_for_sm90a():
    """Each kernel's I64 build compiles for Hopper (in a subprocess: compiling needs TRITON_INTERPRET unset)."""
    from test_kernel_report import run_python

    lines = run_python(["-c", I64_BUILDS]).stdout.split("\n")
    built = {line.split()[0] for line in lines if line.strip()}
    assert {"scaled_mm_fp8_rowwise", "w8a16_splitk", "w8a16_gemm", "w8a16_dequant"} <= built, lines
