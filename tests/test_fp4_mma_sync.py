"""FP4 (MXFP4, NVFP4) on warp-level tensor cores (``fusekern.kernels.fp4_mma_sync``) against its float64
reference and eager's dequantized weight.

CPU: the kernel runs in the Triton interpreter (fp32 arithmetic in place of its inline PTX, the warp's MMA summed
out by reshapes) on small shapes: 1-16 rows (one or two MMAs per k slice), column tails, every split of K,
biases, strided and misaligned rows, codes that start 4- but not 16-byte aligned, NaN-poisoned workspaces;
one-hot rows read every weight back bit for bit as eager dequantizes it (all 16 codes; E8M0 scales from
2**-127, a subnormal, to 2**73; E4M3 scales of every finite value times a global scale); NaN and infinite
scales reach the output as eager's do. The dispatcher offers it for FP4 layouts only, and bad input gets a
clear error. GPU: the same checks, where the lookup table and the packed bf16 multiply run, and issue 4's sizes.
"""
import dataclasses

import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import fp4_mma_sync as f4s
from fusekern.kernels import packed_mm as pm
from fusekern.testing import rel_err
from fusekern.testing.decode_zoo import E2M1
from test_int4_mma import DEVICE, TOL, setup

F = f4s.Fp4MmaSync
FORMATS = ["mxfp4", "nvfp4"]


def run(x, leaves, lay, K, N, cfg, bias=None):
    ws = torch.full((cfg.SPLIT_K, x.shape[0], N), float("nan"), device=x.device)  # poisoned partials
    out = pm.packed_mm(x, leaves, lay, K, N, cfg, bias, workspace=ws if cfg.SPLIT_K > 1 else None)
    assert out.shape == (x.shape[0], N) and out.dtype == torch.bfloat16
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("K,N,cfg", [(256, 136, F(2)), (384, 64, F(3, 2)), (256, 128, F(1))],
                         ids=["tail", "three_splits", "no_split"])
def test_matches_reference(K, N, cfg, M, fmt):
    _, lay, leaves, x = setup(K, N, M, seed=K + N + M, fmt=fmt)
    assert f4s.fits(lay, M, K, torch.bfloat16)
    bias = torch.randn(N, dtype=torch.bfloat16, device=DEVICE)
    got = run(x, leaves, lay, K, N, cfg, bias)
    want = pm.packed_mm_reference(x, leaves, lay, K, N, bias)
    assert not got.isnan().any() and rel_err(got.float(), want.float()) < TOL


def _table(device):
    return torch.tensor(E2M1, dtype=torch.float32, device=device)


def _codes(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 values [N, K] of the bytes [N, K/2] (low nibble first), fp32."""
    t = _table(codes.device)
    return torch.stack([t[(codes & 0xF).long()], t[(codes >> 4).long()]], -1).view(codes.shape[0], -1)


def _one_hot_rows(K, rows):
    x = torch.zeros(len(rows), K, dtype=torch.bfloat16, device=DEVICE)
    x[torch.arange(len(rows), device=DEVICE), torch.tensor(list(rows), device=DEVICE)] = 1.0
    return x


@pytest.mark.parametrize("split_k", [1, 2])
def test_one_hot_rows_read_every_mxfp4_weight_exactly(split_k):
    """x = rows of the identity: out = W's rows, bit for bit, for every code and E8M0 scales 0 (2**-127, a
    subnormal) to 200 (the decode, the scale and the slot order exact; the rounding is eager's)."""
    K, N = 256, 40
    _, lay, leaves, _ = setup(K, N, 1, seed=5, fmt="mxfp4")
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    codes[0], codes[1] = torch.arange(128), torch.arange(128, 256)  # columns 0 and 1: every byte value
    scales = torch.randint(0, 201, (N, K // 32), dtype=torch.uint8, generator=g)
    scales[2] = 0
    leaves = list(leaves)
    leaves[lay.code], leaves[lay.scale] = codes.to(DEVICE), scales.to(DEVICE)
    # eager (decode_zoo.mxfp4): fp32 products, rounded to bf16
    want = (_codes(codes).view(N, -1, 32) * torch.exp2(scales.float() - 127)[..., None]).view(N, K)
    want = want.to(torch.bfloat16).t()
    for rows in _windows(K):
        got = run(_one_hot_rows(K, rows), leaves, lay, K, N, F(split_k))
        assert torch.equal(got.cpu(), want[list(rows)]), rows


def _windows(K):
    """Every row of W, 16 at a time (one call per 16 rows of x)."""
    return [range(k, k + 16) for k in range(0, K, 16)]


@pytest.mark.parametrize("split_k", [1, 2])
def test_one_hot_rows_read_every_nvfp4_weight_exactly(split_k):
    """The same for NVFP4: every code, every finite E4M3 scale (subnormals, negatives), a global scale; the
    kernel rounds ``g * (e2m1 * s)`` once, as eager rounds its fp32 weight."""
    K, N = 256, 40
    _, lay, leaves, _ = setup(K, N, 1, seed=6, fmt="nvfp4")
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    codes[0], codes[1] = torch.arange(128), torch.arange(128, 256)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    scales = finite[torch.randint(0, len(finite), (N, K // 16), generator=g)]
    scales.view(-1)[: len(finite)] = finite  # every finite value at least once
    glob = torch.tensor([0.0371], dtype=torch.float32)
    leaves = list(leaves)
    leaves[lay.code] = codes.to(DEVICE)
    leaves[lay.scale] = scales.view(torch.float8_e4m3fn).to(DEVICE)
    leaves[lay.glob] = glob.to(DEVICE)
    s = scales.view(torch.float8_e4m3fn).float()
    want = (_codes(codes).view(N, -1, 16) * s[..., None] * glob).view(N, K).to(torch.bfloat16).t()
    for rows in _windows(K):
        got = run(_one_hot_rows(K, rows), leaves, lay, K, N, F(split_k))
        assert torch.equal(got.cpu(), want[list(rows)]), rows


@pytest.mark.parametrize("enc,gk,glob", [("e8m0", 16, False), ("fp8", 32, False), ("fp8", 16, False),
                                         ("e8m0", 32, True)])
@pytest.mark.parametrize("N,M", [(3, 12), (20, 9), (1, 1)])
def test_other_scale_layouts_and_narrow_outputs(enc, gk, glob, N, M):
    """The layouts ``layout_fits`` accepts beyond MXFP4 and NVFP4 (E8M0 per 16 k, E4M3 per 32, E4M3 without a
    global scale, E8M0 with one; a float64 or bf16 global), at widths below one MMA's 8 columns."""
    K = 256
    _, lay, _, _ = setup(K, 64, 1, fmt="nvfp4" if glob or enc == "fp8" else "mxfp4")
    lay = dataclasses.replace(lay, scale_enc=enc, group_k=gk, glob=2 if glob else -1)
    g = torch.Generator().manual_seed(N + M + gk)
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    if enc == "e8m0":
        scales = torch.randint(118, 130, (N, K // gk), dtype=torch.uint8, generator=g)
    else:
        scales = (torch.rand(N, K // gk, generator=g) * 4 - 2).to(torch.float8_e4m3fn)
    leaves = [codes.to(DEVICE), scales.to(DEVICE)]
    if glob:
        leaves.append(torch.tensor([0.03], dtype=torch.float64 if N == 3 else torch.bfloat16, device=DEVICE))
    x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
    assert f4s.fits(lay, M, K, torch.bfloat16)
    for cfg in (F(1), F(2)):
        got = run(x, leaves, lay, K, N, cfg)
        want = pm.packed_mm_reference(x, leaves, lay, K, N)
        assert not got.isnan().any() and rel_err(got.float(), want.float()) < TOL, cfg


def test_non_finite_scales_reach_the_output_as_in_eager():
    """A NaN E4M3 scale and an E8M0 scale of 255 (2**128: inf) make their columns non-finite, as eager's
    weights do; the other columns are unchanged."""
    K, N, M = 256, 32, 3
    for fmt, bad in (("nvfp4", 0x7F), ("mxfp4", 255)):
        _, lay, leaves, x = setup(K, N, M, seed=7, fmt=fmt)
        leaves = list(leaves)
        s = leaves[lay.scale].clone()
        s.view(torch.uint8)[5, 1] = bad
        leaves[lay.scale] = s
        got = run(x, leaves, lay, K, N, F(2))
        assert not got[:, 5].isfinite().any(), fmt
        keep = [n for n in range(N) if n != 5]
        want = pm.packed_mm_reference(x, leaves, lay, K, N)
        assert rel_err(got[:, keep].float(), want[:, keep].float()) < TOL, fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_strided_misaligned_rows_and_codes(fmt):
    """Rows strided or starting off 16 bytes are copied (at most 16 rows); codes that start 4- but not 16-byte
    aligned are read a word at a time: the same result."""
    K, N, M = 512, 40, 5
    _, lay, leaves, x = setup(K, N, M, seed=4, fmt=fmt)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    wide = torch.zeros(M, 2 * K, dtype=torch.bfloat16, device=DEVICE)
    wide[:, ::2] = x
    off = torch.zeros(M * K + 1, dtype=torch.bfloat16, device=DEVICE)[1:].view(M, K)
    off.copy_(x)
    for rows in (wide[:, ::2], x.t().contiguous().t(), off):
        got = run(rows, leaves, lay, K, N, F(2))
        assert rel_err(got.float(), want.float()) < TOL
    codes = leaves[lay.code]
    buf = torch.zeros(codes.numel() + 4, dtype=torch.uint8, device=DEVICE)
    shifted = buf[4:].view(codes.shape)
    shifted.copy_(codes)
    assert shifted.data_ptr() % 16 and shifted.data_ptr() % 4 == 0
    moved = list(leaves)
    moved[lay.code] = shifted
    got = run(x, moved, lay, K, N, F(2))
    assert rel_err(got.float(), want.float()) < TOL


def test_offered_for_fp4_up_to_16_rows():
    for fmt in FORMATS:
        _, lay, _, _ = setup(256, 64, 1, fmt=fmt)
        sync = lambda M, **kw: [c for c in dm.candidates(M, 8192, 8192, layout=lay.to_text(), **kw)  # noqa: E731
                                if isinstance(c, F)]
        offered = sync(16, x_dtype=torch.bfloat16)
        assert offered and all((8192 // 128) % c.SPLIT_K == 0 for c in offered), fmt
        assert sync(1) and not sync(17), fmt
        assert not sync(16, x_dtype=torch.float16), fmt  # the MMA reads bf16
    assert not f4s.layout_fits(dataclasses.replace(lay, group_k=64))
    assert not f4s.layout_fits(dataclasses.replace(lay, zero="const", zero_value=1.0))
    assert not f4s.layout_fits(dataclasses.replace(lay, zero_value=0.5))
    assert not f4s.layout_fits(dataclasses.replace(lay, order=(1, 0)))
    assert not f4s.layout_fits(dataclasses.replace(lay, scale_dims=("k", "n")))
    assert not f4s.layout_fits(dataclasses.replace(lay, group_n=2))
    assert not f4s.layout_fits(dataclasses.replace(lay, scale_enc="float"))
    for name in ("gptq", "int4_k_stack", "fp8_channel", "awq"):
        assert not f4s.layout_fits(pm.REPORT_LAYOUTS[name][0]), name


def test_bad_input_gets_a_clear_error():
    K, N = 256, 64
    _, lay, leaves, x = setup(K, N, 2, fmt="nvfp4")
    cfg = F(2)
    with pytest.raises(ValueError, match="bf16"):
        f4s.fp4_mma_sync(x.half(), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="M <= 16"):
        f4s.fp4_mma_sync(torch.randn(17, K, dtype=torch.bfloat16, device=DEVICE), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="do not fit"):
        f4s.fp4_mma_sync(x, leaves, lay, K, N, F(3))
    with pytest.raises(ValueError, match="E2M1"):
        f4s.fp4_mma_sync(x, leaves, dataclasses.replace(lay, group_k=64), K, N, cfg)
    strided = list(leaves)
    strided[lay.code] = leaves[lay.code].t().contiguous().t()  # same values, column-major
    with pytest.raises(ValueError, match="contiguous"):
        f4s.fp4_mma_sync(x, strided, lay, K, N, cfg)
    e5m2 = list(leaves)
    e5m2[lay.scale] = leaves[lay.scale].float().to(torch.float8_e5m2)  # another fp8: not read as E4M3
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        f4s.fp4_mma_sync(x, e5m2, lay, K, N, cfg)
    odd = list(leaves)
    buf = torch.zeros(leaves[lay.code].numel() + 2, dtype=torch.uint8, device=DEVICE)
    odd[lay.code] = buf[2:].view(leaves[lay.code].shape)  # 2-byte aligned: not readable as words
    with pytest.raises(ValueError, match="4-byte aligned"):
        f4s.fp4_mma_sync(x, odd, lay, K, N, cfg)
    shaped = list(leaves)
    shaped[lay.scale] = leaves[lay.scale][:, :-1].contiguous()
    with pytest.raises(ValueError, match="contiguous"):
        f4s.fp4_mma_sync(x, shaped, lay, K, N, cfg)
    ints = list(leaves)
    ints[lay.glob] = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="global scale"):
        f4s.fp4_mma_sync(x, ints, lay, K, N, cfg)
    two = list(leaves)
    two[lay.glob] = torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="global scale"):
        f4s.fp4_mma_sync(x, two, lay, K, N, cfg)
    with pytest.raises(ValueError, match="bias"):
        f4s.fp4_mma_sync(x, leaves, lay, K, N, cfg, bias=torch.zeros(N + 1, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("K,N", [(4096, 14336), (14336, 4096), (4096, 4104), (8192, 8192)])
def test_gpu_sizes(K, N, M, fmt):
    _, lay, leaves, x = setup(K, N, M, seed=K + N, fmt=fmt)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    offered = [c for c in dm.candidates(M, N, K, layout=lay.to_text(), x_dtype=torch.bfloat16) if isinstance(c, F)]
    assert offered
    for cfg in offered:
        got = run(x, leaves, lay, K, N, cfg)
        assert not got.isnan().any() and rel_err(got.float(), want.float()) < TOL, cfg
        assert torch.equal(got, run(x, leaves, lay, K, N, cfg)), cfg  # the split-K reduction is deterministic
