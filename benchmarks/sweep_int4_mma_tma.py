"""int4_mma with its words read through TMA (pipelined num_stages deep) against direct loads, and with the
scale applied before the MMA (``scale_first``: bf16 scales, 128 registers).

    python benchmarks/sweep_int4_mma_tma.py [--csv OUT.csv] [--formats gptq,int4_k_stack] [--shapes ...]
                                            [--ms 1,16] [--grid tma|wide|regs] [--cold]

Every config is checked against the float64 reference and timed in a CUDA graph (``do_bench_cudagraph``,
median); the floor moves the codes, zeros and scales once at 4.3 TB/s.
"""
from __future__ import annotations

import argparse

from bench_int4_mma import sweep_against_others
from fusekern.kernels import int4_mma as im


def configs(N: int, K: int, sms: int, grid: str = "tma") -> list:
    if grid == "wide":
        return wide_configs(N, K, sms)
    if grid == "regs":
        return regs_configs(N, K, sms)
    out = []
    for per_sm in (4, 2):
        sk = im.split_k_for(N, K, 128, sms, per_sm)
        out.append(im.Int4Mma(128, sk, 4))
        for stages in (2, 3, 4):
            out.append(im.Int4Mma(128, sk, 4, tma=True, num_stages=stages))
        out.append(im.Int4Mma(128, sk, 4, tma=True, num_stages=3, scale_first=True))
    return list(dict.fromkeys(out))


def wide_configs(N: int, K: int, sms: int) -> list:
    """Tile width x warps x programs per SM, TMA words, scaling after or before the MMA: where the shipped
    128-column, 4-warp tile sits among its neighbours (at M = 1 it runs 1-2 programs per SM)."""
    out = []
    for bn, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
        for per_sm in (2, 4, 8):
            sk = im.split_k_for(N, K, bn, sms, per_sm)
            for stages, sf in ((3, False), (3, True), (4, True)):
                out.append(im.Int4Mma(bn, sk, warps, tma=True, num_stages=stages, scale_first=sf))
    return list(dict.fromkeys(out))


def regs_configs(N: int, K: int, sms: int) -> list:
    """The TMA variants with and without a 128-register cap (4 programs per SM instead of 3), scale_first
    (128 registers on its own) beside them, at 4 and 2 programs per SM."""
    out = []
    for per_sm in (4, 2):
        sk = im.split_k_for(N, K, 128, sms, per_sm)
        for stages in (3, 4):
            for cap in (None, 128):
                out.append(im.Int4Mma(128, sk, 4, tma=True, num_stages=stages, maxnreg=cap))
        out.append(im.Int4Mma(128, sk, 4, tma=True, num_stages=3, scale_first=True))
    return list(dict.fromkeys(out))


def kind_of(cfg, grid: str) -> str:
    """The kind a config's best is printed under: direct / tma / scale_first, its register cap, its tile."""
    kind = "scale_first" if cfg.scale_first else "tma" if cfg.tma else "direct"
    if cfg.maxnreg:
        kind += f" maxnreg{cfg.maxnreg}"
    if grid == "wide":
        kind += f" {cfg.BLOCK_N}w{cfg.num_warps}"
    return kind


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--formats", default="gptq,int4_k_stack")
    ap.add_argument("--shapes", default="8192x8192,4096x4096,14336x4096,4096x14336")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--grid", default="tma", choices=("tma", "wide", "regs"))
    ap.add_argument("--cold", action="store_true", help="each call reads another copy of the weight (from DRAM)")
    args = ap.parse_args()
    sweep_against_others(args, im.Int4Mma, lambda N, K, sms: configs(N, K, sms, args.grid),
                         kind=lambda cfg: kind_of(cfg, args.grid),
                         columns=lambda cfg: dict(tma=cfg.tma, scale_first=cfg.scale_first, maxnreg=cfg.maxnreg or ""))


if __name__ == "__main__":
    main()
