"""Sweep the FP8-KV decode attention kernel's launch parameters (issue 6's attention target).

    python benchmarks/sweep_fp8_kv_attention.py [--csv benchmarks/results/h200/fp8_kv_attention_sweep.csv]

For each split count (given, or the heuristic's for a target of programs per SM), tile size (TILE_BYTES:
one fp8 K tile), pipeline depth, warp count and register cap: the
kernel's result checked against the float64 reference, then its GPU time in a CUDA graph
(``do_bench_cudagraph`` median; the kernel alone, the host's launch path excluded). The module's
heuristics are module constants read at each call, so the sweep sets them in turn.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from bench_common import RowWriter, floor_bandwidth, versions, warm_up_clocks
from fusekern.kernels import fp8_kv_attention as A

BW = floor_bandwidth()  # bytes/s (bench_common: per GPU)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shape", default="8,32,8,8192", help="B,Hq,Hkv,S (d = 128)")
    ap.add_argument("--splits", default="6,7,8,9,16")
    ap.add_argument("--tile-bytes", default="4096,8192,16384")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--maxnreg", default="0", help="register caps per thread, 0 for none")
    ap.add_argument("--ctas", default="4", help="programs per SM the split heuristic aims for")
    args = ap.parse_args()
    dev = "cuda"
    warm_up_clocks(dev)
    out = RowWriter(args.csv)
    B, Hq, Hkv, S = map(int, args.shape.split(","))
    D = 128
    g = torch.Generator(device=dev).manual_seed(S)
    q = torch.randn(B, Hq, 1, D, device=dev, generator=g).to(torch.bfloat16)
    k8 = torch.randn(B, Hkv, S, D, device=dev, generator=g).to(torch.float8_e4m3fn)
    v8 = torch.randn(B, Hkv, S, D, device=dev, generator=g).to(torch.float8_e4m3fn)
    ks = torch.rand(B, Hkv, S, device=dev, generator=g) * 0.1 + 0.01
    vs = torch.rand(Hkv, device=dev, generator=g) * 0.1 + 0.01
    c = D ** -0.5
    ref = A.reference_fp8_kv_attention(q, k8, ks, v8, vs, c).float()
    floor = (2 * B * Hkv * S * D + 4 * B * Hkv * S) / BW * 1e6
    default = dict(TILE_BYTES=A.TILE_BYTES, NUM_STAGES=A.NUM_STAGES, NUM_WARPS=A.NUM_WARPS, MAXNREG=A.MAXNREG,
                   CTAS_PER_SM_WANTED=A.CTAS_PER_SM_WANTED)
    print(f"default splits {A.kv_splits(B * Hkv, S, 132)}, {default}, floor {floor:.1f} us")
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    grid = itertools.product(ints(args.tile_bytes), ints(args.stages), ints(args.warps), ints(args.maxnreg),
                             ints(args.ctas), [None] + ints(args.splits))
    for tile_bytes, stages, warps, maxnreg, ctas, splits in grid:
        if splits is not None and ctas != ints(args.ctas)[0]:
            continue  # explicit split counts: once, not again for every heuristic target
        A.TILE_BYTES, A.NUM_STAGES, A.NUM_WARPS = tile_bytes, stages, warps
        A.MAXNREG, A.CTAS_PER_SM_WANTED = maxnreg or None, ctas
        f = lambda: A.fp8_kv_decode_attention(q, k8, ks, v8, vs, c, num_splits=splits)  # noqa: E731
        try:
            f()  # compile
            # poison: a NaN block of the output's size left in the caching allocator, which the next
            # output most likely reuses (a kernel that skips part of its output then shows NaN)
            torch.full(q.shape, float("nan"), dtype=q.dtype, device=dev)
            got = f().float()
            err = ((got - ref).norm() / ref.norm()).item()
            us = triton.testing.do_bench_cudagraph(f, rep=100, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001 - reported (e.g. out of shared memory), the sweep goes on
            print(f"tile {tile_bytes} stages {stages} warps {warps} maxnreg {maxnreg} splits {splits}: "
                  f"{type(e).__name__}: {str(e)[:160]}")
            continue
        used = splits if splits is not None else A.kv_splits(B * Hkv, S, 132)
        block = A.block_tokens(D, A.padded_rows(Hq // Hkv))
        row = dict(B=B, Hq=Hq, Hkv=Hkv, D=D, S=S, tile_bytes=tile_bytes, block_s=block, stages=stages,
                   warps=warps, maxnreg=maxnreg, ctas_per_sm=ctas, splits=used,
                   programs=B * Hkv * A.split_chunk(S, used, block)[1],
                   us_cudagraph=round(us, 2), x_floor=round(us / floor, 3), rel_err=f"{err:.2e}", **versions())
        print(row)
        out.write(row)
    for name, value in default.items():
        setattr(A, name, value)
    out.close()


if __name__ == "__main__":
    main()
