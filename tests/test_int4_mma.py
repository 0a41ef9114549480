"""The register-decoded int4 tensor-core kernel (``fusekern.kernels.int4_mma``) against its float64 reference.

Formats: GPTQ (int32 words, packed zeros), two codes per byte with 8-bit zeros (the demo's W4A16) and
symmetric (q - 8). CPU: the kernel runs in the Triton interpreter (plain operations in place of its inline
PTX) on small shapes with column tails, every split of K, zero offsets and 8-bit zeros at their extremes,
biases, strided activations and NaN-poisoned workspaces; the dispatcher offers it only for layouts it
reads exactly, groups of 128 and bf16 rows up to 64 (x padded to 16, 32 or 64), and bad input gets a clear
error. GPU: the same checks at issue 4's sizes.
"""
import dataclasses

import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import int4_mma as im
from fusekern.kernels import packed_mm as pm
from fusekern.patterns.decode.formats import recognize
from fusekern.patterns.decode.layout import derive_layout
from fusekern.patterns.decode.program import DecodeProgram
from fusekern.testing import rel_err
from fusekern.testing.decode_cones import decode_program
from fusekern.testing.decode_zoo import BY_NAME

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 4e-3  # bf16 output: its rounding alone is ~2e-3 of the norm


FORMATS = ["gptq", "int4_k_stack", "int4_k_sym"]


def setup(K, N, M, group=128, seed=0, device=DEVICE, fmt="gptq"):
    """Leaves of the zoo's program for ``fmt``, its derived layout, its text and bf16 rows."""
    torch.manual_seed(seed)
    case = BY_NAME[fmt]
    ws = [w.to(torch.bfloat16) if w.dtype == torch.float32 else w for w in case.make(K, N, group, "cpu")]
    x = torch.randn(M, K, dtype=torch.bfloat16)
    text, leaves, consts = decode_program(case.fn, x, *ws)
    prog = DecodeProgram.from_text(text)
    lay = derive_layout(prog, recognize(prog, consts), consts)
    return prog, lay, [t.to(device) for t in leaves], x.to(device)


def run(x, leaves, lay, K, N, cfg, bias=None):
    ws = torch.full((cfg.SPLIT_K, x.shape[0], N), float("nan"), device=x.device)  # poisoned partials
    return pm.packed_mm(x, leaves, lay, K, N, cfg, bias, workspace=ws if cfg.SPLIT_K > 1 else None)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 3, 16, 17, 33, 64])  # x padded to 16, 32, 64 rows
@pytest.mark.parametrize("K,N,split_k,block_n", [(256, 136, 2, 128), (384, 64, 3, 64), (256, 128, 1, 64)],
                         ids=["tail", "three_splits", "no_split"])
def test_matches_reference(K, N, split_k, block_n, M, fmt):
    prog, lay, leaves, x = setup(K, N, M, fmt=fmt)
    assert im.layout_fits(lay)
    cfg = im.Int4Mma(block_n, split_k, 4)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    got = run(x, leaves, lay, K, N, cfg)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16 and not got.isnan().any()
    assert rel_err(got.cpu(), want.cpu()) < TOL


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("offset,K,split_k", [(0, 256, 2), (0, 512, 2), (0, 512, 1), (4, 256, 2)],
                         ids=["aligned", "two_tiles_per_split", "no_split", "misaligned"])
def test_tma_words_match_reference(fmt, offset, K, split_k):
    """Words through a TMA descriptor, with N not a multiple of the tile (the tile's columns past N read
    zeros and are not stored), the next tile's scale and zero carried across iterations and split
    boundaries; a base that is not 16-byte aligned falls back to direct loads, with the same result."""
    N, M = 136, 3
    prog, lay, leaves, x = setup(K, N, M, fmt=fmt)
    q = leaves[lay.code]
    if offset:  # the same codes, 4 bytes into a fresh buffer
        flat = torch.empty(q.numel() * q.element_size() + 16, dtype=torch.uint8, device=q.device)
        view = flat[offset:offset + q.numel() * q.element_size()].view(q.dtype).view(q.shape)
        view.copy_(q)
        leaves = list(leaves)
        leaves[lay.code] = view
        assert view.data_ptr() % 16 == offset
    cfg = im.Int4Mma(128, split_k, 4, tma=True, num_stages=3)
    want_mode = 0 if offset else im.TMA_KN if fmt == "gptq" else im.TMA_NK
    assert im._tma_words(im._words_i32(leaves, lay), lay, cfg)[0] == want_mode
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    got = run(x, leaves, lay, K, N, cfg)
    assert got.shape == (M, N) and not got.isnan().any()
    assert rel_err(got.cpu(), want.cpu()) < TOL


def _bf16_agreement(got, want) -> float:
    """The fraction of outputs that are exactly ``want`` rounded to bf16."""
    return (got.cpu() == want.cpu().to(torch.bfloat16)).float().mean().item()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tma", [False, True])
def test_scale_first_rounds_as_eager_does(fmt, tma):
    """Scaling before the MMA rounds (q - z) * s to bf16, as eager's dequantization does: nearly every
    output is x times that bf16 weight (in float64) rounded to bf16 (scaling after the MMA matches that on
    only about 60% of them); fp32 scales keep scaling after the MMA (the launcher checks the dtype), whose
    outputs are the exact product rounded."""
    K, N, M = 512, 136, 5
    prog, lay, leaves, x = setup(K, N, M, fmt=fmt)
    assert leaves[lay.scale].dtype == torch.bfloat16
    cfg = im.Int4Mma(128, 2, 4, tma=tma, num_stages=3 if tma else 1, scale_first=True)
    got = run(x, leaves, lay, K, N, cfg)
    w = pm.decode_weight(leaves, lay, K, N, torch.float32)  # (q - z) * s, exact in fp32
    eager = x.double() @ w.to(torch.bfloat16).double()      # ... rounded to bf16 as eager rounds it
    exact = pm.packed_mm_reference(x, leaves, lay, K, N)
    assert got.shape == (M, N) and not got.isnan().any()
    assert _bf16_agreement(got, eager) > 0.95 and rel_err(got.cpu(), exact.cpu()) < TOL
    f32 = list(leaves)
    f32[lay.scale] = leaves[lay.scale].float()
    after = run(x, f32, lay, K, N, cfg)
    assert _bf16_agreement(after, exact) > 0.95 and _bf16_agreement(after, eager) < 0.9


def test_zero_offset_bias_and_strided_rows():
    """GPTQ v1's zeros stored minus one (the program adds 1), a bias in the epilogue and one added after
    (not a contiguous [N] vector), rows misaligned and column-major."""
    K, N, M = 256, 72, 4
    prog, lay, leaves, _ = setup(K, N, M, seed=1)
    lay1 = dataclasses.replace(lay, zero_value=1.0)
    assert im.layout_fits(lay1)
    misaligned = torch.randn(M, K + 1, dtype=torch.bfloat16, device=DEVICE)[:, 1:]
    col_major = torch.randn(K, M, dtype=torch.bfloat16, device=DEVICE).t()
    for x in (misaligned, col_major):
        for bias in (torch.randn(N, dtype=torch.bfloat16, device=DEVICE),
                     torch.randn(M, N, dtype=torch.float32, device=DEVICE)):
            want = pm.packed_mm_reference(x, leaves, lay1, K, N, bias)
            got = run(x, leaves, lay1, K, N, im.Int4Mma(64, 2, 4), bias)
            assert rel_err(got.cpu(), want.cpu()) < TOL


def test_through_the_dispatcher_with_a_poisoned_workspace():
    K, N, M = 256, 128, 2
    prog, lay, leaves, x = setup(K, N, M, seed=2)
    cfg = im.Int4Mma(128, 2, 4)
    ws = torch.full((2, 1, M, N), float("nan"), device=DEVICE)
    got = dm.decode_mm_triton(x, leaves, prog.to_text(), None, cfg, workspace=ws, layout=lay.to_text())
    assert rel_err(got.cpu(), pm.packed_mm_reference(x, leaves, lay, K, N).cpu()) < TOL
    with pytest.raises(ValueError, match="workspace"):
        dm.decode_mm_triton(x, leaves, prog.to_text(), None, cfg, workspace=ws[:1], layout=lay.to_text())


def test_offered_only_where_it_computes_the_program():
    _, lay, _, _ = setup(256, 64, 1)
    _, lay64, _, _ = setup(256, 64, 1, group=64)
    mma = lambda M, lay, **kw: [c for c in dm.candidates(M, 8192, 8192, layout=lay.to_text(), **kw)  # noqa: E731
                                if isinstance(c, im.Int4Mma)]
    assert [(c.SPLIT_K, c.tma, c.scale_first) for c in mma(1, lay)] == [
        (8, False, False), (4, False, False), (8, True, False), (4, True, False), (8, True, True), (4, True, True)]
    assert mma(16, lay, x_dtype=torch.bfloat16) and all(c.BLOCK_N == 128 for c in mma(16, lay))
    assert {c.BLOCK_N for c in mma(64, lay)} == {128, 64}  # (64 padded rows: a 4x accumulator)
    assert not mma(65, lay) and not mma(128, lay)           # more rows than x is padded to
    assert not mma(1, lay, x_dtype=torch.float16)           # the MMA reads bf16
    assert not im.layout_fits(lay64) and not mma(1, lay64)  # groups of 64: a tile holds two
    assert not im.layout_fits(dataclasses.replace(lay, zero_value=0.5))  # not exact in bf16
    assert not im.layout_fits(dataclasses.replace(lay, zero_value=-1.0))  # z + c would leave 0..127
    for name in ("awq", "mxfp4", "nvfp4", "fp8_channel", "int8_channel"):
        assert not im.layout_fits(pm.REPORT_LAYOUTS[name][0]), name
    for fmt in FORMATS:
        assert im.layout_fits(setup(256, 64, 1, fmt=fmt)[1]), fmt
    _, byte_lay, _, _ = setup(256, 64, 1, fmt="int4_k_stack")
    assert not im.layout_fits(dataclasses.replace(byte_lay, order=(1, 0)))  # high nibble first
    assert not im.layout_fits(dataclasses.replace(byte_lay, zero_value=1.0))  # 8-bit zeros plus a constant
    _, by_n, _, _ = setup(256, 64, 1, fmt="int4_n")
    assert not im.layout_fits(by_n)  # two codes per byte along N
    # never the first candidate: select_config (no timing, dtype unknown) keeps the other kernels
    for M in (1, 4, 16):
        assert not isinstance(dm.select_config(M, 8192, 8192, layout=lay.to_text()), im.Int4Mma)
    # every split divides the K tiles
    for N, K in ((8192, 8192), (4096, 14336), (14336, 4096), (128256, 4096), (4096, 384)):
        for per_sm in (4, 2):
            sk = im.split_k_for(N, K, 128, 132, per_sm)
            assert 1 <= sk <= 16 and (K // 128) % sk == 0


def test_bad_input_gets_a_clear_error():
    K, N = 256, 64
    _, lay, leaves, x = setup(K, N, 2)
    cfg = im.Int4Mma(64, 2, 4)
    with pytest.raises(ValueError, match="bf16"):
        im.int4_mma(x.half(), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="M <= 64"):
        im.int4_mma(torch.randn(65, K, dtype=torch.bfloat16, device=DEVICE), leaves, lay, K, N, cfg)
    with pytest.raises(ValueError, match="do not fit"):
        im.int4_mma(x, leaves, lay, K, N, im.Int4Mma(64, 3, 4))  # 3 splits of 2 K tiles
    strided = list(leaves)
    strided[lay.code] = leaves[lay.code].t().contiguous().t()  # same values, column-major
    with pytest.raises(ValueError, match="contiguous"):
        im.int4_mma(x, strided, lay, K, N, cfg)
    with pytest.raises(ValueError, match="layout"):
        im.int4_mma(x, leaves, dataclasses.replace(lay, group_k=64), K, N, cfg)


def test_eight_bit_zeros_at_their_extremes():
    """uint8 zeros up to 255 and int8 zeros down to -128: q - z stays exact (128 + z would not be)."""
    K, N, M = 256, 64, 3
    _, lay, leaves, x = setup(K, N, M, seed=3, fmt="int4_k_stack")
    z = leaves[lay.zero_leaf]
    ends = torch.tensor([0, 255, 128, 1], dtype=torch.uint8, device=DEVICE)
    signed = torch.tensor([-128, 127, -1, 0], dtype=torch.int8, device=DEVICE)
    for zeros in (ends.repeat(z.numel() // 4).view(z.shape), signed.repeat(z.numel() // 4).view(z.shape)):
        ls = list(leaves)
        ls[lay.zero_leaf] = zeros
        want = pm.packed_mm_reference(x, ls, lay, K, N)
        got = run(x, ls, lay, K, N, im.Int4Mma(64, 2, 4))
        assert rel_err(got.cpu(), want.cpu()) < TOL


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tma", [False, True])
def test_register_cap_matches_reference(fmt, tma):
    """A config with a register cap (``maxnreg``, a launch option) launches and computes the same product."""
    K, N, M = 512, 136, 3
    _, lay, leaves, x = setup(K, N, M, seed=11, fmt=fmt)
    cfg = im.Int4Mma(128, 2, 4, tma=tma, num_stages=3 if tma else 1, maxnreg=128)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    got = run(x, leaves, lay, K, N, cfg)
    assert got.shape == (M, N) and not got.isnan().any() and rel_err(got.cpu(), want.cpu()) < TOL


@pytest.mark.parametrize("fmt", ["gptq", "int4_k_stack"])
@pytest.mark.parametrize("M", [20, 64])
def test_padded_rows_through_tma_and_scale_first(fmt, M):
    """More than 16 rows (x padded to 32 or 64) through the TMA words and the scale-first variant, with a
    column tail and a bias, against a NaN-poisoned workspace."""
    K, N = 512, 136
    _, lay, leaves, x = setup(K, N, M, seed=M, fmt=fmt)
    bias = torch.randn(N, dtype=torch.bfloat16, device=DEVICE)
    want = pm.packed_mm_reference(x, leaves, lay, K, N, bias)
    for cfg in (im.Int4Mma(128, 2, 4, tma=True, num_stages=3), im.Int4Mma(64, 4, 4, tma=True, num_stages=3,
                                                                          scale_first=True)):
        got = run(x, leaves, lay, K, N, cfg, bias)
        assert got.shape == (M, N) and not got.isnan().any() and rel_err(got.cpu(), want.cpu()) < TOL, cfg


def test_misaligned_bytes_are_refused():
    K, N = 256, 64
    _, lay, leaves, x = setup(K, N, 2, fmt="int4_k_stack")
    q = leaves[lay.code]
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEVICE)[1:].view(q.shape)
    shifted.copy_(q)
    ls = list(leaves)
    ls[lay.code] = shifted
    with pytest.raises(ValueError, match="aligned"):
        im.int4_mma(x, ls, lay, K, N, im.Int4Mma(64, 2, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 3, 16, 24, 64])
@pytest.mark.parametrize("K,N", [(8192, 8192), (4096, 4104), (14336, 4096)])
def test_gpu_sizes(K, N, M, fmt):
    prog, lay, leaves, x = setup(K, N, M, seed=K + N, fmt=fmt)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    offered = [c for c in dm.candidates(M, N, K, layout=lay.to_text(), x_dtype=torch.bfloat16)
               if isinstance(c, im.Int4Mma)]
    capped = [dataclasses.replace(c, maxnreg=128) for c in offered if c.tma and not c.scale_first]  # the lead
    for cfg in dict.fromkeys(offered + capped):
        got = run(x, leaves, lay, K, N, cfg)
        assert not got.isnan().any() and rel_err(got.float(), want.float()) < TOL, cfg
        again = run(x, leaves, lay, K, N, cfg)
        assert torch.equal(got, again), cfg  # the split-K reduction is deterministic
