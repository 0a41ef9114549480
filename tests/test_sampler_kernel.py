"""The fused top-k sampler against its float64 reference, exactly (injected noise) and statistically.

On CPU the Triton kernels run in the interpreter (conftest); the same tests run compiled on a GPU.
"""
import math

import pytest
import torch

from fusekern.kernels import sampler as S

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def seed_tensor(value=1234):
    return torch.tensor([value], dtype=torch.int64, device=DEVICE)


def make_logits(B, V, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, V, generator=g) * scale).to(DEVICE, dtype)


def exp_noise(B, V, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.empty(B, V).exponential_(1, generator=g).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,V,block,capacity", [(3, 300, 128, None), (5, 1100, 256, None), (1, 777, 128, 16)])
@pytest.mark.parametrize("top_k", [1, 7, 50, "V+5", "per_row"])
def test_matches_reference_with_injected_noise(dtype, B, V, block, capacity, top_k):
    """capacity=16 forces most rows onto the slow path (candidate list overflow)."""
    logits = make_logits(B, V, dtype, seed=V + B)
    q = exp_noise(B, V, seed=V)
    if top_k == "V+5":
        top_k = V + 5
    elif top_k == "per_row":
        top_k = torch.tensor([1, 3, 40, V, 9][:B], dtype=torch.int32, device=DEVICE)
    temperature = torch.linspace(0.5, 1.5, B, device=DEVICE) if B > 1 else 0.8
    out = torch.full((B,), -7, dtype=torch.int64, device=DEVICE)  # poisoned
    S.sample_top_k_triton(logits, temperature, top_k, seed_tensor(), noise=q, out=out, block=block, capacity=capacity)
    ref = S.sample_top_k_reference(logits, temperature, top_k, q)
    assert out.cpu().tolist() == ref.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_1_is_argmax(dtype):
    B, V = 4, 701
    logits = make_logits(B, V, dtype, seed=2)
    logits[torch.arange(B), torch.tensor([5, 700, 370, 0])] = 100.0  # a unique maximum per row
    out = S.sample_top_k_triton(logits, 0.7, 1, seed_tensor(), block=256)
    assert out.cpu().tolist() == [5, 700, 370, 0]


def test_ties_at_the_pivot_are_kept():
    # Top-2 of [5, 4, 4, 4, 1...]: the pivot is 4 and all three 4s stay (torch.where(x < pivot) keeps ties).
    V = 64
    logits = torch.full((1, V), -20.0)
    logits[0, :4] = torch.tensor([5.0, 4.0, 4.0, 4.0])
    logits = logits.to(DEVICE, torch.bfloat16).expand(128, V).contiguous()
    q = exp_noise(128, V, seed=5)
    out = S.sample_top_k_triton(logits, 1.0, 2, seed_tensor(), noise=q, block=32)
    assert set(out.cpu().tolist()) == {0, 1, 2, 3}
    assert out.cpu().tolist() == S.sample_top_k_reference(logits, 1.0, 2, q).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_tokens_are_never_sampled(dtype):
    B, V, k = 16, 120, 5
    logits = make_logits(1, V, dtype, seed=9, scale=0.5).expand(B, V).contiguous()  # flat: masks matter
    out = S.sample_top_k_triton(logits, 1.0, k, seed_tensor(7), block=128).cpu()
    x = logits[0].float().cpu()
    allowed = set(torch.nonzero(x >= x.topk(k).values[-1]).flatten().tolist())
    assert set(out.tolist()) <= allowed
    assert len(set(out.tolist())) > 1  # it does sample, not just argmax


def test_frequencies_match_the_distribution():
    """Chi-square goodness of fit against softmax over the kept set (fixed seeds: deterministic).

    12288 draws on a GPU; 300 under the CPU interpreter (about 40 ms per program there), which still
    catches a wrong distribution but not a subtle bias: the GPU run is the strong one.
    """
    V, k, T = 12, 6, 0.7
    B, calls = (4096, 3) if DEVICE == "cuda" else (300, 1)
    base = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.45, 0.1, -0.3, -1.0, -2.0, 0.0])
    logits = base.to(DEVICE).expand(B, V).contiguous()
    counts = torch.zeros(V)
    for s in range(calls):
        out = S.sample_top_k_triton(logits, T, k, seed_tensor(100 + s), block=16)
        counts += torch.bincount(out.cpu(), minlength=V).float()
    x = (base / T).double()
    kept = x >= x.topk(k).values[-1]
    p = torch.softmax(torch.where(kept, x, float("-inf")), 0)
    assert counts[~kept].sum() == 0
    expected = p[kept] * counts.sum()
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 22.46, chi2  # 99.9% quantile of chi-square with 5 degrees of freedom


def test_both_slot_reservations_sample_the_same(monkeypatch):
    logits = make_logits(40, 700, torch.bfloat16, seed=12, scale=0.5)
    a = S.sample_top_k_triton(logits, 0.9, 25, seed_tensor(4), block=128)  # B = 40: one atomic per candidate
    monkeypatch.setattr(S, "block_slots", lambda B: True)
    b = S.sample_top_k_triton(logits, 0.9, 25, seed_tensor(4), block=128)
    assert torch.equal(a, b)


def test_slow_path_samples_what_the_fast_path_samples():
    """Both paths draw the same Philox uniform per (row, token): the same seed gives the same tokens."""
    logits = make_logits(8, 600, torch.bfloat16, seed=6, scale=0.5)
    fast = S.sample_top_k_triton(logits, 0.9, 30, seed_tensor(11), block=256)
    slow = S.sample_top_k_triton(logits, 0.9, 30, seed_tensor(11), block=256, capacity=8)
    assert torch.equal(fast, slow)


def test_seed_reproduces_and_changes_the_draws():
    logits = make_logits(8, 200, torch.bfloat16, seed=4, scale=0.3)
    a = S.sample_top_k_triton(logits, 1.0, 60, seed_tensor(1), block=128)
    b = S.sample_top_k_triton(logits, 1.0, 60, seed_tensor(1), block=128)
    c = S.sample_top_k_triton(logits, 1.0, 60, seed_tensor(2), block=128)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_special_values():
    V = 40
    inf = float("inf")
    logits = torch.randn(5, V)
    logits[0] = -inf
    logits[0, 17] = 1.0  # one finite logit: always that token
    logits[1] = -inf  # all -inf: the original's all-NaN softmax gives argmax 0
    logits[2, 9] = inf
    logits[2, 30] = inf  # +inf: the original's softmax is all NaN (inf - inf), its argmax token 0
    logits[3, 11] = float("nan")  # NaN anywhere: token 0, as the original
    logits = logits.to(DEVICE, torch.bfloat16)
    q = exp_noise(5, V, seed=3)
    out = S.sample_top_k_triton(logits, 1.0, 50, seed_tensor(), noise=q, block=16).cpu().tolist()
    assert out[:4] == [17, 0, 0, 0]
    assert 0 <= out[4] < V
    eager = sample_eager_gpt_fast(logits, 1.0, 50, q)
    assert out[:4] == eager[:4].tolist()


def sample_eager_gpt_fast(logits, temperature, top_k, q):
    """The original chain with given noise, in the logits' dtype (what a user's graph computes)."""
    logits = logits / max(temperature, 1e-5)
    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
    pivot = v.select(-1, -1).unsqueeze(-1)
    logits = torch.where(logits < pivot, -float("Inf"), logits)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return torch.argmax(probs / q.to(probs.dtype), dim=-1).cpu()


def test_bad_input_is_a_clear_error():
    logits = make_logits(2, 10, torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        S.sample_top_k_triton(logits[0], 1.0, 5, seed_tensor())
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        S.sample_top_k_triton(logits.to(torch.int32), 1.0, 5, seed_tensor())
    with pytest.raises(ValueError, match="seed"):
        S.sample_top_k_triton(logits, 1.0, 5, torch.tensor([1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="top_k must be a number or hold"):
        S.sample_top_k_triton(logits, 1.0, torch.ones(3, dtype=torch.int32, device=DEVICE), seed_tensor())
    with pytest.raises(ValueError, match="empty vocabulary"):
        S.sample_top_k_triton(logits[:, :0], 1.0, 5, seed_tensor())
    assert S.sample_top_k_triton(logits[:0], 1.0, 5, seed_tensor()).shape == (0,)


def test_strided_rows():
    logits = make_logits(3, 2 * 333, torch.float16, seed=8)[:, ::2]  # column stride 2
    q = exp_noise(3, 333, seed=8)
    out = S.sample_top_k_triton(logits, 1.3, 20, seed_tensor(), noise=q, block=64)
    assert out.cpu().tolist() == S.sample_top_k_reference(logits, 1.3, 20, q).tolist()


def test_size_heuristics():
    assert S.sample_size(128256) == 4096 and S.sample_size(300) == 512
    assert S.candidate_capacity(128256, 50) == 4096  # 2 x 50 x 31.3 expected candidates, a power of 2
    assert S.candidate_capacity(300, 5) == 512  # never more than the vocabulary needs


def test_chunks_heuristic():
    assert S.chunks_per_row(1, 128256, 132, 2048) == 63  # one row spreads over many SMs
    assert S.chunks_per_row(256, 128256, 132, 2048) == 2
    assert S.chunks_per_row(1024, 128256, 132, 2048) == 1
    assert math.isclose(S.chunks_per_row(1, 100, 132, 2048), 1)
