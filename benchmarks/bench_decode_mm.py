"""The structural dequant -> matmul rewrite on every format, N = K = 8192, M = 1, 16, 2048 (issues 3, 4).

    python benchmarks/bench_decode_mm.py [--csv benchmarks/results/h200/decode_mm.csv] [--ms 1,16,2048]
                                         [--formats gptq,awq,...] [--nk 8192]
                                         [--shapes 8192x8192,4096x4096,14336x4096,4096x14336,128256x4096]
                                         [--autotune]

``--shapes`` takes N x K pairs (issue 4's list); ``--autotune`` adds stock torch.compile with
``mode="max-autotune-no-cudagraphs"`` and the unquantized bf16 cuBLAS mm of the same shape (the M = 2048
yardstick of issue 4).

Each zoo decode (fusekern/testing/decode_zoo.py) as the user wrote it, timed as: eager; stock
torch.compile (default, static shapes); fusekern (``backend="fusekern"``: the generated kernels, the
path and tile measured on the first call). Each compiled function is timed twice: ``call`` (do_bench: what a Python caller pays, launch
overhead included) and ``graph`` (do_bench_cudagraph: GPU time, as under CUDA graphs). The floor is the
bytes that must move at the floor bandwidth (weights + activations + output) or the bf16 dense peak (989 TF/s),
whichever is larger. Medians, one run; rows are written as they are measured; each fusekern output is
checked against eager. ``kernel``: the config(s) the dispatcher measured fastest on that first call
(``StockConfig()``: stock inductor's code for the decode, the fallback); ``tuner_kernel_us`` /
``tuner_stock_us``: what the tuner measured for its fastest kernel and for that fallback (cold L2, GPU time).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import BF16_PEAK, RowWriter, floor_bandwidth, versions, warm_up_clocks  # noqa: E402

import fusekern  # noqa: E402,F401
from fusekern.kernels import decode_mm as dm  # noqa: E402
from fusekern.kernels.decode_mm_stock import StockConfig  # noqa: E402
from fusekern.testing import rel_err  # noqa: E402
from fusekern.testing.decode_zoo import BY_NAME  # noqa: E402

BW, PEAK = floor_bandwidth(), BF16_PEAK
EXACT = ["w8a16_linear_scale_bias", "w8a16_linear_scale", "w8a16_dequant_linear_bias", "w8a16_dequant_linear",
         "w8a16_dequant_linear_col_scale", "w8a16_dequant_fp32_linear"]
DEFAULT_FORMATS = "gptq,int4_k_stack,awq,mxfp4,nvfp4,fp8_block,fp8_channel,int8_group,hqq"


def floor_us(M, N, K, weights) -> float:
    moved = sum(t.numel() * t.element_size() for t in weights) + 2 * M * K + 2 * M * N
    return max(moved / BW, 2 * M * N * K / PEAK) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--ms", default="1,16,2048")
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--nk", type=int, default=8192)
    ap.add_argument("--shapes", default=None, help="N x K pairs, e.g. 8192x8192,4096x14336 (overrides --nk)")
    ap.add_argument("--autotune", action="store_true")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else \
        [(args.nk, args.nk)]
    info = versions()
    warm_up_clocks()
    out = RowWriter(args.csv)
    for (N, K), name in ((shape, name) for shape in shapes for name in args.formats.split(",")):
        case = BY_NAME[name]
        torch.manual_seed(0)
        ws = case.make(K, N, case.group, "cuda")
        fk = torch.compile(case.fn, backend="fusekern", dynamic=False,
                           options={"fusekern.disable": EXACT})
        # cuBLAS on a bf16 weight of the same shape: issue 4's reference at prefill sizes (and with --autotune)
        w_bf16 = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) if args.autotune or max(ms) >= 1024 else None
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            stock = torch.compile(case.fn)
            ref = case.fn(x, *ws)
            tuned_before = set(dm._tuned)
            fusekern.reset_match_report()
            got = fk(x, *ws)
            fired = fusekern.match_report().fired(cached=True)
            if not fired.get("decode_matmul"):  # the fusekern columns would time stock's graph
                raise RuntimeError(f"{name} {N}x{K} M={M}: decode_matmul did not fire ({dict(fired)})")
            chosen = [repr(dm._tuned[k]) for k in dm._tuned if k not in tuned_before] or [  # else tuned before:
                repr(cfg) for (text, _, bucket, _, _), cfg in dm._tuned.items()  # this M bucket and shape
                if bucket == triton.next_power_of_2(M) and (dm.DecodeProgram.from_text(text).N,
                                                             dm.DecodeProgram.from_text(text).K) == (N, K)]
            err = rel_err(got, ref)
            # The tuner's own timings of this call (cold L2, GPU time): the fastest kernel, and stock inductor's
            # code for the same decode (the fallback candidate)
            new = [dm.timings[k] for k in dm._tuned if k not in tuned_before and k in dm.timings]
            kernel_ms = [ms for t in new for c, ms in t.items() if not isinstance(c, StockConfig)]
            stock_ms = [t[StockConfig()] for t in new if StockConfig() in t]
            if not err < 1e-2:  # bf16 activations: the tests' tolerance
                raise RuntimeError(f"{name} {N}x{K} M={M}: fusekern differs from eager, rel_err {err:.2e}")
            variants = {"eager": lambda: case.fn(x, *ws), "stock": lambda: stock(x, *ws), "fusekern": lambda: fk(x, *ws)}
            if args.autotune:
                tuned = torch.compile(case.fn, mode="max-autotune-no-cudagraphs")
                variants["stock_autotune"] = lambda: tuned(x, *ws)
            if w_bf16 is not None:  # (every row then: the CSV's columns are the first row's)
                variants["cublas_bf16"] = lambda: x @ w_bf16
            row = dict(format=name, recognized=case.format, M=M, N=N, K=K, rel_err=f"{err:.2e}",
                       floor_us=round(floor_us(M, N, K, ws), 2), kernel="; ".join(chosen) or "(not tuned)",
                       tuner_kernel_us=round(1e3 * min(kernel_ms), 2) if kernel_ms else "",
                       tuner_stock_us=round(1e3 * min(stock_ms), 2) if stock_ms else "")
            for v, fn in variants.items():
                fn()
                row[f"{v}_call_us"] = round(
                    triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3, 2)
                if v != "eager":  # (cuBLAS too: the "x cuBLAS" ratio compares graph times)
                    try:
                        row[f"{v}_graph_us"] = round(
                            triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3, 2)
                    except Exception as e:  # not capturable
                        row[f"{v}_graph_us"] = f"n/a ({type(e).__name__})"
            row.update(info)
            print(row, flush=True)
            out.write(row)
            torch._dynamo.reset()
    out.close()


if __name__ == "__main__":
    main()
