"""int4 packed along K on warp-level tensor cores (``fusekern.kernels.int4_mma_sync``) against its float64
reference.

CPU: the kernel runs in the Triton interpreter (plain operations in place of its inline PTX, the warp's MMA
summed out by reshapes) on small shapes: GPTQ words, two codes per byte with 8-bit zeros, symmetric codes;
1-8 rows, column tails (N not a multiple of the tile, nor of 16), every split of K, biases, one or two
column groups per warp, words loaded one or two groups ahead, misaligned and strided rows, NaN-poisoned
workspaces. The dispatcher offers it only for layouts it reads exactly and bf16 rows up to 8, and bad
input gets a clear error. GPU: the demo's and issue 4's sizes with every offered config, deterministic.
"""
import dataclasses

import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import int4_mma_sync as ims
from fusekern.kernels import packed_mm as pm
from fusekern.testing import rel_err
from test_int4_mma import DEVICE, FORMATS, TOL, setup


def run(x, leaves, lay, K, N, cfg, bias=None):
    ws = torch.full((cfg.SPLIT_K, x.shape[0], N), float("nan"), device=x.device)  # poisoned partials
    out = pm.packed_mm(x, leaves, lay, K, N, cfg, bias, workspace=ws if cfg.SPLIT_K > 1 else None)
    assert out.shape == (x.shape[0], N) and out.dtype == torch.bfloat16
    return out


S = ims.Int4MmaSync


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("K,N,cfg", [(256, 136, S(SPLIT_K=2)), (384, 72, S(SPLIT_K=3, GROUPS_PER_WARP=2)),
                                     (512, 64, S(SPLIT_K=2, PREFETCH=2)), (256, 200, S(SPLIT_K=1))],
                         ids=["tail", "two_groups", "prefetch2", "no_split"])
def test_matches_reference(K, N, cfg, M, fmt):
    _, lay, leaves, x = setup(K, N, M, seed=K + N + M, fmt=fmt)
    assert ims.fits(lay, M, K, torch.bfloat16)
    bias = torch.randn(N, dtype=torch.bfloat16, device=DEVICE)
    got = run(x, leaves, lay, K, N, cfg, bias)
    want = pm.packed_mm_reference(x, leaves, lay, K, N, bias)
    assert not got.isnan().any() and rel_err(got.float(), want.float()) < TOL


def test_strided_misaligned_rows_and_every_split():
    K, N, M = 512, 40, 5
    _, lay, leaves, x = setup(K, N, M, seed=4, fmt="int4_k_stack")
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    wide = torch.zeros(M, 2 * K + 1, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 1:2 * K + 1:2] = x  # every other element, one element off 16 bytes
    strided = wide[:, 1:2 * K + 1:2]
    shifted = torch.zeros(M * K + 3, dtype=torch.bfloat16, device=DEVICE)[3:].view(M, K)
    shifted.copy_(x)  # contiguous, 6 bytes off 16
    for rows in (strided, shifted, x.t().contiguous().t()):
        for split in (1, 2, 4):
            got = run(rows, leaves, lay, K, N, S(SPLIT_K=split))
            assert rel_err(got.float(), want.float()) < TOL, (rows.stride(), split)


def test_through_decode_mm_triton():
    K, N, M = 256, 96, 2
    prog, lay, leaves, x = setup(K, N, M, seed=2, fmt="gptq")
    cfg = S(SPLIT_K=2)
    ws = torch.full((2, 1, M, N), float("nan"), device=DEVICE)
    got = dm.decode_mm_triton(x, leaves, prog.to_text(), None, cfg, workspace=ws, layout=lay.to_text())
    assert rel_err(got.float(), pm.packed_mm_reference(x, leaves, lay, K, N).float()) < TOL


def test_offered_only_where_it_computes_the_program():
    _, lay, _, _ = setup(256, 64, 1, fmt="int4_k_stack")
    sync = lambda M, lay, **kw: [c for c in dm.candidates(M, 8192, 8192, layout=lay.to_text(), **kw)  # noqa: E731
                                 if isinstance(c, S)]
    offered = sync(1, lay)
    assert [(c.GROUPS_PER_WARP, c.PREFETCH) for c in offered] == [(1, 1), (1, 1), (2, 1), (2, 1)]
    for c in offered:  # about 8 or 4 programs per SM, whole groups of 128 per split
        assert (8192 // 128) % c.SPLIT_K == 0 and -(-8192 // c.BLOCK_N) * c.SPLIT_K <= 8 * 132
    assert sync(8, lay, x_dtype=torch.bfloat16) and not sync(9, lay)  # x's rows are the MMA's 8 columns
    assert not sync(1, lay, x_dtype=torch.float16)  # the MMA reads bf16
    assert not ims.fits(dataclasses.replace(lay, group_k=64), 1, 8192)  # one scale row per 128 k
    for name in ("awq", "mxfp4", "nvfp4", "fp8_channel", "int8_channel"):
        assert not ims.fits(pm.REPORT_LAYOUTS[name][0], 1, 8192), name
    for M in (1, 4):  # never first: select_config (no timing, dtype unknown) keeps the GEMV
        assert not isinstance(dm.select_config(M, 8192, 8192, layout=lay.to_text()), S)


@pytest.mark.parametrize("fmt", ["int4_k_stack", "gptq"])
@pytest.mark.parametrize("cfg", [S(SPLIT_K=2), S(SPLIT_K=1, GROUPS_PER_WARP=2), S(SPLIT_K=2, PREFETCH=2)],
                         ids=["one_group", "two_groups", "prefetch2"])
def test_unrolled_loop_gives_the_plain_loops_bits(cfg, fmt):
    """``UNROLL`` (a probe field) changes where ptxas puts the loads, not the arithmetic: the same bits,
    with a K slice of 5 groups (a remainder for both factors)."""
    K, N, M = 128 * 5 * cfg.SPLIT_K, 72, 3
    _, lay, leaves, x = setup(K, N, M, seed=11, fmt=fmt)
    plain = run(x, leaves, lay, K, N, cfg)
    for unroll in (2, 4):
        assert torch.equal(run(x, leaves, lay, K, N, dataclasses.replace(cfg, UNROLL=unroll)), plain), unroll
    assert rel_err(plain.float(), pm.packed_mm_reference(x, leaves, lay, K, N).float()) < TOL


@pytest.mark.parametrize("fmt", ["int4_k_stack", "gptq"])
@pytest.mark.parametrize("groups", [1, 2])
def test_words_loaded_in_their_own_iteration_give_the_plain_loops_bits(groups, fmt):
    """``PREFETCH=0`` (a probe field: no loop-carried copy of the next group's words) moves loads, not
    arithmetic: the bits of the prefetching loop, over a K slice of 3 groups and a tail of columns."""
    K, N, M = 128 * 3 * 2, 72, 5
    _, lay, leaves, x = setup(K, N, M, seed=13, fmt=fmt)
    cfg = S(SPLIT_K=2, GROUPS_PER_WARP=groups)
    plain = run(x, leaves, lay, K, N, cfg)
    assert torch.equal(run(x, leaves, lay, K, N, dataclasses.replace(cfg, PREFETCH=0)), plain)
    assert rel_err(plain.float(), pm.packed_mm_reference(x, leaves, lay, K, N).float()) < TOL


def test_bad_input_gets_a_clear_error():
    K, N = 256, 64
    _, lay, leaves, x = setup(K, N, 2, fmt="int4_k_stack")
    cfg = S(SPLIT_K=2)
    with pytest.raises(ValueError, match="bf16"):
        ims.int4_mma_sync(x.half(), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="M <= 8"):
        ims.int4_mma_sync(torch.randn(9, K, dtype=torch.bfloat16, device=DEVICE), leaves, lay, K, N, cfg)
    for bad in (S(SPLIT_K=3), S(GROUPS_PER_WARP=3, SPLIT_K=1), S(SPLIT_K=1, PREFETCH=2, GROUPS_PER_WARP=2),
                S(SPLIT_K=1, UNROLL=3), S(SPLIT_K=1, PREFETCH=3)):
        with pytest.raises(ValueError, match="do not fit"):
            ims.int4_mma_sync(x, leaves, lay, K, N, bad)
    strided = list(leaves)
    strided[lay.code] = leaves[lay.code].t().contiguous().t()  # same values, column-major
    with pytest.raises(ValueError, match="contiguous"):
        ims.int4_mma_sync(x, strided, lay, K, N, cfg)
    with pytest.raises(ValueError, match="layout"):
        ims.int4_mma_sync(x, leaves, dataclasses.replace(lay, group_k=64), K, N, cfg)
    with pytest.raises(ValueError, match="bias"):
        ims.int4_mma_sync(x, leaves, lay, K, N, cfg, bias=torch.zeros(N + 1, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="workspace"):
        ims.int4_mma_sync(x, leaves, lay, K, N, cfg, workspace=torch.empty(1, 2, N, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_k_stack", "gptq"])
@pytest.mark.parametrize("M", [1, 5, 8])
@pytest.mark.parametrize("K,N", [(4096, 14336), (14336, 4096), (4096, 4104), (8192, 8192)])
def test_gpu_sizes(K, N, M, fmt):
    _, lay, leaves, x = setup(K, N, M, seed=K + N, fmt=fmt)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    offered = [c for c in dm.candidates(M, N, K, layout=lay.to_text(), x_dtype=torch.bfloat16) if isinstance(c, S)]
    assert offered
    for cfg in offered:
        got = run(x, leaves, lay, K, N, cfg)
        assert not got.isnan().any() and rel_err(got.float(), want.float()) < TOL, cfg
        assert torch.equal(got, run(x, leaves, lay, K, N, cfg)), cfg  # the split-K reduction is deterministic


@pytest.mark.gpu
def test_gpu_tuner_times_it_and_agrees():
    """The first call at a shape times int4_mma_sync beside the GEMV and int4_mma; whatever it picks matches
    the reference."""
    K, N, M = 8192, 8192, 1
    prog, lay, leaves, x = setup(K, N, M, seed=9, fmt="int4_k_stack")
    got = dm.decode_mm_triton(x, leaves, prog.to_text(), None, layout=lay.to_text())
    assert rel_err(got.float(), pm.packed_mm_reference(x, leaves, lay, K, N).float()) < TOL
    timed = dm.timings[(prog.to_text(), lay.to_text(), 1, 1, x.device)]
    assert any(isinstance(c, ims.Int4MmaSync) for c in timed), list(timed)
