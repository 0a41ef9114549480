"""FP8 KV attention with per-token K scales and per-head V scales: the forms users write become one
``fusekern::fp8_kv_attention`` call (K and V never dequantized), near misses stay as written.

Compared with the float64 reference of the same math (fusekern.kernels.fp8_kv_attention), by relative error.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

import fusekern
from fusekern.kernels import fp8_kv_attention as A
from fusekern.testing import assert_compiled, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16 = torch.bfloat16, torch.float16
FUSED = "fusekern.fp8_kv_attention.default"
TOL = {BF16: 1e-2, FP16: 2e-3}


def make(B=2, Hq=8, Hkv=2, Lq=1, S=200, D=64, dtype=BF16, seed=0, v_scale_shape=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g).to(DEVICE, dtype)
    k8 = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE, torch.float8_e4m3fn)
    v8 = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE, torch.float8_e4m3fn)
    ks = (torch.rand(B, Hkv, S, generator=g) * 0.1 + 0.01).to(DEVICE)
    vs = (torch.rand(*(v_scale_shape or (Hkv, 1, 1)), generator=g) * 0.1 + 0.01).to(DEVICE)
    return q, k8, ks, v8, vs


def plain(c, q, k8, ks, v8, vs):
    group = q.shape[1] // k8.shape[1]
    k = (k8.to(q.dtype) * ks[..., None].to(q.dtype)).repeat_interleave(group, dim=1)
    v = (v8.to(q.dtype) * vs.to(q.dtype)).repeat_interleave(group, dim=1)
    return torch.softmax((q @ k.transpose(-1, -2)) * c, dim=-1) @ v


def sdpa(c, q, k8, ks, v8, vs):
    k = k8.to(q.dtype) * ks[..., None].to(q.dtype)
    v = v8.to(q.dtype) * vs.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, scale=c, enable_gqa=True)


def _reference(q, k8, ks, v8, vs, c):
    # The graph rounds the scales to q's dtype before multiplying: the reference takes the same values.
    vs_heads = A.per_head_v_scale(vs.to(q.dtype), k8.shape[0], k8.shape[1])
    return A.reference_fp8_kv_attention(q.cpu(), k8.cpu(), ks.to(q.dtype).cpu(), v8.cpu(), vs_heads.cpu(), c)


def check(fn, args, c=0.125, fired=1, dynamic=False, extra_args=()):
    f = functools.partial(fn, c)
    # decode_attention (16-bit caches) would take the near misses' dequantized K / V: off, so each test
    # sees what this rewrite alone does (tests/test_decode_attention.py checks the two together)
    result = assert_compiled(f, args, fired={"fp8_kv_attention": fired} if fired else {}, dynamic=dynamic,
                             extra_args=extra_args, options={"fusekern.disable": ["decode_attention"]})
    if fired:
        assert FUSED in result.targets, result.targets
        # the graph casts both scales to q's dtype: the kernel is told to round them the same way
        dtype = args[0].dtype
        assert f"k_scale_round: {dtype}, v_scale_round: {dtype}" in "\n".join(result.graphs), result.graphs
        for call in (args, *extra_args):
            got = torch.compile(f, backend="fusekern", dynamic=dynamic)(*call)
            want = _reference(*call, c)
            assert rel_err(got.cpu().double(), want) < TOL[call[0].dtype]
    return result


@pytest.mark.parametrize("form", [plain, sdpa], ids=["softmax_matmul", "sdpa"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gqa_decode_step(form, dtype):
    check(form, make(dtype=dtype))


def test_multi_head_no_gqa_and_several_queries():
    check(sdpa, make(Hq=4, Hkv=4, Lq=3, D=128))


def test_v_scale_per_batch_and_head():
    check(sdpa, make(v_scale_shape=(2, 2, 1, 1)))


@pytest.mark.parametrize("v_scale_shape", [(1, 1, 1), (2, 1, 1, 1)], ids=["per_head", "per_batch"])
def test_one_kv_head_at_batch_two(v_scale_shape):
    """MQA (one KV head) at B = 2: the V scale reaches the op as [B, 1], which the op once read as [B] and
    refused at the first call (the compile had succeeded)."""
    check(sdpa, make(B=2, Hq=8, Hkv=1, v_scale_shape=v_scale_shape))


def sliced(c, q, k8, ks, v8, vs, n=150):  # the first n tokens of a static cache
    k = k8[:, :, :n].to(q.dtype) * ks[:, :, :n, None].to(q.dtype)
    v = v8[:, :, :n].to(q.dtype) * vs.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, scale=c, enable_gqa=True)


def heads_last(c, q, k8h, ks, v8h, vs):  # caches stored [B, S, Hkv, D], transposed in the graph
    k = k8h.transpose(1, 2).to(q.dtype) * ks[..., None].to(q.dtype)
    v = v8h.transpose(1, 2).to(q.dtype) * vs.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, scale=c, enable_gqa=True)


@pytest.mark.parametrize("form", ["sliced", "heads_last"])
def test_views_of_the_fp8_cache(form):
    """A slice of the tokens or a transposed heads-last cache: the graph casts the view (canonicalize puts the
    cast under it); the op reads the same view of the fp8 cache (they were declined as 'not an fp8 cache')."""
    q, k8, ks, v8, vs = make()
    if form == "sliced":
        fn, args = sliced, (q, k8, ks, v8, vs)
        want = _reference(q, k8[:, :, :150], ks[:, :, :150], v8[:, :, :150], vs, 0.125)
    else:
        fn, args = heads_last, (q, k8.transpose(1, 2).contiguous(), ks, v8.transpose(1, 2).contiguous(), vs)
        want = _reference(q, k8, ks, v8, vs, 0.125)
    f = functools.partial(fn, 0.125)
    result = assert_compiled(f, args, fired={"fp8_kv_attention": 1}, options={"fusekern.disable": ["decode_attention"]})
    assert FUSED in result.targets
    got = torch.compile(f, backend="fusekern")(*args)
    assert rel_err(got.cpu().double(), want) < TOL[BF16]


@pytest.mark.usefixtures("no_compile_caches")
def test_a_slice_of_growing_length():
    """A decode loop reads one more token each step: after the length changes torch makes it symbolic, and
    the op reads a symbolic slice of the fp8 cache (re-emitting the view once crashed that compile)."""
    q, k8, ks, v8, vs = make()

    def f(q, k8, ks, v8, vs, n):
        return sliced(0.125, q, k8, ks, v8, vs, n)

    g = torch.compile(f, backend="fusekern", options={"fusekern.disable": ["decode_attention"]})
    for n in (150, 151, 152, 97):
        fusekern.reset_match_report()
        got = g(q, k8, ks, v8, vs, n)
        want = _reference(q, k8[:, :, :n], ks[:, :, :n], v8[:, :, :n], vs, 0.125)
        assert rel_err(got.cpu().double(), want) < TOL[BF16], n
        if n == 151:  # the recompile with a symbolic length
            assert dict(fusekern.match_report().fired()) == {"fp8_kv_attention": 1}


def test_a_slice_of_the_head_dim_is_not_a_cache_view():
    """The op loads the head dim as 4-byte words: a slice of it stays as written."""
    q, k8, ks, v8, vs = make(D=64)

    def f(q, k8, ks, v8, vs):
        k = k8[..., :32].to(q.dtype) * ks[..., None].to(q.dtype)
        v = v8[..., :32].to(q.dtype) * vs.to(q.dtype)
        return F.scaled_dot_product_attention(q[..., :32], k, v, scale=0.125, enable_gqa=True)

    assert_compiled(f, (q, k8, ks, v8, vs), fired={}, options={"fusekern.disable": ["decode_attention"]})


def test_scalar_scales():
    def legacy(c, q, k8, v8):
        k = k8.to(q.dtype) * 0.05
        v = v8.to(q.dtype) * 0.03
        return F.scaled_dot_product_attention(q, k, v, scale=c, enable_gqa=True)

    q, k8, _, v8, _ = make()
    result = assert_compiled(functools.partial(legacy, 0.125), (q, k8, v8), fired={"fp8_kv_attention": 1})
    assert FUSED in result.targets
    got = torch.compile(functools.partial(legacy, 0.125), backend="fusekern")(q, k8, v8)
    ones = torch.ones(k8.shape[:3], device=DEVICE)
    want = A.reference_fp8_kv_attention(q.cpu(), k8.cpu(), (ones * 0.05).to(q.dtype).cpu(), v8.cpu(),
                                        torch.tensor([0.03] * k8.shape[1]).to(q.dtype), 0.125)
    assert rel_err(got.cpu().double(), want) < TOL[BF16]


def test_dynamic_batch_and_context():
    # sizes distinct from every other dim, so the first compile does not tie B to a head count
    check(sdpa, make(B=3, S=200), dynamic=True, extra_args=[make(B=5, S=131, seed=1)])


# -- near misses ------------------------------------------------------------------------------------------


def _reasons():
    return [r.reason for r in fusekern.match_report().rejections() if r.pattern == "fp8_kv_attention"]


def test_per_token_v_scale_does_not_move():
    def per_token_v(c, q, k8, ks, v8, vs):
        k = k8.to(q.dtype) * ks[..., None].to(q.dtype)
        v = v8.to(q.dtype) * ks[..., None].to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, scale=c, enable_gqa=True)

    check(per_token_v, make(), fired=0)
    assert any("V's scale" in r for r in _reasons()), _reasons()


def test_causal_is_not_a_decode_step():
    def causal(c, q, k8, ks, v8, vs):
        k = k8.to(q.dtype) * ks[..., None].to(q.dtype)
        v = v8.to(q.dtype) * vs.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, scale=c, enable_gqa=True, is_causal=True)

    check(causal, make(Lq=2), fired=0)
    assert any("is_causal" in r for r in _reasons()), _reasons()


def test_head_dim_the_kernel_does_not_take():
    check(sdpa, make(D=96), fired=0)
    assert any("head dim" in r for r in _reasons()), _reasons()


def test_bf16_cache_is_not_a_candidate():
    q, _, ks, _, vs = make()
    k, v = torch.randn(2, 2, 200, 64, device=DEVICE, dtype=BF16), torch.randn(2, 2, 200, 64, device=DEVICE, dtype=BF16)
    check(sdpa, (q, k, ks, v, vs), fired=0)
    assert _reasons() == []


def test_a_reshape_that_folds_tokens_into_heads_does_not_fire():
    q, k8, ks, v8, vs = make(B=2, Hq=8, Hkv=2, S=200, D=64)

    def folded(c, q, k8, ks, v8, vs):
        B, Hkv, S, D = k8.shape
        k = (k8.to(q.dtype) * ks[..., None].to(q.dtype))[:, :, None].expand(B, Hkv, 2, S, D).reshape(B, Hkv * 4, S // 2, D)
        v = (v8.to(q.dtype) * vs.to(q.dtype))[:, :, None].expand(B, Hkv, 2, S, D).reshape(B, Hkv * 4, S // 2, D)
        return F.scaled_dot_product_attention(q, k, v, scale=c)

    check(folded, (q, k8, ks, v8, vs), fired=0)


def test_a_cpu_scalar_with_cuda_caches_declines_instead_of_breaking_the_compile():
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusekern.compiler_pass.canonicalize import canonicalize
    from fusekern.patterns import scale_folding_attention as SA

    def attn(q, k8, ks, v8, vs):
        k, v = k8.to(q.dtype) * ks, v8.to(q.dtype) * vs
        return torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, False, False, scale=0.125)[0]

    with FakeTensorMode(allow_non_fake_inputs=True):
        args = (torch.empty(2, 2, 1, 64, device="cuda", dtype=BF16), torch.empty(2, 2, 256, 64, device="cuda",
                dtype=torch.float8_e4m3fn), torch.tensor(0.5, dtype=BF16),
                torch.empty(2, 2, 256, 64, device="cuda", dtype=torch.float8_e4m3fn), torch.tensor(0.25, dtype=BF16))
    gm = make_fx(attn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    canonicalize(gm.graph)
    assert SA.rewrite_fp8_kv_attention(gm.graph) == 0


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_scale_casts_are_rounded_exactly_as_the_graph_rounds_them(dtype):
    """Scales off the 16-bit grid: the compiled result is the op's math with the scales rounded to q's
    dtype (what the graph's casts do), bit for bit on CPU, and not the math with unrounded scales."""
    q, k8, ks, v8, vs = make(dtype=dtype)
    ks, vs = ks * (1 + 2 ** -12), vs * (1 + 2 ** -12)
    got = torch.compile(functools.partial(plain, 0.125), backend="fusekern")(q, k8, ks, v8, vs)
    B, Hkv = k8.shape[:2]
    vs_heads = A.per_head_v_scale(vs, B, Hkv)
    rounded = A.attention_math(q, k8, ks, v8, vs_heads, 0.125, dtype, dtype)
    unrounded = A.attention_math(q, k8, ks, v8, vs_heads, 0.125)
    if DEVICE == "cpu":  # the op's CPU path is attention_math itself
        assert torch.equal(got, rounded)
        assert not torch.equal(got, unrounded)
    assert rel_err(got.cpu().double(), _reference(q, k8, ks, v8, vs, 0.125)) < TOL[dtype]
