"""FP4 (MXFP4, NVFP4) on warp-level tensor cores (``fp4_mma_sync``) against the kernels the dispatcher offered
before it.

    python benchmarks/sweep_fp4_mma_sync.py [--csv OUT.csv] [--formats mxfp4,nvfp4] [--shapes 8192x8192,...]
                                            [--ms 1,16] [--cold] [--others 0|1]

Per shape (N x K) and M: the dispatcher's other candidates (GEMV tiles, the swap-AB ``tl.dot`` tile, ``fp4_mma``
for MXFP4, decode + cuBLAS), then ``fp4_mma_sync`` on 4 or 8 warps (64 or 128 columns per program) with K split
for 2-16 programs per SM. Every config is checked against the float64 reference and timed in a CUDA graph
(``do_bench_cudagraph``, median); the floor moves the codes and scales once at 4.3 TB/s.
"""
from __future__ import annotations

import argparse

from bench_int4_mma import sweep_against_others
from fusekern.kernels import fp4_mma_sync as f4s
from fusekern.kernels.int4_mma import split_k_for


def configs(N: int, K: int, sms: int) -> list:
    return list(dict.fromkeys(f4s.Fp4MmaSync(split_k_for(N, K, 16 * w, sms, per_sm), w)
                              for w in (4, 8) for per_sm in (2, 4, 8, 16)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--formats", default="mxfp4,nvfp4")
    ap.add_argument("--shapes", default="8192x8192,14336x4096,4096x14336,4096x4096")
    ap.add_argument("--others", type=int, default=1, help="0: only fp4_mma_sync configs")
    ap.add_argument("--cold", action="store_true", help="each call reads another copy of the weight (from DRAM)")
    ap.add_argument("--ms", default="1,16")
    args = ap.parse_args()
    sweep_against_others(args, f4s.Fp4MmaSync, configs, best_max_err=4e-3)


if __name__ == "__main__":
    main()
