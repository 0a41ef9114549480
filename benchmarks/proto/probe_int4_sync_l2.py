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

import torch
import triton

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/proto")
from bench_common import RowWriter, copies_for_cold, cycling, versions, warm_up_clocks  # noqa: E402
from bench_int4_mma import floor_us, zoo_weight  # noqa: E402
from probe_int4_m1 import stream_read_kernel  # noqa: E402
from fusekern.kernels import decode_mm as dm  # noqa: E402
from fusekern.kernels import int4_mma_sync as ims  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402

def median_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,4096x4096,28672x4096,4096x14336")
    args = ap.parse_args()
    warm_up_clocks()
    meta = versions()
    out = RowWriter(args.csv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        _, leaves, lay = zoo_weight("int4_k_stack", N, K)
        nbytes = sum(t.numel() * t.element_size() for t in leaves)
        weights = copies_for_cold(leaves)
        copies = len(weights)
        fl = floor_us(leaves, N, K, 1)
        x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        ref = pm.packed_mm_reference(x, leaves, lay, K, N).float().to(x.device)
        print(f"== int4_k_stack {N}x{K} M=1 floor {fl:.2f} us ({nbytes / 1e6:.1f} MB, {copies} copies cold)",
              flush=True)

        def row(kind, cfg, err, warm, cold):
            out.write(dict(**meta, format="int4_k_stack", N=N, K=K, M=1, kernel=kind, config=cfg,
                           warm_us=round(warm, 2), cold_us=round(cold, 2), floor_us=round(fl, 2),
                           x_floor_cold=round(cold / fl, 2), rel_err=err))
            print(f"  {cfg:100s} warm {warm:7.2f}  cold {cold:7.2f} us  x{cold / fl:.2f}  {err}", flush=True)

        for block, unroll, per_sm in ((1024, 4, 4), (512, 8, 4), (1024, 4, 8)):
            grid = sms * per_sm
            sink = torch.empty(grid * block, dtype=torch.int32, device="cuda")
            words = [w[0].view(torch.int32) for w in weights]

            def read(i, grid=grid, sink=sink, block=block, unroll=unroll):
                return lambda: stream_read_kernel[(grid,)](words[i], sink, words[i].numel(), BLOCK=block,
                                                           UNROLL=unroll, num_warps=4)
            row("stream_read", f"stream read (codes only) BLOCK={block} UNROLL={unroll} {per_sm}/SM", "",
                median_us(read(0)), median_us(cycling([read(i) for i in range(copies)])))
        for cfg in [c for c in dm._packed_candidates(1, N, K, sms, lay) if isinstance(c, ims.Int4MmaSync)]:
            try:
                got = pm.packed_mm(x, leaves, lay, K, N, cfg).float()
                err = f"{((got - ref).norm() / ref.norm()).item():.2e}"

                def call(i, cfg=cfg):
                    return lambda: pm.packed_mm(x, weights[i], lay, K, N, cfg)
                row("Int4MmaSync", str(cfg), err, median_us(call(0)),
                    median_us(cycling([call(i) for i in range(copies)])))
            except Exception as e:  # a config that does not compile or fit
                print(f"  {cfg}: n/a ({type(e).__name__}: {str(e)[:100]})", flush=True)
    out.close()


if __name__ == "__main__":
    main()
