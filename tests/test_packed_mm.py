"""The hand-tuned packed kernels (issue 4): layouts derived from recognized formats, and every kernel
(GEMV packed along K or N, swap-AB tensor-core tile, decode + matmul) against its float64 reference.

CPU: the layout of every known zoo format is derived and proven on the program; wrong layouts are
refused; each kernel runs in the Triton interpreter with NaN-poisoned split-K workspaces on odd shapes
(N and K tails), strided and misaligned activations, misaligned and non-contiguous packed weights,
fp16 / fp32 activations and biases.
"""
import dataclasses


import pytest
import torch
import torch.nn.functional as F

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import packed_mm as pm
from fusekern.patterns.decode.formats import recognize
from fusekern.patterns.decode.layout import PackedLayout, derive_layout, verify
from fusekern.patterns.decode.program import DecodeProgram
from fusekern.testing import rel_err
from fusekern.testing.decode_cones import decode_program
from fusekern.testing.decode_zoo import BY_NAME, CASES
from fusekern.testing.sm90_launches import configs  # the configs these tests run (and sm90_launches compiles)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
KNOWN = [c for c in CASES if c.format != "generic"]
EXACT = ["w8a16_linear_scale_bias", "w8a16_linear_scale", "w8a16_dequant_linear_bias", "w8a16_dequant_linear",
         "w8a16_dequant_linear_col_scale", "w8a16_dequant_fp32_linear"]


def shape_of(case, odd: bool):
    """(K, N, G): odd shapes have K and N tails against every tile (N packed along N stays a multiple
    of its word), 128x128 blocks keep multiples of 128."""
    if case.name == "fp8_block":
        return (384, 256, 128) if odd else (256, 128, 128)
    g = case.group if case.group != 128 else 64
    if odd:
        return 320, 72, g
    return 256, 128, g


def setup(case, odd=False, M=3, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    K, N, G = shape_of(case, odd)
    ws = [w.to(dtype) if w.dtype in (torch.bfloat16, torch.float16) else w for w in case.make(K, N, G, "cpu")]
    x = torch.randn(M, K, dtype=dtype)
    text, leaves, consts = decode_program(case.fn, x, *ws)
    prog = DecodeProgram.from_text(text)
    lay = derive_layout(prog, recognize(prog, consts), consts)
    return prog, text, lay, [t.to(DEVICE) for t in leaves], consts, x.to(DEVICE)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("case", KNOWN, ids=lambda c: c.name)
def test_layout_computes_the_programs_weight(case):
    prog, _, lay, leaves, _, _ = setup(case, odd=True)
    assert lay is not None, case.name
    cpu = [t.cpu() for t in leaves]
    want = prog.evaluate(cpu).to(torch.float64)
    got = lay.weight_at(cpu, torch.arange(prog.K), torch.arange(prog.N))
    assert rel_err(got, want) < TOL[prog.dtype] / 2
    assert PackedLayout.from_text(lay.to_text()) == lay


def test_generic_format_has_no_layout():
    prog, _, lay, _, _, _ = setup(BY_NAME["sign_magnitude_ldexp"])
    assert lay is None


@pytest.mark.parametrize("change", [
    dict(order=(1, 0, 3, 2, 5, 4, 7, 6)),  # the wrong nibble order
    dict(zero_value=1.0),                  # GPTQ v1's zero + 1 where the program has none
    dict(zero_order=(0, 4, 1, 5, 2, 6, 3, 7)),
    dict(group_k=32),
    dict(code_dims=("n", "k")),             # the packed leaf read the other way round
], ids=lambda d: next(iter(d)))
def test_wrong_layouts_are_refused(change):
    prog, _, lay, _, consts, _ = setup(BY_NAME["gptq"])
    assert verify(prog, lay, consts)
    assert not verify(prog, dataclasses.replace(lay, **change), consts)


def test_runtime_table_gets_no_layout():
    """An E2M1 table passed as an input (not a constant) could hold anything: no hard-coded decode."""
    case = BY_NAME["mxfp4"]
    prog, _, lay, _, consts, _ = setup(case)
    assert lay is not None and consts
    assert derive_layout(prog, recognize(prog, consts), {}) is None


def test_unsigned_byte_wraparound_is_not_taken_for_a_subtraction():
    """(q - z) computed in uint8 wraps where z > q; the layout's float subtraction would not: refused."""
    def wraps(x, wp, s, z):
        N = wp.shape[0]
        w = torch.stack([wp & 0xF, wp >> 4], dim=-1).view(N, -1, 64) - z[:, :, None]  # uint8 arithmetic
        return x @ (w.to(x.dtype) * s[:, :, None]).view(N, -1).t()

    K, N = 256, 64
    wp = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
    s = torch.rand(N, K // 64, dtype=torch.bfloat16)
    z = torch.randint(0, 16, (N, K // 64), dtype=torch.uint8)
    text, leaves, consts = decode_program(wraps, torch.randn(2, K, dtype=torch.bfloat16), wp, s, z)
    prog = DecodeProgram.from_text(text)
    assert derive_layout(prog, recognize(prog, consts), consts) is None


# ----------------------------------------------------------------------------- kernels


def run(x, leaves, lay, prog, cfg, bias=None):
    """The config through decode_mm_triton, split-K workspaces poisoned with NaN."""
    ws = None
    if isinstance(cfg, (pm.PackedGemv, pm.PackedDot)):
        dt = torch.float32 if cfg.SPLIT_K > 1 else x.dtype
        ws = torch.full((cfg.SPLIT_K, 1, x.shape[0], prog.N), float("nan"), dtype=dt, device=x.device)
    return dm.decode_mm_triton(x, leaves, prog.to_text(), bias, cfg, workspace=ws, layout=lay.to_text())


@pytest.mark.parametrize("odd", [False, True], ids=["even", "odd"])
@pytest.mark.parametrize("case", KNOWN, ids=lambda c: c.name)
def test_kernels_match_reference(case, odd):
    M = 5
    prog, _, lay, leaves, _, x = setup(case, odd=odd, M=M)
    want = pm.packed_mm_reference(x, leaves, lay, prog.K, prog.N)
    cfgs = configs(lay, M)
    assert any(isinstance(c, pm.PackedGemv) for c in cfgs) and any(isinstance(c, pm.PackedDot) for c in cfgs)
    for cfg in cfgs:
        got = run(x, leaves, lay, prog, cfg)
        assert got.shape == (M, prog.N) and not got.isnan().any(), cfg
        assert rel_err(got.cpu(), want) < TOL[x.dtype], (cfg, rel_err(got.cpu(), want))


@pytest.mark.parametrize("name", ["gptq", "int4_k_stack", "awq", "nvfp4", "int8_group_asym", "fp8_channel"])
def test_strided_misaligned_activations_and_bias(name):
    prog, _, lay, leaves, _, x = setup(BY_NAME[name], M=4)
    xs = torch.randn(4, prog.K + 1, dtype=torch.bfloat16, device=DEVICE)[:, 1:]  # misaligned rows
    xt = torch.randn(prog.K, 4, dtype=torch.bfloat16, device=DEVICE).t()      # column-major
    bias = torch.randn(prog.N, dtype=torch.bfloat16, device=DEVICE)
    bias2 = torch.randn(4, prog.N, dtype=torch.float32, device=DEVICE)
    for xx in (xs, xt):
        for b in (bias, bias2):
            want = pm.packed_mm_reference(xx, leaves, lay, prog.K, prog.N, b)
            for cfg in configs(lay, 4):
                got = run(xx, leaves, lay, prog, cfg, b)
                assert rel_err(got.cpu(), want) < TOL[torch.bfloat16], (cfg, rel_err(got.cpu(), want))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["gptq", "mxfp4", "int8_channel"])
def test_activation_dtypes(name, dtype):
    prog, _, lay, leaves, _, x = setup(BY_NAME[name], M=3, dtype=dtype)
    want = pm.packed_mm_reference(x, leaves, lay, prog.K, prog.N)
    for cfg in configs(lay, 3):
        got = run(x, leaves, lay, prog, cfg)
        assert got.dtype == dtype
        assert rel_err(got.cpu(), want) < TOL[dtype], (cfg, rel_err(got.cpu(), want))


@pytest.mark.parametrize("name", ["int4_k_stack", "mxfp4", "int8_group"])
def test_misaligned_and_non_contiguous_packed_weights(name):
    """1-byte codes are read as int32 words only when aligned and contiguous along K; otherwise byte
    by byte. Both give the reference."""
    case = BY_NAME[name]
    prog, _, lay, leaves, _, x = setup(case, M=2)
    code = leaves[lay.code]
    shifted = torch.empty(code.numel() + 1, dtype=code.dtype, device=DEVICE)[1:].view(code.shape)
    shifted.copy_(code)                                     # misaligned by one byte
    assert not pm._words(lay, shifted)[0] and pm._words(lay, code)[0]
    col_major = code.t().contiguous().t()                   # K no longer contiguous
    assert not pm._words(lay, col_major)[0]
    want = pm.packed_mm_reference(x, leaves, lay, prog.K, prog.N)
    for q in (shifted, col_major):
        ls = list(leaves)
        ls[lay.code] = q
        for cfg in configs(lay, 2):
            got = pm.packed_mm(x, ls, lay, prog.K, prog.N, cfg)
            assert rel_err(got.cpu(), want) < TOL[torch.bfloat16], (cfg, rel_err(got.cpu(), want))


def test_code_offsets_past_two_to_the_31_elements():
    """The generic kernels (swap-AB tile, weight decode) formed code offsets in 32 bits and the GEMV switched to
    64 bits by the element count: a leaf whose rows lie 2**31 elements apart (an fp8 / int8 [N, K] head with N * K
    of 2**31 or more; here a strided view into a large allocation, touched only where the rows are) read row 2 from
    a wrapped address. The allocation is left uninitialized: only its three rows are written."""
    case = BY_NAME["fp8_channel"]
    prog, _, lay, leaves, _, _ = setup(case, M=2)
    K, N = prog.K, 3
    row = 2**30 + 65  # (not a multiple of 4: the codes are read byte by byte)
    big = torch.empty(2**31 + 2 * row + 256, dtype=torch.uint8, device=DEVICE)
    codes = big[2**31:].as_strided((N, K), (row, 1))
    codes.copy_((torch.randn(N, K) * 2).to(torch.float8_e4m3fn).view(torch.uint8))
    codes = codes.view(torch.float8_e4m3fn)
    assert pm.needs_i64(codes) and not pm.needs_i64(leaves[lay.code])
    ls = [codes, (torch.rand(N) * 0.02 + 0.005).to(DEVICE)]
    x = torch.randn(2, K, dtype=torch.float16, device=DEVICE)
    want = pm.packed_mm_reference(x, ls, lay, K, N)
    for cfg in (pm.PackedDot(16, 64, 64, 1, 4), pm.PackedDequant(64, 64), pm.PackedGemv(32, 64, 1, 4)):
        got = pm.packed_mm(x, ls, lay, K, N, cfg)
        assert rel_err(got.cpu(), want) < TOL[torch.float16], (cfg, got[:, 2], want[:, 2])
    del big, codes


def test_dispatch_offers_packed_kernels_first():
    prog, text, lay, leaves, _, x = setup(BY_NAME["gptq"])
    cands = dm.candidates(1, 8192, 8192, layout=lay.to_text())
    assert isinstance(cands[0], pm.PackedGemv)
    assert any(isinstance(c, dm.Config) for c in cands)  # the generated kernels stay candidates
    assert isinstance(dm.select_config(1, prog.N, prog.K, layout=lay.to_text()), pm.PackedGemv)
    assert isinstance(dm.select_config(16, prog.N, prog.K, layout=lay.to_text()), pm.PackedDot)
    assert not any(isinstance(c, pm.PackedGemv) for c in dm.candidates(16, 8192, 8192, layout=lay.to_text()))
    # no layout: as before
    assert not any(isinstance(c, (pm.PackedGemv, pm.PackedDot)) for c in dm.candidates(1, 8192, 8192))


def test_every_launch_compiles_for_sm90():
    """The interpreter never compiles: every launch the kernel tests above make (real argument dtypes, each
    config, odd and even shapes) is compiled for sm_90a in a subprocess without it. (The fp8 formats'
    tensor-core and decode configs once passed here on CPU and failed to compile on the H200: an fp8
    pointer stood in for the absent zero point.)"""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "fusekern.testing.sm90_launches", *(c.name for c in KNOWN)],
                          capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(": ok") >= 10 * len(KNOWN)  # two shapes x the configs that fit, per format


def test_tuning_never_picks_a_fast_wrong_kernel():
    """The first call checks every candidate on its own probe rows, then times it on the caller's; one
    whose output is off anywhere (a kernel wrong on this GPU: here one wrong column of 64), NaN, or that
    fails is skipped, however fast; one that refuses the input (ValueError) too."""
    probe, x = torch.randn(4, 32), torch.full((4, 32), float("nan"))  # the caller's rows may be garbage
    w = torch.randn(32, 64)
    ref = (probe @ w).bfloat16()
    one_column = ref.clone()
    one_column[:, 63] += 4 * ref.float().abs().mean().bfloat16()
    outs = {"right": ref.clone(), "column": one_column, "nan": ref * float("nan"),
            "close": (ref.float() * 1.002).bfloat16(), "fails": RuntimeError("does not compile"),
            "refuses": ValueError("cannot read these leaves")}
    times = {"right": 3.0, "column": 1.0, "nan": 0.5, "close": 2.0, "fails": 0.1, "refuses": 0.1}
    timed = []

    def run_of(name, rows):
        def run():
            if isinstance(outs[name], Exception):
                raise outs[name]
            return outs[name] if rows is probe else torch.full_like(ref, float("nan"))
        run.name, run.rows = name, rows
        return run

    def time_of(run):
        timed.append((run.name, run.rows is x))
        return times[run.name]

    assert dm.fastest_correct(list(outs), run_of, x, probe, time_of, ref, "a test weight") == "close"
    assert ("column", True) not in timed and ("close", True) in timed  # timed on the caller's rows
    assert dm.fastest_correct(["column", "nan", "fails", "refuses"], run_of, x, probe, time_of, ref, "w") is None
    # nothing to check against: timing alone, as before the check
    assert dm.fastest_correct(["right", "column"], run_of, x, probe, time_of, None, "w") == "column"


def test_rewrite_passes_the_layout():
    """The compiled graph's decode_mm call carries the layout; the match report names the kernels."""
    from fusekern.compiler_pass.report import match_report, reset_match_report

    for name, kernels in (("gptq", "hand-tuned packed kernels"), ("sign_magnitude_ldexp", "generated kernel")):
        case = BY_NAME[name]
        ws = case.make(256, 128, 64, "cpu")
        x = torch.randn(2, 256, dtype=torch.bfloat16)
        reset_match_report()
        torch._dynamo.reset()
        # A graph from inductor's FX cache skips the passes (and their notes): compile afresh.
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            out = torch.compile(case.fn, backend="fusekern", options={"fusekern.disable": EXACT})(x, *ws)
        assert rel_err(out, case.fn(x, *ws)) < 1e-2
        notes = [n.reason for n in match_report().notes() if n.pattern == "decode_matmul"]
        assert len(notes) == 1 and notes[0].endswith(kernels), notes


def test_partial_last_group():
    """K = 320 with groups of 128: the last scale group is partial. The layout reads the scale of k // 128
    and the kernels mask the tail, so every path still gives the reference."""
    def partial(x, wp, s):
        N, K = wp.shape[0], wp.shape[1] * 2
        w = torch.stack([wp & 0xF, wp >> 4], dim=-1).view(N, K).to(x.dtype) - 8
        return F.linear(x, w * s.repeat_interleave(128, dim=1)[:, :K])

    torch.manual_seed(0)
    K, N = 320, 72
    wp = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
    s = (torch.rand(N, 3) * 0.02 + 0.005).to(torch.bfloat16)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    text, leaves, consts = decode_program(partial, x, wp, s)
    prog = DecodeProgram.from_text(text)
    lay = derive_layout(prog, recognize(prog, consts), consts)
    assert lay is not None and lay.group_k == 128
    leaves, x = [t.to(DEVICE) for t in leaves], x.to(DEVICE)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    assert rel_err(want, partial(x.cpu(), wp, s).double()) < 1e-2
    for cfg in configs(lay, 3):
        got = run(x, leaves, lay, prog, cfg)
        assert rel_err(got.cpu(), want) < TOL[torch.bfloat16], (cfg, rel_err(got.cpu(), want))


def test_gemv_scale_groups_that_straddle_its_column_tiles():
    """Found in review: scales shared by 24 columns, zeros packed 8 to a word along N (192 columns per word).
    A 64-column GEMV tile starts inside a scale group, so the per-tile addressing that forms a scale's
    address as tile base // GN + column // GN must not serve it (it checked GN * 8 against the tile only)."""
    K, N, GN = 256, 384, 24
    lay = dataclasses.replace(pm.REPORT_LAYOUTS["gptq"][0], group_n=GN)
    torch.manual_seed(0)
    q = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32)
    s = (torch.rand(K // 128, N // GN) * 0.02 + 0.005).to(torch.bfloat16)
    z = torch.randint(-2**31, 2**31 - 1, (K // 128, N // (GN * 8)), dtype=torch.int32)
    assert (lay.code, lay.zero_leaf, lay.scale) == (0, 1, 2)
    leaves = [t.to(DEVICE) for t in (q, z, s)]
    x = torch.randn(1, K, dtype=torch.bfloat16, device=DEVICE)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    for cfg in (pm.PackedGemv(64, 128, 2, 4), pm.PackedGemv(32, 128, 1, 4)):
        got = pm.gemv(x, leaves, lay, K, N, cfg)
        assert rel_err(got.cpu(), want) < TOL[torch.bfloat16], (cfg, rel_err(got.cpu(), want))


def test_fp8_with_a_zero_point():
    """Found in review: fp8 codes with a float zero point, ``(w8 - z) * s``. The GPU's four-at-a-time fp8
    path formed no sum of x for the zero; zero points now take the general path."""
    def fp8_zero(x, w8, z, s):
        return F.linear(x, ((w8.float() - z[:, None]) * s[:, None]).to(x.dtype))

    torch.manual_seed(0)
    K, N = 256, 72
    w8 = (torch.randn(N, K) * 2).to(torch.float8_e4m3fn)
    z = torch.randn(N) * 0.5
    s = torch.rand(N) * 0.02 + 0.005
    x = torch.randn(3, K, dtype=torch.bfloat16)
    prog, leaves, lay = _layout_of(fp8_zero, x, w8, z, s)
    assert lay is not None and lay.value == "fp8" and lay.zero == "float"
    leaves, x = [t.to(DEVICE) for t in leaves], x.to(DEVICE)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    for cfg in configs(lay, 3):
        got = run(x, leaves, lay, prog, cfg)
        assert rel_err(got.cpu(), want) < TOL[torch.bfloat16], (cfg, rel_err(got.cpu(), want))


def _layout_of(fn, *args):
    text, leaves, consts = decode_program(fn, *args)
    prog = DecodeProgram.from_text(text)
    return prog, leaves, derive_layout(prog, recognize(prog, consts), consts)


def test_layouts_the_kernels_cannot_compute_are_refused():
    """Found in review: each of these once got a layout that computed something else."""
    torch.manual_seed(0)
    K, N = 256, 384
    x = torch.randn(2, K, dtype=torch.bfloat16)
    wq = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    z = torch.randint(0, 256, (N,), dtype=torch.uint8)
    s = torch.rand(N, dtype=torch.bfloat16)

    def zero_plus_one_wraps(x, wq, z, s):  # uint8 z + 1 wraps at 255; a float zero + 1 would not
        return F.linear(x, (wq - (z + 1).to(torch.bfloat16)[:, None]) * s[:, None])

    def constant_factor(x, wq, s):  # a factor within bf16 rounding of 1 is still a different weight
        return F.linear(x, ((wq.to(torch.bfloat16) - 8) * s[:, None]) * 1.0078125)

    assert _layout_of(zero_plus_one_wraps, x, wq, z, s)[2] is None
    assert _layout_of(constant_factor, x, wq, s)[2] is None

    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

    def e2m1_with_zero(x, codes, s):
        w = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], -1).view(codes.shape[0], -1)
        return F.linear(x, ((w - 0.5) * s[:, None]).to(x.dtype))

    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
    assert _layout_of(e2m1_with_zero, x, codes, s.float())[2] is None

    def gptq_2bit(x, qw, s):  # 16 fields per int32: more than the kernels encode
        shifts = torch.arange(0, 32, 2, dtype=torch.int32)
        w = ((qw[:, None, :] >> shifts[None, :, None]) & 3).reshape(K, N)
        return x @ ((w - 2).to(x.dtype) * s)

    qw = torch.randint(-2**31, 2**31 - 1, (K // 16, N), dtype=torch.int32)
    assert _layout_of(gptq_2bit, x, qw, s)[2] is None


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_fp16_e2m1_small_scales(name):
    """E2M1 tiles scaled inside the tensor-core tile and rounded to fp16 must not underflow (small E8M0
    exponents; NVFP4 with a small global scale)."""
    case = BY_NAME[name]
    torch.manual_seed(0)
    K, N = 256, 128
    ws = list(case.make(K, N, case.group, "cpu"))
    if name == "mxfp4":
        ws[1] = torch.randint(108, 112, ws[1].shape, dtype=torch.uint8)
    else:
        ws[2] = torch.tensor([2e-4])
    x = torch.randn(4, K, dtype=torch.float16)
    prog, leaves, lay = _layout_of(case.fn, x, *ws)
    leaves, x = [t.to(DEVICE) for t in leaves], x.to(DEVICE)
    want = pm.packed_mm_reference(x, leaves, lay, K, N)
    for cfg in configs(lay, 4):
        got = run(x, leaves, lay, prog, cfg)
        assert rel_err(got.cpu(), want) < TOL[torch.float16], (cfg, rel_err(got.cpu(), want))
