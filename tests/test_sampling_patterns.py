"""Sampling chains written as users write them: the rewrite fires, and the compiled graph samples
from the same distribution as the original (chi-square against the exact distribution).

On CPU the op runs its PyTorch implementation; the Triton kernel is covered by test_sampler_kernel.py
(interpreter) and by the GPU runs of both files.
"""
import pytest
import torch

import fusekern
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
    assert fired() == {"sample_top_k": 1}
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
    assert fired() == {"sample_top_k": 1}
    assert out.shape == (1,) and out.dtype == torch.int32
    x = (logits[0, -1].float() / 0.8).to(torch.bfloat16)
    assert x[out.long()] >= x.topk(5).values[-1]


def test_manual_seed_reproduces_a_run():
    logits = torch.zeros(64, 100, device=DEVICE)  # flat: every draw differs by seed
    f = compiled(lambda x: gpt_fast(x, 1.0, 100))
    with torch.no_grad():
        torch.manual_seed(3)
        a = f(logits)
        torch.manual_seed(3)
        b = f(logits)
        c = f(logits)
    assert fired() == {"sample_top_k": 1}
    assert torch.equal(a, b) and not torch.equal(b, c)


def test_nan_and_inf_rows_give_token_0_like_the_original():
    logits = torch.randn(3, 50, device=DEVICE)
    logits[0, 7] = float("nan")
    logits[1, 9] = float("inf")
    f = compiled(lambda x: gpt_fast(x, 1.0, 10))
    with torch.no_grad():
        torch.manual_seed(0)
        want = gpt_fast(logits, 1.0, 10)
        got = f(logits)
    assert fired() == {"sample_top_k": 1}
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
    assert fired() == {"sample_top_k": graphs["fusekern"]}  # every compiled graph, including the dynamic ones


def test_dynamic_batch_one_compile():
    f = compiled(lambda x: gpt_fast(x, 0.9, 8), dynamic=True)
    counters.clear()
    with torch.no_grad():
        for B in (3, 17, 40):
            out = f(torch.randn(B, 300, device=DEVICE, dtype=torch.bfloat16))
            assert out.shape == (B, 1)
    assert counters["stats"]["unique_graphs"] == 1
    assert fired() == {"sample_top_k": 1}


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
    reasons = [r.reason for g in report.graphs for r in g.rejected if r.pattern == "sample_top_k"]
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
    reasons = [r.reason for g in report.graphs for r in g.rejected if r.pattern == "sample_top_k"]
    assert any(reason in r for r in reasons), reasons


def test_disable_keeps_the_original():
    f = compiled(gpt_fast, options={"fusekern.disable": ["sampling"]})
    with torch.no_grad():
        f(torch.randn(2, 100, device=DEVICE))
    assert fired() == {}
