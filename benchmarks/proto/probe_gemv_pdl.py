"""Programmatic dependent launch (PDL) for the GEMV, in a CUDA graph: a producer kernel writes x (a torch
elementwise op), then the GEMV (plain, or x-prep + GEMV on prepared x) -- with and without PDL.

Runs over git 4a03248's kernels (the prepared-x GEMV, since reverted) with two probe switches added: the
GEMV launched with ``launch_pdl=True`` and ``tl.extra.cuda.gdc_wait()`` first (``packed_mm.PDL_ON``), the
preparing kernel calling ``gdc_launch_dependents()`` first (``gemv_x_prep.TRIGGER_ON``). Those patched
files are not in the tree; the results are ``benchmarks/results/h200/gemv_pdl.csv``.
"""
import csv
import os
import sys
import torch, triton.testing
sys.path.insert(0, "benchmarks")
from bench_int4_mma import zoo_weight
from bench_common import versions, warm_up_clocks
from fusekern.kernels import decode_mm as dm, packed_mm as pm
from fusekern.kernels import gemv_x_prep as gx

warm_up_clocks()
meta = versions()
rows = []
for fmt, N, K in (("int4_k_stack", 4096, 4096), ("int4_k_stack", 8192, 8192), ("int4_k_stack", 4096, 14336),
                  ("gptq", 8192, 8192)):
    _, leaves, lay = zoo_weight(fmt, N, K)
    src = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
    ref = pm.packed_mm_reference(src * 1.5, leaves, lay, K, N).float().cuda()
    cfgs = [c for c in dm._packed_candidates(1, N, K, 132, lay) if isinstance(c, pm.PackedGemv)]
    base = triton.testing.do_bench_cudagraph(lambda: src * 1.5, rep=50, return_mode="median") * 1e3
    for cfg in cfgs:
        res = {}
        for pdl in (False, True):
            pm.PDL_ON = pdl
            gx.TRIGGER_ON = pdl
            step = lambda: pm.gemv(src * 1.5, leaves, lay, K, N, cfg)
            out = step()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (cfg, pdl, err)
            res[pdl] = (triton.testing.do_bench_cudagraph(step, rep=50, return_mode="median") * 1e3, err)
        pm.PDL_ON = gx.TRIGGER_ON = False
        r = dict(**meta, format=fmt, shape=f"{N}x{K}", config=str(cfg), us_producer_alone=round(base, 2),
                 us_no_pdl=round(res[False][0], 2), us_pdl=round(res[True][0], 2), rel_err=f"{res[True][1]:.2e}")
        rows.append(r)
        print(fmt, N, K, str(cfg)[10:95], r["us_producer_alone"], r["us_no_pdl"], r["us_pdl"], r["rel_err"], flush=True)
with open(os.path.join(os.environ["OUT"], "gemv_pdl.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader(); w.writerows(rows)
