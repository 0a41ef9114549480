"""A/B of two versions of the CUDA-core GEMV (``packed_mm`` and ``packed_gemv_group``) at M = 1.

    python benchmarks/proto/probe_gemv_ab.py --old DIR [--csv OUT.csv] [--formats ...] [--shapes ...]
    python benchmarks/proto/probe_gemv_ab.py --old - --splits 1,2,4,8 [...]   (this version, SPLIT_K swept)
    python benchmarks/proto/probe_gemv_ab.py --old - [...]   (this version only, every config it offers)

DIR holds the other version's ``packed_mm.py`` and ``packed_gemv_group.py`` (e.g. ``git show
<sha>:fusekern/kernels/packed_mm.py > DIR/packed_mm.py``); both versions run every GEMV config the
dispatcher offers, checked against the float64 reference and timed in a CUDA graph (median), in the same
process. Shapes ``A+B+C`` run the grouped launch over members of those widths (q / k / v, gate / up).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import triton.testing  # noqa: E402
from bench_common import RowWriter, versions, warm_up_clocks  # noqa: E402
from bench_int4_mma import floor_us, zoo_weight  # noqa: E402

from fusekern.kernels import decode_mm as dm  # noqa: E402
from fusekern.kernels import packed_gemv_group as pg_new  # noqa: E402
from fusekern.kernels import packed_mm as pm_new  # noqa: E402


def load_old(d: str):
    """The other version's two modules; its group module imports its own packed_mm."""
    mods = {}
    for name in ("packed_mm", "packed_gemv_group"):
        src = open(os.path.join(d, f"{name}.py")).read()
        src = src.replace("from fusekern.kernels import packed_mm as pm", "import fk_old_packed_mm as pm")
        path = os.path.join(d, f"fk_old_{name}.py")
        open(path, "w").write(src)
        spec = importlib.util.spec_from_file_location(f"fk_old_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"fk_old_{name}"] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["packed_mm"], mods["packed_gemv_group"]


def check_and_time(fn, ref: torch.Tensor) -> tuple[float, float | str]:
    """(relative error, median µs in a CUDA graph) of a launcher returning a tensor or a list of them
    (timed as it is: no concatenation in the timed call)."""
    try:
        got = fn()
        got = (torch.cat(got, dim=1) if isinstance(got, list) else got).float()
        err = ((got - ref).norm() / ref.norm()).item()
        return err, triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
    except Exception as e:
        return float("nan"), f"n/a ({type(e).__name__}: {str(e)[:80]})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--formats", default="int4_k_stack")
    ap.add_argument("--shapes", default="4096x4096,6144x4096,4096+1024+1024x4096,14336+14336x4096,8192x8192")
    ap.add_argument("--splits", default="",
                    help="instead of the A/B: this version's GEMV at these SPLIT_K (e.g. 1,2,3,4) for the "
                         "dispatcher's tile shapes")
    args = ap.parse_args()
    pm_old, pg_old = load_old(args.old) if args.old != "-" else (None, None)
    warm_up_clocks()
    meta = versions()
    out = RowWriter(args.csv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            ns, K = shape.split("x")
            Ns = [int(n) for n in ns.split("+")]
            K = int(K)
            made = [zoo_weight(fmt, n, K) for n in Ns]
            lay = made[0][2]
            members = [m[1] for m in made]
            x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
            ref = torch.cat([pm_new.packed_mm_reference(x, lv, lay, K, n).float().to(x.device)
                             for lv, n in zip(members, Ns)], dim=1)
            floor = sum(floor_us(lv, n, K, 1) for lv, n in zip(members, Ns))
            cfgs = [c for c in dm._packed_candidates(1, sum(Ns), K, sms, lay) if isinstance(c, pm_new.PackedGemv)]
            versions_run = (("old", pm_old, pg_old), ("new", pm_new, pg_new)) if pm_old is not None else \
                (("new", pm_new, pg_new),)
            if args.splits:
                tiles = dict.fromkeys((c.BLOCK_N, c.BLOCK_K, c.num_warps, c.vec_k) for c in cfgs)
                cfgs = [pm_new.PackedGemv(bn, bk, sk, w, vec_k=vk) for bn, bk, w, vk in tiles
                        for sk in map(int, args.splits.split(","))]
                versions_run = (("new", pm_new, pg_new),)
            for cfg in cfgs:
                for ver, pm, pg in versions_run:
                    c = pm.PackedGemv(cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.num_warps, vec_k=cfg.vec_k)
                    if len(Ns) == 1:
                        fn = (lambda pm=pm, c=c: pm.gemv(x, members[0], lay, K, Ns[0], c))
                    else:
                        fn = (lambda pg=pg, c=c: pg.gemv_group(x, members, lay, K, Ns, c))
                    err, us = check_and_time(fn, ref)
                    row = dict(**meta, version=ver, format=fmt, shape=shape, config=str(cfg),
                               us=us if isinstance(us, str) else round(us, 2), floor_us=round(floor, 2),
                               rel_err=f"{err:.2e}")
                    out.write(row)
                    print(f"{ver} {fmt} {shape:22s} {str(cfg):70s} {row['us']!s:>8} us floor {row['floor_us']} "
                          f"err {row['rel_err']}", flush=True)
    out.close()


if __name__ == "__main__":
    main()
