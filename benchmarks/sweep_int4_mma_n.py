"""int4 packed along N (AWQ) on tensor cores (``int4_mma_n``) against the kernels the dispatcher offered before.

    python benchmarks/sweep_int4_mma_n.py [--csv OUT.csv] [--formats awq] [--shapes 8192x8192,...] [--ms 1,16]
                                          [--others 0|1] [--grid variants|dispatcher]

Per shape (N x K) and M: the dispatcher's other hand-tuned candidates (GEMV tiles, swap-AB ``packed_dot``
tiles, decode + cuBLAS), then ``int4_mma_n`` with the next tile's words
loaded ahead or not, or through TMA, with the scale applied before or after the MMA, with and without a
register cap (``configs``). Every config is checked against the
float64 reference and timed in a CUDA graph (``do_bench_cudagraph``, median); the floor moves the codes,
zeros and scales once at 4.3 TB/s.
"""
from __future__ import annotations

import argparse

from bench_int4_mma import sweep_against_others
from fusekern.kernels import decode_mm as dm
from fusekern.kernels import int4_mma_n as imn
from fusekern.kernels import packed_mm as pm


def configs(N: int, K: int, sms: int, grid: str = "variants") -> list:
    """grid "dispatcher": the configs ``decode_mm`` offers (timed per shape on the first call). "variants":
    direct words (the next tile's loaded ahead) or TMA words 3-4 deep; scaling before or after the MMA;
    168 registers (3 programs per SM, the split sized for one wave of them) or capped at 128 (4 per SM:
    only the scale-first variants fit without a spill, sm_90a)."""
    if grid == "dispatcher":
        lay = pm.REPORT_LAYOUTS["awq"][0]
        return [c for c in dm._packed_candidates(1, N, K, sms, lay) if isinstance(c, imn.Int4MmaN)]
    N_ = imn.Int4MmaN
    three, four = imn.split_k_for(N, K, sms, 3), imn.split_k_for(N, K, sms, 4)
    out = [N_(three), N_(three, prefetch=False), N_(three, scale_first=True),
           N_(four, scale_first=True, maxnreg=128), N_(2 * four, scale_first=True, maxnreg=128),
           N_(three, prefetch=False, tma=True, num_stages=3), N_(three, prefetch=False, tma=True, num_stages=4,
                                                                  scale_first=True),
           N_(four, prefetch=False, tma=True, num_stages=3, scale_first=True, maxnreg=128),
           N_(four, prefetch=False, tma=True, num_stages=4, scale_first=True, maxnreg=128)]
    return list(dict.fromkeys(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--formats", default="awq")
    ap.add_argument("--shapes", default="8192x8192,4096x4096,14336x4096,4096x14336,128256x4096")
    ap.add_argument("--others", type=int, default=1, help="0: only int4_mma_n configs")
    ap.add_argument("--grid", default="variants", choices=("variants", "dispatcher"))
    ap.add_argument("--cold", action="store_true", help="each call reads another copy of the weight (from DRAM)")
    ap.add_argument("--ms", default="1,16")
    args = ap.parse_args()
    sweep_against_others(args, imn.Int4MmaN, lambda N, K, sms: configs(N, K, sms, args.grid))


if __name__ == "__main__":
    main()
