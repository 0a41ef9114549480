"""8-bit weights (FP8 e4m3, int8, uint8 with zero points) on tensor cores in f16 (``fusekern.kernels.fp8_mma``)
against the float64 reference.

CPU: the kernel runs in the Triton interpreter on small shapes: 1-16 rows, column and K tails, splits of K
(including more splits than K tiles), per-channel, per-tensor and 128 x 128 block scales, a global scale, biases,
NaN-poisoned workspaces, strided and column-major rows, strided and misaligned codes; rows with values near bf16's
limits and far below their neighbours (x is scaled into f16's range per K tile: nothing overflows, nothing
small is lost beyond f16's subnormal grid); int8 codes at their extremes with 8-bit zero points, uint8 codes
minus a constant. The dispatcher offers it for 8-bit codes at 2-16 bf16 rows only, and bad input
gets a clear error. GPU: issue 4's sizes, the same extreme rows, and the replay of a recorded launch.
"""
import dataclasses

import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import fp8_mma as f8
from fusekern.kernels import packed_mm as pm
from fusekern.testing import rel_err
from test_int4_mma import DEVICE, TOL, setup

F = f8.Fp8Mma
FP8_FORMATS = ["fp8_channel", "fp8_tensor", "fp8_block"]
INT8_FORMATS = ["int8_channel", "int8_group", "int8_group_asym"]
FORMATS = FP8_FORMATS + INT8_FORMATS


def run(x, leaves, lay, K, N, cfg, bias=None):
    ws = torch.full((cfg.SPLIT_K, x.shape[0], N), float("nan"), device=x.device)  # poisoned partials
    out = pm.packed_mm(x, leaves, lay, K, N, cfg, bias, workspace=ws if cfg.SPLIT_K > 1 else None)
    assert out.shape == (x.shape[0], N) and out.dtype == torch.bfloat16
    return out


def check(got, x, leaves, lay, K, N, bias=None, tol=TOL):
    want = pm.packed_mm_reference(x, leaves, lay, K, N, bias)
    assert not got.isnan().any() and rel_err(got.float(), want.float()) < tol, rel_err(got.float(), want.float())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("K,N,cfg", [(384, 136, F(64, 128, 2)), (512, 256, F(128, 128, 3, 8)),
                                     (256, 64, F(64, 128, 1)), (256, 64, F(64, 64, 5))],
                         ids=["col_tail", "three_splits", "no_split", "more_splits_than_tiles"])
def test_matches_reference(K, N, cfg, M, fmt):
    if fmt == "fp8_block" and N % 128:
        pytest.skip("128 x 128 blocks")
    _, lay, leaves, x = setup(K, N, M, seed=K + N + M, fmt=fmt)
    assert f8.fits(lay, M, K, torch.bfloat16, cfg.BLOCK_K)
    bias = torch.randn(N, dtype=torch.bfloat16, device=DEVICE)
    got = run(x, leaves, lay, K, N, cfg, bias)
    check(got, x, leaves, lay, K, N, bias)
    assert torch.equal(got, run(x, leaves, lay, K, N, cfg, bias))  # the split-K sum is deterministic


def test_k_tail_and_global_scale():
    K, N, M = 600, 72, 7  # K not a multiple of the 128-deep tile, N not of the 64-column one
    _, lay, leaves, x = setup(K, N, M, seed=3, fmt="fp8_channel")
    check(run(x, leaves, lay, K, N, F(64, 128, 2)), x, leaves, lay, K, N)
    glob = torch.tensor([0.37], device=DEVICE)
    lay_g = dataclasses.replace(lay, glob=len(leaves))
    check(run(x, leaves + [glob], lay_g, K, N, F(64, 128, 3)), x, leaves + [glob], lay_g, K, N)


def test_extreme_activations():
    """Per row: values near bf16's largest, ones 2**40 below them, subnormal bf16, a zero row, a row whose K tiles
    differ by 2**100; each K tile takes its own power of two, so every product stays exact in f16."""
    K, N, M = 512, 64, 6
    _, lay, leaves, x = setup(K, N, M, seed=5, fmt="fp8_channel")
    x = x.clone()
    x[0] *= 1e35  # near bf16's 3.4e38 (f16 alone: inf)
    x[1, :8] = 3e4 * 2.0 ** 40
    x[1, 8:] *= 3e4  # the rest 2**40 below the tile's first values
    x[2] = (torch.randn(K, device=DEVICE) * 1e-39).to(torch.bfloat16)  # bf16 subnormals
    x[3] = 0
    x[4, :128] *= 2.0 ** 60
    x[4, 128:] *= 2.0 ** -40
    for cfg in (F(64, 128, 1), F(64, 128, 4)):
        got = run(x, leaves, lay, K, N, cfg)
        want = pm.packed_mm_reference(x, leaves, lay, K, N)
        for m in range(M):
            if m == 3:
                assert not got[m].any()
                continue
            assert torch.isfinite(got[m]).all(), m
            if m == 2:
                # every output of this row is a bf16 subnormal, whose spacing is 2**-133 (3% of these values):
                # the output's own rounding exceeds TOL, so each value must be within one spacing of the exact one
                assert 0 < want[m].abs().max() < 2.0 ** -126, m
                err = (got[m].double().cpu() - want[m].double().cpu()).abs().max().item()  # (the reference is on the CPU)
                assert err <= 2.0 ** -133, (m, err)
                continue
            assert rel_err(got[m].float(), want[m].float()) < TOL, (m, rel_err(got[m].float(), want[m].float()))


def test_products_beyond_fp32_with_small_scales():
    """Found in review: x times the codes can pass fp32's largest value where the scale brings the true result
    back (1e37 x 448 x 1e-4): the scale is applied to each tile's sum before its power of two is taken off."""
    K, N, M = 256, 64, 3
    for fmt in ("fp8_channel", "fp8_block", "fp8_tensor"):
        if fmt == "fp8_block":
            N = 128
        _, lay, leaves, x = setup(K, N, M, seed=11, fmt=fmt)
        leaves = [torch.full_like(t, 1e-4) if i == lay.scale else t for i, t in enumerate(leaves)]
        x = x.clone()
        x[1] *= 1e37
        for cfg in (F(64, 128, 1), F(64, 128, 2)):
            got = run(x, leaves, lay, K, N, cfg)
            assert torch.isfinite(got).all(), (fmt, cfg)
            check(got, x, leaves, lay, K, N)


def test_strided_rows_and_codes():
    K, N, M = 384, 128, 4
    _, lay, leaves, x = setup(K, N, M, seed=9, fmt="fp8_channel")
    cfg = F(64, 128, 2)
    wide = torch.zeros(M, K + 8, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :K] = x
    check(run(wide[:, :K], leaves, lay, K, N, cfg), x, leaves, lay, K, N)  # row stride K + 8
    check(run(x.t().contiguous().t(), leaves, lay, K, N, cfg), x, leaves, lay, K, N)  # column-major: copied
    q = leaves[lay.code]
    padded = torch.zeros(N, K + 17, dtype=torch.uint8, device=DEVICE)
    padded[:, 1:K + 1] = q.view(torch.uint8)
    moved = [padded[:, 1:K + 1].view(torch.float8_e4m3fn) if i == lay.code else t for i, t in enumerate(leaves)]
    assert moved[lay.code].data_ptr() % 2 == 1 and moved[lay.code].stride(0) == K + 17
    check(run(x, moved, lay, K, N, cfg), x, leaves, lay, K, N)  # rows K + 17 bytes apart, an odd start


def test_unsigned_codes_with_a_constant_zero():
    """uint8 codes minus a constant (128: symmetric codes stored unsigned), per-group scales."""
    K, N, M = 384, 72, 6
    _, lay, leaves, x = setup(K, N, M, seed=5, fmt="int8_group")
    codes = leaves[lay.code].view(torch.uint8)
    ulay = dataclasses.replace(lay, value="uint", zero="const", zero_value=128.0)
    uleaves = [codes if i == lay.code else t for i, t in enumerate(leaves)]
    assert f8.layout_fits(ulay)
    for cfg in (F(64, 128, 1), F(64, 128, 3)):
        check(run(x, uleaves, ulay, K, N, cfg), x, uleaves, ulay, K, N)
    assert not f8.layout_fits(dataclasses.replace(ulay, zero_value=0.5))  # q - 0.5: not an integer
    assert not f8.layout_fits(dataclasses.replace(ulay, zero_value=300.0))  # beyond ZERO_MAX


def test_int8_codes_at_their_extremes():
    """Every int8 value (-128 and 127 included) and the largest 8-bit zero points: q - z up to 255 in size,
    exact in f16."""
    K, N, M = 256, 64, 3
    _, lay, leaves, x = setup(K, N, M, seed=8, fmt="int8_group_asym")
    codes = torch.arange(N * K, device=DEVICE).remainder(256).sub(128).to(torch.int8).reshape(N, K)
    zeros = leaves[lay.zero_leaf].clone()
    zeros[0::2] = 127
    zeros[1::2] = -128
    extreme = [codes if i == lay.code else zeros if i == lay.zero_leaf else t for i, t in enumerate(leaves)]
    check(run(x, extreme, lay, K, N, F(64, 128, 2)), x, extreme, lay, K, N)


def test_dispatch_offers_it_for_8_bit_codes_at_2_to_16_bf16_rows():
    for fmt in FORMATS:
        _, lay, _, _ = setup(256, 128, 2, fmt=fmt)
        mma = lambda M, **kw: [c for c in dm.candidates(M, 8192, 8192, layout=lay.to_text(), **kw)  # noqa: E731
                               if isinstance(c, F)]
        assert mma(2) and mma(16) and mma(16, x_dtype=torch.bfloat16)
        assert not mma(1) and not mma(17) and not mma(16, x_dtype=torch.float16)
    for fmt in ("gptq", "mxfp4", "hqq"):  # (HQQ: uint8 codes minus a float zero, not an integer)
        _, lay, _, _ = setup(256, 128, 2, fmt=fmt)
        assert not f8.layout_fits(lay)
    _, lay, _, _ = setup(256, 128, 2, fmt="int8_group")
    assert dm.min_capability(F(), lay) == dm.device_info.MIN_CAPABILITY  # no FP8 conversion for int8 codes
    _, lay, _, _ = setup(256, 128, 2, fmt="fp8_channel")
    assert not f8.layout_fits(dataclasses.replace(lay, zero="float", zero_leaf=2, zero_dims=("n",)))  # (w8 - z) * s
    assert not f8.layout_fits(dataclasses.replace(lay, scale_enc="e8m0"))


def test_bad_input_gets_a_clear_error():
    K, N = 256, 64
    _, lay, leaves, x = setup(K, N, 2, fmt="fp8_channel")
    cfg = F(64, 128, 2)
    with pytest.raises(ValueError, match="bf16"):
        f8.fp8_mma(x.half(), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="bf16"):
        f8.fp8_mma(torch.randn(17, K, dtype=torch.bfloat16, device=DEVICE), leaves, lay, K, N, cfg)
    as_bytes = [t.view(torch.uint8) if i == lay.code else t for i, t in enumerate(leaves)]
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        f8.fp8_mma(x, as_bytes, lay, K, N, cfg)
    col_major = [t.t().contiguous().t() if i == lay.code else t for i, t in enumerate(leaves)]
    with pytest.raises(ValueError, match="unit stride"):
        f8.fp8_mma(x, col_major, lay, K, N, cfg)
    with pytest.raises(ValueError, match="layout_fits"):
        f8.fp8_mma(x, leaves, dataclasses.replace(lay, zero="const"), K, N, cfg)
    with pytest.raises(ValueError, match="whole"):
        f8.fp8_mma(x, leaves, dataclasses.replace(lay, group_k=64, scale_dims=("n", "k")), K, N, cfg)
    with pytest.raises(ValueError, match="bias"):
        f8.fp8_mma(x, leaves, lay, K, N, cfg, bias=torch.zeros(N + 1, dtype=torch.bfloat16, device=DEVICE))
    short = [t[:-1] if i == lay.scale else t for i, t in enumerate(leaves)]
    with pytest.raises(ValueError, match="scales are"):
        f8.fp8_mma(x, short, lay, K, N, cfg)
    fp8_scales = [t.to(torch.float8_e4m3fn) if i == lay.scale else t for i, t in enumerate(leaves)]
    with pytest.raises(ValueError, match="16-, 32- or 64-bit"):
        f8.fp8_mma(x, fp8_scales, lay, K, N, cfg)
    with pytest.raises(ValueError, match="workspace"):
        f8.fp8_mma(x, leaves, lay, K, N, cfg, workspace=torch.empty(1, 2, N, device=DEVICE))
    e8m0_glob = torch.tensor([0.5], device=DEVICE).to(torch.float8_e8m0fnu)  # Triton's pointers do not take E8M0
    with pytest.raises(ValueError, match="global scale must be one float"):
        f8.fp8_mma(x, leaves + [e8m0_glob], dataclasses.replace(lay, glob=len(leaves)), K, N, cfg)
    _, lay8, leaves8, x8 = setup(K, N, 2, fmt="int8_group_asym")
    wide_zeros = [t.to(torch.int32) if i == lay8.zero_leaf else t for i, t in enumerate(leaves8)]
    with pytest.raises(ValueError, match="zero points must be int8 or uint8"):
        f8.fp8_mma(x8, wide_zeros, lay8, K, N, cfg)
    unsigned = [t.view(torch.uint8) if i == lay8.code else t for i, t in enumerate(leaves8)]
    with pytest.raises(ValueError, match="the kernel reads int8"):
        f8.fp8_mma(x8, unsigned, lay8, K, N, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [2, 16])
@pytest.mark.parametrize("K,N", [(4096, 14336), (8192, 8192), (4096, 4224)])
def test_gpu_sizes(K, N, M, fmt):
    _, lay, leaves, x = setup(K, N, M, seed=K + N, fmt=fmt)
    offered = [c for c in dm.candidates(M, N, K, layout=lay.to_text(), x_dtype=torch.bfloat16) if isinstance(c, F)]
    assert offered
    for cfg in offered:
        got = run(x, leaves, lay, K, N, cfg)
        check(got, x, leaves, lay, K, N)
        assert torch.equal(got, run(x, leaves, lay, K, N, cfg)), cfg


@pytest.mark.gpu
def test_gpu_extreme_activations_and_replay():
    test_extreme_activations()
    from fusekern.kernels import replay

    K, N, M = 4096, 2048, 16
    _, lay, leaves, x = setup(K, N, M, seed=1, fmt="fp8_block")
    reps = []
    for cfg in (F(64, 128, 4), F(128, 128, 1)):
        first = pm.packed_mm(x, leaves, lay, K, N, cfg, record=reps.append)
        assert isinstance(reps[-1], replay.Replay)
        x2 = torch.randn_like(x)
        assert torch.equal(reps[-1](x2), pm.packed_mm(x2, leaves, lay, K, N, cfg))
        check(first, x, leaves, lay, K, N)
