"""Where does the M = 1 int4 time go? (probe, H200)

    python benchmarks/proto/probe_int4_m1.py [--ncu]

1. Read-only kernels over the same bytes (int32 words [N, K/8]): tiles [BLOCK_N, BLOCK_K / 8] read with
   vector loads along K over (N / BLOCK_N, SPLIT_K) programs (tile shapes and grids like the GEMV's and
   int4_mma's; a split that does not divide the K tiles is lowered to one that does), and a grid-stride
   streaming read: the time the loads alone take (no decode, no MMA), the practical floor at this size.
2. int4_mma as the dispatcher offers it (direct and TMA words, 4 and 2 programs per SM; not scale_first),
   the two GEMV configs it offers for these codes, and two vector-K GEMV configs it does not offer.
Timed with do_bench_cudagraph. With --ncu, each kernel runs twice without CUDA graphs (for ncu's
counters: ``benchmarks/results/h200/int4_m1_ncu.csv`` keeps the second), and nothing is timed or printed.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from bench_common import warm_up_clocks  # noqa: E402
from bench_int4_mma import floor_us, zoo_weight  # noqa: E402
from fusekern.kernels import int4_mma as im  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402


@triton.jit
def read_tiles_kernel(q_ptr, out_ptr, KW, BLOCK_N: tl.constexpr, BKW: tl.constexpr, TILES: tl.constexpr,
                      VEC: tl.constexpr):
    """Program (n tile, k split) reads TILES tiles [BLOCK_N, BKW] of K-contiguous words, xor-folds them."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BKW)
    if VEC:
        kk = tl.max_contiguous(tl.multiple_of(kk, 4), 4)
    acc = tl.zeros((BLOCK_N, BKW), dtype=tl.int32)
    for t in range(pid_k * TILES, (pid_k + 1) * TILES):
        w = tl.load(q_ptr + n[:, None] * KW + t * BKW + kk[None, :])
        acc ^= w
    tl.store(out_ptr + (pid_k * tl.num_programs(0) + pid_n) * BLOCK_N + tl.arange(0, BLOCK_N),
             tl.xor_sum(acc, 1))


@triton.jit
def stream_read_kernel(q_ptr, out_ptr, n_words, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Grid-stride streaming read, UNROLL blocks of BLOCK words in flight per iteration."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    step = tl.num_programs(0) * BLOCK * UNROLL
    for base in range(pid * BLOCK * UNROLL, n_words, step):
        for u in tl.static_range(UNROLL):
            offs = base + u * BLOCK + tl.arange(0, BLOCK)
            acc ^= tl.load(q_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--shapes", default="8192x8192,14336x4096,4096x4096")
    args = ap.parse_args()
    run = (lambda f: [f(), f()]) if args.ncu else bench
    if not args.ncu:
        warm_up_clocks()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        _, leaves, lay = zoo_weight("int4_k_stack", N, K)
        fl = floor_us(leaves, N, K, 1)
        KW = K // 8
        q = leaves[0].view(torch.int32).reshape(N, KW) if leaves[0].dtype != torch.int32 else leaves[0]
        res = {}
        # 1a: the streaming read
        for block, unroll, per_sm in ((1024, 4, 2), (1024, 8, 2), (2048, 4, 2), (1024, 4, 4), (512, 8, 4)):
            grid = sms * per_sm
            out = torch.empty(grid * block, dtype=torch.int32, device="cuda")
            f = lambda: stream_read_kernel[(grid,)](q, out, q.numel(), BLOCK=block, UNROLL=unroll, num_warps=4)
            res[f"stream b{block} u{unroll} {per_sm}/SM"] = run(f)
        # 1b: GEMV / int4_mma tile reads: (BLOCK_N, BLOCK_K) x split K
        for bn, bk, sk, warps in ((64, 128, 9, 4), (64, 128, 5, 4), (128, 128, 8, 4), (128, 128, 4, 4),
                                  (128, 256, 4, 4), (64, 256, 8, 4), (32, 512, 4, 4)):
            tiles_k = K // bk
            if tiles_k % sk:
                sk = max(d for d in range(1, sk + 1) if tiles_k % d == 0)
            grid = (N // bn, sk)
            out = torch.empty(N * sk, dtype=torch.int32, device="cuda")
            f = lambda: read_tiles_kernel[grid](q, out, KW, BLOCK_N=bn, BKW=bk // 8, TILES=tiles_k // sk,
                                                VEC=True, num_warps=warps)
            res[f"tiles {bn}x{bk} sk{sk} w{warps}"] = run(f)
        # 2: the shipped kernels
        x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        for per_sm in (4, 2):
            sk = im.split_k_for(N, K, 128, sms, per_sm)
            for cfg in (im.Int4Mma(128, sk, 4), im.Int4Mma(128, sk, 4, tma=True, num_stages=3),
                        im.Int4Mma(128, sk, 4, tma=True, num_stages=4)):
                res[str(cfg)] = run(lambda: pm.packed_mm(x, leaves, lay, K, N, cfg))
        for cfg in (pm.PackedGemv(64, 128, 5, 4), pm.PackedGemv(64, 128, 9, 4),
                    pm.PackedGemv(128, 256, 4, 4, vec_k=True), pm.PackedGemv(64, 256, 8, 4, vec_k=True)):
            try:
                res[str(cfg)] = run(lambda: pm.packed_mm(x, leaves, lay, K, N, cfg))
            except Exception as e:  # a config the layout check refuses
                res[str(cfg)] = f"refused: {str(e)[:60]}"
        if not args.ncu:
            print(f"== int4_k_stack {N}x{K} M=1 floor {fl:.2f} us "
                  f"(codes {q.numel() * 4 / 1e6:.1f} MB: {q.numel() * 4 / 4.3e6:.2f} us at 4.3 TB/s)")
            for k, v in res.items():
                print(f"  {k:90s} {v if isinstance(v, str) else f'{v:7.2f} us  x{v / fl:.2f}'}")


if __name__ == "__main__":
    main()
