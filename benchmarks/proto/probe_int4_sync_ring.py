"""Do int4_mma_sync's words come faster through a ring of shared-memory slots (cp.async), with its MMA
chains split in two, or with its loads pinned before a fence? (probe, H200; the variants are config fields
of the kernel at git e20b9e2 only, where this runs)

    python benchmarks/proto/probe_int4_sync_ring.py [--csv OUT.csv] [--shapes 8192x8192,...] [--ring]

Results: ``int4_mma_sync_ring_probe.csv`` (``--ring``, before ``PIN`` existed) and
``int4_mma_sync_fence_probe.csv`` (the default run). None was faster cold than the plain kernel. ``--unroll``
(the loop unrolled whole, ``UNROLL`` / ``maxnreg`` fields at git b29199a only): ``int4_mma_sync_unroll_probe.csv``.

int4 two codes per byte (the demo's W4A16, 8-bit zeros), M = 1. Per shape: a streaming read of the same code
bytes (the practical floor, ``probe_int4_m1.stream_read_kernel``), then ``int4_mma_sync`` in the configs the
dispatcher offers and each with
- ``CHAINS=2``: a group's 8 product MMAs (and the 8 for sum x) as two independent chains of 4, added at the
  end (the chain of dependent MMAs is the longest latency inside an iteration);
- ``STAGES=S``: the words cp.async'ed into S slots of shared memory private to each lane (S - 1 groups in
  flight, no registers held for them, no barrier: a lane reads back only what it copied); ncu showed the
  kernel's warps waiting on memory (long scoreboard) with DRAM under half busy
  (``int4_mma_sync_ncu.csv``), and holding two groups ahead in registers cost occupancy;
- ``PIN=fence``: the iteration's loads (next words, x, scales, zeros; coherent loads, since ptxas moves .nc
  ones across the fence) issued before a ``membar.cta`` / ``fence.acq_rel.cta``: ptxas otherwise sinks the
  next group's words and this group's scales to the end of the iteration (the SASS of the plain kernel;
  ``int4_mma_sync_stall_lines.csv`` has ncu's stall samples per instruction).
Timed warm (one weight again and again) and cold (cycling through copies, > 120 MB, so every call reads
DRAM), ``do_bench_cudagraph`` medians, every config checked against the float64 reference and against
the plain config bit for bit (same arithmetic; CHAINS changes the order of the fp32 sums).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/proto")
from int4_sync_probe import dispatcher_configs, probe_shapes  # noqa: E402
from fusekern.kernels import int4_mma as im  # noqa: E402
from fusekern.kernels import int4_mma_sync as ims  # noqa: E402


RING = False


def variants(base: list, N: int, K: int, sms: int) -> list:
    out = list(base)
    for c in base:
        if RING:
            out.append(dataclasses.replace(c, CHAINS=2))
            for s in ((3, 4, 6) if c.GROUPS_PER_WARP == 1 else (2, 3)):
                out.append(dataclasses.replace(c, STAGES=s))
            out.append(dataclasses.replace(c, STAGES=3 if c.GROUPS_PER_WARP == 2 else 4, CHAINS=2))
        for pin in ("membar.cta", "fence.acq_rel.cta"):
            out.append(dataclasses.replace(c, PIN=pin))
    for per_sm in (7, 6, 3):  # the fenced kernel holds more registers (72 for one column group: 7 per SM)
        for gpw in ((1,) if per_sm > 3 else (1, 2)):
            c = ims.Int4MmaSync(GROUPS_PER_WARP=gpw, PIN="membar.cta")
            out.append(dataclasses.replace(c, SPLIT_K=im.split_k_for(N, K, c.BLOCK_N, sms, per_sm)))
    return list(dict.fromkeys(out))


def unroll_variants(base: list, N: int, K: int, sms: int) -> list:
    """The K slice's loop unrolled whole (``UNROLL``), uncapped and capped at 64 registers (8 programs of 4
    warps per SM), for the dispatcher's one-column-group configs; two column groups capped at 128."""
    out = list(base)
    for c in base:
        if (K // 128) // c.SPLIT_K > 16:
            continue
        if c.GROUPS_PER_WARP == 1:
            out += [dataclasses.replace(c, UNROLL=True), dataclasses.replace(c, UNROLL=True, maxnreg=64)]
        else:
            out += [dataclasses.replace(c, UNROLL=True, maxnreg=128)]
    return list(dict.fromkeys(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,28672x4096,4096x14336,4096x4096")
    ap.add_argument("--ring", action="store_true", help="also the ring and chain variants")
    ap.add_argument("--unroll", action="store_true", help="the unrolled variants only (fields at git b29199a)")
    args = ap.parse_args()
    global RING
    RING = args.ring
    for shape, sms in probe_shapes(args.shapes, args.csv, width=110):
        N, K = shape.N, shape.K
        shape.stream_read(sms)
        base = dispatcher_configs(shape, sms)
        plain = {}
        for cfg in (unroll_variants if args.unroll else variants)(base, N, K, sms):
            key = dataclasses.replace(cfg, UNROLL=False, maxnreg=None) if args.unroll else \
                dataclasses.replace(cfg, STAGES=0, PIN="")
            got = shape.run_config(cfg, plain.get(key) if key != cfg else None)
            if key == cfg:
                plain[key] = got


if __name__ == "__main__":
    main()
