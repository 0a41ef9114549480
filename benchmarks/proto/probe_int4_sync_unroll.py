"""Does int4_mma_sync's K loop go faster unrolled by two (or four)? (probe, H200; ``Int4MmaSync.UNROLL``)

    python benchmarks/proto/probe_int4_sync_unroll.py [--csv OUT.csv] [--shapes 8192x8192,...]

Why: in the plain loop's SASS (sm_90a) ptxas issues the next group's word loads at the end of the iteration,
next to the register copies of the loop-carried words, which wait for them: no load is in flight while a
warp decodes and multiplies (docs/results-h200.md, "Where the warps wait"). Unrolled by two, compiled on
the CPU, each group's word loads sit among the previous group's MMAs. It takes 72 registers against 62
(one column group per warp), so 7 programs of 4 warps fit an SM instead of 8: besides the dispatcher's own
splits of K (about 8 and 4 programs per SM), each is also timed at a split for 7 and 6 per SM. Unrolling
the whole K slice was 2-5% slower cold at a 64-register cap (int4_mma_sync_unroll_probe.csv).

Rows as the other int4_mma_sync probes write them (``int4_sync_probe``): a streaming read of the same code
bytes, then each config warm and cold, checked against float64 and bit for bit against the plain loop at
the same split (unrolling changes no arithmetic).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/proto")
from int4_sync_probe import dispatcher_configs, probe_against_twins  # noqa: E402
from fusekern.kernels import int4_mma as im  # noqa: E402
from fusekern.kernels import int4_mma_sync as ims  # noqa: E402


def variants(base: list, N: int, K: int, sms: int, factors) -> list:
    """The dispatcher's configs, then one column group per warp at 7 and 6 programs per SM, each plain and
    unrolled by every factor."""
    plain = list(base) + [dataclasses.replace(ims.Int4MmaSync(), SPLIT_K=im.split_k_for(N, K, 64, sms, per_sm))
                          for per_sm in (7, 6)]
    out = []
    for c in dict.fromkeys(plain):
        out += [c] + [dataclasses.replace(c, UNROLL=u) for u in factors if (K // 128) // c.SPLIT_K >= u]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,28672x4096,4096x14336,4096x4096")
    ap.add_argument("--factors", default="2,4", help="unroll factors to try besides the plain loop")
    args = ap.parse_args()
    factors = [int(f) for f in args.factors.split(",")]
    probe_against_twins(args.shapes, args.csv,
                        lambda shape, sms: variants(dispatcher_configs(shape, sms), shape.N, shape.K, sms, factors),
                        lambda cfg: dataclasses.replace(cfg, UNROLL=1))


if __name__ == "__main__":
    main()
