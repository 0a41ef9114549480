"""Decode attention over an FP8 KV cache with per-token K scales and per-head V scales (issue 6, form 6).

    python benchmarks/bench_fp8_kv_attention.py [--csv benchmarks/results/h200/fp8_kv_attention.csv]

B = 8, 32 query heads, 8 KV heads, d = 128, 8k context (and --contexts). Times, in one run: eager (the
plain-PyTorch form: dequantize K and V, repeat for GQA, softmax(q k^T c) v), stock torch.compile default,
torch.compile(backend="fusekern") (the rewrite feeds the kernel), the kernel called directly, and the floor
(FP8 K + V + K-scale bytes / floor bandwidth). Median of triton.testing.do_bench; each variant first checked
against the float64 reference.
"""
from __future__ import annotations

import argparse

import torch

from bench_common import RowWriter, check_and_time_both, floor_bandwidth, versions, warm_up_clocks
from fusekern.kernels import fp8_kv_attention as A

BW = floor_bandwidth()  # bytes/s (bench_common: per GPU)


def plain_attention(q, k8, ks, v8, vs, c: float):
    group = q.shape[1] // k8.shape[1]
    k = (k8.to(q.dtype) * ks[..., None].to(q.dtype)).repeat_interleave(group, dim=1)
    v = (v8.to(q.dtype) * vs.to(q.dtype)).repeat_interleave(group, dim=1)
    return torch.softmax((q @ k.transpose(-1, -2)) * c, dim=-1) @ v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--contexts", default="8192")
    ap.add_argument("--batches", default="8")
    ap.add_argument("--autotune", action="store_true", help="also stock torch.compile with mode=\"max-autotune-no-cudagraphs\"")
    ap.add_argument("--splits", default="", help="also time these split counts (a sweep), e.g. 4,8,32")
    args = ap.parse_args()
    dev = "cuda"
    warm_up_clocks(dev)
    out = RowWriter(args.csv)
    Hq, Hkv, D = 32, 8, 128
    for B in map(int, args.batches.split(",")):
        for S in map(int, args.contexts.split(",")):
            g = torch.Generator(device=dev).manual_seed(S)
            q = torch.randn(B, Hq, 1, D, device=dev, generator=g).to(torch.bfloat16)
            k8 = torch.randn(B, Hkv, S, D, device=dev, generator=g).to(torch.float8_e4m3fn)
            v8 = torch.randn(B, Hkv, S, D, device=dev, generator=g).to(torch.float8_e4m3fn)
            ks = torch.rand(B, Hkv, S, device=dev, generator=g) * 0.1 + 0.01
            vs = torch.rand(Hkv, 1, 1, device=dev, generator=g) * 0.1 + 0.01
            c = D ** -0.5
            ref = A.reference_fp8_kv_attention(q, k8, ks, v8, vs.view(Hkv), c).float()
            floor = (2 * B * Hkv * S * D + 4 * B * Hkv * S) / BW * 1e6
            torch._dynamo.reset()
            stock = torch.compile(plain_attention, dynamic=False)
            fused = torch.compile(plain_attention, dynamic=False, backend="fusekern")
            variants = {
                "eager": lambda: plain_attention(q, k8, ks, v8, vs, c),
                "stock_default": lambda: stock(q, k8, ks, v8, vs, c),
                "fusekern": lambda: fused(q, k8, ks, v8, vs, c),
                "fusekern_kernel": lambda: A.fp8_kv_decode_attention(q, k8, ks, v8, vs.view(Hkv), c),
            }
            if args.autotune:
                tuned = torch.compile(plain_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
                variants["stock_autotune"] = lambda: tuned(q, k8, ks, v8, vs, c)
            for n in filter(None, args.splits.split(",")):
                variants[f"fusekern_kernel_splits{n}"] = (lambda n=int(n): A.fp8_kv_decode_attention(
                    q, k8, ks, v8, vs.view(Hkv), c, num_splits=n))
            for name, f in variants.items():
                try:
                    err, us, us_graph = check_and_time_both(f, ref)
                except Exception as e:  # noqa: BLE001 - reported, the run goes on
                    print(f"B={B} S={S} {name}: failed {type(e).__name__}: {str(e)[:200]}")
                    continue
                row = dict(B=B, Hq=Hq, Hkv=Hkv, D=D, S=S, variant=name, us=round(us, 2),
                           us_cudagraph=round(us_graph, 2), rel_err=f"{err:.2e}", floor_us=round(floor, 2),
                           x_floor=round(us / floor, 2), x_floor_cudagraph=round(us_graph / floor, 2), **versions())
                print(row)
                out.write(row)
    out.close()


if __name__ == "__main__":
    main()
