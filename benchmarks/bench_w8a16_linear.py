"""W8A16 linear, N = K = 8192: eager vs stock torch.compile vs fusekern vs the bandwidth/compute floor.

    python benchmarks/bench_w8a16_linear.py [--csv benchmarks/results/h200/w8a16_linear.csv]

Median of triton.testing.do_bench (which flushes L2 between runs), all variants in the same run.
Every timed variant is first checked against the float64 reference.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.testing

import fusekern
from bench_common import BF16_PEAK, RowWriter, floor_bandwidth, versions, warm_up_clocks
from fusekern.kernels import w8a16_linear as k
from fusekern.testing import rel_err

BW = floor_bandwidth()  # bytes/s (bench_common: per GPU)
# The spec peak: the 694 TF/s measured once for an 8192^3 mm (../shared) put the floor above cuBLAS's time at M = 2048
BF16_TFLOPS = BF16_PEAK


def w8a16(x, w, s):
    return F.linear(x, w.to(x.dtype)) * s


def floor_us(M, N, K):
    bytes_ = N * K + 2 * M * K + 2 * M * N + 4 * N
    return max(bytes_ / BW, 2 * M * N * K / BF16_TFLOPS) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--ms", default="1,16,2048")
    ap.add_argument("--nk", default="8192x8192")
    ap.add_argument("--autotune", action="store_true", help="also stock torch.compile with mode=\"max-autotune-no-cudagraphs\"")
    args = ap.parse_args()
    dev = "cuda"
    warm_up_clocks(dev)
    out_csv, info = RowWriter(args.csv), versions()
    for nk in args.nk.split(","):
        N, K = map(int, nk.split("x"))
        for M in map(int, args.ms.split(",")):
            torch.manual_seed(M)
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randint(-128, 128, (N, K), device=dev, dtype=torch.int8)
            s = torch.rand(N, device=dev, dtype=torch.bfloat16) * 0.01 + 1e-3
            ref = k.w8a16_linear_reference(x, w, s, None, torch.float32)
            wb = w.to(torch.bfloat16)
            torch._dynamo.reset()
            fusekern.reset_match_report()
            variants = {
                "eager": w8a16,
                "inductor_default": torch.compile(w8a16),
                "fusekern": torch.compile(w8a16, backend="fusekern"),
                "fusekern_kernel": lambda x, w, s: k.w8a16_linear_triton(x, w, s, None, x.dtype),
                "bf16_cublas_unquantized": lambda x, w, s: F.linear(x, wb),
            }
            if args.autotune:
                variants["inductor_autotune"] = torch.compile(w8a16, mode="max-autotune-no-cudagraphs")
            for name, fn in variants.items():
                out = fn(x, w, s)
                err = rel_err(out, ref) if name != "bf16_cublas_unquantized" else float("nan")
                ok = name == "bf16_cublas_unquantized" or err < 1e-2
                us = triton.testing.do_bench(lambda: fn(x, w, s), warmup=25, rep=200, return_mode="median") * 1e3
                out_csv.write(dict(**info, op="w8a16_linear", M=M, N=N, K=K, variant=name, median_us=round(us, 2),
                                   floor_us=round(floor_us(M, N, K), 2), rel_err=f"{err:.2e}", correct=ok))
                print(f"M={M:5d} N={N} K={K} {name:26s} {us:9.1f} us  floor {floor_us(M, N, K):7.1f}  rel_err {err:.1e}  "
                      f"{'ok' if ok else 'WRONG'}", flush=True)
            # (a graph from inductor's FX cache skips the passes: the report keeps what they fired when compiled)
            fired = dict(fusekern.match_report().fired(cached=True))
            print(f"   fusekern fired: {fired}")
            assert fired == {"w8a16_linear_scale": 1}, fired
    out_csv.close()


if __name__ == "__main__":
    main()
