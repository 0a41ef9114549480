"""The W8A16 kernels against their float64 reference: every path, odd shapes, layouts, poisoned outputs.

On CPU the Triton kernels run in the interpreter (conftest); the same tests run compiled on a GPU.
"""
import dataclasses

import pytest
import torch

from fusekern.kernels import w8a16_linear as k
from fusekern.kernels.remat import REMAT_MODES
from fusekern.testing import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}

PATHS = {
    "splitk": k.SplitKConfig(BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2, SPLIT_K=1),
    "splitk3": k.SplitKConfig(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2, SPLIT_K=3),
    "gemm": k.GemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2),
    "dequant": k.DequantConfig(BLOCK_N=16, BLOCK_K=32),
}


def make(M, N, K, dtype, layout="contiguous", seed=0, bias_dtype=None):
    """Inputs on DEVICE; strided / misaligned views are made there (``.to`` would re-densify them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8).to(DEVICE)
    s = (torch.rand(N, generator=g) * 0.02 + 1e-3).to(DEVICE)
    b = torch.randn(N, generator=g).to(DEVICE, bias_dtype) if bias_dtype else None
    if layout == "noncontiguous":
        x = torch.cat([x, x], dim=1)[:, ::2]  # column stride 2
        w = torch.cat([w, w], dim=1)[:, :K]  # row stride 2K
        s = torch.stack([s, s], dim=1)[:, 0]  # stride 2
    elif layout == "misaligned":
        x = torch.cat([torch.zeros(1, dtype=dtype, device=DEVICE), x.flatten()])[1:].view(M, K)
        w = torch.cat([torch.zeros(1, dtype=torch.int8, device=DEVICE), w.flatten()])[1:].view(N, K)
    return x, w, s, b


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 37, 100), (5, 48, 64), (19, 33, 75)])
def test_paths_match_reference(path, dtype, M, N, K):
    x, w, s, b = make(M, N, K, dtype, bias_dtype=dtype, seed=M * N + K)
    out = torch.full((M, N), float("nan"), device=DEVICE, dtype=dtype)
    k.w8a16_linear_triton(x, w, s, b, dtype, config=PATHS[path], out=out)
    ref = k.w8a16_linear_reference(x.cpu(), w.cpu(), s.cpu(), b.cpu())
    assert not torch.isnan(out).any(), "unwritten output elements"
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("remat", REMAT_MODES)
@pytest.mark.parametrize("path", ["splitk", "splitk3", "gemm"])
def test_every_remat_mode_matches_reference(path, remat):
    M, N, K = 19, 70, 100  # several row and column tiles, a masked K tail
    x, w, s, b = make(M, N, K, torch.bfloat16, bias_dtype=torch.bfloat16, seed=11)
    out = torch.full((M, N), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    k.w8a16_linear_triton(x, w, s, b, config=dataclasses.replace(PATHS[path], remat=remat), out=out)
    ref = k.w8a16_linear_reference(x.cpu(), w.cpu(), s.cpu(), b.cpu())
    assert not torch.isnan(out).any(), "unwritten output elements"
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_unknown_remat_mode_is_a_clear_error():
    x, w, s, _ = make(2, 8, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="rematerialization mode"):
        k.w8a16_linear_triton(x, w, s, config=dataclasses.replace(PATHS["gemm"], remat="sometimes"))


@pytest.mark.parametrize("layout", ["noncontiguous", "misaligned"])
@pytest.mark.parametrize("path", ["splitk3", "gemm", "dequant"])
def test_strided_and_misaligned_inputs(layout, path):
    M, N, K = 7, 40, 96
    x, w, s, _ = make(M, N, K, torch.bfloat16, layout=layout, seed=3)
    if layout == "noncontiguous":
        assert not x.is_contiguous() and not w.is_contiguous() and not s.is_contiguous()
    else:
        assert x.data_ptr() % 16 and w.data_ptr() % 16
    out = torch.full((M, N), float("nan"), device=DEVICE, dtype=torch.float32)
    k.w8a16_linear_triton(x, w, s, None, torch.float32, config=PATHS[path], out=out)
    ref = k.w8a16_linear_reference(x.cpu(), w.cpu(), s.cpu(), None, torch.float64)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_fp32_bias_and_output():
    x, w, s, b = make(3, 24, 48, torch.bfloat16, bias_dtype=torch.float32, seed=5)
    out = k.w8a16_linear_triton(x, w, s, b, torch.float32)
    assert out.dtype == torch.float32
    # No bf16 rounding on the way out: the fused result is far closer than bf16 eps.
    assert rel_err(out, k.w8a16_linear_reference(x.cpu(), w.cpu(), s.cpu(), b.cpu(), torch.float64)) < 1e-5


@pytest.mark.parametrize("scale", [600.0, 2e-7])
@pytest.mark.parametrize("path", ["dequant", "gemm", "auto"])
def test_fp16_wider_result_keeps_its_range(path, scale):
    """An fp32 result from fp16 x (a scale after the matmul): neither w * s nor x @ w may pass through fp16 on the
    way. The large-M path rounded w * s to fp16 (inf at s = 600, subnormals at 2e-7) and the product too; the
    automatic choice (M = 300 picks that path otherwise) now takes the tiled kernel there."""
    M, N, K = (300 if path == "auto" else 33), 40, 64
    assert path != "auto" or isinstance(k.select_config(M, N, K), k.DequantConfig)
    x, w, _, b = make(M, N, K, torch.float16, seed=21, bias_dtype=torch.float32)
    x = x * 4  # with s = 600 the outputs pass fp16's 65504 by far
    s = torch.full((N,), scale, device=DEVICE) * (1 + torch.rand(N, device=DEVICE))
    out = torch.full((M, N), float("nan"), device=DEVICE, dtype=torch.float32)
    k.w8a16_linear_triton(x, w, s, b * scale, torch.float32, config=PATHS.get(path), out=out)
    ref = k.w8a16_linear_reference(x.cpu(), w.cpu(), s.cpu(), (b * scale).cpu(), torch.float64)
    assert out.isfinite().all()
    assert rel_err(out, ref) < 1e-5


def test_out_on_another_device_is_a_clear_error():
    x, w, s, _ = make(2, 8, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        k.w8a16_linear_triton(x, w, s, out=torch.empty(2, 8, dtype=torch.bfloat16, device="meta"))


def test_select_config_by_m():
    assert isinstance(k.select_config(1, 8192, 8192), k.GemmConfig)  # many column tiles
    cfg = k.select_config(1, 4096, 14336)
    assert isinstance(cfg, k.SplitKConfig) and cfg.SPLIT_K > 1  # few column tiles: split K
    assert isinstance(k.select_config(64, 8192, 8192), k.GemmConfig)
    assert isinstance(k.select_config(2048, 8192, 8192), k.DequantConfig)


def test_empty_and_bad_input():
    x, w, s, b = make(0, 8, 16, torch.bfloat16, bias_dtype=torch.bfloat16)
    assert k.w8a16_linear_triton(x, w, s, b).shape == (0, 8)
    x, w, s, _ = make(2, 8, 16, torch.bfloat16)
    with pytest.raises(TypeError, match="int8"):
        k.w8a16_linear_triton(x, w.to(torch.int16), s)
    with pytest.raises(ValueError, match="scale must have shape"):
        k.w8a16_linear_triton(x, w, s[:4])
    with pytest.raises(ValueError, match="K mismatch"):
        k.w8a16_linear_triton(x[:, :8], w, s)
    with pytest.raises(TypeError, match="fp16 or bf16"):
        k.w8a16_linear_triton(x.float(), w, s)
    op = torch.ops.fusekern.w8a16_linear
    with pytest.raises(TypeError, match="out_dtype must be fp16, bf16, fp32 or fp64"):
        op(x, w, s, None, torch.int8)
    with pytest.raises(TypeError, match="scale must be fp16, bf16, fp32 or fp64"):
        op(x, w, s.to(torch.complex64), None, torch.bfloat16)  # (its imaginary part was dropped)
    with pytest.raises(TypeError, match="x must be fp16, bf16, fp32 or fp64"):
        op(x.to(torch.float8_e4m3fn), w, s, None, torch.bfloat16)


def test_custom_op_opcheck():
    x, w, s, b = make(4, 16, 32, torch.bfloat16, bias_dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.fusekern.w8a16_linear.default, (x, w, s, b, torch.bfloat16))
    torch.library.opcheck(torch.ops.fusekern.w8a16_linear.default, (x, w, s, None, torch.float32))


def test_custom_op_matches_reference():
    x, w, s, b = make(6, 20, 40, torch.float16, bias_dtype=torch.float16)
    out = torch.ops.fusekern.w8a16_linear(x, w, s, b, torch.float16)
    assert rel_err(out, k.w8a16_linear_reference(x.cpu(), w.cpu(), s.cpu(), b.cpu())) < TOL[torch.float16]


def test_custom_op_fp32_activations_take_the_reference_path():
    """fp32 rows are not the kernel's: the CUDA kernel hands them to the reference implementation (it was
    once decorated away to None, and this call raised TypeError), which the op also runs on CPU."""
    x, w, s, b = make(3, 20, 40, torch.float32, bias_dtype=torch.float32)
    want = k.w8a16_linear_reference(x.cpu(), w.cpu(), s.cpu(), b.cpu())
    out = torch.ops.fusekern.w8a16_linear(x, w, s, b, torch.float32)
    assert out.dtype == torch.float32 and rel_err(out.cpu(), want) < 1e-5
    direct = k._w8a16_linear_cuda(x, w, s, b, torch.float32)  # (falls back before any GPU work)
    assert torch.equal(direct.cpu(), out.cpu())
