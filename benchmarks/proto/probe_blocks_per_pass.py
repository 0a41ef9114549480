"""The block-scaled CuTe GEMM's 128x256 loop at one and at four K blocks per pass, same run, same operands.

    python benchmarks/proto/probe_blocks_per_pass.py [--shapes 4096x7168x7168,2048x7168x7168] [--rounds 3] [--csv OUT]

``cute_scaled_mm.BLOCKS_PER_PASS`` is read when a specialization is traced, so each setting clears the
module's compile, plan and launch caches and builds again. Outputs are checked bit for bit against each
other (every pass count gives the same bits) and against float64. Median µs in a CUDA graph, rounds
alternating the two settings.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_common import RowWriter, versions, warm_up_clocks  # noqa: E402

from fusekern.kernels import cute_scaled_mm as cm  # noqa: E402
from fusekern.testing import rel_err  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x7168x7168,2048x7168x7168")
    ap.add_argument("--passes", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    warm_up_clocks()
    info = versions()
    out = RowWriter(args.csv)
    for shape in args.shapes.split(","):
        M, N, K = (int(v) for v in shape.split("x"))
        g = torch.Generator("cuda").manual_seed(0)
        a = torch.randn(M, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
        sa = torch.rand(M, K // 128, device="cuda", generator=g) + 0.5
        sb = torch.rand(N // 128, K // 128, device="cuda", generator=g) + 0.5
        ref = cm.reference_scaled_mm(a, b, out_dtype=torch.bfloat16, a_block=sa, b_block=sb).float()
        outs = {}
        for rnd in range(args.rounds):
            for per in (int(v) for v in args.passes.split(",")):
                cm.BLOCKS_PER_PASS = per
                cm._COMPILED.clear(), cm._PLANS.clear(), cm._MARSHALS.clear()
                fn = lambda: cm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, a_block=sa, b_block=sb)  # noqa: E731
                got = fn()
                got.fill_(float("nan"))
                got = fn()
                outs.setdefault(per, got.clone())
                same = torch.equal(got, outs[min(outs)])
                err = rel_err(got.float(), ref)
                us = triton.testing.do_bench_cudagraph(fn, rep=300, return_mode="median") * 1e3
                tf = 2 * M * N * K / us / 1e6
                print(f"{shape} round {rnd} per_pass={per}: {us:7.1f} us {tf:7.1f} TFLOP/s  err {err:.2e}  "
                      f"same bits as per_pass={min(outs)}: {same}", flush=True)
                out.write(dict(M=M, N=N, K=K, blocks_per_pass=per, round=rnd, us=round(us, 1), tflops=round(tf, 1),
                               rel_err=f"{err:.2e}", same_bits=same, **info))
    out.close()


if __name__ == "__main__":
    main()
