"""Inductor's shape padding of matmuls (pad_mm, CUDA) is undone before matching and restored after.

Inductor pads a matmul's M / N / K with zeros when its benchmark (cached on disk) finds the padded product
faster; the padded spelling hid ``F.linear(x, w.to(bf16)) * s`` from the W8A16 pattern on an H200 (36
rows), depending on that cache. Here pad_mm is made to pad on CPU so the tests see its real output.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fusekern.compiler_pass.unpad import restore, unpad
from fusekern.testing import assert_compiled

aten = torch.ops.aten


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _mm_padded(a, b):
    r = aten.mm(aten.constant_pad_nd(a, [0, 3, 0, 4]), aten.constant_pad_nd(b, [0, 5, 0, 3]))
    return aten.slice(aten.slice(r, 0, 0, -4), 1, 0, -5) * 2


def _bmm_padded(a, b):
    r = aten.bmm(aten.constant_pad_nd(a, [0, 2, 0, 1, 0, 0]), aten.constant_pad_nd(b, [0, 0, 0, 2, 0, 0]))
    return aten.slice(r, 1, 0, -1)


def _addmm_padded(c, a, b):  # c broadcasts over rows: pad_addmm leaves it unpadded for an M pad
    r = aten.addmm(c, aten.constant_pad_nd(a, [0, 0, 0, 3]), b)
    return aten.slice(r, 0, 0, -3)


@pytest.mark.parametrize("fn,shapes,plain", [
    (_mm_padded, [(5, 7), (7, 6)], lambda a, b: (a @ b) * 2),
    (_bmm_padded, [(2, 5, 7), (2, 7, 6)], lambda a, b: torch.bmm(a, b)),
    (_addmm_padded, [(1, 6), (5, 7), (7, 6)], lambda c, a, b: torch.addmm(c, a, b)),
], ids=["mm_mnk", "bmm_mk", "addmm_m"])
def test_unpad_is_exact_and_restore_brings_the_padding_back(fn, shapes, plain):
    args = [torch.randn(s, dtype=torch.float64) for s in shapes]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    want, padded = plain(*args), fn(*args)  # (a padded K sums in another order: not bitwise the same)
    log = unpad(gm.graph)
    gm.recompile()
    assert len(log) == 1
    assert aten.constant_pad_nd.default not in _targets(gm) and aten.slice.Tensor not in _targets(gm)
    (mm,) = [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.bmm.default, aten.addmm.default)]
    assert tuple(mm.meta["val"].shape) == tuple(want.shape)
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)
    assert restore(gm.graph, log) == 1
    gm.recompile()
    assert aten.constant_pad_nd.default in _targets(gm)
    torch.testing.assert_close(gm(*args), padded, rtol=0, atol=0)


def _shared_pad(a, b, c):
    pa = aten.constant_pad_nd(a, [0, 0, 0, 2])
    return aten.slice(aten.mm(pa, b), 0, 0, -2) + aten.slice(aten.mm(pa, c), 0, 0, -2)


def test_restore_shares_a_pad_the_matmuls_shared():
    args = [torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64),
            torch.randn(5, 3, dtype=torch.float64)]
    gm = make_fx(_shared_pad, tracing_mode="fake")(*args)
    log = unpad(gm.graph)
    assert len(log) == 2 and aten.constant_pad_nd.default not in _targets(gm)
    assert restore(gm.graph, log) == 2
    gm.recompile()
    assert _targets(gm).count(aten.constant_pad_nd.default) == 1
    torch.testing.assert_close(gm(*args), _shared_pad(*args), rtol=0, atol=0)


def _left_pad(a, b):
    return aten.slice(aten.mm(aten.constant_pad_nd(a, [0, 0, 2, 0]), b), 0, 2, 9)


def _nonzero_pad(a, b):
    return aten.slice(aten.mm(aten.constant_pad_nd(a, [0, 0, 0, 2], 1.0), b), 0, 0, -2)


def _rows_kept(a, b):  # the padded rows are used: not an identity
    return aten.mm(aten.constant_pad_nd(a, [0, 0, 0, 2]), b)


def _addmm_input_padded_by_cat(c, a, b):  # pad_addmm pads a non-broadcast input with cat: left alone
    r = aten.addmm(torch.cat([c, c.new_zeros(3, 3)]), aten.constant_pad_nd(a, [0, 0, 0, 3]), b)
    return aten.slice(r, 0, 0, -3)


def _addmm_scalar_input(c, a, b):  # a 0-d input broadcasts everywhere
    return aten.slice(aten.addmm(c, a, aten.constant_pad_nd(b, [0, 2])), 1, 0, -2)


def test_addmm_inputs():
    args = [torch.randn(7, 3), torch.randn(7, 5), torch.randn(5, 3)]
    gm = make_fx(_addmm_input_padded_by_cat, tracing_mode="fake")(*args)
    before = str(gm.graph)
    assert not unpad(gm.graph) and str(gm.graph) == before
    args = [torch.randn(()), torch.randn(7, 5), torch.randn(5, 3)]
    gm = make_fx(_addmm_scalar_input, tracing_mode="fake")(*args)
    assert len(unpad(gm.graph)) == 1
    gm.recompile()
    torch.testing.assert_close(gm(*args), torch.addmm(*args), rtol=0, atol=0)


@pytest.mark.parametrize("fn", [_left_pad, _nonzero_pad, _rows_kept])
def test_padding_that_is_not_an_identity_stays(fn):
    args = [torch.randn(7, 5), torch.randn(5, 3)]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    before = str(gm.graph)
    assert not unpad(gm.graph)
    assert str(gm.graph) == before


@pytest.fixture
def pad_mm_on_cpu(monkeypatch):
    """Make inductor's pad_mm consider CPU matmuls and always pad (as its benchmark may decide on CUDA)."""
    pad_mm = pytest.importorskip("torch._inductor.fx_passes.pad_mm")
    for name in ("check_device", "has_triton"):
        if not hasattr(pad_mm, name):
            pytest.skip(f"this torch's pad_mm has no {name}")
    monkeypatch.setattr(pad_mm, "check_device", lambda a, b: True)
    monkeypatch.setattr(pad_mm, "has_triton", lambda: True)
    return {"force_shape_pad": True}


def test_w8a16_pattern_matches_a_padded_matmul(pad_mm_on_cpu):
    x = torch.randn(4, 9, 256, dtype=torch.bfloat16)  # 36 rows: padded to 40
    w = torch.randint(-128, 128, (72, 256), dtype=torch.int8)
    s = torch.rand(72, dtype=torch.bfloat16) * 0.01

    def f(x, w, s):
        return F.linear(x, w.to(x.dtype)) * s

    assert_compiled(f, (x, w, s), fired={"w8a16_linear_scale": 1}, options=pad_mm_on_cpu)


def test_padding_comes_back_where_nothing_matched(pad_mm_on_cpu):
    x = torch.randn(36, 100, dtype=torch.bfloat16)
    w = torch.randn(100, 60, dtype=torch.bfloat16)
    assert_compiled(lambda x, w: x @ w, (x, w), fired={}, present=["aten.constant_pad_nd.default"],
                    options=pad_mm_on_cpu)
