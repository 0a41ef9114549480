"""The op's top-p tie rule against Hugging Face's on logits rounded from bf16 (CPU, seconds).

    python benchmarks/proto/top_p_ties.py

With logits rounded from bf16 a tie group straddles the top-p cut in most rows. HF's ascending sort + cumsum
keeps the part of the group its sort puts last; the op keeps as many of the group as HF and takes those with
the highest token indices (what a stable sort puts last; ``sampler.kept_mask``, the kernel's reference).
Prints, per setting, the rows whose cut falls inside a tie group, the rows where the op keeps another number
of tokens than HF, and the rows where it keeps another set than HF's code run with a stable sort. (HF's
torch.sort is not stable: which members of the group HF itself keeps is its sort's choice.)
"""
import torch

from fusekern.kernels import sampler as S
from fusekern.testing import sampling_chains as C

torch.manual_seed(0)
sort = torch.sort
for V, k, p in ((32000, 50, 0.9), (128256, 50, 0.9), (32000, None, 0.9), (128256, None, 0.95)):
    x = (torch.randn(64, V) * 3).bfloat16().float() / 0.8  # a bf16 model's logits, cast to fp32 as HF does
    hf = C.hf_warpers(x, None, k, p) > -float("inf")
    torch.sort = lambda *a, **kw: sort(*a, **kw, stable=True)
    hf_stable = C.hf_warpers(x, None, k, p) > -float("inf")
    torch.sort = sort
    op = S.kept_mask(x.double(), k, p, None)
    straddle = ((x >= torch.where(hf, x, float("inf")).amin(-1, keepdim=True)) & ~hf).any(-1)
    print(f"V={V} top_k={k} top_p={p}: cut inside a tie group in {int(straddle.sum())}/64 rows; rows where the "
          f"op keeps another count than HF: {int((op.sum(-1) != hf.sum(-1)).sum())}, another set than HF with a "
          f"stable sort: {int((op != hf_stable).any(-1).sum())}")
