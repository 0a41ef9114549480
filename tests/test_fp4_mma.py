"""MXFP4 on tensor cores, decoded by an in-register lookup table (``fusekern.kernels.fp4_mma``), against its
float64 reference and eager's dequantized weight.

CPU: the kernel runs in the Triton interpreter (fp32 arithmetic in place of its inline PTX) on small shapes:
1-64 rows (x padded to 16, 32, 64), column tails, every split of K, biases, strided rows, NaN-poisoned
workspaces; one-hot rows read every weight back bit for bit as eager dequantizes it (all 16 codes, scales
from 2**-126 to 2**73). The dispatcher offers it for MXFP4 only, and bad input gets a clear error. GPU: the
same checks, where the lookup table and the packed bf16 multiply run, and issue 4's sizes.
"""
import dataclasses

import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import fp4_mma as f4
from fusekern.kernels import packed_mm as pm
from fusekern.testing import rel_err
from fusekern.testing.decode_zoo import E2M1
from test_int4_mma import DEVICE, TOL, setup

F = f4.Fp4Mma


def run(x, leaves, lay, K, N, cfg, bias=None):
    ws = torch.full((cfg.SPLIT_K, x.shape[0], N), float("nan"), device=x.device)  # poisoned partials
    out = pm.packed_mm(x, leaves, lay, K, N, cfg, bias, workspace=ws if cfg.SPLIT_K > 1 else None)
    assert out.shape == (x.shape[0], N) and out.dtype == torch.bfloat16
    return out


@pytest.mark.parametrize("M", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("K,N,cfg", [(256, 136, F(128, 2)), (384, 64, F(64, 3)), (256, 128, F(64, 1))],
                         ids=["tail", "three_splits", "no_split"])
def test_matches_reference(K, N, cfg, M):
    _, lay, leaves, x = setup(K, N, M, seed=K + N + M, fmt="mxfp4")
    assert f4.fits(lay, M, K, torch.bfloat16)
    bias = torch.randn(N, dtype=torch.bfloat16, device=DEVICE)
    got = run(x, leaves, lay, K, N, cfg, bias)
    want = pm.packed_mm_reference(x, leaves, lay, K, N, bias)
    assert not got.isnan().any() and rel_err(got.float(), want.float()) < TOL


def _eager_weight(codes: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """W [K, N] in bf16 as ``decode_zoo.mxfp4`` dequantizes it (fp32 product, then rounded)."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)
    N = codes.shape[0]
    w = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], -1).view(N, -1, 32)
    return (w * torch.exp2(e8m0.float() - 127)[..., None]).view(N, -1).to(torch.bfloat16).t()


@pytest.mark.parametrize("split_k", [1, 2])
def test_one_hot_rows_read_every_weight_exactly(split_k):
    """x = rows of the identity: out = W's rows, bit for bit, for every code and scales from 2**-126 to 2**73
    (the decode, the scale and the slot order exact; the product's rounding is eager's)."""
    K, N = 256, 72
    _, lay, leaves, _ = setup(K, N, 1, seed=5, fmt="mxfp4")
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    codes[0], codes[1] = torch.arange(128), torch.arange(128, 256)  # columns 0 and 1: every byte value
    scales = torch.randint(1, 201, (N, K // 32), dtype=torch.uint8, generator=g)
    leaves = list(leaves)
    leaves[lay.code], leaves[lay.scale] = codes.to(DEVICE), scales.to(DEVICE)
    want = _eager_weight(codes, scales)  # [K, N]
    for rows in (range(0, 64), range(64, 128), range(128, 192), range(192, 256)):
        x = torch.zeros(len(rows), K, dtype=torch.bfloat16, device=DEVICE)
        x[torch.arange(len(rows), device=DEVICE), torch.tensor(list(rows), device=DEVICE)] = 1.0
        got = run(x, leaves, lay, K, N, F(64, split_k))
        assert torch.equal(got.cpu(), want[list(rows)]), rows


def test_strided_rows():
    K, N, M = 512, 40, 5
    _, lay, leaves, x = setup(K, N, M, seed=4, fmt="mxfp4")
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    wide = torch.zeros(M, 2 * K, dtype=torch.bfloat16, device=DEVICE)
    wide[:, ::2] = x
    for rows in (wide[:, ::2], x.t().contiguous().t()):
        got = run(rows, leaves, lay, K, N, F(64, 2))
        assert rel_err(got.float(), want.float()) < TOL


def test_offered_only_for_mxfp4():
    _, lay, _, _ = setup(256, 64, 1, fmt="mxfp4")
    fp4 = lambda M, lay, **kw: [c for c in dm.candidates(M, 8192, 8192, layout=lay.to_text(), **kw)  # noqa: E731
                                if isinstance(c, F)]
    offered = fp4(16, lay, x_dtype=torch.bfloat16)
    assert offered and all((8192 // 128) % c.SPLIT_K == 0 for c in offered)
    assert fp4(1, lay) and fp4(64, lay) and not fp4(65, lay)
    assert not fp4(16, lay, x_dtype=torch.float16)  # the MMA reads bf16
    assert not f4.layout_fits(dataclasses.replace(lay, group_k=16))
    for name in ("nvfp4", "gptq", "int4_k_stack", "fp8_channel", "awq"):
        assert not f4.layout_fits(pm.REPORT_LAYOUTS[name][0]), name


def test_bad_input_gets_a_clear_error():
    K, N = 256, 64
    _, lay, leaves, x = setup(K, N, 2, fmt="mxfp4")
    cfg = F(64, 2)
    with pytest.raises(ValueError, match="bf16"):
        f4.fp4_mma(x.half(), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="M <= 64"):
        f4.fp4_mma(torch.randn(65, K, dtype=torch.bfloat16, device=DEVICE), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="do not fit"):
        f4.fp4_mma(x, leaves, lay, K, N, F(64, 3))
    with pytest.raises(ValueError, match="MXFP4"):
        f4.fp4_mma(x, leaves, dataclasses.replace(lay, group_k=16), K, N, cfg)
    strided = list(leaves)
    strided[lay.code] = leaves[lay.code].t().contiguous().t()  # same values, column-major
    with pytest.raises(ValueError, match="contiguous"):
        f4.fp4_mma(x, strided, lay, K, N, cfg)
    with pytest.raises(ValueError, match="bias"):
        f4.fp4_mma(x, leaves, lay, K, N, cfg, bias=torch.zeros(N + 1, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16, 64])
@pytest.mark.parametrize("K,N", [(4096, 14336), (14336, 4096), (4096, 4104), (8192, 8192)])
def test_gpu_sizes(K, N, M):
    _, lay, leaves, x = setup(K, N, M, seed=K + N, fmt="mxfp4")
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    offered = [c for c in dm.candidates(M, N, K, layout=lay.to_text(), x_dtype=torch.bfloat16) if isinstance(c, F)]
    assert offered
    for cfg in offered:
        got = run(x, leaves, lay, K, N, cfg)
        assert not got.isnan().any() and rel_err(got.float(), want.float()) < TOL, cfg
        assert torch.equal(got, run(x, leaves, lay, K, N, cfg)), cfg  # the split-K reduction is deterministic
