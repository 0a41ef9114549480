"""Is int4_mma_sync held back by the order it reads the weight in, its scale loads, or what? (probe, H200; the
kernel variants are config fields at git 1a1fc12 only, where this runs)

    python benchmarks/proto/probe_int4_sync_strided.py [--csv OUT.csv] [--shapes 8192x8192,...] [--pattern]
                                                       [--strided] [--stage] [--nap] [--drop] [--late]

int4 two codes per byte (the demo's W4A16), M = 1, timed warm (one weight again and again) and cold (cycling
through copies of the weight, > 120 MB) with ``do_bench_cudagraph`` medians; every kernel config checked
against the float64 reference and, where its arithmetic is the plain kernel's, against it bit for bit. Per
shape a plain streaming read of the code bytes, the dispatcher's ``int4_mma_sync`` configs and:
- ``--pattern``: the kernel's grid and word loads (the same 16-byte ``ld.global.nc.L1::no_allocate`` per lane
  and group) with no arithmetic but an XOR: contiguous K slices or interleaved groups (``strided``), one group
  at a time or a slice at once (``ahead``); and the same loads through a per-lane cp.async ring of 2-6 slots.
  Result files: ``int4_mma_sync_strided_probe.csv`` (with ``--strided``), ``int4_mma_sync_nap_probe.csv``.
- ``--strided``: ``STRIDED_K``, the split programs of a column tile take every SPLIT_K-th group, so that they
  read neighbouring 64-byte pieces of the same rows at once.
- ``--stage``: ``STAGE_SZ``, the program's scales and zeros copied into shared memory before the loop (one
  barrier) and read from there (ncu put 29% of the plain kernel's stall samples on a group's first use of
  its scale). ``int4_mma_sync_stage_probe.csv``.
- ``--nap``: ``NAP``, warps start 150 or 400 ns apart in 2 or 4 phases (are they in step: all waiting on
  memory, then all computing?). ``int4_mma_sync_nap_probe.csv``.
- ``--drop``: ``DROP``, wrong results by design, what each part costs: the words loaded once (1), no sum-x
  MMAs (2), the scales and zeros loaded once (8), at a 64-register cap. ``int4_mma_sync_drop_probe.csv``.
- ``--late``: ``LATE_FOLD``, a group's fold (scale, zero, sum x) done in the next iteration, off the group's
  critical path. ``int4_mma_sync_late_fold_probe.csv``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/proto")
from int4_sync_probe import ProbeShape, dispatcher_configs, probe_shapes  # noqa: E402
from fusekern.kernels import int4_mma_sync as ims  # noqa: E402


@triton.jit
def _lane_rows(q_ptr, N, SQN: tl.constexpr, THREADS: tl.constexpr):
    """int4_mma_sync's lane roles (one column group per warp): the thread index and the addresses of the lane's
    word rows g and g + 8, at its quarter c of a group."""
    tid = ims._thread_index(tl.zeros((THREADS,), tl.int32), True)
    n0 = tl.minimum(tl.program_id(0) * (THREADS // 2) + (tid // 32) * 16 + (tid % 32) // 4, N - 1)
    n1 = tl.minimum(n0 + 8, N - 1)
    c = tid % 4
    return tid, q_ptr + n0.to(tl.int64) * SQN + c * 4, q_ptr + n1.to(tl.int64) * SQN + c * 4


@triton.jit
def pattern_read_kernel(q_ptr, out_ptr, N, SQN: tl.constexpr, PER: tl.constexpr, SPLIT_K: tl.constexpr,
                        STRIDED: tl.constexpr, AHEAD: tl.constexpr, THREADS: tl.constexpr):
    """int4_mma_sync's loads of words (one column group per warp), XORed per lane."""
    pid_k = tl.program_id(1)
    tid, wp0, wp1 = _lane_rows(q_ptr, N, SQN, THREADS)
    t0 = pid_k if STRIDED else pid_k * PER
    DT: tl.constexpr = SPLIT_K if STRIDED else 1
    acc = tl.zeros((THREADS,), tl.int32)
    if AHEAD:
        for i in tl.static_range(PER):
            acc ^= _xor8(wp0, wp1, t0 + i * DT)
    else:
        for i in range(PER):
            acc ^= _xor8(wp0, wp1, t0 + i * DT)
    tl.store(out_ptr + (pid_k * tl.num_programs(0) + tl.program_id(0)) * THREADS + tid, acc)


@triton.jit
def _xor8(wp0, wp1, t):
    """Group t's 16-byte word rows of the lane (past L1, as the kernel loads them), XORed."""
    a0, a1, a2, a3 = ims._load4(wp0 + t * 16, True, 1, True, True)
    b0, b1, b2, b3 = ims._load4(wp1 + t * 16, True, 1, True, True)
    return a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3


@triton.jit
def pattern_ring_kernel(q_ptr, out_ptr, N, SQN: tl.constexpr, PER: tl.constexpr, STAGES: tl.constexpr,
                        THREADS: tl.constexpr, DECL: tl.constexpr, WAIT: tl.constexpr):
    """``pattern_read_kernel``'s loads through a per-lane cp.async ring of STAGES slots (no arithmetic but XOR)."""
    pid_k = tl.program_id(1)
    tid, wp0, wp1 = _lane_rows(q_ptr, N, SQN, THREADS)
    t0 = pid_k * PER
    CHUNK: tl.constexpr = THREADS * 16
    SLOT: tl.constexpr = 2 * CHUNK
    lane = tl.inline_asm_elementwise(DECL, "=r,r", [tid], dtype=tl.int32, is_pure=True, pack=1) + tid * 16
    for s in tl.static_range(STAGES - 1):
        _ring_issue(lane + s * SLOT, wp0 + (t0 + s) * 16, wp1 + (t0 + s) * 16, CHUNK)
    acc = tl.zeros((THREADS,), tl.int32)
    for i in range(PER):
        tn = t0 + tl.minimum(i + STAGES - 1, PER - 1)
        tok = _ring_issue(lane + ((i + STAGES - 1) % STAGES) * SLOT, wp0 + tn * 16, wp1 + tn * 16, CHUNK)
        a0, a1, a2, a3, b0, b1, b2, b3 = _ring_read(lane + (i % STAGES) * SLOT, CHUNK, tok, WAIT)
        acc ^= a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3
    tl.store(out_ptr + (pid_k * tl.num_programs(0) + tl.program_id(0)) * THREADS + tid, acc)


@triton.jit
def _ring_issue(dst, p0, p1, CHUNK: tl.constexpr):
    """cp.async (L2 only) of the lane's two 16-byte word rows into its slot at dst, committed as one group."""
    return tl.inline_asm_elementwise(
        "cp.async.cg.shared.global [$1], [$2], 16; cp.async.cg.shared.global [$3], [$4], 16; "
        "cp.async.commit_group; mov.u32 $0, 0;",
        "=r,r,l,r,l", [dst, p0, dst + CHUNK, p1], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ring_read(src, CHUNK: tl.constexpr, token, WAIT: tl.constexpr):
    """Wait until the oldest group in flight has landed, then the lane's eight words of its slot at src."""
    return tl.inline_asm_elementwise(
        WAIT + "ld.shared.v4.b32 {$0, $1, $2, $3}, [$8]; ld.shared.v4.b32 {$4, $5, $6, $7}, [$9];",
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [src, src + CHUNK, token], dtype=(tl.int32,) * 8, is_pure=False, pack=1)


def pattern_rows(shape: ProbeShape, splits) -> None:
    """The kernel's grid and word loads without its arithmetic, plain and through a cp.async ring."""
    N, K = shape.N, shape.K
    tiles = triton.cdiv(N, 64)
    words = shape.words()
    for split in splits:
        per = K // 128 // split
        sink = torch.empty(split * tiles * 128, dtype=torch.int32, device="cuda")
        for strided in (False, True):
            for ahead in ((False, True) if per <= 32 else (False,)):
                def pread(i, strided=strided, ahead=ahead, split=split, per=per):
                    return lambda: pattern_read_kernel[(tiles, split)](
                        words[i], sink, N, SQN=K // 8, PER=per, SPLIT_K=split, STRIDED=strided, AHEAD=ahead,
                        THREADS=128, num_warps=4)
                shape.timed("pattern_read", f"pattern read SPLIT_K={split} strided={strided} ahead={ahead}", "",
                            pread)
        for stages in (2, 3, 4, 6):
            decl = f"{{ .shared .align 16 .b8 fk_pring[{stages * 2 * 128 * 16}]; mov.u32 $0, fk_pring; }}"

            def rread(i, stages=stages, split=split, per=per, decl=decl):
                return lambda: pattern_ring_kernel[(tiles, split)](
                    words[i], sink, N, SQN=K // 8, PER=per, STAGES=stages, THREADS=128, DECL=decl,
                    WAIT=f"cp.async.wait_group {stages - 1}; ", num_warps=4)
            shape.timed("pattern_ring", f"pattern read, cp.async ring SPLIT_K={split} STAGES={stages}", "", rread)


def kernel_variants(base: list, args) -> list:
    """The dispatcher's configs and the variants asked for (one column group per warp where noted)."""
    variants = base + [dataclasses.replace(c, STAGE_SZ=True) for c in base] if args.stage else list(base)
    for c in base:
        if c.GROUPS_PER_WARP == 1 and args.nap:
            variants += [dataclasses.replace(c, NAP=nap, NAP_PHASES=ph) for nap in (150, 400) for ph in (2, 4)]
        if c.GROUPS_PER_WARP == 1 and args.late:
            variants += [dataclasses.replace(c, LATE_FOLD=True), dataclasses.replace(c, LATE_FOLD=True, DROP=1)]
        if c.GROUPS_PER_WARP == 1 and args.drop:
            variants += [dataclasses.replace(c, DROP=d) for d in (1, 2, 8, 1 | 2 | 8)]
    if args.strided:
        variants += [dataclasses.replace(c, STRIDED_K=True) for c in base]
    return variants


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,28672x4096,4096x14336,4096x4096")
    ap.add_argument("--pattern", action="store_true", help="the pattern reads")
    ap.add_argument("--strided", action="store_true", help="the STRIDED_K configs")
    ap.add_argument("--stage", action="store_true", help="the STAGE_SZ configs")
    ap.add_argument("--nap", action="store_true", help="the NAP configs")
    ap.add_argument("--late", action="store_true", help="the LATE_FOLD configs")
    ap.add_argument("--drop", action="store_true", help="the DROP configs (wrong results: what each part costs)")
    args = ap.parse_args()
    for shape, sms in probe_shapes(args.shapes, args.csv):
        shape.stream_read(sms)
        base = dispatcher_configs(shape, sms)
        if args.pattern:
            pattern_rows(shape, sorted({c.SPLIT_K for c in base if c.GROUPS_PER_WARP == 1}))
        plain = {}
        for cfg in kernel_variants(base, args):
            key = dataclasses.replace(cfg, STAGE_SZ=False, NAP=0, NAP_PHASES=2, LATE_FOLD=False)
            same_math = key != cfg and not cfg.STRIDED_K and not cfg.DROP  # the plain kernel's bits expected
            got = shape.run_config(cfg, plain.get(key) if same_math else None,
                                   " (DROP: wrong by design)" if cfg.DROP else "")
            if key == cfg:
                plain[key] = got


if __name__ == "__main__":
    main()
