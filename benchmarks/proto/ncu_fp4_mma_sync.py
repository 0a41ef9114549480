"""Launches for ncu: fp4_mma_sync (MXFP4, N = K = 8192) at one row (8 splits) and 16 rows (4 and 8 splits: 72 and
91 registers), beside int4_mma_sync at one row, to see where 16 rows lose their time (probe, H200)

    ncu --clock-control none -k regex:'mma_sync' --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats --csv python3 benchmarks/proto/ncu_fp4_mma_sync.py

ncu flushes caches between launches by default: the weights come from DRAM, as in a decoder. The launches are
labelled in the order printed.
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_int4_mma import zoo_weight  # noqa: E402
from fusekern.kernels import fp4_mma_sync as f4s  # noqa: E402
from fusekern.kernels import int4_mma_sync as ims  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402

N = K = 8192


def main():
    _, leaves, lay = zoo_weight("mxfp4", N, K)
    for M, cfg in ((1, f4s.Fp4MmaSync(8)), (16, f4s.Fp4MmaSync(4)), (16, f4s.Fp4MmaSync(8))):
        x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
        pm.packed_mm(x, leaves, lay, K, N, cfg)
        print("fp4_mma_sync", M, cfg, flush=True)
    _, leaves, lay = zoo_weight("int4_k_stack", N, K)
    x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
    pm.packed_mm(x, leaves, lay, K, N, ims.Int4MmaSync(8))
    print("int4_mma_sync", 1, ims.Int4MmaSync(8), flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
