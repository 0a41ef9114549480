"""Sampling, V = 128256, bf16 logits, per pattern style (the issue's target: top-k 50 + top-p 0.9 + T 0.8).

    python benchmarks/bench_sampler.py [--csv benchmarks/results/h200/sampler.csv] [--bs 1,8,32,256,512]
                                       [--styles hf,gpt_fast,vllm,vllm_min_p]

Styles: ``hf`` (Hugging Face warpers: temperature, top-k 50, top-p 0.9, multinomial), ``gpt_fast``
(temperature, top-k 50, exponential race), ``vllm`` (vLLM's sort-based top-k/top-p with per-row
temperature / k / p tensors, exponential race; the logits are cloned per call, as vLLM mutates them),
``vllm_min_p`` (the same with vLLM's min-p 0.05 before top-k / top-p, on the logits cast to fp32 as vLLM
samples them: min-p over bf16 probabilities is declined).
Variants: eager, stock torch.compile (default and reduce-overhead = CUDA graphs), fusekern (both modes),
``*_graph``: the default-mode compiled function captured whole in one CUDA graph and replayed by
``do_bench_cudagraph`` (GPU time only: what a serving loop that graphs its decode step sees; the
reduce-overhead rows add cudagraph-tree bookkeeping on the CPU), the fused kernel alone (in a CUDA graph)
and the floor (the logits read once). Median of triton.testing.do_bench, all variants in the same run; a row is
written to the CSV as soon as it is measured. Every variant's tokens are checked against the kept set.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

import fusekern
from bench_common import floor_bandwidth, versions, warm_up_clocks, write_csv
from fusekern.kernels import sampler as S
from fusekern.testing.sampling_chains import gpt_fast, hf_sample, vllm_sample

BW = floor_bandwidth()  # bytes/s (bench_common: per GPU)
V = 128256
T, K, P, MIN_P = 0.8, 50, 0.9, 0.05


def styles(B: int, device="cuda"):
    """name -> (chain, filters for the kernel and the kept-set check)."""
    t_rows = torch.full((B,), T, device=device)
    k_rows = torch.full((B,), K, device=device, dtype=torch.int64)
    p_rows = torch.full((B,), P, device=device)
    return {
        "hf": (lambda x: hf_sample(x, T, K, P), dict(top_k=K, top_p=P)),
        "gpt_fast": (lambda x: gpt_fast(x, T, K), dict(top_k=K)),
        "vllm": (lambda x: vllm_sample(x.clone(), t_rows, k_rows, p_rows), dict(top_k=K, top_p=P)),
        "vllm_min_p": (lambda x: vllm_sample(x.float(), t_rows, k_rows, p_rows, torch.full((B,), MIN_P, device=device)),
                       dict(top_k=K, top_p=P, min_p=MIN_P, min_p_first=True, fp32=True)),
    }


_kept = {"logits": None, "masks": {}}  # float64 kept masks per filter set, for the batch's logits in hand


def in_kept_set(logits, tokens, filters) -> bool:
    # the float64 kept mask takes seconds on the CPU at B = 512: computed once per batch and filter set
    if _kept["logits"] is not logits:
        _kept["logits"], _kept["masks"] = logits, {}
    key = tuple(sorted(filters.items()))
    if key not in _kept["masks"]:
        x = logits.float() / T  # as the chain rounds it: in fp32, or back to the logits' dtype
        x = (x if filters.get("fp32") else x.to(logits.dtype)).double().cpu()
        _kept["masks"][key] = S.kept_mask(x, filters.get("top_k"), filters.get("top_p"), filters.get("min_p"),
                                          filters.get("min_p_first", False))
    return bool(_kept["masks"][key].gather(-1, tokens.long().reshape(-1, 1).cpu()).all())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--bs", default="1,8,32,256,512")
    ap.add_argument("--styles", default="hf,gpt_fast,vllm")
    ap.add_argument("--autotune", action="store_true", help="also stock torch.compile with mode=\"max-autotune-no-cudagraphs\"")
    args = ap.parse_args()
    warm_up_clocks()
    meta = versions()
    rows = []
    seed = torch.tensor([1], device="cuda")
    for B in map(int, args.bs.split(",")):
        logits = torch.randn(B, V, device="cuda", dtype=torch.bfloat16) * 3
        for style in args.styles.split(","):
            chain, filters = styles(B)[style]
            torch._dynamo.reset()
            fusekern.reset_match_report()
            stock, fused = torch.compile(chain), torch.compile(chain, backend="fusekern")
            variants = {
                "eager": chain,
                "inductor_default": stock,
                "inductor_cudagraphs": torch.compile(chain, mode="reduce-overhead"),
                "inductor_default_graph": stock,
                "fusekern": fused,
                "fusekern_cudagraphs": torch.compile(chain, backend="fusekern", mode="reduce-overhead"),
                "fusekern_graph": fused,
            }
            if args.autotune:
                tuned = torch.compile(chain, mode="max-autotune-no-cudagraphs")
                variants["inductor_autotune"] = tuned
                variants["inductor_autotune_graph"] = tuned
            if style not in ("vllm", "vllm_min_p"):  # the kernel alone: same filters for every style
                variants["fusekern_kernel"] = lambda x: S.sample_triton(x, T, seed=seed, **filters)
            for name, fn in variants.items():
                try:
                    with torch.no_grad():
                        for _ in range(3):  # compile, record, warm
                            out = fn(logits)
                    ok = in_kept_set(logits, out, filters)
                    if name.startswith("fusekern_kernel") or name.endswith("_graph"):
                        us = triton.testing.do_bench_cudagraph(lambda: fn(logits), rep=100, return_mode="median") * 1e3
                    else:
                        with torch.no_grad():
                            us = triton.testing.do_bench(lambda: fn(logits), warmup=25, rep=200,
                                                         return_mode="median") * 1e3
                    err = ""
                except Exception as e:  # stock inductor has crashed on sampling graphs: record it, go on
                    us, ok, err = float("nan"), False, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                floor = B * V * 2 / BW * 1e6
                rows.append(dict(**meta, style=style, B=B, V=V, variant=name, median_us=round(us, 2),
                                 floor_us=round(floor, 2), correct=ok, error=err))
                print(f"B={B:4d} {style:8s} {name:22s} {us:9.1f} us  floor {floor:6.2f}  "
                      f"{'ok' if ok else 'WRONG ' + err}", flush=True)
                if args.csv:
                    write_csv(args.csv, rows)
            fired = dict(fusekern.match_report().fired(cached=True))
            print(f"   fusekern fired: {fired}", flush=True)
            if not fired:  # its rows above then timed the graph as written: fail the run, loudly
                raise RuntimeError(f"fusekern fused nothing in the {style} chain at B={B}")


if __name__ == "__main__":
    main()
