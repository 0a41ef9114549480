"""Sampling, V = 128256, bf16 logits: the gpt-fast chain (temperature 0.8, top-k 50, exponential race).

    python benchmarks/bench_sampler.py [--csv benchmarks/results/h200/sampler.csv] [--bs 1,8,32,256,512]

Eager, stock torch.compile (default and reduce-overhead = CUDA graphs), fusekern (both modes), the fused
kernel alone (CUDA graph, no launcher overhead) and the floor (the logits read once at 4.3 TB/s).
Median of triton.testing.do_bench, all variants in the same run. Every fusekern variant is checked:
the rewrite fired once and every sampled token is in the top-k set.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

import fusekern
from bench_common import versions, warm_up_clocks, write_csv
from fusekern.kernels import sampler as S
from fusekern.testing.sampling_chains import gpt_fast

BW = 4.3e12
V = 128256


def in_top_k(logits, tokens, temperature=0.8, k=50) -> bool:
    x = (logits.float() / temperature).to(logits.dtype)
    pivot = x.topk(k, dim=-1).values[:, -1:]
    return bool((x.gather(-1, tokens.long().reshape(-1, 1)) >= pivot).all())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--bs", default="1,8,32,256,512")
    args = ap.parse_args()
    warm_up_clocks()
    meta = versions()
    rows = []
    for B in map(int, args.bs.split(",")):
        logits = torch.randn(B, V, device="cuda", dtype=torch.bfloat16) * 3
        seed = torch.tensor([1], device="cuda")
        torch._dynamo.reset()
        fusekern.reset_match_report()
        variants = {
            "eager": gpt_fast,
            "inductor_default": torch.compile(gpt_fast),
            "inductor_cudagraphs": torch.compile(gpt_fast, mode="reduce-overhead"),
            "fusekern": torch.compile(gpt_fast, backend="fusekern"),
            "fusekern_cudagraphs": torch.compile(gpt_fast, backend="fusekern", mode="reduce-overhead"),
            "fusekern_kernel": lambda x: S.sample_top_k_triton(x, 0.8, 50, seed),
        }
        for name, fn in variants.items():
            try:
                with torch.no_grad():
                    for _ in range(3):  # compile, record, warm
                        out = fn(logits)
                ok = in_top_k(logits, out)
                if name == "fusekern_kernel":
                    us = triton.testing.do_bench_cudagraph(lambda: fn(logits), rep=100, return_mode="median") * 1e3
                else:
                    with torch.no_grad():
                        us = triton.testing.do_bench(lambda: fn(logits), warmup=25, rep=200, return_mode="median") * 1e3
                err = ""
            except Exception as e:  # stock inductor has crashed on sampling graphs: record it, go on
                us, ok, err = float("nan"), False, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            floor = B * V * 2 / BW * 1e6
            rows.append(dict(**meta, op="sample_gpt_fast", B=B, V=V, variant=name, median_us=round(us, 2),
                             floor_us=round(floor, 2), correct=ok, error=err))
            print(f"B={B:4d} {name:22s} {us:9.1f} us  floor {floor:6.2f}  {'ok' if ok else 'WRONG ' + err}", flush=True)
        fired = dict(fusekern.match_report().fired())
        print(f"   fusekern fired: {fired}")
        assert fired.get("sample_top_k", 0) >= 2, fired
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
