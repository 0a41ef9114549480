"""Scale folding (issue 6): FP8 W8A8 rowwise, FP8 128x128 block-scaled, bf16 GEMM + scale/bias epilogue.

    python benchmarks/bench_scaled_mm.py [--csv benchmarks/results/h200/scaled_mm.csv] [--autotune]

Each case times, in one run: eager (the user's graph), stock torch.compile (default; max-autotune-no-
cudagraphs with --autotune), torch.compile(backend="fusekern"), the fused op's two kernels called directly
(CuTe DSL and Triton), the vendor reference where one exists (torch._scaled_mm, cuBLAS mm alone), and the
floor (bytes / floor bandwidth or FLOPs / peak). Medians of triton.testing.do_bench and of do_bench_cudagraph (GPU
time alone); every variant is first checked
against a float32 reference of the same math (relative error in the CSV).
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
import triton.testing

from bench_common import BF16_PEAK, FP8_PEAK, RowWriter, floor_bandwidth, versions, warm_up_clocks
from fusekern.kernels import scaled_mm as S

BW = floor_bandwidth()  # bytes/s (bench_common: per GPU)
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def w8a8_rowwise(x8, w8, sx, sw):
    return ((x8.to(BF16) * sx) @ (w8.to(BF16) * sw).t()).to(BF16)


def w8a8_block(x8, w8, sx, sw):
    M, K = x8.shape
    N = w8.shape[0]
    a = (x8.to(torch.float32).view(M, K // 128, 128) * sx[..., None]).view(M, K)
    b = (w8.to(torch.float32).view(N // 128, 128, K // 128, 128) * sw[:, None, :, None]).view(N, K)
    return (a @ b.t()).to(BF16)


def bf16_scale_bias(x, w, s, b):
    return (F.linear(x, w) * s + b).to(BF16)


def _time(fn, ref):
    """(relative error, median µs of do_bench, median µs of do_bench_cudagraph). The second is GPU time
    alone: at decode sizes do_bench measures the host's launch path, which a CUDA graph removes."""
    out = fn()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    us = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    return err, us, triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def _compiled(fn, args, **kw):
    torch._dynamo.reset()
    c = torch.compile(fn, dynamic=False, **kw)
    return lambda: c(*args)


def run_case(case, M, N, K, fn, args, op_args, vendor, floor_us, flops, autotune, out):
    ref = S.scaled_mm_reference(*op_args[:2], **op_args[2], out_dtype=torch.float32)
    variants = {"eager": lambda: fn(*args), "stock_default": _compiled(fn, args)}
    if autotune:
        variants["stock_max_autotune"] = _compiled(fn, args, mode="max-autotune-no-cudagraphs")
    variants["fusekern"] = _compiled(fn, args, backend="fusekern")
    a, b, kw = op_args
    variants["fusekern_triton"] = lambda: S.scaled_mm_triton(a, b, **kw, out_dtype=BF16)
    try:
        from fusekern.kernels import cute_scaled_mm as C

        ckw = {k: v for k, v in kw.items() if k not in ("group_n", "group_k")}
        if C.supports(a, b, **ckw, out_dtype=BF16) is None:
            variants["fusekern_cute"] = lambda: C.cute_scaled_mm(a, b, **ckw, out_dtype=BF16)
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        print(f"cute unavailable: {type(e).__name__}: {e}")
    variants.update(vendor)
    for name, f in variants.items():
        try:
            err, us, us_graph = _time(f, ref)
        except Exception as e:  # noqa: BLE001
            print(f"{case} M={M} {name}: failed {type(e).__name__}: {str(e)[:200]}")
            continue
        tflops = flops / (us * 1e-6) / 1e12
        row = dict(case=case, M=M, N=N, K=K, variant=name, us=round(us, 2), us_cudagraph=round(us_graph, 2),
                   tflops=round(tflops, 1),
                   rel_err=f"{err:.2e}", floor_us=round(floor_us, 2), x_floor=round(us / floor_us, 2), **versions())
        print(row)
        out.write(row)


def _blockwise_vendor(x8, w8, sx, sw) -> dict:
    """torch._scaled_mm with DeepSeek's 1x128 activation and 128x128 weight scales (cuBLAS's blockwise FP8 GEMM,
    torch >= 2.10 with CUDA >= 12.9 on Hopper), in the first scale layout it accepts; {} where none works."""
    for name, sa, sb in (("row-major", sx, sw.t()), ("M-major", sx.t().contiguous().t(), sw.t()),
                         ("M-major, contiguous", sx.t().contiguous().t(), sw.t().contiguous())):
        fn = functools.partial(torch._scaled_mm, x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=BF16)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a torch or CUDA without it: reported, the case runs without it
            print(f"torch._scaled_mm blockwise, {name} scales: {type(e).__name__}: {str(e)[:160]}")
            continue
        print(f"torch._scaled_mm blockwise: {name} scales")
        return {"torch_scaled_mm_blockwise": fn}
    return {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--autotune", action="store_true")
    ap.add_argument("--cases", default="rowwise,block,bf16")
    args = ap.parse_args()
    dev = "cuda"
    warm_up_clocks(dev)
    out = RowWriter(args.csv)
    cases = args.cases.split(",")
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    if "rowwise" in cases:
        N = K = 8192
        for M in (16, 2048, 8192):
            x8, w8 = randn(M, K, dtype=E4M3), randn(N, K, dtype=E4M3)
            sx, sw = randn(M, 1).abs() * 0.01 + 1e-3, randn(N, 1).abs() * 0.01 + 1e-3
            op = (x8, w8, dict(row=sx.view(M), col=sw.view(N)))
            # cuBLAS promotes the tensor cores' partial sums to fp32 periodically by default; fast accumulation
            # keeps the whole K in the tensor cores' accumulator, as the CuTe rowwise kernel does
            vendor = {name: functools.partial(torch._scaled_mm, x8, w8.t(), scale_a=sx, scale_b=sw.view(1, N),
                                              out_dtype=BF16, use_fast_accum=fast)
                      for name, fast in (("torch_scaled_mm", False), ("torch_scaled_mm_fast_accum", True))}
            floor = max((M * K + N * K + 2 * M * N) / BW, 2 * M * N * K / FP8_PEAK) * 1e6
            run_case("fp8_rowwise", M, N, K, w8a8_rowwise, (x8, w8, sx, sw), op, vendor, floor, 2 * M * N * K,
                     args.autotune, out)
    if "block" in cases:
        M, N, K = 4096, 7168, 7168
        x8, w8 = randn(M, K, dtype=E4M3), randn(N, K, dtype=E4M3)
        sx, sw = randn(M, K // 128).abs() * 0.01 + 1e-3, randn(N // 128, K // 128).abs() * 0.01 + 1e-3
        op = (x8, w8, dict(a_block=sx, b_block=sw, group_n=128, group_k=128))
        floor = max((M * K + N * K + 2 * M * N) / BW, 2 * M * N * K / FP8_PEAK) * 1e6
        run_case("fp8_block128", M, N, K, w8a8_block, (x8, w8, sx, sw), op, _blockwise_vendor(x8, w8, sx, sw),
                 floor, 2 * M * N * K, args.autotune, out)
    if "bf16" in cases:
        M, N, K = 2048, 8192, 8192
        x, w = randn(M, K, dtype=BF16), randn(N, K, dtype=BF16)
        s, b = randn(N).abs() + 0.5, randn(N, dtype=BF16)
        op = (x, w, dict(col=s, bias=b))
        vendor = {"cublas_mm_alone": lambda: x @ w.t()}
        floor = max((2 * M * K + 2 * N * K + 2 * M * N) / BW, 2 * M * N * K / BF16_PEAK) * 1e6
        run_case("bf16_scale_bias", M, N, K, bf16_scale_bias, (x, w, s, b), op, vendor, floor, 2 * M * N * K,
                 args.autotune, out)
    out.close()


if __name__ == "__main__":
    main()
