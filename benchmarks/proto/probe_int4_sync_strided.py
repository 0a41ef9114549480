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
from bench_common import RowWriter, copies_for_cold, cycling, versions, warm_up_clocks  # noqa: E402
from bench_int4_mma import floor_us, zoo_weight  # noqa: E402
from probe_int4_m1 import stream_read_kernel  # noqa: E402
from fusekern.kernels import decode_mm as dm  # noqa: E402
from fusekern.kernels import int4_mma_sync as ims  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402


@triton.jit
def pattern_read_kernel(q_ptr, out_ptr, N, SQN: tl.constexpr, PER: tl.constexpr, SPLIT_K: tl.constexpr,
                        STRIDED: tl.constexpr, AHEAD: tl.constexpr, THREADS: tl.constexpr):
    """int4_mma_sync's loads of words (one column group per warp), XORed per lane."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tid = ims._thread_index(tl.zeros((THREADS,), tl.int32), True)
    warp = tid // 32
    g = (tid % 32) // 4
    c = tid % 4
    n0 = tl.minimum(pid_n * (THREADS // 2) + warp * 16 + g, N - 1)
    n1 = tl.minimum(n0 + 8, N - 1)
    wp0 = q_ptr + n0.to(tl.int64) * SQN + c * 4
    wp1 = q_ptr + n1.to(tl.int64) * SQN + c * 4
    t0 = pid_k if STRIDED else pid_k * PER
    DT: tl.constexpr = SPLIT_K if STRIDED else 1
    acc = tl.zeros((THREADS,), tl.int32)
    if AHEAD:
        for i in tl.static_range(PER):
            a0, a1, a2, a3 = ims._load4(wp0 + (t0 + i * DT) * 16, True, 1, True, True)
            b0, b1, b2, b3 = ims._load4(wp1 + (t0 + i * DT) * 16, True, 1, True, True)
            acc ^= a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3
    else:
        for i in range(PER):
            a0, a1, a2, a3 = ims._load4(wp0 + (t0 + i * DT) * 16, True, 1, True, True)
            b0, b1, b2, b3 = ims._load4(wp1 + (t0 + i * DT) * 16, True, 1, True, True)
            acc ^= a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3
    tl.store(out_ptr + (pid_k * tl.num_programs(0) + pid_n) * THREADS + tid, acc)


@triton.jit
def pattern_ring_kernel(q_ptr, out_ptr, N, SQN: tl.constexpr, PER: tl.constexpr, SPLIT_K: tl.constexpr,
                        STAGES: tl.constexpr, THREADS: tl.constexpr, DECL: tl.constexpr, WAIT: tl.constexpr):
    """``pattern_read_kernel``'s loads through a per-lane cp.async ring of STAGES slots (no arithmetic but XOR)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tid = ims._thread_index(tl.zeros((THREADS,), tl.int32), True)
    warp = tid // 32
    g = (tid % 32) // 4
    c = tid % 4
    n0 = tl.minimum(pid_n * (THREADS // 2) + warp * 16 + g, N - 1)
    n1 = tl.minimum(n0 + 8, N - 1)
    wp0 = q_ptr + n0.to(tl.int64) * SQN + c * 4
    wp1 = q_ptr + n1.to(tl.int64) * SQN + c * 4
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
    tl.store(out_ptr + (pid_k * tl.num_programs(0) + pid_n) * THREADS + tid, acc)


@triton.jit
def _ring_issue(dst, p0, p1, CHUNK: tl.constexpr):
    return tl.inline_asm_elementwise(
        "cp.async.cg.shared.global [$1], [$2], 16; cp.async.cg.shared.global [$3], [$4], 16; "
        "cp.async.commit_group; mov.u32 $0, 0;",
        "=r,r,l,r,l", [dst, p0, dst + CHUNK, p1], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ring_read(src, CHUNK: tl.constexpr, token, WAIT: tl.constexpr):
    return tl.inline_asm_elementwise(
        WAIT + "ld.shared.v4.b32 {$0, $1, $2, $3}, [$8]; ld.shared.v4.b32 {$4, $5, $6, $7}, [$9];",
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [src, src + CHUNK, token], dtype=(tl.int32,) * 8, is_pure=False, pack=1)


def median_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


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
    warm_up_clocks()
    meta = versions()
    out = RowWriter(args.csv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        _, leaves, lay = zoo_weight("int4_k_stack", N, K)
        weights = copies_for_cold(leaves)
        copies = len(weights)
        fl = floor_us(leaves, N, K, 1)
        x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        ref = pm.packed_mm_reference(x, leaves, lay, K, N).float().to(x.device)
        print(f"== int4_k_stack {N}x{K} M=1 floor {fl:.2f} us ({copies} copies cold)", flush=True)

        def row(kind, cfg, err, warm, cold):
            out.write(dict(**meta, format="int4_k_stack", N=N, K=K, M=1, kernel=kind, config=cfg,
                           warm_us=round(warm, 2), cold_us=round(cold, 2), floor_us=round(fl, 2),
                           x_floor_cold=round(cold / fl, 2), rel_err=err))
            print(f"  {cfg:100s} warm {warm:7.2f}  cold {cold:7.2f} us  x{cold / fl:.2f}  {err}", flush=True)

        grid, block, unroll = 4 * sms, 512, 8
        sink = torch.empty(grid * block, dtype=torch.int32, device="cuda")
        words = [w[0].view(torch.int32) for w in weights]

        def read(i):
            return lambda: stream_read_kernel[(grid,)](words[i], sink, words[i].numel(), BLOCK=block,
                                                       UNROLL=unroll, num_warps=4)
        row("stream_read", f"stream read (codes only) BLOCK={block} UNROLL={unroll} 4/SM", "",
            median_us(read(0)), median_us(cycling([read(i) for i in range(copies)])))
        base = [c for c in dm._packed_candidates(1, N, K, sms, lay) if isinstance(c, ims.Int4MmaSync)]
        tiles = triton.cdiv(N, 64)
        for split in sorted({c.SPLIT_K for c in base if c.GROUPS_PER_WARP == 1}) if args.pattern else ():
            per = K // 128 // split
            psink = torch.empty(split * tiles * 128, dtype=torch.int32, device="cuda")
            for strided in (False, True):
                for ahead in ((False, True) if per <= 32 else (False,)):
                    def pread(i, strided=strided, ahead=ahead, split=split, per=per, psink=psink):
                        return lambda: pattern_read_kernel[(tiles, split)](
                            words[i], psink, N, SQN=K // 8, PER=per, SPLIT_K=split, STRIDED=strided, AHEAD=ahead,
                            THREADS=128, num_warps=4)
                    row("pattern_read", f"pattern read SPLIT_K={split} strided={strided} ahead={ahead}", "",
                        median_us(pread(0)), median_us(cycling([pread(i) for i in range(copies)])))
        if args.pattern:
            for split in sorted({c.SPLIT_K for c in base if c.GROUPS_PER_WARP == 1}):
                per = K // 128 // split
                psink = torch.empty(split * tiles * 128, dtype=torch.int32, device="cuda")
                for stages in (2, 3, 4, 6):
                    decl = f"{{ .shared .align 16 .b8 fk_pring[{stages * 2 * 128 * 16}]; mov.u32 $0, fk_pring; }}"

                    def rread(i, stages=stages, split=split, per=per, psink=psink, decl=decl):
                        return lambda: pattern_ring_kernel[(tiles, split)](
                            words[i], psink, N, SQN=K // 8, PER=per, SPLIT_K=split, STAGES=stages, THREADS=128,
                            DECL=decl, WAIT=f"cp.async.wait_group {stages - 1}; ", num_warps=4)
                    row("pattern_ring", f"pattern read, cp.async ring SPLIT_K={split} STAGES={stages}", "",
                        median_us(rread(0)), median_us(cycling([rread(i) for i in range(copies)])))
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
        plain = {}
        for cfg in variants:
            try:
                got = pm.packed_mm(x, leaves, lay, K, N, cfg)
                err = f"{((got.float() - ref).norm() / ref.norm()).item():.2e}"
                key = dataclasses.replace(cfg, STAGE_SZ=False, NAP=0, NAP_PHASES=2, LATE_FOLD=False)
                if cfg.DROP:
                    err += " (DROP: wrong by design)"
                if key == cfg:
                    plain[key] = got
                elif not cfg.STRIDED_K and not cfg.DROP and key in plain and not torch.equal(got, plain[key]):
                    err += " DIFFERS FROM PLAIN"

                def call(i, cfg=cfg):
                    return lambda: pm.packed_mm(x, weights[i], lay, K, N, cfg)
                row("Int4MmaSync", str(cfg).replace("Int4MmaSync", ""), err, median_us(call(0)),
                    median_us(cycling([call(i) for i in range(copies)])))
            except Exception as e:  # a config that does not compile or fit
                print(f"  {cfg}: n/a ({type(e).__name__}: {str(e)[:200]})", flush=True)
    out.close()


if __name__ == "__main__":
    main()
