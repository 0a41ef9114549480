"""int4 along K on warp-level tensor cores (``int4_mma_sync``) against the kernels the dispatcher offered before.

    python benchmarks/sweep_int4_mma_sync.py [--csv OUT.csv] [--formats int4_k_stack,gptq]
                                             [--shapes 14336x4096,...] [--ms 1,4,8] [--others 0|1]

Per shape (N x K) and M: the dispatcher's other hand-tuned candidates (GEMV tiles, swap-AB tiles,
``int4_mma``, decode + cuBLAS), then ``int4_mma_sync`` with one or two 16-column groups per warp (one or two groups of words
loaded ahead) and K split
for 2-16 programs per SM. Every config is checked against the float64 reference and timed in a CUDA graph
(``do_bench_cudagraph``, median); the floor moves the codes, zeros and scales once at 4.3 TB/s.
"""
from __future__ import annotations

import argparse

import torch

from bench_common import RowWriter, check_and_time, versions, warm_up_clocks
from bench_int4_mma import floor_us, zoo_weight
from fusekern.kernels import decode_mm as dm
from fusekern.kernels import int4_mma_sync as ims
from fusekern.kernels import packed_mm as pm


def configs(N: int, K: int, sms: int) -> list:
    out = [ims.Int4MmaSync(SPLIT_K=ims.split_k(N, K, 64 * gpw, sms, per_sm), GROUPS_PER_WARP=gpw, PREFETCH=pf)
           for gpw, pf in ((1, 1), (1, 2), (2, 1)) for per_sm in (2, 4, 8, 16)]
    return list(dict.fromkeys(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--formats", default="int4_k_stack,gptq")
    ap.add_argument("--shapes", default="14336x4096,4096x14336,4096x4096,8192x8192,1024x4096")
    ap.add_argument("--others", type=int, default=1, help="0: only int4_mma_sync configs")
    ap.add_argument("--ms", default="1,8")
    args = ap.parse_args()
    warm_up_clocks()
    meta = versions()
    out = RowWriter(args.csv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            N, K = map(int, shape.split("x"))
            _, leaves, lay = zoo_weight(fmt, N, K)
            for M in map(int, args.ms.split(",")):
                x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
                ref = pm.packed_mm_reference(x, leaves, lay, K, N).float().to(x.device)
                floor = floor_us(leaves, N, K, M)
                others = [c for c in dm._packed_candidates(M, N, K, sms, lay, x.dtype)
                          if not isinstance(c, ims.Int4MmaSync)] if args.others else []
                best = {}
                for cfg in others + configs(N, K, sms):
                    err, us = check_and_time(lambda: pm.packed_mm(x, leaves, lay, K, N, cfg), ref)
                    kind = type(cfg).__name__
                    row = dict(**meta, format=fmt, N=N, K=K, M=M, kernel=kind, config=str(cfg),
                               us=us if isinstance(us, str) else round(us, 2), floor_us=round(floor, 2),
                               x_floor="" if isinstance(us, str) else round(us / floor, 2), rel_err=f"{err:.2e}")
                    out.write(row)
                    if not isinstance(us, str) and err < 4e-3 and us < best.get(kind, (1e9,))[0]:
                        best[kind] = (us, cfg)
                    print(f"{fmt} {N}x{K} M={M} {str(cfg):90s} {row['us']!s:>8} us  x{row['x_floor']}  "
                          f"err {row['rel_err']}", flush=True)
                print(f"BEST {fmt} {N}x{K} M={M} floor {floor:.2f}: " + "; ".join(
                    f"{k} {v[0]:.2f}" for k, v in sorted(best.items())), flush=True)
    out.close()


if __name__ == "__main__":
    main()
