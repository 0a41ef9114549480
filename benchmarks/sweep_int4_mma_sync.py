"""int4 along K on warp-level tensor cores (``int4_mma_sync``) against the kernels the dispatcher offered before.

    python benchmarks/sweep_int4_mma_sync.py [--csv OUT.csv] [--formats int4_k_stack,gptq]
                                             [--shapes 14336x4096,...] [--ms 1,4,8] [--others 0|1]

Per shape (N x K) and M: the dispatcher's other hand-tuned candidates (GEMV tiles, swap-AB tiles,
``int4_mma``, decode + cuBLAS), then ``int4_mma_sync`` with one or two 16-column groups per warp (one or two groups of words
loaded ahead) and K split
for 2-16 programs per SM. Every config is checked against the float64 reference and timed in a CUDA graph
(``do_bench_cudagraph``, median); the floor moves the codes, zeros and scales once at 4.3 TB/s.
"""
from __future__ import annotations

import argparse
import dataclasses

from bench_int4_mma import sweep_against_others
from fusekern.kernels import int4_mma_sync as ims
from fusekern.kernels.int4_mma import split_k_for


def configs(N: int, K: int, sms: int) -> list:
    out = [dataclasses.replace(c, SPLIT_K=split_k_for(N, K, c.BLOCK_N, sms, per_sm))
           for c in (ims.Int4MmaSync(), ims.Int4MmaSync(PREFETCH=2), ims.Int4MmaSync(GROUPS_PER_WARP=2))
           for per_sm in (2, 4, 8, 16)]
    return list(dict.fromkeys(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--formats", default="int4_k_stack,gptq")
    ap.add_argument("--shapes", default="14336x4096,4096x14336,4096x4096,8192x8192,1024x4096")
    ap.add_argument("--others", type=int, default=1, help="0: only int4_mma_sync configs")
    ap.add_argument("--cold", action="store_true", help="each call reads another copy of the weight (from DRAM)")
    ap.add_argument("--ms", default="1,8")
    args = ap.parse_args()
    sweep_against_others(args, ims.Int4MmaSync, configs, best_max_err=4e-3)


if __name__ == "__main__":
    main()
