"""int4 packed along N (AWQ) on tensor cores (``fusekern.kernels.int4_mma_n``) against its float64 reference.

CPU: the kernel runs in the Triton interpreter (plain operations in place of its inline PTX) on small
shapes: AWQ as the zoo writes it, the same codes in plain nibble order, zeros packed, constant or 8-bit,
column tails (N not a multiple of the 256-column tile, nor of 8 words), every split of K, biases,
misaligned and column-major rows, NaN-poisoned workspaces. The dispatcher offers it only for layouts it
reads exactly and bf16 rows up to 16, and bad input gets a clear error. GPU: issue 4's sizes (and column
tails with and without TMA), every config the dispatcher offers, deterministic.
"""
import dataclasses

import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import int4_mma as im
from fusekern.kernels import int4_mma_n as imn
from fusekern.kernels import packed_mm as pm
from fusekern.testing import rel_err
from test_int4_mma import DEVICE, TOL, setup

SEQ8 = tuple(range(8))


def run(x, leaves, lay, K, N, cfg, bias=None):
    ws = torch.full((cfg.SPLIT_K, x.shape[0], N), float("nan"), device=x.device)  # poisoned partials
    out = pm.packed_mm(x, leaves, lay, K, N, cfg, bias, workspace=ws if cfg.SPLIT_K > 1 else None)
    assert out.shape == (x.shape[0], N) and out.dtype == torch.bfloat16
    return out


def with_int_zeros(lay, leaves, groups, N, dims=("k", "n"), seed=0):
    """The layout with one uint8 zero per group and column (a new leaf) in place of the packed nibbles."""
    g = torch.Generator().manual_seed(seed)
    shape = (groups, N) if dims == ("k", "n") else (N, groups)
    z = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(DEVICE)
    return dataclasses.replace(lay, zero="int", zero_leaf=len(leaves), zero_dims=dims, zero_per_word=1,
                               zero_order=()), [*leaves, z]


@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("K,N,split_k", [(256, 256, 2), (384, 264, 3), (256, 512, 1), (512, 72, 8), (384, 264, 5)],
                         ids=["one_tile", "tail_three_splits", "no_split", "narrow_eight_splits", "uneven_splits"])
def test_awq_matches_reference(K, N, split_k, M):
    _, lay, leaves, x = setup(K, N, M, seed=K + N + M, fmt="awq")
    assert imn.layout_fits(lay) and lay.order == (0, 4, 1, 5, 2, 6, 3, 7)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    got = run(x, leaves, lay, K, N, imn.Int4MmaN(split_k))
    assert not got.isnan().any() and rel_err(got.cpu(), want.cpu()) < TOL


@pytest.mark.parametrize("variant", ["plain_order", "zero_order_only", "const_zero", "no_zero", "int_zeros_kn",
                                     "int_zeros_nk", "zero_offset"])
def test_layout_variants(variant):
    """The codes in plain nibble order, and each zero form the kernel reads, with scales either way round."""
    K, N, M = 256, 136, 3
    _, lay, leaves, x = setup(K, N, M, seed=7, fmt="awq")
    if variant == "plain_order":
        lay = dataclasses.replace(lay, order=SEQ8, zero_order=SEQ8)
    elif variant == "zero_order_only":  # the zeros' order read apart from the codes'
        lay = dataclasses.replace(lay, zero_order=SEQ8)
    elif variant == "const_zero":
        lay = dataclasses.replace(lay, zero="const", zero_value=8.0)
    elif variant == "no_zero":
        lay = dataclasses.replace(lay, zero="", zero_value=0.0)
    elif variant == "zero_offset":
        lay = dataclasses.replace(lay, zero_value=1.0)
    else:
        lay, leaves = with_int_zeros(lay, leaves, K // 128, N, ("k", "n") if variant == "int_zeros_kn" else ("n", "k"))
        s = leaves[lay.scale]
        leaves[lay.scale] = s.t().contiguous()  # scales [N, groups]
        lay = dataclasses.replace(lay, scale_dims=("n", "k"))
    assert imn.layout_fits(lay), variant
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    got = run(x, leaves, lay, K, N, imn.Int4MmaN(2))
    assert not got.isnan().any() and rel_err(got.cpu(), want.cpu()) < TOL


def test_bias_scale_first_and_strided_rows():
    """A bias in the epilogue (split K and not) and one added after (not a contiguous [N] vector), rows
    misaligned and column-major, the scale applied before the MMA (bf16 scales), with and without the word
    prefetch, and TMA words."""
    K, N, M = 384, 288, 4  # 36 words per row: TMA reads them (16-byte rows), the second tile 4 words wide
    _, lay, leaves, _ = setup(K, N, M, seed=5, fmt="awq")
    assert imn._tma_words(leaves[lay.code]) is not None
    misaligned = torch.randn(M, K + 1, dtype=torch.bfloat16, device=DEVICE)[:, 1:]
    col_major = torch.randn(K, M, dtype=torch.bfloat16, device=DEVICE).t()
    cfgs = (imn.Int4MmaN(3), imn.Int4MmaN(3, prefetch=False), imn.Int4MmaN(2, scale_first=True),
            imn.Int4MmaN(3, prefetch=False, tma=True, num_stages=4, scale_first=True), imn.Int4MmaN(1))
    for x, cfg in zip((misaligned, col_major, misaligned, col_major, misaligned), cfgs):
        for bias in (torch.randn(N, dtype=torch.bfloat16, device=DEVICE),
                     torch.randn(M, N, dtype=torch.float32, device=DEVICE)):
            want = pm.packed_mm_reference(x, leaves, lay, K, N, bias)
            got = run(x, leaves, lay, K, N, cfg, bias)
            assert rel_err(got.cpu(), want.cpu()) < TOL, cfg


@pytest.mark.parametrize("offset", [0, 4], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_tma_words_and_register_cap(offset, split_k):
    """Words through a TMA descriptor (zero-filled past N / 8 words), uneven splits carrying the next tile's
    scale and zero across group boundaries; a base that is not 16-byte aligned, or rows of N / 8 words not a
    multiple of 16 bytes, load directly; a register cap (a launch option) computes the same product."""
    K, N, M = 640, 288, 3  # 36 words per row: rows 16-byte aligned, the second tile 4 words wide
    _, lay, leaves, x = setup(K, N, M, seed=offset + split_k, fmt="awq")
    q = leaves[lay.code]
    if offset:  # the same codes, 4 bytes into a fresh buffer
        flat = torch.empty(q.numel() * 4 + 16, dtype=torch.uint8, device=q.device)
        view = flat[offset:offset + q.numel() * 4].view(torch.int32).view(q.shape)
        view.copy_(q)
        leaves = list(leaves)
        leaves[lay.code] = view
    assert (imn._tma_words(leaves[lay.code]) is None) == bool(offset)
    assert imn._tma_words(torch.zeros(64, 33, dtype=torch.int32, device=DEVICE)) is None  # 132-byte rows
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    for cfg in (imn.Int4MmaN(split_k, tma=True, num_stages=3),
                imn.Int4MmaN(split_k, tma=True, num_stages=4, scale_first=True, maxnreg=128),
                imn.Int4MmaN(split_k, scale_first=True, maxnreg=128)):
        got = run(x, leaves, lay, K, N, cfg)
        assert not got.isnan().any() and rel_err(got.cpu(), want.cpu()) < TOL, cfg


def test_through_decode_mm_triton():
    K, N, M = 256, 256, 2
    prog, lay, leaves, x = setup(K, N, M, seed=2, fmt="awq")
    cfg = imn.Int4MmaN(2)
    ws = torch.full((2, 1, M, N), float("nan"), device=DEVICE)
    got = dm.decode_mm_triton(x, leaves, prog.to_text(), None, cfg, workspace=ws, layout=lay.to_text())
    assert rel_err(got.cpu(), pm.packed_mm_reference(x, leaves, lay, K, N).cpu()) < TOL


def test_offered_only_where_it_computes_the_program():
    _, lay, _, _ = setup(256, 64, 1, fmt="awq")
    mma = lambda M, lay, **kw: [c for c in dm.candidates(M, 8192, 8192, layout=lay.to_text(), **kw)  # noqa: E731
                                if isinstance(c, imn.Int4MmaN)]
    assert [(c.SPLIT_K, c.scale_first, c.prefetch, c.tma) for c in mma(1, lay)] == [
        (12, True, True, False), (8, True, True, False), (8, False, False, False), (12, False, False, False),
        (12, True, False, True)]
    # rows of N / 8 words not a multiple of 16 bytes: no TMA config (it would run the direct loads)
    assert not any(c.tma for c in dm._packed_candidates(1, 8200, 8192, 132, lay) if isinstance(c, imn.Int4MmaN))
    assert all(c.num_warps == 4 for c in mma(1, lay)) and mma(16, lay, x_dtype=torch.bfloat16)
    assert not mma(17, lay)                                 # x is padded to 16 rows
    assert not mma(1, lay, x_dtype=torch.float16)           # the MMA reads bf16
    assert not imn.layout_fits(dataclasses.replace(lay, group_k=64))  # a group per 128-deep pair of tiles
    assert not imn.layout_fits(dataclasses.replace(lay, zero_value=0.5))  # not exact in bf16
    assert not imn.layout_fits(dataclasses.replace(lay, order=(0, 1, 2, 3, 4, 5, 6, 6)))  # not a permutation
    assert not im.layout_fits(lay)  # (the K-packed kernel does not read AWQ)
    for name in ("gptq", "int4_k_stack", "mxfp4", "nvfp4", "fp8_channel", "int8_channel"):
        assert not imn.layout_fits(pm.REPORT_LAYOUTS[name][0]), name
    _, by_n, _, _ = setup(256, 64, 1, fmt="int4_n")
    assert not imn.layout_fits(by_n)  # two codes per byte along N: not int32 words
    for M in (1, 4, 16):  # never first: select_config (no timing, dtype unknown) keeps the GEMV
        assert not isinstance(dm.select_config(M, 8192, 8192, layout=lay.to_text()), imn.Int4MmaN)
    for N, K in ((8192, 8192), (4096, 14336), (14336, 4096), (128256, 4096), (1024, 4096), (72, 384)):
        for per_sm in (3, 2):  # one wave of programs where the grid allows a split at all
            sk = imn.split_k_for(N, K, 132, per_sm)
            assert 1 <= sk <= min(32, K // imn.BLOCK_K)
            assert sk == 1 or sk * -(-N // 256) <= per_sm * 132


def test_bad_input_gets_a_clear_error():
    K, N = 256, 256
    _, lay, leaves, x = setup(K, N, 2, fmt="awq")
    cfg = imn.Int4MmaN(2)
    with pytest.raises(ValueError, match="bf16"):
        imn.int4_mma_n(x.half(), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="M <= 16"):
        imn.int4_mma_n(torch.randn(17, K, dtype=torch.bfloat16, device=DEVICE), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="do not fit"):
        imn.int4_mma_n(x, leaves, lay, K, N, imn.Int4MmaN(5))  # 5 splits of 4 K tiles
    strided = list(leaves)
    strided[lay.code] = leaves[lay.code].t().contiguous().t()  # same values, column-major
    with pytest.raises(ValueError, match="contiguous"):
        imn.int4_mma_n(x, strided, lay, K, N, cfg)
    with pytest.raises(ValueError, match="layout"):
        imn.int4_mma_n(x, leaves, dataclasses.replace(lay, group_k=64), K, N, cfg)
    with pytest.raises(ValueError, match="workspace"):
        imn.int4_mma_n(x, leaves, lay, K, N, cfg, workspace=torch.empty(1, 2, N, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("K,N", [(8192, 8192), (4096, 4104), (4096, 4128), (14336, 4096), (4096, 14336)])
def test_gpu_sizes(K, N, M):
    _, lay, leaves, x = setup(K, N, M, seed=K + N, fmt="awq")
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    offered = [c for c in dm.candidates(M, N, K, layout=lay.to_text(), x_dtype=torch.bfloat16)
               if isinstance(c, imn.Int4MmaN)]
    assert offered
    extra = [dataclasses.replace(offered[0], scale_first=False), dataclasses.replace(offered[-1], scale_first=False)]
    for cfg in dict.fromkeys(offered + extra):
        got = run(x, leaves, lay, K, N, cfg)
        assert not got.isnan().any() and rel_err(got.float(), want.float()) < TOL, cfg
        assert torch.equal(got, run(x, leaves, lay, K, N, cfg)), cfg  # the split-K reduction is deterministic


@pytest.mark.gpu
def test_gpu_tuner_times_it_and_agrees():
    """The first call at a shape times int4_mma_n beside the GEMV; whatever it picks matches the reference."""
    K, N, M = 8192, 8192, 1
    prog, lay, leaves, x = setup(K, N, M, seed=9, fmt="awq")
    got = dm.decode_mm_triton(x, leaves, prog.to_text(), None, layout=lay.to_text())
    assert rel_err(got.float(), pm.packed_mm_reference(x, leaves, lay, K, N).float()) < TOL
    timed = dm.timings[(prog.to_text(), lay.to_text(), 1, 1, x.device)]
    assert any(isinstance(c, imn.Int4MmaN) for c in timed), list(timed)
