"""Decode once + cuBLAS at prefill sizes, in N chunks small enough to stay in L2 (probe, H200).

    python benchmarks/proto/probe_chunked_decode.py [--csv OUT.csv] [--shapes 8192x8192,...] [--m 2048]

Why: at M = 2048 the dispatcher decodes the whole weight once ([N, K] in bf16: 128 MiB at 8192 x 8192), then
cuBLAS multiplies; 1.07-1.17x the bf16 mm alone (issue 4 asks 1.1x). The decode is bound by its DRAM writes,
which the GEMM then reads back. Decoding N-chunk by N-chunk into one buffer that fits L2 (16-32 MiB of the
H200's 60), each followed by cuBLAS on that chunk writing its columns of the output, lets the GEMM read the
chunk from L2 and the dirty lines drain to DRAM while the (compute-bound) GEMM runs. The cost: cuBLAS on N / c
narrower problems (wave quantization) and c / N as many decode programs per launch. This times both against
cuBLAS alone on the same shapes, with the shipped decode kernel (``packed_mm.packed_decode_kernel``) on
N-slices of the real leaves.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton.testing

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/proto")
from bench_common import RowWriter, versions, warm_up_clocks  # noqa: E402
from dequant_sweep import _layout, decode_into  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402


def n_slices(name: str, leaves, N: int, n0: int, c: int):
    """The leaves of output columns [n0, n0 + c): every leaf dim of size N (N / 8 for GPTQ's zero words)."""
    out = []
    for t in leaves:
        dims = [d for d, s in enumerate(t.shape) if s == N]
        if dims:
            out.append(t.narrow(dims[0], n0, c))
        elif name == "gptq" and t.dim() == 2 and t.shape[1] == N // 8:
            out.append(t.narrow(1, n0 // 8, c // 8))
        else:
            out.append(t)  # (a table or a global scale)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,14336x4096,4096x14336")
    ap.add_argument("--formats", default="gptq,fp8_channel,mxfp4")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--chunk-mib", default="8,16,32,48", help="bf16 chunk sizes to try, MiB")
    args = ap.parse_args()
    info = versions()
    warm_up_clocks()
    out = RowWriter(args.csv)
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3  # noqa: E731
    for N, K in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        x = torch.randn(args.m, K, device="cuda", dtype=torch.bfloat16)
        w_nk = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        base = bench(lambda: x @ w_nk.t())
        row = dict(format="cublas_bf16", N=N, K=K, M=args.m, chunk=N, us=round(base, 2), x_cublas=1.0, rel_err="",
                   **info)
        print(row, flush=True)
        out.write(row)
        chunks = sorted({min(N, max(256, (int(mib) * 2**20 // (2 * K)) // 256 * 256))
                         for mib in args.chunk_mib.split(",")} | {N})
        for name in args.formats.split(","):
            prog, lay, leaves = _layout(name, K, N)
            cfg = pm.dequant_config(lay)
            w_full = torch.empty(N, K, device="cuda", dtype=torch.bfloat16).t()
            decode_into(leaves, lay, K, N, cfg, w_full)
            want = (x.float() @ w_full.float())
            for c in chunks:
                buf = torch.empty(c, K, device="cuda", dtype=torch.bfloat16).t()
                res = torch.empty(args.m, N, device="cuda", dtype=torch.bfloat16)
                parts = [(n0, n_slices(name, leaves, N, n0, min(c, N - n0))) for n0 in range(0, N, c)]

                def run():
                    for n0, sl in parts:
                        width = min(c, N - n0)
                        w = buf[:, :width]
                        decode_into(sl, lay, K, width, cfg, w)
                        torch.mm(x, w, out=res[:, n0:n0 + width])

                res.fill_(float("nan"))
                run()
                err = ((res.float() - want).norm() / want.norm()).item()
                us = bench(run)
                row = dict(format=name, N=N, K=K, M=args.m, chunk=c, us=round(us, 2), x_cublas=round(us / base, 3),
                           rel_err=f"{err:.2e}", **info)
                print(row, flush=True)
                out.write(row)
    out.close()


if __name__ == "__main__":
    main()
