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
from bench_common import git_sha, warm_up_clocks, write_csv
from fusekern.kernels import w8a16_linear as k
from fusekern.testing import rel_err

BW = 4.3e12  # bytes/s, the floor used in ../shared/baselines-h200.md
BF16_TFLOPS = 694e12  # measured bf16 8192^3 mm on the H200 (same file)


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
    gpu = torch.cuda.get_device_name()
    warm_up_clocks(dev)
    rows = []
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
                rows.append(dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, git_sha=git_sha(),
                                 op="w8a16_linear", M=M, N=N, K=K, variant=name, median_us=round(us, 2),
                                 floor_us=round(floor_us(M, N, K), 2), rel_err=f"{err:.2e}", correct=ok))
                print(f"M={M:5d} N={N} K={K} {name:26s} {us:9.1f} us  floor {floor_us(M, N, K):7.1f}  rel_err {err:.1e}  "
                      f"{'ok' if ok else 'WRONG'}", flush=True)
            fired = dict(fusekern.match_report().fired())
            print(f"   fusekern fired: {fired}")
            assert fired == {"w8a16_linear_scale": 1}, fired
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
