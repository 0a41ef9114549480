"""How much the op's top-p tie rule differs from Hugging Face's on logits rounded from bf16 (CPU, seconds).

    python benchmarks/proto/top_p_ties.py

The op keeps the whole tie group at the top-p cut; HF's ascending sort + cumsum keeps only the part of the
group its (stable) sort puts last. Prints, per setting, how many of 64 rows keep another set, the extra
tokens per row, and the probability mass (under the op's distribution) that falls on tokens HF drops.
"""
import torch

from fusekern.kernels import sampler as S
from fusekern.testing import sampling_chains as C

torch.manual_seed(0)
for V, k, p in ((32000, 50, 0.9), (128256, 50, 0.9), (32000, None, 0.9), (128256, None, 0.95)):
    x = (torch.randn(64, V) * 3).bfloat16().float() / 0.8  # a bf16 model's logits, cast to fp32 as HF does
    hf = C.hf_warpers(x, None, k, p) > -float("inf")
    op = S.kept_mask(x.double(), k, p, None)
    extra = op & ~hf
    probs = torch.softmax(torch.where(op, x, -float("inf")).double(), -1)
    mass = (probs * extra).sum(-1)
    print(f"V={V} top_k={k} top_p={p}: rows differing {int(extra.any(-1).sum())}/64, extra tokens per row "
          f"{extra.sum(-1).float().mean():.1f} (HF keeps {hf.sum(-1).float().mean():.1f}), extra mass mean "
          f"{mass.mean():.4f} max {mass.max():.4f}, tokens HF keeps and the op drops: {int((hf & ~op).sum())}")
