"""Does asking L2 or L1 for int4_mma_sync's operands early bring it closer to the floor? (probe, H200)

    python benchmarks/proto/probe_int4_sync_l2.py [--csv OUT.csv] [--shapes 8192x8192,...]

int4 two codes per byte (the demo's W4A16, 8-bit zeros), M = 1. Per shape:
1. the practical floor: a streaming read of the same code bytes (``probe_int4_m1.stream_read_kernel``, the
   best of three grids);
2. ``int4_mma_sync`` in the configs the dispatcher offers (one or two column groups per warp, K split for
   about 4 or 8 programs per SM).
At git 5dbb860 the probe also ran the variants, then config fields of the kernel (``--variants l2``:
``int4_mma_sync_l2_probe.csv``, ``--variants l1``: ``int4_mma_sync_l1_probe.csv``): ``L2`` (the word loads
carry .L2::256B, a bulk prefetch of each program's K slice at its start, both), ``L2_AHEAD``
(prefetch.global.L2 of the words 2 or 4 groups ahead), ``NOALLOC`` (the word loads skip L1: the one that won,
now always on), ``X_AHEAD`` (the next group's x asked of L1, or loaded into registers with its scales and
zeros, a group ahead).
Each is timed twice in a CUDA graph (``do_bench_cudagraph``, median): "warm" reads one weight again and again
(what the sweeps so far measured: at 8.4 MB the weight stays in the 60 MB L2), "cold" cycles through enough
copies (> 120 MB) that every call reads its weight from DRAM, as a decoder's layers do. Every config is
checked against the float64 reference first.
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/proto")
from int4_sync_probe import dispatcher_configs, probe_shapes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,4096x4096,28672x4096,4096x14336")
    args = ap.parse_args()
    for shape, sms in probe_shapes(args.shapes, args.csv):
        for block, unroll, per_sm in ((1024, 4, 4), (512, 8, 4), (1024, 4, 8)):
            shape.stream_read(sms, block, unroll, per_sm)
        for cfg in dispatcher_configs(shape, sms):
            shape.run_config(cfg)


if __name__ == "__main__":
    main()
