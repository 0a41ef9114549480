"""q / k / v and gate / up at 9-64 rows: ``int4_mma_group`` (one launch) against the members' own launches.

    python benchmarks/proto/probe_int4_mma_group.py [--ms 16,32,64] [--groups qkv,gate_up] [--cold] [--csv OUT]

The demo's W4A16 (two int4 codes per byte along K, 8-bit zeros, bf16 scales, groups of 128), K = 4096: q / k /
v is 4096 + 1024 + 1024 columns, gate / up 14336 + 14336. "separate" is what ran before the grouped launch
existed at these rows: each member through the ``decode_mm`` op, its kernel tuned by the dispatcher. Then every
``int4_mma`` config the grouped op's tuner offers (``decode_mm_group.group_candidates``), each member's output
checked against the float64 reference, and the config the tuner picks. Median µs in a CUDA graph; ``--cold``
cycles through copies of the weights (over 120 MB) so that every call reads them from DRAM, as a decoder does.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import triton.testing  # noqa: E402
from bench_common import RowWriter, copies_for_cold, cycling, versions, warm_up_clocks  # noqa: E402
from bench_int4_mma import floor_us, zoo_weight  # noqa: E402

from fusekern.kernels import decode_mm as dm  # noqa: E402
from fusekern.kernels import decode_mm_group as dmg  # noqa: E402
from fusekern.kernels import int4_mma as im  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402
from fusekern.kernels.device_info import sm_count  # noqa: E402
from fusekern.kernels.intmath import next_power_of_2  # noqa: E402
from fusekern.patterns.decode.program import DecodeProgram  # noqa: E402
from fusekern.testing import rel_err  # noqa: E402

K = 4096
GROUPS = {"qkv": (4096, 1024, 1024), "gate_up": (14336, 14336)}
TOL = 4e-3  # bf16 output against the float64 reference (tests/test_int4_mma.py)


def timed(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16,32,64")
    ap.add_argument("--groups", default="qkv,gate_up")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    warm_up_clocks()
    info = versions()
    out = RowWriter(args.csv)
    for gname in args.groups.split(","):
        Ns = GROUPS[gname]
        made = [zoo_weight("int4_k_stack", n, K) for n in Ns]
        texts, members, lay = [m[0] for m in made], [m[1] for m in made], made[0][2]
        layout = lay.to_text()
        flat = [t for m in members for t in m]
        member_sets = [dmg.split_leaves(s, texts) for s in (copies_for_cold(flat) if args.cold else [flat])]
        for M in (int(v) for v in args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            fl = sum(floor_us(m, n, K, M) for m, n in zip(members, Ns))
            refs = [pm.packed_mm_reference(x, m, lay, K, n) for m, n in zip(members, Ns)]
            rows = []

            def record(variant, fn_of, cfg=""):
                try:
                    outs = fn_of(members)
                    errs = [rel_err(o.float().cpu(), r.float().cpu()) for o, r in zip(outs, refs)]
                    if max(errs) > TOL:
                        print(f"{gname} M={M} {variant}: off ({max(errs):.1e})", flush=True)
                        return
                    us = timed(cycling([lambda ms=ms: fn_of(ms) for ms in member_sets]))
                except Exception as e:  # noqa: BLE001 - reported, the others go on
                    print(f"{gname} M={M} {variant}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    return
                rows.append((us, variant))
                print(f"{gname} M={M:3d} {variant:60s} {us:8.1f} us  floor {fl:6.1f} ({us / fl:.2f}x)  "
                      f"err {max(errs):.1e}", flush=True)
                out.write(dict(group=gname, Ns="+".join(map(str, Ns)), K=K, M=M, variant=variant, config=cfg,
                               us=round(us, 2), floor_us=round(fl, 2), x_floor=round(us / fl, 2),
                               cold=args.cold, max_rel_err=f"{max(errs):.1e}", **info))

            record("separate (each member's decode_mm op)",
                   lambda ms: [dm.decode_mm(x, m, t, None, layout) for m, t in zip(ms, texts)])
            for cfg in dmg.group_candidates(next_power_of_2(M),  # (the tuner's row bucket)
                                             sum(Ns), K, sm_count(x.device), lay):
                if isinstance(cfg, im.Int4Mma):
                    name = (f"int4_mma_group BLOCK_N={cfg.BLOCK_N} SPLIT_K={cfg.SPLIT_K}"
                            f"{' tma' if cfg.tma else ''}{' scale_first' if cfg.scale_first else ''}")
                    record(name, lambda ms, cfg=cfg: im.int4_mma_group(x, ms, lay, K, list(Ns), cfg), str(cfg))
            bound = [DecodeProgram.from_text(t).bind(m, x.device) for m, t in zip(members, texts)]
            choice = dmg.tuned_choice(x, bound, texts, layout)
            best = min(rows)[1] if rows else "-"
            print(f"{gname} M={M}: the tuner picks {choice}; fastest here: {best}", flush=True)
    out.close()


if __name__ == "__main__":
    main()
