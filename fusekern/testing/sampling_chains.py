"""Sampling chains written the way inference stacks write them, for tests, benchmarks and the demo.

They are the graphs fusekern's sampling rewrite is meant to find; keeping one copy means the tests and
the benchmarks measure the same code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gpt_fast(logits: torch.Tensor, temperature: float = 0.8, top_k: int = 50) -> torch.Tensor:
    """gpt-fast's ``logits_to_probs`` + ``multinomial_sample_one_no_sync``: an int32 token per row."""
    return gpt_fast_tensor_temperature(logits, max(temperature, 1e-5), top_k)


def gpt_fast_tensor_temperature(logits: torch.Tensor, temperature, top_k: int = 50) -> torch.Tensor:
    """The gpt-fast chain dividing by ``temperature`` as given: a number, one value, or [B, 1] per row."""
    logits = logits / temperature
    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
    pivot = v.select(-1, -1).unsqueeze(-1)
    logits = torch.where(logits < pivot, -float("Inf"), logits)
    probs = F.softmax(logits, dim=-1)
    q = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.int)


def hf_top_k(scores: torch.Tensor, temperature: float = 0.9, top_k: int = 6) -> torch.Tensor:
    """Hugging Face's temperature and top-k logits processors, then an exponential race."""
    scores = scores / temperature
    indices_to_remove = scores < torch.topk(scores, top_k)[0][..., -1, None]
    scores = scores.masked_fill(indices_to_remove, -float("inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs / -torch.log(torch.rand_like(probs))).argmax(dim=-1)


# -- Hugging Face's logits warpers (transformers/generation/logits_process.py), in generate()'s order ----


def hf_repetition_penalty(input_ids: torch.Tensor, scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """RepetitionPenaltyLogitsProcessor: the previous tokens' scores divided (> 0) or multiplied (< 0)."""
    score = torch.gather(scores, 1, input_ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return scores.scatter(1, input_ids, score)


def hf_top_k_warper(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    top_k = min(top_k, scores.size(-1))
    indices_to_remove = scores < torch.topk(scores, top_k)[0][..., -1, None]
    return scores.masked_fill(indices_to_remove, -float("inf"))


def hf_top_p_warper(scores: torch.Tensor, top_p) -> torch.Tensor:
    """TopPLogitsWarper with min_tokens_to_keep = 1; ``top_p`` a number or a tensor (one value, [B, 1])."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_indices_to_remove = cumulative_probs <= (1 - top_p)
    sorted_indices_to_remove[..., -1:] = 0
    indices_to_remove = sorted_indices_to_remove.scatter(1, sorted_indices, sorted_indices_to_remove)
    return scores.masked_fill(indices_to_remove, -float("inf"))


def hf_min_p_warper(scores: torch.Tensor, min_p, keep_step: bool = True) -> torch.Tensor:
    """MinPLogitsWarper as transformers writes it today (min_tokens_to_keep = 1: the topk/scatter step);
    ``keep_step=False``: the bare rule, as other stacks write it."""
    probs = torch.softmax(scores, dim=-1)
    top_probs = probs.amax(dim=-1, keepdim=True)
    scaled_min_p = min_p * top_probs
    tokens_to_remove = probs < scaled_min_p
    if keep_step:
        sorted_indices = torch.topk(probs, min(1, probs.shape[-1]), dim=-1).indices
        tokens_to_remove.scatter_(-1, sorted_indices, False)
    return scores.masked_fill(tokens_to_remove, -float("inf"))


def hf_warpers(scores: torch.Tensor, temperature=None, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """The warpers generate() builds for these settings (None: not used), applied in its order."""
    if temperature is not None:
        scores = scores / temperature
    if top_k is not None:
        scores = hf_top_k_warper(scores, top_k)
    if top_p is not None:
        scores = hf_top_p_warper(scores, top_p)
    if min_p is not None:
        scores = hf_min_p_warper(scores, min_p)
    return scores


def hf_sample(scores: torch.Tensor, temperature=None, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """Hugging Face's sampling step: the warpers, softmax, ``torch.multinomial``; a token per row."""
    probs = torch.softmax(hf_warpers(scores, temperature, top_k, top_p, min_p), dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(1)


# -- vLLM's v1 sampler (vllm/v1/sample/sampler.py, ops/topk_topp_sampler.py), per-row parameters ---------


def vllm_apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """``apply_top_k_top_p``'s sort path: k int [B], p float [B]. (With p None vLLM takes a topk path whose
    k.max() is data-dependent; not written here.) May update ``logits`` in place, as vLLM does."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        top_k_mask = logits_sort.size(1) - k.to(torch.long)
        top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
        top_k_mask = logits_sort < top_k_mask
        logits_sort.masked_fill_(top_k_mask, -float("inf"))
    if p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
        top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
        top_p_mask[:, -1] = False  # at least one token
        logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def vllm_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``MinPLogitsProcessor.apply``: min_p float [B]; masks ``logits`` in place (a boolean index_put)."""
    probability_values = torch.nn.functional.softmax(logits, dim=-1)
    max_probabilities = torch.amax(probability_values, dim=-1, keepdim=True)
    adjusted_min_p = max_probabilities.mul_(min_p.unsqueeze(1))
    invalid_token_mask = probability_values < adjusted_min_p
    logits[invalid_token_mask] = -float("inf")
    return logits


def vllm_sample(logits: torch.Tensor, temperature: torch.Tensor, k: torch.Tensor | None,
                p: torch.Tensor | None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature (in place, as vLLM's ``apply_temperature``), min-p (an argmax-invariant logits processor,
    before top-k / top-p), top-k / top-p, then ``random_sample``'s exponential race; int64 [B]. Mutates
    ``logits``."""
    logits = logits.div_(temperature.unsqueeze(dim=1))
    if min_p is not None:
        logits = vllm_min_p(logits, min_p)
    logits = vllm_apply_top_k_top_p(logits, k, p)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs).exponential_()
    return probs.div_(q).argmax(dim=-1).view(-1)
