"""Sampling chains written as users write them: the rewrite fires, and the compiled graph samples
from the same distribution as the original (chi-square against the exact distribution), from the same
kept set (the op gets the chain's parameters), and, for the race chains, the same tokens given the same
exponential draws.

On CPU the op runs its PyTorch implementation; the Triton kernel is covered by test_sampler_kernel.py
(interpreter) and by the GPU runs of both files.
"""
import pytest
import torch
import torch.nn.functional as F

import fusekern
from fusekern.kernels import sampler as kernel
from fusekern.testing import sampling_chains as chains
from torch._dynamo.utils import counters

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _no_compile_caches():
    """A graph from inductor's caches skips the passes: these tests must see the passes run."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


# -- the chains, as written in gpt-fast, Hugging Face and by hand -----------------------------------


def gpt_fast(logits, temperature: float = 0.8, top_k: int = 5):
    return chains.gpt_fast(logits, temperature, top_k)


def gpt_fast_batch1(logits):  # gpt-fast's sample(): logits[0, -1] is one row, 1-D
    return gpt_fast(logits[0, -1])


def top_k_only(logits):
    return gpt_fast(logits, 1.0, 4)


def temperature_only(logits):
    probs = torch.softmax(logits / 0.7, dim=-1)
    q = torch.empty_like(probs).exponential_(2.0)  # any rate: the argmax does not change
    return torch.argmax(probs / q, dim=-1)


def hf_top_k(scores):
    return chains.hf_top_k(scores, 0.9, 6)


def hf_multinomial(scores):  # HF's TemperatureLogitsWarper + TopKLogitsWarper, then torch.multinomial
    scores = scores / 0.9
    indices_to_remove = scores < torch.topk(scores, 6)[0][..., -1, None]
    scores = scores.masked_fill(indices_to_remove, -float("inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(1)


def per_row_temperature(logits):  # one temperature per row, as serving stacks batch requests
    temperature = torch.full((logits.shape[0],), 0.8, device=logits.device, dtype=logits.dtype)
    return chains.gpt_fast_tensor_temperature(logits, temperature[:, None], 5)


# (function, temperature, top_k) of each chain, for the exact distribution
FORMS = {
    "gpt_fast": (gpt_fast, 0.8, 5),
    "top_k_only": (top_k_only, 1.0, 4),
    "temperature_only": (temperature_only, 0.7, None),
    "hf_top_k": (hf_top_k, 0.9, 6),
    "hf_multinomial": (hf_multinomial, 0.9, 6),
    "per_row_temperature": (per_row_temperature, 0.8, 5),
}


def exact_distribution(row: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """softmax over the kept set of one row, x rounded to the logits' dtype as the graph computes it."""
    x = (row.float() / temperature).to(row.dtype).double().cpu()
    if top_k is not None:
        x = torch.where(x < x.topk(top_k).values[-1], float("-inf"), x)
    return torch.softmax(x, 0)


def compiled(fn, **kw):
    torch._dynamo.reset()
    fusekern.reset_match_report()
    return torch.compile(fn, backend="fusekern", **kw)


def fired():
    return dict(fusekern.match_report().fired())


BASE = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.45, 0.1, -0.3, -1.0, -2.0, 0.0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_forms_fire_and_match_the_distribution(form, dtype):
    fn, temperature, top_k = FORMS[form]
    B = 4096
    logits = BASE.to(DEVICE, dtype).expand(B, -1).contiguous()
    f = compiled(fn)
    torch.manual_seed(0)
    with torch.no_grad():
        want = fn(logits)
        got = f(logits)
    assert fired() == {"sample": 1}
    assert got.shape == want.shape and got.dtype == want.dtype
    p = exact_distribution(logits[0], temperature, top_k)
    for tokens in (got, want):  # the original passes the same test: the test itself is sound
        counts = torch.bincount(tokens.flatten().long().cpu(), minlength=len(BASE)).double()
        assert counts[p == 0].sum() == 0, "a masked token was sampled"
        kept = p > 0
        expected = p[kept] * B
        chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
        assert chi2 < 30.0, (chi2, counts.tolist())  # above the 99.9% quantile for <= 11 degrees of freedom


def test_one_row_1d_logits():
    logits = torch.randn(1, 3, 1000, device=DEVICE, dtype=torch.bfloat16)
    f = compiled(gpt_fast_batch1)
    with torch.no_grad():
        out = f(logits)
    assert fired() == {"sample": 1}
    assert out.shape == (1,) and out.dtype == torch.int32
    x = (logits[0, -1].float() / 0.8).to(torch.bfloat16)
    assert x[out.long()] >= x.topk(5).values[-1]


def test_a_rounding_cast_before_the_softmax_is_sampled_through():
    """softmax(x.to(bf16)) of fp32 x samples from the rounded logits: at temperature 0.1 the rounding moves
    two near-tied tokens half a unit apart (100.24 and 100.26 round to 100.0 and 100.5), so token 1 is drawn
    with probability sigmoid(0.5) = 0.62, not sigmoid(0.02) = 0.505. The rewrite once stripped that cast
    with the widening ones and sampled from the fp32 values."""
    def sample(logits):
        x = logits / 0.1
        x = torch.where(x < torch.topk(x, 2)[0][..., -1:], -float("inf"), x)
        probs = torch.softmax(x.to(torch.bfloat16), dim=-1)
        return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)

    rows = 20000
    logits = torch.tensor([[10.024, 10.026, -5.0]], device=DEVICE).expand(rows, -1).contiguous()
    with torch.no_grad():
        out = compiled(sample)(logits)
    assert fired() == {"sample": 1}
    share = (out == 1).float().mean().item()
    want = torch.sigmoid(torch.tensor(0.5)).item()
    assert abs(share - want) < 6 * (want * (1 - want) / rows) ** 0.5, share  # the fp32 logits give 0.505


def test_manual_seed_reproduces_a_run():
    logits = torch.zeros(64, 100, device=DEVICE)  # flat: every draw differs by seed
    f = compiled(lambda x: gpt_fast(x, 1.0, 100))
    with torch.no_grad():
        torch.manual_seed(3)
        a = f(logits)
        torch.manual_seed(3)
        b = f(logits)
        c = f(logits)
    assert fired() == {"sample": 1}
    assert torch.equal(a, b) and not torch.equal(b, c)


def test_the_rewrite_leaves_the_op_alone_in_the_graph():
    """The op draws its own seed (on CUDA beside its first step): no randint node, which inductor lowered
    to two launches before the sampler's; and it writes gpt-fast's int32 tokens itself (no cast launch)."""
    from fusekern.testing.equivalence import GraphCapture

    capture = GraphCapture()
    f = compiled(lambda x: gpt_fast(x, 0.8, 20), options={"post_grad_custom_post_pass": capture})
    with torch.no_grad():
        f(torch.randn(4, 100, device=DEVICE))
    assert fired() == {"sample": 1}
    targets = set().union(*capture.targets)
    assert "fusekern.sample.default" in targets
    random = {t for t in targets if "rand" in t or "seed" in t or "exponential" in t}
    assert not random, random
    assert targets == {"fusekern.sample.default", "aten.reshape.default"}, targets


def test_nan_and_inf_rows_give_token_0_like_the_original():
    logits = torch.randn(3, 50, device=DEVICE)
    logits[0, 7] = float("nan")
    logits[1, 9] = float("inf")
    f = compiled(lambda x: gpt_fast(x, 1.0, 10))
    with torch.no_grad():
        torch.manual_seed(0)
        want = gpt_fast(logits, 1.0, 10)
        got = f(logits)
    assert fired() == {"sample": 1}
    assert got[:2].flatten().tolist() == want[:2].flatten().tolist() == [0, 0]


def test_changing_temperature_and_top_k_adds_no_recompile():
    """Dynamo makes the Python temperature and top-k dynamic after they change (torch 2.13: 3 graphs for
    these calls; torch 2.11 still guards on the temperature's value: 5). fusekern must fire in every
    graph and add no guard of its own: as many graphs as stock inductor."""
    calls = [(0.8, 50), (0.9, 50), (1.1, 40), (0.5, 30), (0.6, 20)]
    x = torch.randn(4, 1000, device=DEVICE)
    graphs = {}
    for backend in ("inductor", "fusekern"):
        torch._dynamo.reset()
        fusekern.reset_match_report()
        counters.clear()
        f = torch.compile(gpt_fast, backend=backend)
        with torch.no_grad():
            for t, k in calls:
                f(x, t, k)
        graphs[backend] = counters["stats"]["unique_graphs"]
    assert graphs["fusekern"] == graphs["inductor"] <= 5
    assert fired() == {"sample": graphs["fusekern"]}  # every compiled graph, including the dynamic ones


def test_dynamic_batch_one_compile():
    f = compiled(lambda x: gpt_fast(x, 0.9, 8), dynamic=True)
    counters.clear()
    with torch.no_grad():
        for B in (3, 17, 40):
            out = f(torch.randn(B, 300, device=DEVICE, dtype=torch.bfloat16))
            assert out.shape == (B, 1)
    assert counters["stats"]["unique_graphs"] == 1
    assert fired() == {"sample": 1}


def returns_probs(logits):
    probs = torch.softmax(logits / 0.8, dim=-1)
    q = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / q, dim=-1), probs


def finite_fill(logits):
    v, _ = torch.topk(logits, 5)
    logits = torch.where(logits < v[..., -1:], -1e4, logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


def smallest_k(logits):
    v, _ = torch.topk(logits, 5, largest=False)
    logits = torch.where(logits < v[..., -1:], -float("inf"), logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


def uniform_noise(logits):
    probs = torch.softmax(logits, dim=-1)
    return torch.argmax(probs / torch.rand_like(probs), dim=-1)  # not an exponential race


def softmax_other_dim(logits):
    probs = torch.softmax(logits, dim=0)
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


def pivot_from_other_tensor(logits, other):
    v, _ = torch.topk(other, 5)
    logits = torch.where(logits < v[..., -1:], -float("inf"), logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


@pytest.mark.parametrize("fn,reason", [
    (returns_probs, "also used by"),
    (finite_fill, "does not fill with -inf"),
    (smallest_k, "largest values"),
    (uniform_noise, "not exponential noise"),
    (softmax_other_dim, "not over the last dim"),
    (pivot_from_other_tensor, "another tensor than the one masked"),
])
def test_near_misses_stay_as_written(fn, reason):
    args = (torch.randn(4, 64, device=DEVICE),)
    if fn is pivot_from_other_tensor:
        args += (torch.randn(4, 64, device=DEVICE),)
    f = compiled(fn)
    with torch.no_grad():
        f(*args)
    report = fusekern.match_report()
    assert fired() == {}
    reasons = [r.reason for g in report.graphs for r in g.rejected if r.pattern == "sample"]
    assert any(reason in r for r in reasons), reasons


def fp32_temperature(logits):  # bf16 logits / fp32 [B, 1] temperatures promote x to fp32
    return chains.gpt_fast_tensor_temperature(logits, torch.full((logits.shape[0], 1), 0.8, device=logits.device), 5)


def two_samples(logits):
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=2)


@pytest.mark.parametrize("fn,reason", [
    (fp32_temperature, "promotes them"),
    (two_samples, "draws 2 samples"),
])
def test_near_misses_bf16_stay_as_written(fn, reason):
    f = compiled(fn)
    with torch.no_grad():
        f(torch.randn(4, 64, device=DEVICE, dtype=torch.bfloat16))
    report = fusekern.match_report()
    assert fired() == {}
    reasons = [r.reason for g in report.graphs for r in g.rejected if r.pattern == "sample"]
    assert any(reason in r for r in reasons), reasons


def test_disable_keeps_the_original():
    f = compiled(gpt_fast, options={"fusekern.disable": ["sampling"]})
    with torch.no_grad():
        f(torch.randn(2, 100, device=DEVICE))
    assert fired() == {}


# -- top-p, min-p, vLLM's sorted filters, a repetition penalty upstream -------------------------------
# Each form: (sample, warp): the chain, and the same chain up to its filtered logits (-inf: dropped).

B_FILTER = 4096
PREVIOUS = torch.tensor([0, 3, 5])  # the tokens a repetition penalty sees as generated


def per_row(logits, value, dtype=None):
    return torch.full((logits.shape[0],), value, device=logits.device, dtype=dtype or torch.float32)


def hf_top_p_warp(s):
    return chains.hf_warpers(s, 0.9, None, 0.8)


def hf_top_p_tensor_warp(s):  # one value in a tensor, as Dynamo passes a Python float that changes
    return chains.hf_warpers(s, 0.9, None, torch.tensor(0.8, device=s.device))


def hf_top_p_per_row_warp(s):
    return chains.hf_warpers(s, 0.9, None, per_row(s, 0.8)[:, None])


def hf_top_k_top_p_min_p_warp(s):
    return chains.hf_warpers(s, 0.9, 8, 0.9, 0.3)


def hf_min_p_per_row_warp(s):  # the bare min-p rule (no keep step) with one min_p per row
    return chains.hf_min_p_warper(s / 0.9, per_row(s, 0.2)[:, None], keep_step=False)


def hf_min_p_older_warp(scores, min_p=0.2):  # transformers 4.4x: argsort, gather, scatter back (no-op step)
    probs = torch.softmax(scores, dim=-1)
    top_probs, _ = probs.max(dim=-1, keepdim=True)
    tokens_to_remove = probs < min_p * top_probs
    sorted_indices = torch.argsort(scores, descending=True, dim=-1)
    sorted_indices_to_remove = torch.gather(tokens_to_remove, dim=-1, index=sorted_indices)
    sorted_indices_to_remove[..., :1] = False
    indices_to_remove = sorted_indices_to_remove.scatter(1, sorted_indices, sorted_indices_to_remove)
    return scores.masked_fill(indices_to_remove, -float("inf"))


def hf_min_p_before_top_p_warp(s):  # vLLM's order written with HF's warpers: top-p's mass is min-p's set
    return chains.hf_top_p_warper(chains.hf_min_p_warper(s / 0.9, 0.3), 0.8)


def repetition_penalty_warp(s):
    ids = PREVIOUS.to(s.device).expand(s.shape[0], -1)
    return chains.hf_warpers(chains.hf_repetition_penalty(ids, s, 1.3), 0.9, 8, 0.9, 0.1)


def multinomial_of(warp):
    def sample(s):
        return torch.multinomial(torch.softmax(warp(s), dim=-1), num_samples=1).squeeze(1)
    return sample


def vllm_params(logits):
    return per_row(logits, 0.9), per_row(logits, 8, torch.int64), per_row(logits, 0.8)


def vllm_sample(logits):
    return chains.vllm_sample(logits.clone(), *vllm_params(logits))  # vLLM divides its logits in place


def vllm_warp(logits):
    t, k, p = vllm_params(logits)
    return chains.vllm_apply_top_k_top_p(logits / t[:, None], k, p)


def vllm_min_p_sample(logits):  # with vLLM's min-p processor (logits[mask] = -inf), before top-k / top-p
    return chains.vllm_sample(logits.clone(), *vllm_params(logits), per_row(logits, 0.3))


def vllm_min_p_warp(logits):
    t, k, p = vllm_params(logits)
    return chains.vllm_apply_top_k_top_p(chains.vllm_min_p(logits / t[:, None], per_row(logits, 0.3)), k, p)


FILTER_FORMS = {name: (multinomial_of(warp), warp) for name, warp in {
    "hf_top_p": hf_top_p_warp,
    "hf_top_p_tensor": hf_top_p_tensor_warp,
    "hf_top_p_per_row": hf_top_p_per_row_warp,
    "hf_top_k_top_p_min_p": hf_top_k_top_p_min_p_warp,
    "hf_min_p_per_row": hf_min_p_per_row_warp,
    "hf_min_p_older": hf_min_p_older_warp,
    "hf_min_p_before_top_p": hf_min_p_before_top_p_warp,
    "repetition_penalty": repetition_penalty_warp,
}.items()}
FILTER_FORMS["vllm"] = (vllm_sample, vllm_warp)
FILTER_FORMS["vllm_min_p"] = (vllm_min_p_sample, vllm_min_p_warp)
MIN_P_FORMS = {"hf_top_k_top_p_min_p", "hf_min_p_per_row", "hf_min_p_older", "hf_min_p_before_top_p",
               "repetition_penalty", "vllm_min_p"}


def test_min_p_before_top_p_forms_keep_another_set_than_hf_order():
    """The two min-p-first forms above are not Hugging Face's order in disguise: on BASE the order matters."""
    x = BASE[None] / 0.9
    hf = chains.hf_warpers(x, None, None, 0.8, 0.3) > -float("inf")
    for warp in (hf_min_p_before_top_p_warp, vllm_min_p_warp):
        kept = warp(BASE[None]) > -float("inf")
        assert not torch.equal(kept, hf) and 1 < int(kept.sum()) < int(hf.sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", sorted(FILTER_FORMS))
def test_filter_chains_fire_and_match_the_distribution(form, dtype):
    sample, warp = FILTER_FORMS[form]
    logits = BASE.to(DEVICE, dtype).expand(B_FILTER, -1).contiguous()
    f = compiled(sample)
    torch.manual_seed(0)
    with torch.no_grad():
        want = sample(logits)
        got = f(logits)
        kept_x = warp(logits[:1]).double()[0].cpu()
    if form in MIN_P_FORMS and dtype != torch.float32:
        # min-p over 16-bit probabilities: their rounding keeps other tokens near the bound (declined)
        assert fired() == {}
        reasons = [r.reason for r in fusekern.match_report().rejections()]
        assert any("probabilities, whose rounding" in r for r in reasons), reasons
        return
    assert fired() == {"sample": 1}
    assert got.shape == want.shape and got.dtype == want.dtype
    p = torch.softmax(kept_x, 0)  # the original's distribution: softmax over what its filters keep
    assert 1 < int((p > 0).sum()) < len(BASE), "the filters keep everything or one token: a weak test"
    for tokens in (got, want):
        counts = torch.bincount(tokens.flatten().long().cpu(), minlength=len(BASE)).double()
        assert counts[p == 0].sum() == 0, "a token the original drops was sampled"
        kept = p > 0
        expected = p[kept] * B_FILTER
        chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
        assert chi2 < 30.0, (chi2, counts.tolist())


# Per-row parameters that differ row by row: the op must get each row's own.
ROWS, VOCAB = 16, 150


def row_values(lo, hi, dtype=torch.float32):
    return torch.linspace(lo, hi, ROWS, device=DEVICE).to(dtype)


def hf_rows_warp(s):  # temperature, top-p and min-p per row ([B, 1]); the bare min-p rule
    s = s / row_values(0.6, 1.3)[:, None]
    s = chains.hf_top_k_warper(s, 40)
    s = chains.hf_top_p_warper(s, row_values(0.3, 0.99)[:, None])
    return chains.hf_min_p_warper(s, row_values(0.0, 0.2)[:, None], keep_step=False)


def vllm_rows_params():
    return row_values(0.6, 1.3), row_values(2, VOCAB, torch.int64), row_values(0.3, 0.99)


def vllm_rows_sample(logits):
    return chains.vllm_sample(logits.clone(), *vllm_rows_params())


def vllm_rows_warp(logits):
    t, k, p = vllm_rows_params()
    return chains.vllm_apply_top_k_top_p(logits / t[:, None], k, p)


def vllm_min_p_rows_sample(logits):
    return chains.vllm_sample(logits.clone(), *vllm_rows_params(), row_values(0.0, 0.6))


def vllm_min_p_rows_warp(logits):
    t, k, p = vllm_rows_params()
    return chains.vllm_apply_top_k_top_p(chains.vllm_min_p(logits / t[:, None], row_values(0.0, 0.6)), k, p)


@pytest.fixture
def op_calls(monkeypatch):
    """The arguments the op's CPU implementation gets (it samples as usual)."""
    calls = []

    def recording(logits, temperature=1.0, top_k=None, top_p=None, min_p=None, *, seed, min_p_first=False):
        calls.append(dict(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          min_p_first=min_p_first))
        return real(logits, temperature, top_k, top_p, min_p, seed=seed, min_p_first=min_p_first)

    real = kernel.sample_torch
    monkeypatch.setattr(kernel, "sample_torch", recording)
    return calls


@pytest.mark.skipif(DEVICE != "cpu", reason="records the op's CPU implementation")
@pytest.mark.parametrize("sample,warp", [
    (multinomial_of(hf_rows_warp), hf_rows_warp),
    (multinomial_of(hf_top_k_top_p_min_p_warp), hf_top_k_top_p_min_p_warp),
    (multinomial_of(repetition_penalty_warp), repetition_penalty_warp),
    (vllm_rows_sample, vllm_rows_warp),
    (vllm_min_p_rows_sample, vllm_min_p_rows_warp),
    (multinomial_of(hf_min_p_before_top_p_warp), hf_min_p_before_top_p_warp),
], ids=["hf_per_row", "hf_top_k_top_p_min_p", "repetition_penalty", "vllm_per_row", "vllm_min_p_per_row",
        "hf_min_p_before_top_p"])
def test_the_op_keeps_what_the_chain_keeps(sample, warp, op_calls):
    """Random logits, parameters per row: the set the op keeps (by its definition, from the arguments it
    got) is the set the original's filters keep, and every token drawn lies in it."""
    torch.manual_seed(1)
    logits = torch.randn(ROWS, VOCAB, device=DEVICE) * 2
    f = compiled(sample)
    with torch.no_grad():
        tokens = torch.stack([f(logits) for _ in range(20)])
        want = warp(logits) > -float("inf")
    assert fired() == {"sample": 1}
    call = op_calls[-1]
    t = call["temperature"]
    t = t.reshape(-1, 1) if isinstance(t, torch.Tensor) else t
    x = (call["logits"].float() / t).to(call["logits"].dtype).double()
    got = kernel.kept_mask(x, call["top_k"], call["top_p"], call["min_p"], call["min_p_first"])
    assert torch.equal(got, want.cpu()), (got != want).nonzero().tolist()
    assert want.gather(1, tokens.T.reshape(ROWS, -1)).all(), "a token the original drops was sampled"
    assert 1 < int(want.sum(1).max()) < VOCAB  # the filters cut, and keep more than one token somewhere


@pytest.mark.skipif(DEVICE != "cpu", reason="replaces the op's CPU noise")
@pytest.mark.parametrize("sample", [vllm_rows_sample, vllm_min_p_rows_sample])
def test_vllm_race_gives_the_original_tokens_given_its_noise(monkeypatch, sample):
    """vLLM's chain draws q with exponential_ from torch's generator: with the op's noise set to the same
    draws (its reference semantics), the compiled graph returns the original's tokens."""
    torch.manual_seed(2)
    logits = torch.randn(ROWS, VOCAB) * 2
    torch.manual_seed(5)
    q = torch.empty(ROWS, VOCAB).exponential_()  # the original's first random draw after the seed

    def with_q(logits, temperature=1.0, top_k=None, top_p=None, min_p=None, *, seed, min_p_first=False):
        return kernel.sample_reference(logits, temperature, top_k, top_p, min_p, q=q, min_p_first=min_p_first)

    monkeypatch.setattr(kernel, "sample_torch", with_q)
    f = compiled(sample)
    with torch.no_grad():
        torch.manual_seed(5)
        want = sample(logits)
        got = f(logits)
    assert fired() == {"sample": 1}
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("sample", [vllm_sample, vllm_min_p_sample])
def test_vllm_dynamic_batch_one_compile(sample):
    f = compiled(sample, dynamic=True)
    counters.clear()
    with torch.no_grad():
        for B in (3, 17, 40):
            out = f(torch.randn(B, 100, device=DEVICE))
            assert out.shape == (B,)
    assert counters["stats"]["unique_graphs"] == 1
    assert fired() == {"sample": 1}


def test_changing_top_p_adds_no_recompile():
    """A Python top-p that changes becomes a graph input (1 - p computed from a tensor): the rewrite fires
    in every graph and adds no guard: as many graphs as stock inductor."""
    graphs = {}
    for backend in ("inductor", "fusekern"):
        torch._dynamo.reset()
        fusekern.reset_match_report()
        counters.clear()
        f = torch.compile(lambda s, p: chains.hf_sample(s, 0.9, 20, p), backend=backend)
        with torch.no_grad():
            for p in (0.9, 0.8, 0.7, 0.95):
                f(torch.randn(4, 100, device=DEVICE), p)
        graphs[backend] = counters["stats"]["unique_graphs"]
    assert graphs["fusekern"] == graphs["inductor"] >= 2  # the second graph takes p as a tensor
    assert fired() == {"sample": graphs["fusekern"]}


# -- near misses of the filters: declined, with the reason ---------------------------------------------


def top_k_unsorted(logits, k=5):  # gpt-fast's mask over topk(sorted=False): the pivot is any of the k on CUDA
    v, _ = torch.topk(logits, k, sorted=False)
    logits = torch.where(logits < v[:, -1:], -float("inf"), logits)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1)


def top_p_strict(scores, top_p=0.8):  # cumsum < 1 - p: keeps a token whose cumsum equals 1 - p
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) < (1 - top_p)
    remove[..., -1:] = 0
    scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return torch.multinomial(torch.softmax(scores, dim=-1), 1)


def top_p_descending(logits, top_p=0.8):  # the classic descending form: shift the mask right by one
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    remove = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = 0
    logits = logits.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1)


def top_p_before_top_k(scores):
    scores = chains.hf_top_k_warper(chains.hf_top_p_warper(scores, 0.8), 5)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1)


def top_p_before_min_p_before_top_k(scores):
    scores = chains.hf_top_k_warper(chains.hf_min_p_warper(chains.hf_top_p_warper(scores, 0.8), 0.1), 5)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1)


def min_p_of_other_probs(logits):  # the probabilities of the logits, the mask on logits / T
    scores = logits / 0.7
    probs = torch.softmax(logits, dim=-1)
    scores = scores.masked_fill(probs < 0.1 * probs.amax(dim=-1, keepdim=True), -float("inf"))
    return torch.multinomial(torch.softmax(scores, dim=-1), 1)


def top_p_keeps_two(scores):  # min_tokens_to_keep = 2
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 0.2
    remove[..., -2:] = 0
    scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return torch.multinomial(torch.softmax(scores, dim=-1), 1)


def top_p_returns_cumsum(scores):
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= 0.2
    remove[..., -1:] = 0
    scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return torch.multinomial(torch.softmax(scores, dim=-1), 1), cumulative


def min_p_tensor_keep_step(scores):  # the keep step is a no-op only for min_p <= 1: not provable here
    return chains.hf_sample(scores, None, None, None, per_row(scores, 0.1)[:, None])


def clamped_noise(logits):  # a clamp of log(u) other than exponential_'s is another distribution
    probs = torch.softmax(logits, dim=-1)
    u = torch.rand_like(probs)
    return torch.argmax(probs / -torch.where(u >= 0.5, -100.0, torch.log(u)), dim=-1)


def softmax_without_keepdim(logits):  # e / e.sum(-1) broadcasts along the last dim (square logits run)
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    probs = e / e.sum(-1)
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


def temperatures_broadcast(logits):  # one row of logits at several temperatures: [1, V] / [B, 1]
    t = torch.linspace(0.5, 2.0, logits.shape[0], device=logits.device, dtype=logits.dtype)[:, None]
    return torch.multinomial(torch.softmax(logits[:1] / t, dim=-1), 1)


@pytest.mark.parametrize("fn,reason", [
    (clamped_noise, "not exponential_'s clamp"),
    (softmax_without_keepdim, "no keepdim"),
    (temperatures_broadcast, "broadcasts the logits"),
])
def test_probed_near_misses_stay_as_written(fn, reason):
    """Forms a review probe found the rewrite firing on with another result (a clamp of the noise, a
    'softmax' whose sum broadcasts) or crashing the compile (temperatures broadcasting one row)."""
    f = compiled(fn)
    logits = torch.randn(8, 8, device=DEVICE)
    with torch.no_grad():
        out = f(logits)
    assert out.shape == fn(logits).shape
    assert fired() == {}
    reasons = [r.reason for g in fusekern.match_report().graphs for r in g.rejected if r.pattern == "sample"]
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("fn,reason", [
    (top_k_unsorted, "topk(sorted=False)"),
    (top_p_strict, "cumsum < 1 - p"),
    (top_p_descending, "sorts descending"),
    (top_p_before_top_k, "applied as top-p -> top-k"),
    (top_p_before_min_p_before_top_k, "applied as top-p -> min-p -> top-k"),
    (min_p_of_other_probs, "another tensor than the one masked"),
    (top_p_keeps_two, "min_tokens_to_keep > 1"),
    (top_p_returns_cumsum, "also used by"),
    (min_p_tensor_keep_step, "constant min_p <= 1"),
])
def test_filter_near_misses_stay_as_written(fn, reason):
    f = compiled(fn)
    with torch.no_grad():
        f(torch.randn(4, 64, device=DEVICE))
    report = fusekern.match_report()
    assert fired() == {}
    reasons = [r.reason for g in report.graphs for r in g.rejected if r.pattern == "sample"]
    assert any(reason in r for r in reasons), reasons
