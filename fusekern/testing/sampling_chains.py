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
