"""Does int4_mma_sync go faster without its loop-carried word copies? (probe; ``Int4MmaSync.PREFETCH=0``)

    python benchmarks/proto/probe_int4_sync_prefetch0.py [--csv OUT.csv] [--shapes 8192x8192,...]

Why: the shipped loop (``PREFETCH=1``) loads the next group's words into fresh registers and copies them into
the loop-carried ones at the end of the iteration. In its sm_90a SASS (compiled on the CPU, one column group per
warp, two codes per byte, 14336 x 4096) those are 8 of the loop's 157 instructions, and each copy waits for its
load, so the prefetch is waited for in the iteration that issues it (docs/results-h200.md, "Where the warps
wait"). ``PREFETCH=0`` loads a group's words at the top of its own iteration: 151 instructions at the same 62
registers, and 80 registers instead of 96 with two column groups per warp (6 programs of 4 warps per SM instead
of 5). Each of the dispatcher's configs is timed as shipped and with ``PREFETCH=0``, and two column groups per
warp also at the split that fills 6 programs per SM.

Rows as the other int4_mma_sync probes write them (``int4_sync_probe``): a streaming read of the same code
bytes, then each config warm and cold, checked against float64 and bit for bit against the shipped loop at the
same split and column groups (the variant changes no arithmetic).
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


def variants(base: list, N: int, K: int, sms: int) -> list:
    """The dispatcher's configs and two column groups per warp at 6 programs per SM, each shipped and with
    ``PREFETCH=0``."""
    shipped = list(base) + [ims.Int4MmaSync(GROUPS_PER_WARP=2, SPLIT_K=im.split_k_for(N, K, 128, sms, 6))]
    out = []
    for c in dict.fromkeys(c for c in shipped if c.PREFETCH == 1):
        out += [c, dataclasses.replace(c, PREFETCH=0)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,28672x4096,4096x14336,4096x4096")
    args = ap.parse_args()
    probe_against_twins(args.shapes, args.csv,
                        lambda shape, sms: variants(dispatcher_configs(shape, sms), shape.N, shape.K, sms),
                        lambda cfg: dataclasses.replace(cfg, PREFETCH=1))


if __name__ == "__main__":
    main()
