"""The fused top-k sampler against its float64 reference, exactly (injected noise) and statistically.

On CPU the Triton kernels run in the interpreter (conftest); the same tests run compiled on a GPU.
"""

import os

import pytest
import torch
import triton

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


FILTERS = {
    "top-k": dict(top_k=7),
    "top-k ties at V": dict(top_k="V+5"),
    "top-p": dict(top_p=0.6),
    "min-p": dict(min_p=0.2),
    "top-k + top-p + min-p": dict(top_k=40, top_p=0.8, min_p=0.05),
    "temperature only": dict(),
    "per row": "per_row",
    # vLLM's order: min-p before top-p, whose softmax is then over what min-p (and top-k) keep
    "min-p, then top-p": dict(top_p=0.8, min_p=0.1, min_p_first=True),
    "min-p, then top-k + top-p": dict(top_k=40, top_p=0.8, min_p=0.5, min_p_first=True),
    "per row, min-p first": "per_row_first",
}


def filters_for(name, B, V):
    f = FILTERS[name]
    if f in ("per_row", "per_row_first"):
        return dict(top_k=torch.tensor([1, 3, 40, V, 9][:B], device=DEVICE),
                    top_p=torch.tensor([0.3, 1.0, 0.8, 0.95, 0.5][:B], device=DEVICE),
                    **(dict(min_p=torch.tensor([0.0, 0.2, 0.05, 0.0, 0.01][:B], device=DEVICE)) if f == "per_row" else
                       # min-p cutting inside top-k / top-p's sets, where the order matters
                       dict(min_p=torch.tensor([0.0, 0.2, 0.5, 0.3, 0.6][:B], device=DEVICE), min_p_first=True)))
    return {k: (V + 5 if v == "V+5" else v) for k, v in f.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,V,block,span,slots", [(3, 300, 128, None, None), (5, 1100, 256, None, None),
                                                  (2, 1300, 64, 448, None), (4, 777, 64, None, 8)])
@pytest.mark.parametrize("name", list(FILTERS))
def test_matches_reference_with_injected_noise(dtype, B, V, block, span, slots, name):
    """span 448: a chunk of 7 steps (the first pass carries group maxima and the softmax sum across steps,
    the last chunk is cut short); slots=8 sends most rows to the slow path (chunk overflow, top-k beyond
    the slots)."""
    logits = make_logits(B, V, dtype, seed=V + B, scale=0.7)
    q = exp_noise(B, V, seed=V)
    filters = filters_for(name, B, V)
    temperature = torch.linspace(0.5, 1.5, B, device=DEVICE) if B > 1 else 0.8
    out = torch.full((B,), -7, dtype=torch.int64, device=DEVICE)  # poisoned
    S.sample_triton(logits, temperature, seed=seed_tensor(), noise=q, out=out, block=block, span=span, slots=slots,
                    **filters)
    assert out.cpu().tolist() == S.sample_reference(logits, temperature, q=q, **filters).tolist()


@pytest.mark.parametrize("variant", [dict(block=64), dict(block=32, span=256), dict(slots=8), "binary_search_top_p",
                                     dict(pivot_fan=1), dict(pivot_fan=4), dict(pivot_fan=32)], ids=str)
def test_every_path_draws_the_same_tokens(variant, monkeypatch):
    """Other chunk sizes, fast or slow path, top-p by a sort or by binary search, the top-k pivot searched
    by halves, 4 points a round (counts packed in one int64) or 32 (a 2-D count): the same Philox uniform per
    (row, token), so the same tokens."""
    logits = make_logits(6, 900, torch.bfloat16, seed=21, scale=0.7)
    params = dict(temperature=0.9, top_k=30, top_p=0.8, min_p=0.02, seed=seed_tensor(11))
    base = S.sample_triton(logits, **params, block=128)
    if variant == "binary_search_top_p":
        monkeypatch.setattr(S, "kept_block", lambda slots: 4)  # the kept set never fits the small block
        variant = {}
    assert torch.equal(base, S.sample_triton(logits, **params, **{"block": 128, **variant}))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["top-k", "top-p", "top-k + top-p + min-p", "per row"])
@pytest.mark.parametrize("pivot_fan", [1, 2, 4, 8])  # 2 and 4: counts packed in an int64; 8: a 2-D count
def test_tied_keys_at_the_cuts_match_reference(dtype, name, pivot_fan):
    """Step 2's top-k pivot search and sort-based top-p threshold against the float64 reference, with ties:
    each row's largest 64 logits appear twice, so tied keys straddle the top-k and top-p boundaries."""
    B, V = 5, 1100
    logits = make_logits(B, V, dtype, seed=B + V, scale=0.7)
    top = logits.topk(64, dim=-1).indices
    logits[:, V - 64:] = logits.gather(1, top)
    q = exp_noise(B, V, seed=V)
    filters = filters_for(name, B, V)
    out = torch.full((B,), -7, dtype=torch.int64, device=DEVICE)  # poisoned
    S.sample_triton(logits, 0.9, seed=seed_tensor(), noise=q, out=out, block=256, pivot_fan=pivot_fan, **filters)
    assert out.cpu().tolist() == S.sample_reference(logits, 0.9, q=q, **filters).tolist()


def tied_logits(B, V, dtype, seed=0):
    """Logits on a coarse grid (quarters): tie groups of many tokens everywhere, top-p cuts inside them."""
    g = torch.Generator().manual_seed(seed)
    return (torch.round(torch.randn(B, V, generator=g) * 12) / 4).to(DEVICE, dtype)


@pytest.mark.parametrize("filters", [dict(top_k=50, top_p=0.9), dict(top_p=0.9), dict(top_p=0.5),
                                     dict(top_k=50, top_p=0.8, min_p=0.001)], ids=str)
def test_kept_set_is_hugging_faces_on_ties(filters, monkeypatch):
    """On rows whose top-p cut falls inside a tie group, the reference keeps as many tokens per row as
    Hugging Face's warpers, and the same ones as its code with a stable sort (whose ascending order puts a
    tie group's highest token indices last, where they stay). HF's own sort is not stable (torch.sort's
    default): which members of the group it keeps is its sort's choice, not a rule."""
    from fusekern.testing.sampling_chains import hf_warpers

    x = tied_logits(16, 3000, torch.float32, seed=3).cpu()
    args = (x, None, filters.get("top_k"), filters["top_p"], filters.get("min_p"))
    hf = hf_warpers(*args) > -float("inf")
    kept = S.kept_mask(x.double(), filters.get("top_k"), filters["top_p"], filters.get("min_p"))
    assert torch.equal(kept.sum(-1), hf.sum(-1))
    sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sort(*a, **k, stable=True))
    hf_stable = hf_warpers(*args) > -float("inf")
    assert torch.equal(kept, hf_stable), (kept != hf_stable).nonzero().tolist()
    cut_in_group = ((x >= torch.where(hf, x, float("inf")).amin(-1, keepdim=True)) & ~hf).any(-1)
    assert cut_in_group.sum() >= 4  # (the rows test the tie rule)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["sorted_block", "binary_search_top_p", "slow_path"])
@pytest.mark.parametrize("filters", [dict(top_k=50, top_p=0.9), dict(top_p=0.8)], ids=["top_k_top_p", "top_p"])
def test_top_p_cut_inside_a_tie_group_drops_hugging_faces_part(dtype, path, filters, monkeypatch):
    """Each of step 2's paths (the small sorted block, 16- and 32-bit keys; the binary search over the
    candidates; the slow path over the whole row) drops the members of the cut's tie group that Hugging
    Face drops (the lowest token indices): the noise gives exactly those tokens the largest scores, so a
    kept one would win the race."""
    B, V = 6, 1500
    logits = tied_logits(B, V, dtype, seed=7)
    x = logits.double().cpu()
    hf = S.kept_mask(x, filters.get("top_k"), filters["top_p"], None)
    dropped_ties = (x >= torch.where(hf, x, float("inf")).amin(-1, keepdim=True)) & ~hf
    assert dropped_ties.any(-1).sum() >= 3
    q = exp_noise(B, V, seed=5)
    q[dropped_ties.to(q.device)] = 1e-30  # a score of x + 69: far above any other
    kw = {}
    if path == "binary_search_top_p":
        monkeypatch.setattr(S, "kept_block", lambda slots: 4)  # the kept set never fits the small block
    elif path == "slow_path":
        kw = dict(slots=8)  # every chunk overflows its slots
    out = torch.full((B,), -7, dtype=torch.int64, device=DEVICE)  # poisoned
    S.sample_triton(logits, 1.0, seed=seed_tensor(), noise=q, out=out, block=128, **filters, **kw)
    want = S.sample_reference(logits, 1.0, q=q, **filters)
    assert out.cpu().tolist() == want.tolist()
    # the setup's point: keeping the whole tie group would draw one of HF's dropped members in those rows
    whole = (torch.where(hf | dropped_ties, x, float("-inf")) - q.double().cpu().log()).argmax(-1)
    rows = dropped_ties.any(-1)
    assert dropped_ties.gather(1, whole[:, None])[rows].all()


@pytest.mark.parametrize("name", ["min-p, then top-p", "min-p, then top-k + top-p", "per row, min-p first"])
def test_min_p_first_keeps_another_set(name):
    """The min-p-first cases above are not Hugging Face's order in disguise: on their logits the order
    changes the kept set (top-p's mass is then over fewer tokens, so it keeps fewer)."""
    B, V = 5, 1100
    x = (make_logits(B, V, torch.float32, seed=B + V, scale=0.7).cpu() / 0.9).double()
    f = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in filters_for(name, B, V).items()}
    first = S.kept_mask(x, f.get("top_k"), f["top_p"], f["min_p"], min_p_first=True)
    hf = S.kept_mask(x, f.get("top_k"), f["top_p"], f["min_p"])
    assert not torch.equal(first, hf)
    assert (first <= hf).all()  # never more: top-p over a subset's mass


@pytest.mark.parametrize("dtype", DTYPES)
def test_min_p_first_on_peaked_rows_with_and_without_min_p(dtype):
    """Peaked logits (the kept sets lie above the chunks' thresholds: the fast path) with top-p only and a
    per-row min_p that is 0 in some rows (vLLM passes 0 for requests without min-p: those rows are top-p
    only, and must not be sent down the slow path by a min-p that does nothing)."""
    B, V = 6, 1100
    logits = make_logits(B, V, dtype, seed=17, scale=3.0)
    q = exp_noise(B, V, seed=5)
    filters = dict(top_p=torch.tensor([0.9, 0.8, 0.95, 0.7, 0.9, 0.5], device=DEVICE),
                   min_p=torch.tensor([0.0, 0.1, 0.0, 0.3, 0.05, 0.0], device=DEVICE), min_p_first=True)
    out = torch.full((B,), -7, dtype=torch.int64, device=DEVICE)  # poisoned
    S.sample_triton(logits, 0.8, seed=seed_tensor(), noise=q, out=out, block=128, **filters)
    assert out.cpu().tolist() == S.sample_reference(logits, 0.8, q=q, **filters).tolist()


def test_min_p_first_reference_is_vllms_chain():
    """kept_mask's min-p-first order against vLLM's own steps in float64: the min-p mask on the softmax,
    then top-k and top-p on the sorted logits (apply_top_k_top_p)."""
    B, V = 6, 500
    x = (make_logits(B, V, torch.float32, seed=9, scale=1.0).cpu()).double()
    k = torch.tensor([3, 50, 500, 20, 7, 100])
    p = torch.tensor([0.9, 0.5, 0.8, 0.99, 0.3, 0.7], dtype=torch.float64)
    mp = torch.tensor([0.1, 0.05, 0.2, 0.0, 0.3, 0.02], dtype=torch.float64)
    probs = x.softmax(-1)
    y = x.masked_fill(probs < probs.amax(-1, keepdim=True) * mp[:, None], float("-inf"))
    s, idx = y.sort(-1)
    s = s.masked_fill(s < s.gather(1, (V - k)[:, None]), float("-inf"))
    drop = s.softmax(-1).cumsum(-1) <= 1 - p[:, None]
    drop[:, -1] = False
    s = s.masked_fill(drop, float("-inf"))
    want = s.scatter(-1, idx, s) > float("-inf")
    assert torch.equal(S.kept_mask(x, k, p, mp, min_p_first=True), want)


def test_top_p_zero_keeps_the_most_likely_token():
    """Hugging Face keeps one token (min_tokens_to_keep = 1) even for p = 0: the top one."""
    logits = make_logits(4, 500, torch.float32, seed=3)
    out = S.sample_triton(logits, 1.0, top_p=0.0, seed=seed_tensor(), block=128)
    assert out.cpu().tolist() == logits.argmax(-1).cpu().tolist()


@pytest.mark.parametrize("min_p_first", [False, True])
def test_nan_top_p_or_min_p_turns_its_filter_off(min_p_first):
    """A NaN top-p or min-p removes no token (Hugging Face's comparisons with NaN are false), on every path:
    the kernel once dropped every token of a NaN min-p row (token 0 every draw), and the CPU path kept one
    token for a NaN top-p."""
    B, V = 3, 300
    logits = make_logits(B, V, torch.float32, seed=8, scale=0.5)
    nan = float("nan")
    filters = dict(top_p=torch.tensor([nan, 0.5, nan], device=DEVICE),
                   min_p=torch.tensor([0.2, nan, nan], device=DEVICE), min_p_first=min_p_first)
    off = dict(top_p=torch.tensor([1.0, 0.5, 1.0], device=DEVICE),
               min_p=torch.tensor([0.2, 0.0, 0.0], device=DEVICE), min_p_first=min_p_first)
    cpu, cpu_off = ({k: v.cpu() if torch.is_tensor(v) else v for k, v in f.items()} for f in (filters, off))
    kept = S.kept_mask((logits.double() / 0.9).cpu(), None, **cpu)
    assert kept[2].all() and kept[0].sum() < V and kept[1].sum() < V  # row 2: nothing filtered
    for seed in range(4):
        q = exp_noise(B, V, seed=seed)
        out = torch.full((B,), -1, dtype=torch.int64, device=DEVICE)
        S.sample_triton(logits, 0.9, seed=seed_tensor(), noise=q, out=out, block=128, **filters)
        assert out.cpu().tolist() == S.sample_reference(logits, 0.9, q=q, **off).cpu().tolist()
        assert out.cpu().tolist() == S.sample_reference(logits, 0.9, q=q, **filters).cpu().tolist()
    for seed in range(4):
        got = S.sample_torch(logits.cpu(), 0.9, seed=torch.tensor([seed]), **cpu)
        assert got.tolist() == S.sample_torch(logits.cpu(), 0.9, seed=torch.tensor([seed]), **cpu_off).tolist()


def test_cpu_path_matches_reference():
    """sample_torch (the op's CPU implementation) against the float64 reference, same generator draws."""
    B, V = 5, 400
    logits = make_logits(B, V, torch.bfloat16, seed=5, scale=0.7).cpu()
    for filters in (dict(top_k=20, top_p=0.7, min_p=0.05), dict(top_p=0.5), dict(),
                    dict(top_k=20, top_p=0.7, min_p=0.1, min_p_first=True)):
        out = S.sample_torch(logits, 0.8, seed=torch.tensor([77]), **filters)
        g = torch.Generator().manual_seed(77)
        q = torch.empty(B, V).exponential_(1, generator=g)
        assert out.tolist() == S.sample_reference(logits, 0.8, q=q, **filters).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_1_is_argmax(dtype):
    B, V = 4, 701
    logits = make_logits(B, V, dtype, seed=2)
    logits[torch.arange(B), torch.tensor([5, 700, 370, 0])] = 100.0  # a unique maximum per row
    out = S.sample_triton(logits, 0.7, 1, seed=seed_tensor(), block=256)
    assert out.cpu().tolist() == [5, 700, 370, 0]


def test_ties_at_the_pivot_are_kept():
    # Top-2 of [5, 4, 4, 4, 1...]: the pivot is 4 and all three 4s stay (torch.where(x < pivot) keeps ties).
    V = 64
    logits = torch.full((1, V), -20.0)
    logits[0, :4] = torch.tensor([5.0, 4.0, 4.0, 4.0])
    logits = logits.to(DEVICE, torch.bfloat16).expand(128, V).contiguous()
    q = exp_noise(128, V, seed=5)
    out = S.sample_triton(logits, 1.0, 2, seed=seed_tensor(), noise=q, block=32)
    assert set(out.cpu().tolist()) == {0, 1, 2, 3}
    assert out.cpu().tolist() == S.sample_reference(logits, 1.0, 2, q=q).tolist()


WRITE_PATH_LAYOUTS = ["one position", "tied at one position", "constant row", "spread"]


def write_path_logits(layout, dtype, seed, B=2, V=4096, block=64):
    """Rows for step 1's write paths: "one position": the largest tokens all at position 3 of every step;
    "tied at one position": the same, all equal; "constant row": every logit equal; "spread": random."""
    logits = make_logits(B, V, dtype, seed=seed, scale=0.5)
    if layout == "one position":
        logits[:, 3::block] = torch.linspace(5.0, 9.0, V // block, device=DEVICE).to(dtype)
    elif layout == "tied at one position":
        logits[:, 3::block] = 9.0
    elif layout == "constant row":
        logits[:] = 1.0
    return logits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", WRITE_PATH_LAYOUTS)
def test_candidate_write_paths(dtype, layout):
    """Step 1 re-reads only the step positions whose running max reaches the chunk's threshold. "one
    position": the largest tokens all sit at one position of every step (the gathered count overflows the
    slots: a search among the gathered tokens); "tied at one position": the same with equal values (no
    threshold fits the slots: the row takes step 2's slow path); "constant row": every position is
    flagged (more than the slots: the search over the whole chunk); "spread": the usual case."""
    B, V, block = 2, 4096, 64
    logits = write_path_logits(layout, dtype, seed=31, B=B, V=V, block=block)
    q = exp_noise(B, V, seed=32)
    out = torch.full((B,), -7, dtype=torch.int64, device=DEVICE)
    S.sample_triton(logits, 1.0, 5, 0.9, seed=seed_tensor(), noise=q, out=out, block=block, span=V)
    assert out.cpu().tolist() == S.sample_reference(logits, 1.0, 5, 0.9, q=q).tolist()


def raw_keys(logits):
    """The kernel's order-preserving integer key of each raw logit (+0 for -0), as int64."""
    if logits.dtype == torch.float32:
        b = logits.view(torch.int32).long()
        return b ^ ((b >> 31) & 0x7FFFFFFF)
    b = logits.view(torch.int16).long()
    return torch.where(b >= 0, b + 32768, torch.where(b == -32768, 32768, -1 - b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", WRITE_PATH_LAYOUTS)
def test_step1_writes_every_token_at_or_above_its_threshold(dtype, layout):
    """Step 1 alone, chunk by chunk: the count is the number of tokens with key >= the threshold, at least
    k; when it fits the slots they hold exactly those tokens (key and index), otherwise distinct ones of
    them (the row then takes step 2's slow path)."""
    B, V, block, k = 2, 4096, 64, 5
    # 32 tokens of a chunk at one position: more than its 32 slots with the others; 64 ties: no threshold fits
    span = {"one position": 2048, "tied at one position": 4096}.get(layout, 1024)
    logits = write_path_logits(layout, dtype, seed=41, B=B, V=V, block=block)
    thr, cnt, cand = S.sample_triton(logits, 1.0, k, seed=seed_tensor(), block=block, span=span, step1_only=True)
    slots = cand.shape[-1]
    keys = raw_keys(logits.cpu())
    thr, cnt, cand = thr.cpu(), cnt.cpu(), cand.cpu()
    for b in range(B):
        for c in range(V // span):
            chunk = keys[b, c * span:(c + 1) * span]
            n = int(cnt[b, c])
            at_or_above = set((torch.nonzero(chunk >= int(thr[b, c])).flatten() + c * span).tolist())
            assert n == len(at_or_above) >= k, (b, c)
            got = cand[b, c, :min(n, slots)]
            tokens = (got & 0xFFFFFFFF).tolist()
            assert len(set(tokens)) == len(tokens) and set(tokens) <= at_or_above
            assert (got >> 32).tolist() == keys[b, tokens].tolist()
            if n <= slots:
                assert set(tokens) == at_or_above
    if layout in ("tied at one position", "constant row"):
        assert (cnt > slots).any()  # the overflow paths did run
    else:
        assert (cnt <= slots).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_tokens_are_never_sampled(dtype):
    B, V, k, p = 16, 120, 8, 0.7
    logits = make_logits(1, V, dtype, seed=9, scale=0.5).expand(B, V).contiguous()  # flat: masks matter
    out = S.sample_triton(logits, 1.0, k, p, seed=seed_tensor(7), block=128).cpu()
    x = logits[:1].double().cpu()
    allowed = set(torch.nonzero(S.kept_mask(x, k, p, None)[0]).flatten().tolist())
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
        out = S.sample_triton(logits, T, k, 0.9, seed=seed_tensor(100 + s), block=16)
        counts += torch.bincount(out.cpu(), minlength=V).float()
    x = (base / T).double()
    kept = S.kept_mask(x[None], k, 0.9, None)[0]
    p = torch.softmax(torch.where(kept, x, float("-inf")), 0)
    assert counts[~kept].sum() == 0
    expected = p[kept] * counts.sum()
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 22.46, chi2  # 99.9% quantile of chi-square with 5 degrees of freedom


def test_seed_reproduces_and_changes_the_draws():
    logits = make_logits(8, 200, torch.bfloat16, seed=4, scale=0.3)
    a = S.sample_triton(logits, 1.0, 60, seed=seed_tensor(1), block=128)
    b = S.sample_triton(logits, 1.0, 60, seed=seed_tensor(1), block=128)
    c = S.sample_triton(logits, 1.0, 60, seed=seed_tensor(2), block=128)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("filters", [dict(top_k=60), dict()], ids=["filtered", "temperature only"])
def test_seed_none_draws_from_torch_generator(filters):
    """seed=None: the launcher draws the seed from torch's generator (beside step 1 only under CUDA-graph
    capture: tests/test_gpu.py): manual_seed reproduces the draws, the next call draws new ones, and every
    token is one the filters keep."""
    logits = make_logits(64, 200, torch.bfloat16, seed=5, scale=0.3)
    torch.manual_seed(11)
    a = S.sample_triton(logits, 1.0, **filters, seed=None, block=128)
    b = S.sample_triton(logits, 1.0, **filters, seed=None, block=128)
    torch.manual_seed(11)
    c = S.sample_triton(logits, 1.0, **filters, seed=None, block=128)
    assert torch.equal(a, c)
    assert not torch.equal(a, b)
    kept = S.kept_mask(logits.double().cpu(), filters.get("top_k"), None, None)
    assert kept.gather(1, torch.stack([a, b]).T.cpu()).all()


def test_int32_out_holds_the_same_tokens():
    logits = make_logits(6, 300, torch.bfloat16, seed=8, scale=0.5)
    out = torch.full((6,), -1, dtype=torch.int32, device=DEVICE)
    got = S.sample_triton(logits, 0.9, 40, 0.9, seed=seed_tensor(3), block=128, out=out)
    want = S.sample_triton(logits, 0.9, 40, 0.9, seed=seed_tensor(3), block=128)
    assert got is out and got.dtype == torch.int32
    assert got.tolist() == want.tolist()


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
    out = S.sample_triton(logits, 1.0, 50, 0.9, seed=seed_tensor(), noise=q, block=16).cpu().tolist()
    assert out[:4] == [17, 0, 0, 0]
    assert 0 <= out[4] < V
    eager = sample_eager_gpt_fast(logits, 1.0, 50, q)
    assert out[:4] == eager[:4].tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_nan_gives_token_0(dtype):
    """A NaN with its sign bit set (its key lies below -inf's; step 1 moves it above every key)."""
    V = 300
    logits = make_logits(3, V, dtype, seed=12)
    bits = {torch.bfloat16: (torch.int16, -63), torch.float16: (torch.int16, -511),
            torch.float32: (torch.int32, -4194303)}[dtype]  # 0xFFC1 / 0xFE01 / 0xFFC00001: negative NaNs
    raw = logits.view(bits[0])
    raw[1, 123] = bits[1]
    assert torch.isnan(logits[1, 123]) and logits.view(bits[0])[1, 123] < 0
    q = exp_noise(3, V, seed=13)
    for filters in (dict(top_k=20, top_p=0.9), dict(top_p=0.8), dict()):
        out = S.sample_triton(logits, 0.9, seed=seed_tensor(), noise=q, block=64, **filters).cpu().tolist()
        assert out[1] == 0
        assert out == S.sample_reference(logits, 0.9, q=q, **filters).tolist()


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
        S.sample_triton(logits[0], 1.0, 5, seed=seed_tensor())
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        S.sample_triton(logits.to(torch.int32), 1.0, 5, seed=seed_tensor())
    with pytest.raises(ValueError, match="seed"):
        S.sample_triton(logits, 1.0, 5, seed=torch.tensor([1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="top_k must be a number or hold"):
        S.sample_triton(logits, 1.0, torch.ones(3, dtype=torch.int32, device=DEVICE), seed=seed_tensor())
    with pytest.raises(ValueError, match="top_p must be a number or hold"):
        S.sample_triton(logits, 1.0, 5, torch.ones(3, device=DEVICE), seed=seed_tensor())
    with pytest.raises(ValueError, match="empty vocabulary"):
        S.sample_triton(logits[:, :0], 1.0, 5, seed=seed_tensor())
    assert S.sample_triton(logits[:0], 1.0, 5, seed=seed_tensor()).shape == (0,)
    # tuning overrides: powers of two, kc <= groups <= block, span a positive multiple of block
    with pytest.raises(ValueError, match="slots must be a power of two"):
        S.sample_triton(logits, 1.0, 5, seed=seed_tensor(), slots=48)
    with pytest.raises(ValueError, match="kc <= groups <= block"):
        S.sample_triton(logits, 1.0, 5, seed=seed_tensor(), block=16, kc=32)
    with pytest.raises(ValueError, match="multiple of block"):
        S.sample_triton(logits, 1.0, 5, seed=seed_tensor(), block=16, span=24)
    with pytest.raises(ValueError, match="sub <= block"):
        S.sample_triton(logits, 1.0, 5, seed=seed_tensor(), block=16, sub=32)
    with pytest.raises(ValueError, match="step1_only needs a filter"):
        S.sample_triton(logits, 1.0, seed=seed_tensor(), step1_only=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("filters", [dict(min_p=0.2), dict(top_p=0.7), dict(min_p=0.05, top_p=0.9)], ids=str)
def test_vocabulary_smaller_than_the_keys_per_chunk(dtype, filters):
    """V < KC without top-k: every chunk's threshold is the key of -inf (all its tokens are candidates), and
    step 2 must not derive its bound from the key just below it (a NaN's, whose sign the GPU drops)."""
    B, V = 3, 40
    logits = make_logits(B, V, dtype, seed=5, scale=1.5)
    q = exp_noise(B, V, seed=6)
    out = S.sample_triton(logits, 0.9, seed=seed_tensor(), noise=q, **filters)
    assert out.cpu().tolist() == S.sample_reference(logits, 0.9, q=q, **filters).tolist()


def test_strided_rows():
    logits = make_logits(3, 2 * 333, torch.float16, seed=8)[:, ::2]  # column stride 2
    q = exp_noise(3, 333, seed=8)
    out = S.sample_triton(logits, 1.3, 20, 0.9, seed=seed_tensor(), noise=q, block=64)
    assert out.cpu().tolist() == S.sample_reference(logits, 1.3, 20, 0.9, q=q).tolist()


def test_size_heuristics():
    V = 128256
    assert S.chunk_block(1, V) == 2048 and S.chunk_block(4, 300) == 512  # never more than the vocabulary needs
    # about two CTAs per SM over the batch, 4 to 16 chunks a row, spans in whole steps
    assert triton.cdiv(V, S.chunk_span(1, V, 2048, 132)) == 16
    assert triton.cdiv(V, S.chunk_span(8, V, 2048, 132)) == 16
    assert triton.cdiv(V, S.chunk_span(32, V, 2048, 132)) == 8
    assert triton.cdiv(V, S.chunk_span(256, V, 2048, 132)) == 4
    assert triton.cdiv(V, S.chunk_span(1024, V, 2048, 132)) == 4
    assert S.chunk_span(5, 300, 128, 132) == 128
    assert S.keys_per_chunk(50, 2048) == 64 and S.keys_per_chunk(1, 2048) == 16 and S.keys_per_chunk(None, 2048) == 64
    assert S.keys_per_chunk(5000, 2048) == 256 and S.keys_per_chunk(50, 32) == 32  # never more than a step
    # KC slots only with many chunks and a scalar top-k that leaves room for ties (k_c = KC never fits KC)
    assert S.slots_for(64, 32, 50) == 64 and S.slots_for(64, 32) == 128 and S.slots_for(64, 32, 60) == 128
    assert S.slots_for(64, 4, 50) == 128
    assert S.groups_for(64, 2048) == 256 and S.groups_for(64, 128) == 128
    assert S.kept_block(64) == 64 and S.kept_block(1024) == 128 and S.kept_block(4) == 16


def test_dependent_launch_only_where_it_runs_and_helps():
    # compiled Hopper kernels only (the interpreter has no griddepcontrol), and large batches only
    assert not S.uses_pdl(256, torch.device("cpu"))
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        dev = torch.device("cuda", torch.cuda.current_device())
        hopper = torch.cuda.get_device_capability(dev)[0] >= 9
        assert S.uses_pdl(256, dev) == hopper and not S.uses_pdl(8, dev)
