"""Decode attention over a bf16 KV cache: the demo's masked GQA layer and long contexts.

    python benchmarks/bench_decode_attention.py [--csv benchmarks/results/h200/decode_attention.csv]
                                                [--cases demo,long] [--splits 1,2,4,8]

32 query heads, 8 KV heads, d = 128, one query row per head. ``demo``: the demo's attention (B = 1, 16,
64; a 256-token cache; the causal row of the current position as a bool mask,
``F.scaled_dot_product_attention(q, k, v, attn_mask=causal[pos], enable_gqa=True)``). The demo's step
is at position 8 (a static cache: the mask keeps 9 of 256 tokens), also timed at 216. ``long``: B = 1
and 8 over 8k tokens and B = 32 over 2k, no mask, and B = 8 at position 4096 of 8k. Times, in one run: eager, stock torch.compile default,
torch.compile(backend="fusekern") (the ``decode_attention`` rewrite feeds the kernel), the kernel called
directly (and at each ``--splits``), and the floor (K + V bytes / floor bandwidth). ``fusekern`` runs whichever of
the kernel and PyTorch's SDPA the op measured faster for the shape on its first call. Medians of
triton.testing.do_bench and do_bench_cudagraph; each variant first checked against the float64 reference.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import fusekern
from bench_common import RowWriter, check_and_time_both, floor_bandwidth, versions, warm_up_clocks
from fusekern.kernels import decode_attention as A

BW = floor_bandwidth()  # bytes/s (bench_common: per GPU)


def attention(q, k, v, causal, pos):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal[pos], enable_gqa=True)


def attention_unmasked(q, k, v, causal, pos):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


# (B, S, position or None for no mask): the demo's benchmark step is at position 8 of its 256-token cache
CASES = {
    "demo": [(1, 256, 8), (64, 256, 8), (1, 256, 216), (16, 256, 216), (64, 256, 216)],
    "long": [(1, 8192, None), (8, 8192, None), (32, 2048, None), (8, 8192, 4096)],
}


def main():
    torch._inductor.config.fx_graph_cache = False  # each case runs the passes (the match count is real)
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--cases", default="demo,long")
    ap.add_argument("--autotune", action="store_true", help="also stock torch.compile with mode=\"max-autotune-no-cudagraphs\"")
    ap.add_argument("--splits", default="", help="also time the kernel at these split counts, e.g. 1,2,4,8")
    args = ap.parse_args()
    dev = "cuda"
    warm_up_clocks(dev)
    out = RowWriter(args.csv)
    Hq, Hkv, D = 32, 8, 128
    for case in args.cases.split(","):
        for B, S, at in CASES[case]:
            masked = at is not None
            g = torch.Generator(device=dev).manual_seed(S + B)
            # q as the demo makes it: [B, 1, Hq, D] projected, then transposed (not contiguous)
            q = torch.randn(B, 1, Hq, D, device=dev, generator=g).to(torch.bfloat16).transpose(1, 2)
            k = torch.randn(B, Hkv, S, D, device=dev, generator=g).to(torch.bfloat16)
            v = torch.randn(B, Hkv, S, D, device=dev, generator=g).to(torch.bfloat16)
            causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
            pos = torch.tensor([at or 0], device=dev)  # the cache past the position holds stale rows
            fn = attention if masked else attention_unmasked
            mask = causal[pos] if masked else None
            ref = A.reference_decode_attention(q, k, v, mask).float()
            floor = 2 * B * Hkv * S * D * 2 / BW * 1e6
            torch._dynamo.reset()
            stock = torch.compile(fn, dynamic=False)
            fused = torch.compile(fn, dynamic=False, backend="fusekern")
            fusekern.reset_match_report()
            fused(q, k, v, causal, pos)
            fired = fusekern.match_report().fired(cached=True).get("decode_attention", 0)
            variants = {
                "eager": lambda: fn(q, k, v, causal, pos),
                "stock_default": lambda: stock(q, k, v, causal, pos),
                "fusekern": lambda: fused(q, k, v, causal, pos),
                "fusekern_kernel": lambda: A.decode_attention(q, k, v, mask),
            }
            if args.autotune:
                tuned = torch.compile(fn, dynamic=False, mode="max-autotune-no-cudagraphs")
                variants["stock_autotune"] = lambda: tuned(q, k, v, causal, pos)
            for n in filter(None, args.splits.split(",")):
                variants[f"fusekern_kernel_splits{n}"] = (lambda n=int(n): A.decode_attention(q, k, v, mask,
                                                                                               num_splits=n))
            for name, f in variants.items():
                try:
                    err, us, us_graph = check_and_time_both(f, ref)
                except Exception as e:  # noqa: BLE001 - reported, the run goes on
                    print(f"B={B} S={S} {name}: failed {type(e).__name__}: {str(e)[:200]}")
                    continue
                row = dict(case=case, B=B, Hq=Hq, Hkv=Hkv, D=D, S=S, position=at if masked else "",
                           mask="bool" if masked else "none",
                           variant=name, fired=fired if name == "fusekern" else "", us=round(us, 2),
                           us_cudagraph=round(us_graph, 2), rel_err=f"{err:.2e}", floor_us=round(floor, 2),
                           x_floor_cudagraph=round(us_graph / floor, 2), **versions())
                print(row)
                out.write(row)
    out.close()


if __name__ == "__main__":
    main()
