"""Checks for the CuTe DSL scaled GEMM (fusekern/kernels/cute_scaled_mm.py).

CPU (CI): every shipped specialization builds for sm_90a without a GPU and has no local memory;
``supports`` gives reasons for bad input and ``cute_scaled_mm`` raises on them; the float64 reference
matches a plain computation. GPU (``gpu`` marker): results against the reference for every shipped
epilogue combination, odd M, N and K tails, and no recompilation when only M changes; the DeepSeek
128x128 block-scaled fp8 GEMM (``-k block``) against the reference, with a one-row a_block, N / K
tails and the row/col/bias epilogue, at the 128x128 tile and at 128x256 (which gives the same bits).
"""
import itertools
import math
import os

import pytest
import torch

from fusekern.kernels import cute_scaled_mm as csm

needs_cutlass = pytest.mark.skipif(csm._CUTLASS_ERROR is not None, reason=str(csm._CUTLASS_ERROR))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------------------------------
# CPU: sm_90a builds
# --------------------------------------------------------------------------------------------------


@needs_cutlass
def test_aot_compile_sm90a_builds_every_shipped_config(tmp_path):
    builds = csm.aot_compile_sm90a(str(tmp_path))
    assert len(builds) == len(csm.shipped_configs())
    assert len({b["name"] for b in builds}) == len(builds)
    names = {b["name"] for b in builds}
    assert "f8e4m3_bf16_128x128_row_col_biasbf16" in names
    assert "bf16_bf16_128x128_col_res" in names
    assert "f8e4m3_bf16_128x128_block128" in names
    assert "f8e4m3_bf16_128x256_block128" in names
    for build in builds:
        assert build["cubin"] and os.path.getsize(build["cubin"]) > 0, build["name"]
        print(f"{build['name']}: REG {build.get('registers')} STACK {build.get('stack')} "
              f"LOCAL {build.get('local')} spill stores/loads {build.get('spill_stores')}/{build.get('spill_loads')}")
        if "stack" in build:  # spills live in the stack frame: none in a shipped config
            assert build["stack"] == 0 and build["local"] == 0, build
        if "spill_stores" in build:
            assert build["spill_stores"] == 0 and build["spill_loads"] == 0, build
            assert not build["wgmma_serialized"], build["name"]  # ptxas kept the WGMMAs asynchronous
        # the launch writes its arguments straight into the slots the compiled function reads
        assert build["fast_args"], build["name"]


def test_heuristics_pick_small_tiles_for_small_batches():
    assert csm.heuristics(1, 4096)[0] == 64
    assert csm.heuristics(64, 4096)[0] == 64
    assert csm.heuristics(4096, 8192) == (128, 256)
    assert csm.heuristics(256, 4096) == (128, 128)
    for m, n in itertools.product((1, 7, 100, 1000, 8192), (64, 4096, 8200, 28672)):
        assert csm.heuristics(m, n) in csm._TILES


# --------------------------------------------------------------------------------------------------
# CPU: argument checks
# --------------------------------------------------------------------------------------------------


def _operands(m=16, n=32, k=64, dtype=torch.bfloat16, device="cpu"):
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, k, device=device).to(dtype)
    return a, b


def _misaligned(m, k, dtype=torch.bfloat16):
    storage = torch.randn(m * k + 1).to(dtype)
    return storage[1:].view(m, k)  # base pointer 2 bytes past a 16-byte boundary


BAD_CASES = {
    "cpu": lambda: (*_operands(), {}),
    "float32 inputs": lambda: (*_operands(dtype=torch.float32), {}),
    "mixed dtypes": lambda: (_operands()[0], _operands()[1].half(), {}),
    "b not K-major": lambda: (_operands()[0], torch.randn(64, 32).bfloat16().T, {}),
    "misaligned base": lambda: (_misaligned(16, 64), _operands()[1], {}),
    "K not 16 bytes": lambda: (*_operands(k=12), {}),
    "int8 out": lambda: (*_operands(), {"out_dtype": torch.int8}),
    "row wrong dtype": lambda: (*_operands(), {"row": torch.ones(16, dtype=torch.bfloat16)}),
    "col wrong length": lambda: (*_operands(), {"col": torch.ones(31)}),
    "residual wrong dtype": lambda: (*_operands(), {"residual": torch.ones(16, 32)}),
}


def _block_operands(m=16, n=200, k=304, dtype=torch.float8_e4m3fn):
    """fp8 operands with valid 128x128 block scales (N and K tails): a_block [m, 3], b_block [2, 3]."""
    a, b = _operands(m, n, k, dtype=dtype)
    return a, b, torch.ones(m, math.ceil(k / 128)), torch.ones(math.ceil(n / 128), math.ceil(k / 128))


def _block_case(change):
    a, b, a_block, b_block = _block_operands()
    kwargs = {"a_block": a_block, "b_block": b_block}
    return change(a, b, kwargs)


BLOCK_BAD_CASES = {  # case -> (arguments, a word the reason must contain)
    "block scales on bf16": (lambda: (*_block_operands(dtype=torch.bfloat16)[:2],
                                      dict(zip(("a_block", "b_block"), _block_operands()[2:]))), "fp8"),
    "a_block only": (lambda: _block_case(lambda a, b, kw: (a, b, {"a_block": kw["a_block"]})), "both"),
    "b_block only": (lambda: _block_case(lambda a, b, kw: (a, b, {"b_block": kw["b_block"]})), "both"),
    "a_block bf16": (lambda: _block_case(
        lambda a, b, kw: (a, b, {**kw, "a_block": kw["a_block"].bfloat16()})), "float32"),
    "b_block float64": (lambda: _block_case(
        lambda a, b, kw: (a, b, {**kw, "b_block": kw["b_block"].double()})), "float32"),
    "a_block too few K blocks": (lambda: _block_case(
        lambda a, b, kw: (a, b, {**kw, "a_block": kw["a_block"][:, :2]})), "shape"),
    "a_block wrong rows": (lambda: _block_case(
        lambda a, b, kw: (a, b, {**kw, "a_block": torch.ones(2, 3)})), "shape"),
    "b_block per-row (not per 128 rows)": (lambda: _block_case(
        lambda a, b, kw: (a, b, {**kw, "b_block": torch.ones(200, 3)})), "shape"),
    "a_block 1-D": (lambda: _block_case(
        lambda a, b, kw: (a, b, {**kw, "a_block": torch.ones(3)})), "shape"),
    "a_block K-strided": (lambda: _block_case(
        lambda a, b, kw: (a, b, {**kw, "a_block": torch.ones(3, 16).T})), "stride"),
}
BAD_CASES.update({name: case for name, (case, _) in BLOCK_BAD_CASES.items()})


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_supports_gives_a_reason_and_the_kernel_raises(case):
    a, b, kwargs = BAD_CASES[case]()
    kwargs.setdefault("out_dtype", torch.bfloat16)
    reason = csm.supports(a, b, **kwargs)
    assert isinstance(reason, str) and reason, case
    with pytest.raises(ValueError, match="unsupported"):
        csm.cute_scaled_mm(a, b, **kwargs)


def test_supports_reasons_name_the_problem():
    a, b = _operands()
    assert "cpu" in csm.supports(a, b, out_dtype=torch.bfloat16).lower() or csm._CUTLASS_ERROR
    if csm._CUTLASS_ERROR is None:
        assert "K-major" in csm.supports(a, torch.randn(64, 32).bfloat16().T, out_dtype=torch.bfloat16)
        assert "aligned" in csm.supports(_misaligned(16, 64), b, out_dtype=torch.bfloat16)
        assert "16 bytes" in csm.supports(*_operands(k=12), out_dtype=torch.bfloat16)


def test_supports_refuses_operands_whose_rows_overlap(monkeypatch):
    """An expanded A (row stride 0: one row serving every row) passed the row-stride check (0 is a multiple of
    16 bytes) and reached a TMA tensor map built with a zero row stride; the Triton kernel takes it instead."""
    if csm._CUTLASS_ERROR is not None:
        pytest.skip(csm._CUTLASS_ERROR)
    monkeypatch.setattr(csm, "_check_device", lambda tensors: None)  # (CPU tensors stand for the GPU's here)
    monkeypatch.setattr(csm, "_SUPPORTED", {})
    a, b = _operands(dtype=torch.float8_e4m3fn)
    assert csm.supports(a, b, out_dtype=torch.bfloat16) is None
    assert "overlap" in csm.supports(a[:1].expand(16, -1), b, out_dtype=torch.bfloat16)
    assert "overlap" in csm.supports(a, b[:1].expand(32, -1), out_dtype=torch.bfloat16)
    assert "overlap" in csm.supports(a.as_strided((1, 64), (0, 1)), b, out_dtype=torch.bfloat16)  # one row


@pytest.mark.parametrize("case", list(BLOCK_BAD_CASES))
def test_supports_block_scale_reasons_name_the_problem(case):
    if csm._CUTLASS_ERROR is not None:
        pytest.skip(csm._CUTLASS_ERROR)
    make, word = BLOCK_BAD_CASES[case]
    a, b, kwargs = make()
    reason = csm.supports(a, b, out_dtype=torch.bfloat16, **kwargs)
    assert word in reason, (case, reason)


def test_supports_accepts_valid_block_scales_up_to_the_device():
    """Valid block scales (M rows, one row, an expanded row, a strided slice) fail only on the device."""
    if csm._CUTLASS_ERROR is not None:
        pytest.skip(csm._CUTLASS_ERROR)
    a, b, a_block, b_block = _block_operands()
    for a_scales in (a_block, a_block[:1], a_block[:1].expand(16, 3), torch.ones(16, 6)[:, ::2].contiguous(),
                     torch.ones(16, 5)[:, 1:4]):
        reason = csm.supports(a, b, a_block=a_scales, b_block=b_block, out_dtype=torch.bfloat16)
        assert "cpu" in reason.lower(), reason
    reason = csm.supports(a, b, a_block=a_block, b_block=b_block[:1].expand(2, 3), out_dtype=torch.bfloat16)
    assert "cpu" in reason.lower(), reason
    a = torch.empty(8, 1008, dtype=torch.float8_e4m3fn, device="meta")  # partial last K block
    b = torch.empty(296, 1008, dtype=torch.float8_e4m3fn, device="meta")
    reason = csm.supports(a, b, a_block=torch.empty(8, 8, device="meta"), b_block=torch.empty(3, 8, device="meta"),
                          out_dtype=torch.bfloat16)
    assert "meta" in reason, reason


def test_block_scaled_k_1000_and_n_300_are_refused():
    for n, k in ((296, 1000), (300, 1008)):
        a, b, a_block, b_block = _block_operands(n=n, k=k)
        reason = csm.supports(a, b, a_block=a_block, b_block=b_block, out_dtype=torch.bfloat16)
        assert "16 bytes" in reason or csm._CUTLASS_ERROR, reason


def test_block_scaled_config_and_scale_views():
    a, b, a_block, b_block = _block_operands(m=4096, n=7168, k=7168)
    # 128x256 where its waves (each 1.76 times a 128x128 wave) take less time. N = 7168 on 132 SMs: 28 wide or
    # 56 narrow N tiles; M = 4096 is 7 wide waves against 14, M = 2048 4 against 7 (wide lost there on an H100),
    # M = 1000 2 against 4.
    for m, tile in ((1, (64, 128)), (64, (64, 128)), (65, (128, 128)), (1000, (128, 256)), (2048, (128, 128)),
                    (4096, (128, 256))):
        config = csm.config_for(a[:m], b, out_dtype=torch.bfloat16, block_scaled=True)
        assert config.block_scaled and (config.tile_m, config.tile_n) == tile, m
        assert config.name.endswith("block128")
    assert csm.block_scaled_heuristics(1100, 1664) == (128, 128)  # one wave either way: wide lost on an H100
    assert csm.block_scaled_heuristics(4096, 7168, num_sms=2000) == (128, 128)  # one wave either way
    assert csm.block_scaled_heuristics(4096, 7168, num_sms=114) == (128, 256)  # an H100 PCIe: 8 against 16
    if csm._CUTLASS_ERROR is None:  # block scales need fp8 and a tile of _BLOCK_TILES
        for tile in ((128, 64), (64, 256), (64, 64)):
            with pytest.raises(ValueError):
                csm._ScaledMmKernel(csm.KernelConfig("f8e4m3", "bf16", *tile, block_scaled=True))
        for tile in csm._BLOCK_TILES:
            csm._ScaledMmKernel(csm.KernelConfig("f8e4m3", "bf16", *tile, block_scaled=True))
        with pytest.raises(ValueError):
            csm._ScaledMmKernel(csm.KernelConfig("bf16", "bf16", 128, 128, block_scaled=True))
    # What the kernel loads: views of the same elements with a unit last stride.
    one_row = torch.rand(1, 3)
    for scales in (torch.rand(5, 3), one_row, one_row.expand(5, 3), torch.rand(3, 5).T[:, :1], torch.rand(7, 3)[::2]):
        view = csm._scales_for_kernel(scales)
        assert view.stride(1) == 1 and view.data_ptr() == scales.data_ptr()
        assert torch.equal(view, scales[: view.shape[0]])
        assert view.shape[0] in (1, scales.shape[0])
    assert csm._scales_for_kernel(one_row.expand(5, 3)).shape == (1, 3)


def test_supports_never_raises_on_fake_and_meta_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(8, 64, dtype=torch.bfloat16), torch.empty(32, 64, dtype=torch.bfloat16)
        reason = csm.supports(a, b, col=torch.empty(32), out_dtype=torch.bfloat16)
    assert isinstance(reason, str)
    a = torch.empty(8, 64, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(32, 64, dtype=torch.float8_e4m3fn, device="meta")
    assert isinstance(csm.supports(a, b, out_dtype=torch.bfloat16), str)


# --------------------------------------------------------------------------------------------------
# CPU: reference
# --------------------------------------------------------------------------------------------------


def test_kernel_choice_thresholds_and_measured_band(monkeypatch):
    """Large FP8 products take CuTe, small ones Triton, with no timing; in between (CUDA only) the first
    product of a shape is timed once and the answer kept per shape, block scaling and device."""
    from fusekern.kernels import cute_dispatch as cd

    monkeypatch.setattr(cd, "_CHOSEN", {})
    calls = []

    def timer(*key):
        calls.append(key)
        return key[0] == 2048  # "CuTe faster" at M = 2048 only

    fp8, cuda, cpu = torch.float8_e4m3fn, torch.device("cuda", 0), torch.device("cpu")
    assert cd.choice(8192, 8192, 8192, fp8, False, cuda, timer) and not cd.choice(16, 8192, 8192, fp8, False, cuda, timer)
    assert cd.choice(256, 8192, 8192, torch.bfloat16, False, cuda, timer)  # 16-bit operands: from M = 128
    assert not cd.choice(2048, 8192, 8192, fp8, False, cpu, timer) and not calls  # CPU: never timed
    assert cd.choice(2048, 8192, 8192, fp8, False, cuda, timer) and cd.choice(2048, 8192, 8192, fp8, False, cuda, timer)
    assert not cd.choice(1024, 8192, 8192, fp8, False, cuda, timer)
    assert cd.choice(2048, 8192, 8192, fp8, True, cuda, timer)  # block scaling is its own key
    assert len(calls) == 3  # each key timed once
    a = torch.empty(2048, 64, device="meta", dtype=fp8)
    assert not cd.prefers_cute(a, torch.empty(64, 64, device="meta", dtype=torch.bfloat16))  # mixed dtypes
    big = torch.empty(8192, 64, device="meta", dtype=fp8)
    assert cd.prefers_cute(big, big, True) and not cd.prefers_cute(big, big, True, (1, 128))  # 128 x 128 blocks only
    # A prefill of each new length in the band reuses its power-of-two bucket's measurement: no timing per length
    assert all(cd.choice(m, 8192, 8192, fp8, False, cuda, timer) for m in range(1025, 2049, 37))
    assert len(calls) == 3


def test_a_failed_timing_or_cute_launch_falls_back_to_triton(monkeypatch):
    """Out of memory while timing, or a CuTe compile or launch that raises: the op answers with Triton (None
    here), logs, and does not try that shape again."""
    from fusekern.kernels import cute_dispatch as cd

    monkeypatch.setattr(cd, "_CHOSEN", {})
    monkeypatch.setattr(cd, "_FAILED", set())
    fp8, cuda = torch.float8_e4m3fn, torch.device("cuda", 0)

    def oom(*key):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    assert not cd.choice(2048, 8192, 8192, fp8, False, cuda, oom)

    class Broken:
        launches = 0

        def supports(self, *args, **kwargs):
            return None

        def run_supported(self, *args):
            Broken.launches += 1
            raise RuntimeError("launch failed (test)")

    monkeypatch.setattr(cd, "_module", lambda: Broken())
    monkeypatch.setattr(cd, "prefers_cute", lambda a, b, block=False, groups=(128, 128): True)
    a, b = torch.empty(8192, 64, dtype=fp8), torch.empty(64, 64, dtype=fp8)
    args = (a, b, None, None, None, None, None, None, 0, 0, torch.bfloat16)
    assert cd.try_cute_scaled_mm(*args) is None and cd.try_cute_scaled_mm(*args) is None
    assert Broken.launches == 1


def test_reference_matches_a_plain_float64_computation():
    torch.manual_seed(0)
    m, n, k = 5, 12, 48
    a, b = _operands(m, n, k)
    row, col = torch.rand(m) + 0.5, torch.rand(n) + 0.5
    bias, residual = torch.randn(n).bfloat16(), torch.randn(m, n).float()
    out = csm.reference_scaled_mm(a, b, row=row, col=col, bias=bias, residual=residual, out_dtype=torch.float32)
    want = torch.empty(m, n, dtype=torch.float64)
    for i in range(m):
        for j in range(n):
            dot = sum(float(a[i, t]) * float(b[j, t]) for t in range(k))
            want[i, j] = dot * float(row[i]) * float(col[j]) + float(bias[j]) + float(residual[i, j])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-5)
    plain = csm.reference_scaled_mm(a, b, out_dtype=torch.bfloat16)
    torch.testing.assert_close(plain, (a.double() @ b.double().T).bfloat16())


def test_reference_block_scales():
    torch.manual_seed(1)
    m, n, k = 3, 200, 300  # N and K tails of the 128-wide blocks
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn)
    a_block = torch.rand(m, math.ceil(k / 128)) + 0.5
    b_block = torch.rand(math.ceil(n / 128), math.ceil(k / 128)) + 0.5
    out = csm.reference_scaled_mm(a, b, a_block=a_block, b_block=b_block, out_dtype=torch.float32)
    a_full = a.double() * a_block.double().repeat_interleave(128, dim=1)[:, :k]
    b_full = b.double() * b_block.double().repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]
    torch.testing.assert_close(out.double(), a_full @ b_full.T, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------

TOLERANCE = {  # (input, output) -> relative error bound
    (torch.float8_e4m3fn, torch.bfloat16): 2e-2,
    (torch.float8_e4m3fn, torch.float16): 2e-2,
    (torch.bfloat16, torch.bfloat16): 1e-2,
    (torch.bfloat16, torch.float32): 1e-4,
    (torch.float16, torch.float16): 2e-3,
}


def _gpu_inputs(m, n, k, ab_dtype, out_dtype, has_row, has_col, bias_dtype, has_residual, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    a, b = randn(m, k).to(ab_dtype), randn(n, k).to(ab_dtype)
    epilogue = {
        "row": randn(m).abs() + 0.5 if has_row else None,
        "col": randn(n).abs() + 0.5 if has_col else None,
        "bias": randn(n).to(bias_dtype) if bias_dtype is not None else None,
        "residual": randn(m, n).to(out_dtype) if has_residual else None,
    }
    return a, b, epilogue


def _poison_allocator(m, n, out_dtype):
    """Leave a NaN block of the output's size in the caching allocator: torch.empty will likely reuse it."""
    torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")


def _check(m, n, k, ab_dtype, out_dtype, has_row=False, has_col=False, bias_dtype=None, has_residual=False):
    a, b, epi = _gpu_inputs(m, n, k, ab_dtype, out_dtype, has_row, has_col, bias_dtype, has_residual)
    assert csm.supports(a, b, out_dtype=out_dtype, **epi) is None
    _poison_allocator(m, n, out_dtype)
    out = csm.cute_scaled_mm(a, b, out_dtype=out_dtype, **epi)
    torch.cuda.synchronize()
    ref = csm.reference_scaled_mm(a, b, out_dtype=torch.float64, **epi)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert torch.isfinite(out).all()
    err = _rel_err(out, ref)
    assert err < TOLERANCE[(ab_dtype, out_dtype)], (m, n, k, ab_dtype, out_dtype, epi.keys(), err)


EPILOGUES = [  # (row, col, bias dtype, residual)
    (False, False, None, False),
    (True, True, torch.bfloat16, False),
    (False, True, None, True),
    (True, False, torch.float32, False),
    (True, True, torch.float32, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("ab_dtype,out_dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: f"row{int(e[0])}col{int(e[1])}bias{e[2]}res{int(e[3])}")
@pytest.mark.parametrize("m", [1, 7, 100, 1000])
def test_matches_reference(ab_dtype, out_dtype, epilogue, m):
    has_row, has_col, bias_dtype, has_residual = epilogue
    k = 1024 if ab_dtype != torch.float8_e4m3fn else 2048
    _check(m, 4096, k, ab_dtype, out_dtype, has_row, has_col, bias_dtype, has_residual)


@pytest.mark.gpu
@pytest.mark.parametrize("ab_dtype,out_dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("m,n,k", [(7, 8200, 1040), (1000, 8200, 1040), (300, 136, 80), (129, 264, 4112)])
def test_n_and_k_tails(ab_dtype, out_dtype, m, n, k):
    _check(m, n, k, ab_dtype, out_dtype, has_row=True, has_col=True, bias_dtype=torch.bfloat16, has_residual=True)


@pytest.mark.gpu
def test_timing_leaves_the_seeded_generator_alone_and_times_partial_blocks(monkeypatch):
    """The dispatcher's timing draws its operands from a generator of its own, and a block-scaled shape whose N
    and K are not multiples of 128 gets scales the CuTe kernel takes (ceil, not floor: it used to refuse them,
    so the timing always answered Triton there)."""
    from fusekern.kernels import cute_dispatch as cd

    mod = cd._module()
    if mod is None:
        pytest.skip("CuTe DSL not installed")
    refusals = []
    supports = mod.supports
    monkeypatch.setattr(mod, "supports", lambda *a, **k: refusals.append(supports(*a, **k)) or refusals[-1])
    torch.manual_seed(7)
    want = torch.rand(3, device="cuda")
    torch.manual_seed(7)
    cd._cute_is_faster(1024, 7232, 7168, torch.float8_e4m3fn, True, torch.device("cuda", torch.cuda.current_device()))
    assert torch.equal(torch.rand(3, device="cuda"), want)
    assert refusals == [None]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8192])
def test_large_tiles(m):
    _check(m, 8192, 4096, torch.float8_e4m3fn, torch.bfloat16, True, True, torch.bfloat16)
    _check(m, 8192, 4096, torch.bfloat16, torch.bfloat16, False, True, None, True)


@pytest.mark.gpu
def test_a_new_batch_size_does_not_recompile():
    _check(1, 4096, 1024, torch.bfloat16, torch.bfloat16, has_col=True)
    size = csm.cache_size()
    _check(7, 4096, 1024, torch.bfloat16, torch.bfloat16, has_col=True)  # same 64-row config
    assert csm.cache_size() == size
    _check(100, 4096, 1024, torch.bfloat16, torch.bfloat16, has_col=True)
    size = csm.cache_size()
    _check(500, 4096, 1024, torch.bfloat16, torch.bfloat16, has_col=True)  # same 128x128 config
    assert csm.cache_size() == size
    sms = csm._sm_count(torch.device("cuda"))  # (500 rows: 64 tiles of 128x256, fewer than any Hopper's SMs)
    assert csm.heuristics(500, 4096, sms) == csm.heuristics(100, 4096, sms) == (128, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [False, True], ids=["rowwise", "block128"])
def test_fast_argument_path_matches_the_dsl_path(block):
    """The launch that writes its arguments into the compiled function's slots (_Marshal) gives bit for
    bit what the DSL's own argument conversion gives, over tails, a strided operand and epilogues."""
    for m, n, k in [(100, 296, 1008), (1000, 4096, 1024), (7, 256, 512)]:
        if block:
            a, b, kwargs = _block_inputs(m, n, k, one_row_a=m == 7, has_row=True, has_col=True,
                                         bias_dtype=torch.bfloat16)
        else:
            a, b, kwargs = _gpu_inputs(m, n, k, torch.float8_e4m3fn, torch.bfloat16, True, True, torch.bfloat16, True)
        wide = torch.zeros(m, k + 32, dtype=torch.uint8, device="cuda")
        wide[:, 16:16 + k] = a.view(torch.uint8)
        a = wide.view(torch.float8_e4m3fn)[:, 16:16 + k]  # row stride k + 32, starts 16 bytes in
        out = csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, **kwargs)
        config = csm.config_for(a, b, out_dtype=torch.bfloat16, block_scaled=block, num_sms=csm._sm_count(a.device), **{
            key: kwargs[key] for key in ("row", "col", "bias", "residual") if key in kwargs})
        marshal = csm._MARSHALS[config]
        assert marshal is not None  # the fast path ran
        # a config's first launch on a thread goes through the DSL's run_compiled_program (here, unless an
        # earlier test launched it), later ones call the executor's entry directly: one more launch, into
        # a block the allocator just held NaN in
        first = out
        poison = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        del poison
        out = csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, **kwargs)
        assert marshal._state()[2] is not None  # the direct launch is set up
        csm._MARSHALS[config] = None
        csm._PLANS.clear()  # (the plans hold the marshal they were made with)
        try:
            slow = csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, **kwargs)
        finally:
            del csm._MARSHALS[config]
            csm._PLANS.clear()
        assert torch.equal(out, slow) and torch.equal(first, slow), (m, n, k)
        ref = csm.reference_scaled_mm(a, b, out_dtype=torch.float64, **kwargs)
        assert _rel_err(out, ref) < 1e-2


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    a, b, epi = _gpu_inputs(100, 4096, 1024, torch.bfloat16, torch.bfloat16, True, True, None, False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, **epi)
    stream.synchronize()
    assert _rel_err(out, csm.reference_scaled_mm(a, b, out_dtype=torch.float64, **epi)) < 1e-2


# --------------------------------------------------------------------------------------------------
# GPU: DeepSeek 128x128 block-scaled fp8
# --------------------------------------------------------------------------------------------------

BLOCK_TOLERANCE = 1e-2  # relative, bf16 output


def _block_inputs(m, n, k, one_row_a=False, has_row=False, has_col=False, bias_dtype=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    a, b = randn(m, k).to(torch.float8_e4m3fn), randn(n, k).to(torch.float8_e4m3fn)
    kb, nb = math.ceil(k / 128), math.ceil(n / 128)
    # Scales spread over ~4 octaves so that a scale read for the wrong row / N tile / K block shows.
    a_block = torch.exp2(randn(1 if one_row_a else m, kb).clamp(-2, 2))
    b_block = torch.exp2(randn(nb, kb).clamp(-2, 2))
    kwargs = {
        "a_block": a_block, "b_block": b_block,
        "row": randn(m).abs() + 0.5 if has_row else None,
        "col": randn(n).abs() + 0.5 if has_col else None,
        "bias": randn(n).to(bias_dtype) if bias_dtype is not None else None,
    }
    return a, b, kwargs


def _check_block(m, n, k, one_row_a=False, has_row=False, has_col=False, bias_dtype=None):
    a, b, kwargs = _block_inputs(m, n, k, one_row_a, has_row, has_col, bias_dtype)
    assert csm.supports(a, b, out_dtype=torch.bfloat16, **kwargs) is None
    _poison_allocator(m, n, torch.bfloat16)
    out = csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, **kwargs)
    torch.cuda.synchronize()
    ref = csm.reference_scaled_mm(a, b, out_dtype=torch.float64, **kwargs)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    err = _rel_err(out, ref)
    assert err < BLOCK_TOLERANCE, (m, n, k, one_row_a, has_row, has_col, bias_dtype, err)
    return a, b, kwargs, out


@pytest.mark.gpu
# K = 1008: a partial last K block (7 * 128 + 112); N = 296: a partial last N block (2 * 128 + 40).
# K = 1000 and N = 300 themselves are refused: TMA needs 16-byte rows, and 1000 fp8 bytes (a, b) or
# 300 bf16 values (the output) are not (test_block_scaled_k_1000_and_n_300_are_refused).
# K = 128, 256 and 1136 (9 blocks, the last partial): one, two and an odd number of K blocks, the
# cases of the promotion loop's peeled tail (it alternates two fragments, unrolled by two).
@pytest.mark.parametrize("n,k", [(256, 512), (7168, 7168), (296, 1008), (256, 128), (256, 256), (296, 1136)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 100, 1000, 4096])
def test_block_scaled_matches_reference(m, n, k):
    _check_block(m, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 296, 1008), (100, 7168, 512), (1000, 296, 1008), (4096, 256, 7168)])
@pytest.mark.parametrize("one_row_a", [False, True], ids=["a_rows", "a_one_row"])
@pytest.mark.parametrize("epilogue", [(False, False, None), (True, True, torch.bfloat16), (False, True, torch.float32)],
                         ids=lambda e: f"row{int(e[0])}col{int(e[1])}bias{e[2]}")
def test_block_scaled_epilogue_and_one_row_a(m, n, k, one_row_a, epilogue):
    _check_block(m, n, k, one_row_a, *epilogue)


def _pin_block_tile(monkeypatch, tile):
    """Every block-scaled product from here on takes ``tile``, whatever the heuristic would choose."""
    monkeypatch.setattr(csm, "block_scaled_heuristics", lambda m, n, num_sms=132: tile)
    csm._PLANS.clear()  # plans cached per shape by earlier calls hold the tile chosen then


@pytest.fixture
def wide_block_tiles(monkeypatch):
    """Every block-scaled product takes the 128x256 tile (the heuristic gives it to large problems only)."""
    _pin_block_tile(monkeypatch, (128, 256))
    yield
    csm._PLANS.clear()


# The compile, plan and marshal caches of the wide loop built at one and at eight K blocks per pass, kept across
# tests.
_PASS_CACHES = {1: ({}, {}, {}), 8: ({}, {}, {})}


@pytest.fixture(params=[1, 8], ids=["pass1", "pass8"])
def blocks_per_pass(request, monkeypatch):
    """The wide loop built at one and at eight K blocks per pass, whatever the epilogue (it ships at eight for a
    bare 16-bit epilogue and one where it reads row or column scales or a residual or writes fp32:
    ``csm.blocks_per_pass``): other builds of the same KernelConfig, so each gets caches of its own."""
    monkeypatch.setattr(csm, "blocks_per_pass", lambda config: request.param)
    for name, cache in zip(("_COMPILED", "_PLANS", "_MARSHALS"), _PASS_CACHES[request.param]):
        monkeypatch.setattr(csm, name, cache)
    csm._PLANS.clear()  # plans are keyed without the tile: an earlier test's 128x128 plan must not serve
    yield


@pytest.mark.gpu
# N = 296: the last tile's second 128-column half lies wholly past N (its b_block row clamped); K = 128, 1008, 1136,
# 512 and 848: 1, 8 (the last partial), 9, 4 and 7 (partial) K blocks (with eight K blocks to a pass: no full
# pass, one, one and one block, no full pass, no full pass; K = 2176: 17 blocks, two full passes and one block);
# M = 1, 777 and 129: M tails of a 128-row tile.
@pytest.mark.parametrize("m,n,k", [(1, 256, 128), (100, 296, 1008), (777, 7168, 1136), (4096, 1664, 512),
                                   (129, 640, 848), (129, 640, 2176)], ids=lambda v: str(v))
@pytest.mark.parametrize("one_row_a", [False, True], ids=["a_rows", "a_one_row"])
@pytest.mark.parametrize("epilogue", [(False, False, None), (True, True, torch.float32)],
                         ids=lambda e: f"row{int(e[0])}col{int(e[1])}bias{e[2]}")
def test_block_scaled_wide_tile_matches_reference_and_the_narrow_tile(wide_block_tiles, blocks_per_pass,
                                                                      monkeypatch, m, n, k, one_row_a, epilogue):
    a, b, kwargs, out = _check_block(m, n, k, one_row_a, *epilogue)
    assert {plan[0].tile_n for plan in csm._PLANS.values()} == {256}
    # The same arithmetic as the 128x128 tile (a fresh WGMMA sum per K block, 128 columns wide there and 64 in
    # the wide tile, folded in K order): the same bits.
    _pin_block_tile(monkeypatch, (128, 128))
    narrow = csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, **kwargs)
    assert {plan[0].tile_n for plan in csm._PLANS.values()} == {128}
    assert torch.equal(out, narrow)


@pytest.mark.gpu
# N = 424: the last tile's second half is partly inside N (its own b_block row); 4096 x 7168 x 256: 896 tiles
# over 132 CTAs at two K blocks each (the pipeline's phases wrap across a CTA's tiles).
@pytest.mark.parametrize("m,n,k", [(300, 424, 1008), (4096, 7168, 256)], ids=lambda v: str(v))
@pytest.mark.parametrize("out_dtype,bias_dtype,residual", [(torch.float16, torch.float32, False),
                                                          (torch.float32, None, True),
                                                          (torch.bfloat16, torch.bfloat16, True)],
                         ids=["f16_biasf32", "f32_residual", "bf16_bias_residual"])
def test_block_scaled_wide_tile_outputs_and_epilogues(wide_block_tiles, monkeypatch, m, n, k, out_dtype, bias_dtype,
                                                      residual):
    a, b, kwargs = _block_inputs(m, n, k, has_row=True, has_col=True, bias_dtype=bias_dtype)
    if residual:
        kwargs["residual"] = torch.randn(m, n, device="cuda").to(out_dtype)
    assert csm.supports(a, b, out_dtype=out_dtype, **kwargs) is None
    _poison_allocator(m, n, out_dtype)
    out = csm.cute_scaled_mm(a, b, out_dtype=out_dtype, **kwargs)
    torch.cuda.synchronize()
    assert {plan[0].tile_n for plan in csm._PLANS.values()} == {256}
    ref = csm.reference_scaled_mm(a, b, out_dtype=torch.float64, **kwargs)
    assert out.dtype == out_dtype and torch.isfinite(out).all()
    assert _rel_err(out, ref) < BLOCK_TOLERANCE, (m, n, k, out_dtype)
    _pin_block_tile(monkeypatch, (128, 128))
    assert torch.equal(csm.cute_scaled_mm(a, b, out_dtype=out_dtype, **kwargs), out)


@pytest.mark.gpu
def test_block_scaled_wide_tile_expanded_b_block(wide_block_tiles):
    a, b, kwargs, out = _check_block(300, 1664, 1008)
    one_b = dict(kwargs, b_block=kwargs["b_block"][:1].expand(13, -1))  # every N block reads row 0
    _poison_allocator(300, 1664, torch.bfloat16)
    out_b = csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, **one_b)
    ref_b = csm.reference_scaled_mm(a, b, out_dtype=torch.float64, **one_b)
    assert _rel_err(out_b, ref_b) < BLOCK_TOLERANCE


@pytest.mark.gpu
def test_block_scaled_expanded_a_block_and_no_recompile():
    a, b, kwargs, out = _check_block(1000, 296, 1008, one_row_a=True)
    size = csm.cache_size()
    expanded = dict(kwargs, a_block=kwargs["a_block"].expand(1000, -1))  # row stride 0
    assert torch.equal(csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, **expanded), out)
    one_b = dict(kwargs, b_block=kwargs["b_block"][:1].expand(3, -1))  # every N block: row 0
    out_b = csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, **one_b)
    ref_b = csm.reference_scaled_mm(a, b, out_dtype=torch.float64, **one_b)
    assert _rel_err(out_b, ref_b) < BLOCK_TOLERANCE
    _check_block(777, 296, 1008)  # same 128x128 specialization (the cache may hold it from an earlier test:
    assert csm.cache_size() == size  # the configs are compared too)
    a777 = a[:777]
    assert csm.config_for(a777, b, out_dtype=torch.bfloat16, block_scaled=True) == \
        csm.config_for(a, b, out_dtype=torch.bfloat16, block_scaled=True)
