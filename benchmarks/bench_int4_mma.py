"""W4A16 (g128) at decode sizes: the register-decoded int4 tensor-core kernel against the other packed kernels.

    python benchmarks/bench_int4_mma.py [--csv OUT.csv] [--formats gptq,int4_k_stack] [--shapes 8192x8192,...]
                                        [--ms 1,16]

Formats: GPTQ (int32 words, packed zeros) and two codes per byte with uint8 zeros (the demo's W4A16).

Per shape (N x K) and M: every config the dispatcher offers (``decode_mm.candidates``: GEMV tiles,
swap-AB ``packed_dot`` tiles, ``int4_mma``, decode + cuBLAS), each checked against the float64 reference
and timed in a CUDA graph (``do_bench_cudagraph``, median), and the one ``decode_mm.tuned_config`` picks
(``chosen``). The floor moves the codes, zeros and scales at the floor bandwidth. (benchmarks/results/h200/
gptq_mma.csv is this script's GPTQ run when it was bench_gptq_mma.py and the kernel gptq_mma.)
"""
from __future__ import annotations

import argparse

import torch

from bench_common import (RowWriter, check_and_time, copies_for_cold, cycling, floor_bandwidth, versions,
                          warm_up_clocks)
from fusekern.kernels import decode_mm as dm
from fusekern.kernels import packed_mm as pm
from fusekern.patterns.decode.formats import recognize
from fusekern.patterns.decode.layout import derive_layout
from fusekern.patterns.decode.program import DecodeProgram
from fusekern.testing.decode_cones import decode_program
from fusekern.testing.decode_zoo import BY_NAME

SHAPES = "8192x8192,4096x4096,14336x4096,4096x14336,128256x4096"
BANDWIDTH = floor_bandwidth()


def floor_us(leaves, N: int, K: int, M: int) -> float:
    weight = sum(t.numel() * t.element_size() for t in leaves)
    return (weight + 2 * M * (K + N)) / BANDWIDTH * 1e6


def zoo_weight(fmt: str, N: int, K: int):
    """(decode program text, leaves on the GPU, layout) of the zoo format ``fmt`` at N x K, groups of 128,
    bf16 scales, seed 0."""
    case = BY_NAME[fmt]
    torch.manual_seed(0)
    ws = [w.to(torch.bfloat16) if w.dtype == torch.float32 else w for w in case.make(K, N, 128, "cpu")]
    text, leaves, consts = decode_program(case.fn, torch.randn(1, K, dtype=torch.bfloat16), *ws)
    prog = DecodeProgram.from_text(text)
    lay = derive_layout(prog, recognize(prog, consts), consts)
    return text, [t.cuda() for t in leaves], lay


def sweep_against_others(args, kernel_cls, configs, best_max_err: float | None = None, kind=None,
                         columns=None) -> None:
    """One kernel's configs (``configs(N, K, sms)``) beside the dispatcher's other candidates (``args.others``,
    none without it) for each of ``args.formats``, ``args.shapes`` (N x K) and ``args.ms``: every config
    checked against the float64 reference and timed in a CUDA graph (median), a CSV row each (``args.csv``),
    and the fastest of each kind printed (``kind(cfg)``, by default the config's class; ``best_max_err``: only
    configs within this error count). ``columns(cfg)``: more CSV columns of a config. ``args.cold``: each call
    reads another copy of the weight (``copies_for_cold``), so the weight comes from DRAM as in a decoder."""
    kind = kind or (lambda cfg: type(cfg).__name__)
    columns = columns or (lambda cfg: {})
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
                          if not isinstance(c, kernel_cls)] if getattr(args, "others", 0) else []
                best = {}
                weights = copies_for_cold(leaves) if getattr(args, "cold", False) else [leaves]
                for cfg in others + configs(N, K, sms):
                    err, us = check_and_time(lambda: pm.packed_mm(x, leaves, lay, K, N, cfg), ref, timed=cycling(
                        [lambda w=w, cfg=cfg: pm.packed_mm(x, w, lay, K, N, cfg) for w in weights]))
                    row = dict(**meta, format=fmt, N=N, K=K, M=M, kernel=type(cfg).__name__, config=str(cfg),
                               cold=len(weights) > 1, **columns(cfg), us=us if isinstance(us, str) else round(us, 2),
                               floor_us=round(floor, 2), x_floor="" if isinstance(us, str) else round(us / floor, 2),
                               rel_err=f"{err:.2e}")
                    out.write(row)
                    ok = best_max_err is None or err < best_max_err
                    if not isinstance(us, str) and ok and us < best.get(kind(cfg), (1e9,))[0]:
                        best[kind(cfg)] = (us, cfg)
                    print(f"{fmt} {N}x{K} M={M} {str(cfg):90s} {row['us']!s:>8} us  x{row['x_floor']}  "
                          f"err {row['rel_err']}", flush=True)
                print(f"BEST {fmt} {N}x{K} M={M} floor {floor:.2f}: " + "; ".join(
                    f"{k} {v[0]:.2f}" for k, v in sorted(best.items())), flush=True)
    out.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--formats", default="gptq,int4_k_stack")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ms", default="1,16")
    args = ap.parse_args()
    warm_up_clocks()
    meta = versions()
    out = RowWriter(args.csv)
    for fmt, shape in ((f, s) for f in args.formats.split(",") for s in args.shapes.split(",")):
        N, K = map(int, shape.split("x"))
        text, leaves, lay = zoo_weight(fmt, N, K)
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
            ref = pm.packed_mm_reference(x, leaves, lay, K, N).float().to(x.device)
            chosen = dm.tuned_config(x, leaves, text, None, 1, M, lay.to_text())
            for cfg in dm.candidates(M, N, K, 1, torch.cuda.get_device_properties(0).multi_processor_count,
                                     lay.to_text(), x.dtype):
                if not isinstance(cfg, (dm.Config, dm.DequantConfig)):  # the hand-tuned kernels (and their decode)
                    err, us = check_and_time(lambda: pm.packed_mm(x, leaves, lay, K, N, cfg), ref)
                    row = dict(**meta, format=fmt, N=N, K=K, M=M, kernel=type(cfg).__name__, config=str(cfg),
                               chosen=cfg == chosen, us=us if isinstance(us, str) else round(us, 2),
                               floor_us=round(floor_us(leaves, N, K, M), 2), rel_err=f"{err:.2e}")
                    out.write(row)
                    print(f"{fmt} {N}x{K} M={M:3d} {str(cfg):80s} {row['us']!s:>8} us  floor {row['floor_us']}  "
                          f"err {row['rel_err']}{'  <- chosen' if row['chosen'] else ''}", flush=True)
    out.close()


if __name__ == "__main__":
    main()
