"""MXFP4 on tensor cores (``fp4_mma``) against the kernels the dispatcher offered before it.

    python benchmarks/sweep_fp4_mma.py [--csv OUT.csv] [--shapes 8192x8192,...] [--ms 1,16] [--cold] [--others 0|1]

Per shape (N x K) and M: the dispatcher's other candidates for MXFP4 (GEMV tiles, the swap-AB ``tl.dot`` tile,
decode + cuBLAS), then ``fp4_mma`` with 64- and 128-column tiles and K split for 1-8 programs per SM. Every
config is checked against the float64 reference and timed in a CUDA graph (``do_bench_cudagraph``, median); the
floor moves the codes and scales once at 4.3 TB/s.
"""
from __future__ import annotations

import argparse

from bench_int4_mma import sweep_against_others
from fusekern.kernels import fp4_mma as f4
from fusekern.kernels.int4_mma import split_k_for


def configs(N: int, K: int, sms: int) -> list:
    return list(dict.fromkeys(f4.Fp4Mma(bn, split_k_for(N, K, bn, sms, per_sm))
                              for bn in (128, 64) for per_sm in (1, 2, 4, 8)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--formats", default="mxfp4")
    ap.add_argument("--shapes", default="8192x8192,14336x4096,4096x14336,4096x4096")
    ap.add_argument("--others", type=int, default=1, help="0: only fp4_mma configs")
    ap.add_argument("--cold", action="store_true", help="each call reads another copy of the weight (from DRAM)")
    ap.add_argument("--ms", default="1,16")
    args = ap.parse_args()
    sweep_against_others(args, f4.Fp4Mma, configs, best_max_err=4e-3)


if __name__ == "__main__":
    main()
