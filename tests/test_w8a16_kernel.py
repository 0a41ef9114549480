"""The W8A16 kernels against their float64 reference: every path, odd shapes, layouts, poisoned outputs.

On CPU the Triton kernels run in the interpreter (conftest); the same tests run compiled on a GPU.
"""
import os
import subprocess
import sys

import pytest
import torch

from fusekern.kernels import w8a16_linear as k
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


def test_custom_op_opcheck():
    x, w, s, b = make(4, 16, 32, torch.bfloat16, bias_dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.fusekern.w8a16_linear.default, (x, w, s, b, torch.bfloat16))
    torch.library.opcheck(torch.ops.fusekern.w8a16_linear.default, (x, w, s, None, torch.float32))


def test_custom_op_matches_reference():
    x, w, s, b = make(6, 20, 40, torch.float16, bias_dtype=torch.float16)
    out = torch.ops.fusekern.w8a16_linear(x, w, s, b, torch.float16)
    assert rel_err(out, k.w8a16_linear_reference(x.cpu(), w.cpu(), s.cpu(), b.cpu())) < TOL[torch.float16]


AOT_SCRIPT = r"""
from fusekern.kernels import w8a16_linear as k
from fusekern.kernels.aot import compile_sm90, resources
ptrs = dict(x_ptr="*bf16", w_ptr="*i8", scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16")
ints = {n: "i32" for n in "M N K stride_xm stride_xk stride_wn stride_wk stride_s stride_b stride_om stride_on".split()}
sig = {**ptrs, **ints}
for M, N, K in [(1, 8192, 8192), (1, 4096, 14336), (64, 8192, 8192)]:
    cfg = k.select_config(M, N, K)
    if isinstance(cfg, k.SplitKConfig):
        c = compile_sm90(k._w8a16_splitk_kernel, sig, dict(HAS_BIAS=True, EVEN_K=True, SPLIT_K=cfg.SPLIT_K,
                         BLOCK_M=16, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K), cfg.num_warps, cfg.num_stages)
    else:
        c = compile_sm90(k._w8a16_gemm_kernel, sig, dict(HAS_BIAS=True, EVEN_K=True, BLOCK_M=cfg.BLOCK_M,
                         BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M), cfg.num_warps, cfg.num_stages)
    r = resources(c)
    assert "sm_90" in c.asm["ptx"], "not compiled for sm_90"
    print(type(cfg).__name__, M, N, K, r)
    assert r.local == 0, f"spills: {r}"
"""


def test_kernels_compile_for_sm90_without_gpu():
    env = {k_: v for k_, v in os.environ.items() if k_ != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("Resources(") == 3
