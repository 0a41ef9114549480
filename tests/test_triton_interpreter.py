"""The interpreter speed-ups (fusekern.testing.triton_interpreter) compute what Triton's interpreter computes.

numpy's sort stands in for Triton's bitonic network in ``tl.sort`` / ``tl.topk``: checked here bit for bit
against the network itself on ties, infinities and every dtype, and on the inputs the stand-in hands back
to the network (NaN, -0.0, fp8). The interpreter keeps fp8 and bf16 as raw bits: its network orders fp8 by
the bits (not a float sort, as before the stand-in) and fails on bf16 (a reshape), so neither is checked as a sort.
"""
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from fusekern.testing import triton_interpreter as ti

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks Triton's CPU interpreter")


@triton.jit
def _sort_kernel(x_ptr, asc_ptr, desc_ptr, top_ptr, N: tl.constexpr, K: tl.constexpr):
    rows = tl.arange(0, 2)[:, None]
    cols = tl.arange(0, N)[None, :]
    x = tl.load(x_ptr + rows * N + cols)
    tl.store(asc_ptr + rows * N + cols, tl.sort(x))
    tl.store(desc_ptr + rows * N + cols, x.sort(descending=True))  # the member form
    tl.store(top_ptr + rows * K + tl.arange(0, K)[None, :], tl.topk(x, K))


def _run(x, k):
    asc, desc = torch.empty_like(x).fill_(7), torch.empty_like(x).fill_(7)  # poisoned
    top = torch.full((2, k), 7, dtype=x.dtype)
    _sort_kernel[(1,)](x, asc, desc, top, N=x.shape[1], K=k)
    return asc, desc, top


def _as_network(monkeypatch):
    for module in (tl, tl.standard):
        monkeypatch.setattr(module, "sort", ti.ORIGINAL_SORT["sort"])
        monkeypatch.setattr(module, "topk", ti.ORIGINAL_SORT["topk"])
    monkeypatch.setattr(tl.tensor, "sort", lambda self, dim=None, descending=tl.core.CONSTEXPR_0:
                        ti.ORIGINAL_SORT["sort"](self, dim=dim, descending=descending))


def _inputs(kind, n):
    g = torch.Generator().manual_seed(n)
    if kind == "int64 ties":
        return torch.randint(-5, 5, (2, n), generator=g, dtype=torch.int64) << 40
    x = torch.randn(2, n, generator=g)
    m = x[:, 1::3].shape[1]
    x[:, 0:3 * m:3] = x[:, 1::3]  # ties
    x[0, 5], x[1, 2] = float("-inf"), float("inf")
    if kind == "nan":
        x[0, 7] = float("nan")
    if kind == "signed zeros":
        x[0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
    if kind == "float8":
        return x.clamp(-400, 400).to(torch.float8_e4m3fn)
    return x.half() if kind == "float16" else x


@pytest.mark.parametrize("kind", ["int64 ties", "float32", "float16", "float8", "nan", "signed zeros"])
@pytest.mark.parametrize("n,k", [(16, 4), (64, 64), (128, 8)])
def test_fast_sort_matches_the_bitonic_network(kind, n, k, monkeypatch):
    assert ti.patch_fast_sort()
    x = _inputs(kind, n)
    fast = _run(x, k)
    with monkeypatch.context() as m:
        _as_network(m)
        network = _run(x, k)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    for a, b in zip(fast, network):
        assert torch.equal(a.view(bits), b.view(bits))  # bit for bit: -0.0 and NaN placed as the network does
    if kind in ("int64 ties", "float32", "float16"):  # a sort, not just the network's twin
        ref = np.sort(x.float().numpy() if kind != "int64 ties" else x.numpy(), axis=-1)
        assert np.array_equal(fast[0].float().numpy() if kind != "int64 ties" else fast[0].numpy(), ref)


def test_launches_still_restore_the_language():
    """Skipping helpers' re-patching leaves a launch's own patch and restore as they were."""
    assert ti.patch_nested_calls()
    before = tl.sum
    _run(_inputs("float32", 16), 4)
    assert tl.sum is before


@triton.jit
def _bf16_casts_kernel(x_ptr, f_ptr, h_ptr, i_ptr, r_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(x_ptr + o)
    tl.store(f_ptr + o, x.to(tl.float32))
    tl.store(h_ptr + o, x.to(tl.float16))
    tl.store(i_ptr + o, x.to(tl.int32))
    tl.store(r_ptr + o, (x.to(tl.float32) * 1.0078125).to(tl.bfloat16))  # fp32 -> bf16, rounded to nearest even


def test_bf16_casts_match_torch():
    """bf16 -> fp32 / fp16 / int32 and fp32 -> bf16 as torch (and the GPU) compute them, subnormals included: the
    interpreter's own bf16 -> fp32 read 1e-39 as 4.4e-39 (fp8_mma's subnormal test could not run on CPU)."""
    assert ti.patch_bf16_support()
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(56, generator=g) * 10.0 ** torch.randint(-45, 38, (56,), generator=g),
                   torch.tensor([1e-39, -3e-40, 9.2e-41, -0.0, 0.0, float("inf"), float("-inf"), 65504.0])])
    x = x.to(torch.bfloat16)
    f, h = torch.full((64,), 7.0), torch.full((64,), 7.0, dtype=torch.float16)  # poisoned
    i, r = torch.full((64,), 7, dtype=torch.int32), torch.full((64,), 7.0, dtype=torch.bfloat16)
    _bf16_casts_kernel[(1,)](x, f, h, i, r, N=64)
    assert torch.equal(f.view(torch.int32), x.float().view(torch.int32))
    assert torch.equal(h.view(torch.int16), x.float().half().view(torch.int16))
    finite = x.isfinite() & (x.float().abs() < 2.0 ** 31)
    assert torch.equal(i[finite], x.float()[finite].to(torch.int32))
    assert torch.equal(r.view(torch.int16), (x.float() * 1.0078125).to(torch.bfloat16).view(torch.int16))
