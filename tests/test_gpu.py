"""GPU-only checks: the kernels at model sizes, every dispatch path, and the compiled pattern on CUDA."""
import pytest
import torch
import torch.nn.functional as F

from fusekern.kernels import w8a16_linear as k
from fusekern.testing import assert_compiled, rel_err
from fusekern.testing.sampling_chains import gpt_fast

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 8192, 8192), (16, 8192, 8192), (1, 4096, 14336), (7, 4099, 1000),
                                   (64, 8192, 8192), (333, 1031, 4096), (2048, 8192, 8192)])
def test_kernel_at_model_sizes(M, N, K, dtype):
    torch.manual_seed(M + N)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randint(-128, 128, (N, K), device="cuda", dtype=torch.int8)
    s = torch.rand(N, device="cuda") * 0.01 + 1e-3
    b = torch.randn(N, device="cuda", dtype=dtype)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    k.w8a16_linear_triton(x, w, s, b, dtype, out=out)
    ref = k.w8a16_linear_reference(x, w, s, b, torch.float32)
    assert not out.isnan().any()
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


def test_compiled_on_cuda_skips_inductor_woq():
    x = torch.randn(4, 9, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(-128, 128, (1024, 4096), device="cuda", dtype=torch.int8)
    s = torch.rand(1024, device="cuda", dtype=torch.bfloat16) * 0.01

    def f(x, w, s):
        return F.linear(x, w.to(x.dtype)) * s

    # Static M: the kernel launches themselves are in the graph, not an opaque op call.
    assert_compiled(f, (x, w, s), fired={"w8a16_linear_scale": 1},
                    gone=["aten.mm.default", "aten._weight_int8pack_mm.default", "fusekern.w8a16_linear.default"])


def test_padded_by_inductor_still_matches():
    """Inductor's pad_mm (forced here; it pads when its cached timing says so) pads M = 36 to 40: the W8A16
    pattern still takes the matmul (fusekern.compiler_pass.unpad). Once seen failing without the fix."""
    x = torch.randn(4, 9, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(-128, 128, (1024, 4096), device="cuda", dtype=torch.int8)
    s = torch.rand(1024, device="cuda", dtype=torch.bfloat16) * 0.01

    def f(x, w, s):
        return F.linear(x, w.to(x.dtype)) * s

    assert_compiled(f, (x, w, s), fired={"w8a16_linear_scale": 1}, options={"force_shape_pad": True},
                    gone=["aten.mm.default", "aten.constant_pad_nd.default"])


@pytest.mark.parametrize("M", [1, 16, 300])
def test_compiled_static_m_every_path(M):
    """Static M on CUDA traces the launcher inline: each dispatch path, with bias, against eager."""
    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(-128, 128, (2048, 4096), device="cuda", dtype=torch.int8)
    s = torch.rand(2048, device="cuda") * 0.01
    b = torch.randn(2048, device="cuda", dtype=torch.bfloat16)

    def f(x, w, s, b):
        return F.linear(x, w.to(x.dtype)) * s + b

    w0 = w.clone()
    assert_compiled(f, (x, w, s, b), fired={"w8a16_linear_scale_bias": 1}, gone=["aten._weight_int8pack_mm.default"])
    assert torch.equal(w, w0), "the compiled graph wrote to an input"


def test_compiled_dynamic_m_uses_runtime_dispatch():
    w = torch.randint(-128, 128, (2048, 4096), device="cuda", dtype=torch.int8)
    s = torch.rand(2048, device="cuda", dtype=torch.bfloat16) * 0.01

    def f(x, w, s):
        return F.linear(x, w.to(x.dtype)) * s

    x = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.mark_dynamic(x, 0)
    more = [(torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16), w, s) for m in (3, 40, 700)]
    assert_compiled(f, (x, w, s), fired={"w8a16_linear_scale": 1}, present=["fusekern.w8a16_linear.default"],
                    extra_args=more)


def test_reduce_overhead_cuda_graphs():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(-128, 128, (4096, 4096), device="cuda", dtype=torch.int8)
    s = torch.rand(4096, device="cuda", dtype=torch.bfloat16) * 0.01

    def f(x, w, s):
        return F.linear(x, w.to(x.dtype)) * s

    compiled = torch.compile(f, backend="fusekern", mode="reduce-overhead")
    for _ in range(3):
        out = compiled(x, w, s)
    assert rel_err(out, k.w8a16_linear_reference(x, w, s, None, torch.float32)) < 1e-2


# -- sampler -----------------------------------------------------------------------------------------


SAMPLER_FILTERS = [dict(top_k=50), dict(top_k=50, top_p=0.9), dict(top_p=0.9), dict(min_p=0.1),
                   dict(top_k=50, top_p=0.8, min_p=0.05), dict(top_k=1000), dict()]


@pytest.mark.parametrize("B,filters", [(B, f) for B in (1, 8, 32) for f in SAMPLER_FILTERS]
                         + [(256, f) for f in SAMPLER_FILTERS[:3]], ids=str)  # the float64 reference is slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampler_at_vocab_size_with_injected_noise(B, dtype, filters):
    from fusekern.kernels import sampler as S

    V = 128256
    logits = (torch.randn(B, V, device="cuda") * 4).to(dtype)
    q = torch.empty(B, V, device="cuda").exponential_(1)
    out = torch.full((B,), -1, dtype=torch.int64, device="cuda")
    S.sample_triton(logits, 0.7, seed=torch.tensor([9], device="cuda"), noise=q, out=out, **filters)
    assert out.tolist() == S.sample_reference(logits, 0.7, q=q, **filters).tolist()


@pytest.mark.parametrize("variant", [dict(block=2048), dict(slots=16)], ids=str)
def test_sampler_variants_draw_the_same_tokens(variant):
    from fusekern.kernels import sampler as S

    logits = (torch.randn(64, 128256, device="cuda") * 4).to(torch.bfloat16)
    per_row = dict(temperature=torch.rand(64, device="cuda") + 0.5,
                   top_k=torch.randint(1, 200, (64,), device="cuda"), top_p=torch.rand(64, device="cuda"))
    seed = torch.tensor([3], device="cuda")
    assert torch.equal(S.sample_triton(logits, seed=seed, **per_row),
                       S.sample_triton(logits, seed=seed, **per_row, **variant))


def test_sampler_under_cuda_graphs_draws_fresh_numbers_and_reproduces_by_seed():
    import fusekern

    torch._dynamo.reset()
    fusekern.reset_match_report()
    with torch._inductor.config.patch(fx_graph_cache=False):
        f = torch.compile(lambda x: gpt_fast(x, 1.0, 1000), backend="fusekern", mode="reduce-overhead")
        logits = torch.zeros(64, 1000, device="cuda")  # flat: every draw depends on the noise
        with torch.no_grad():
            outs = [f(logits).clone() for _ in range(4)]  # warm-up, record, replays
            torch.manual_seed(5)
            a = f(logits).clone()
            torch.manual_seed(5)
            b = f(logits).clone()
    assert dict(fusekern.match_report().fired()) == {"sample": 1}
    assert not torch.equal(outs[2], outs[3]), "a CUDA-graph replay repeated the previous draws"
    assert torch.equal(a, b), "torch.manual_seed did not reproduce the draws"


def test_sampler_seed_drawn_beside_step_1_under_a_cuda_graph():
    """seed=None with a filter: the seed's draw runs on a side stream joined back before step 2. Captured
    in a CUDA graph it is part of the graph: replays draw fresh numbers, and every token is a kept one."""
    from fusekern.kernels import sampler as S

    logits = (torch.randn(64, 5000, device="cuda") * 0.3).to(torch.bfloat16)
    out = torch.full((64,), -1, dtype=torch.int64, device="cuda")
    S.sample_triton(logits, 0.9, 100, 0.95, seed=None, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        S.sample_triton(logits, 0.9, 100, 0.95, seed=None, out=out)
    draws = []
    for _ in range(3):
        out.fill_(-1)
        graph.replay()
        draws.append(out.clone())
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    x = (logits.float() / 0.9).to(logits.dtype).double().cpu()
    kept = S.kept_mask(x, 100, 0.95, None)
    assert kept.gather(1, torch.stack(draws).T.cpu()).all()
