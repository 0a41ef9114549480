"""GPTQ's register-decoded tensor-core kernel (``fusekern.kernels.gptq_mma``) against its float64 reference.

CPU: the kernel runs in the Triton interpreter (plain operations in place of its inline PTX) on small
shapes with column tails, every split of K, a zero offset, biases, strided activations and NaN-poisoned
workspaces; the dispatcher offers it only for GPTQ's layout with groups of 128 and bf16 rows up to 16, and
bad input gets a clear error. GPU: the same checks at issue 4's sizes.
"""
import dataclasses

import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import gptq_mma as gm
from fusekern.kernels import packed_mm as pm
from fusekern.patterns.decode.formats import recognize
from fusekern.patterns.decode.layout import derive_layout
from fusekern.patterns.decode.program import DecodeProgram
from fusekern.testing import rel_err
from fusekern.testing.decode_cones import decode_program
from fusekern.testing.decode_zoo import BY_NAME

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 4e-3  # bf16 output: its rounding alone is ~2e-3 of the norm


def setup(K, N, M, group=128, seed=0, device=DEVICE):
    """GPTQ leaves of the zoo's program, its derived layout, its text and bf16 rows."""
    torch.manual_seed(seed)
    case = BY_NAME["gptq"]
    ws = [w.to(torch.bfloat16) if w.dtype == torch.float32 else w for w in case.make(K, N, group, "cpu")]
    x = torch.randn(M, K, dtype=torch.bfloat16)
    text, leaves, consts = decode_program(case.fn, x, *ws)
    prog = DecodeProgram.from_text(text)
    lay = derive_layout(prog, recognize(prog, consts), consts)
    return prog, lay, [t.to(device) for t in leaves], x.to(device)


def run(x, leaves, lay, K, N, cfg, bias=None):
    ws = torch.full((cfg.SPLIT_K, x.shape[0], N), float("nan"), device=x.device)  # poisoned partials
    return pm.packed_mm(x, leaves, lay, K, N, cfg, bias, workspace=ws if cfg.SPLIT_K > 1 else None)


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("K,N,split_k,block_n", [(256, 136, 2, 128), (384, 64, 3, 64), (256, 128, 1, 64)],
                         ids=["tail", "three_splits", "no_split"])
def test_matches_reference(K, N, split_k, block_n, M):
    prog, lay, leaves, x = setup(K, N, M)
    assert gm.layout_fits(lay)
    cfg = gm.GptqMma(block_n, split_k, 4)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    got = run(x, leaves, lay, K, N, cfg)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16 and not got.isnan().any()
    assert rel_err(got.cpu(), want.cpu()) < TOL


def test_zero_offset_bias_and_strided_rows():
    """GPTQ v1's zeros stored minus one (the program adds 1), a bias in the epilogue and one added after
    (not a contiguous [N] vector), rows misaligned and column-major."""
    K, N, M = 256, 72, 4
    prog, lay, leaves, _ = setup(K, N, M, seed=1)
    lay1 = dataclasses.replace(lay, zero_value=1.0)
    assert gm.layout_fits(lay1)
    misaligned = torch.randn(M, K + 1, dtype=torch.bfloat16, device=DEVICE)[:, 1:]
    col_major = torch.randn(K, M, dtype=torch.bfloat16, device=DEVICE).t()
    for x in (misaligned, col_major):
        for bias in (torch.randn(N, dtype=torch.bfloat16, device=DEVICE),
                     torch.randn(M, N, dtype=torch.float32, device=DEVICE)):
            want = pm.packed_mm_reference(x, leaves, lay1, K, N, bias)
            got = run(x, leaves, lay1, K, N, gm.GptqMma(64, 2, 4), bias)
            assert rel_err(got.cpu(), want.cpu()) < TOL


def test_through_the_dispatcher_with_a_poisoned_workspace():
    K, N, M = 256, 128, 2
    prog, lay, leaves, x = setup(K, N, M, seed=2)
    cfg = gm.GptqMma(128, 2, 4)
    ws = torch.full((2, 1, M, N), float("nan"), device=DEVICE)
    got = dm.decode_mm_triton(x, leaves, prog.to_text(), None, cfg, workspace=ws, layout=lay.to_text())
    assert rel_err(got.cpu(), pm.packed_mm_reference(x, leaves, lay, K, N).cpu()) < TOL
    with pytest.raises(ValueError, match="workspace"):
        dm.decode_mm_triton(x, leaves, prog.to_text(), None, cfg, workspace=ws[:1], layout=lay.to_text())


def test_offered_only_where_it_computes_the_program():
    _, lay, _, _ = setup(256, 64, 1)
    _, lay64, _, _ = setup(256, 64, 1, group=64)
    mma = lambda M, lay, **kw: [c for c in dm.candidates(M, 8192, 8192, layout=lay.to_text(), **kw)  # noqa: E731
                                if isinstance(c, gm.GptqMma)]
    assert [c.SPLIT_K for c in mma(1, lay)] == [8, 4] and mma(16, lay, x_dtype=torch.bfloat16)
    assert not mma(32, lay)                                 # more rows than the MMA's 16
    assert not mma(1, lay, x_dtype=torch.float16)           # the MMA reads bf16
    assert not gm.layout_fits(lay64) and not mma(1, lay64)  # groups of 64: a tile holds two
    assert not gm.layout_fits(dataclasses.replace(lay, zero_value=0.5))  # not exact in bf16
    assert not gm.layout_fits(dataclasses.replace(lay, zero_value=-1.0))  # z + c would leave 0..127
    for name in ("awq", "int4_k_stack", "mxfp4"):
        assert not gm.layout_fits(pm.REPORT_LAYOUTS[name][0]), name
    # never the first candidate: select_config (no timing, dtype unknown) keeps the other kernels
    for M in (1, 4, 16):
        assert not isinstance(dm.select_config(M, 8192, 8192, layout=lay.to_text()), gm.GptqMma)
    # every split divides the K tiles
    for N, K in ((8192, 8192), (4096, 14336), (14336, 4096), (128256, 4096), (4096, 384)):
        for per_sm in (4, 2):
            sk = gm.split_k_for(N, K, 128, 132, per_sm)
            assert 1 <= sk <= 16 and (K // 128) % sk == 0


def test_bad_input_gets_a_clear_error():
    K, N = 256, 64
    _, lay, leaves, x = setup(K, N, 2)
    cfg = gm.GptqMma(64, 2, 4)
    with pytest.raises(ValueError, match="bf16"):
        gm.gptq_mma(x.half(), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="M <= 16"):
        gm.gptq_mma(torch.randn(17, K, dtype=torch.bfloat16, device=DEVICE), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="do not fit"):
        gm.gptq_mma(x, leaves, lay, K, N, gm.GptqMma(64, 3, 4))  # 3 splits of 2 K tiles
    strided = list(leaves)
    strided[lay.code] = leaves[lay.code].t().contiguous().t()  # same values, column-major
    with pytest.raises(ValueError, match="contiguous"):
        gm.gptq_mma(x, strided, lay, K, N, cfg)
    with pytest.raises(ValueError, match="layout"):
        gm.gptq_mma(x, leaves, dataclasses.replace(lay, group_k=64), K, N, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("K,N", [(8192, 8192), (4096, 4104), (14336, 4096)])
def test_gpu_sizes(K, N, M):
    prog, lay, leaves, x = setup(K, N, M, seed=K + N)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    for cfg in dict.fromkeys(c for c in dm.candidates(M, N, K, layout=lay.to_text(), x_dtype=torch.bfloat16)
                             if isinstance(c, gm.GptqMma)):
        got = run(x, leaves, lay, K, N, cfg)
        assert not got.isnan().any() and rel_err(got.float(), want.float()) < TOL, cfg
        again = run(x, leaves, lay, K, N, cfg)
        assert torch.equal(got, again), cfg  # the split-K reduction is deterministic
