"""Launches for ncu: int4_mma_sync's configs (one or two column groups per warp, and two groups of words
ahead, which the dispatcher does not offer) and a streaming read of the same codes (probe, H200)

    ncu --clock-control none -k regex:'int4_mma_sync|stream_read' --metrics <...> --csv \
        python3 benchmarks/proto/ncu_int4_mma_sync.py

Each kernel runs twice (ncu flushes caches between launches by default: the weights come from DRAM, as in a
decoder); ``benchmarks/results/h200/int4_mma_sync_ncu.csv`` keeps both launches, labelled in this order
(run at git 2a94ba5, before the code words skipped L1).
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/proto")
from bench_int4_mma import zoo_weight  # noqa: E402
from probe_int4_m1 import stream_read_kernel  # noqa: E402
from fusekern.kernels import int4_mma_sync as ims  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402

S = ims.Int4MmaSync
RUNS = ((8192, 8192, [S(8, 4, 1), S(8, 4, 2), S(4, 4, 1, PREFETCH=2)]),
        (28672, 4096, [S(2, 4, 1), S(2, 4, 1, PREFETCH=2)]))


def main():
    for N, K, cfgs in RUNS:
        _, leaves, lay = zoo_weight("int4_k_stack", N, K)
        x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        q = leaves[0].view(torch.int32)
        sink = torch.empty(528 * 512, dtype=torch.int32, device="cuda")
        for _ in range(2):
            stream_read_kernel[(528,)](q, sink, q.numel(), BLOCK=512, UNROLL=8, num_warps=4)
        for cfg in cfgs:
            for _ in range(2):
                pm.packed_mm(x, leaves, lay, K, N, cfg)
        torch.cuda.synchronize()
        print(N, K, [str(c) for c in cfgs])


if __name__ == "__main__":
    main()
