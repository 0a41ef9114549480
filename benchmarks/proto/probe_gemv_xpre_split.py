"""Where the prepared-x GEMV's time went (git 4a03248's kernels, since reverted): the preparing launch
alone, the GEMV alone on prepared x, both, and the plain GEMV; CUDA graph medians, checked against float64.

    git show 4a03248:fusekern/kernels/{packed_mm,gemv_x_prep,replay,packed_gemv_group,decode_mm,decode_mm_group}.py
    into fusekern/kernels/ (a scratch checkout), then  OUT=DIR python benchmarks/proto/probe_gemv_xpre_split.py
"""
import csv, os, sys
import torch, triton.testing
sys.path.insert(0, "benchmarks")
from bench_int4_mma import zoo_weight
from bench_common import versions, warm_up_clocks
from fusekern.kernels import decode_mm as dm, packed_mm as pm

warm_up_clocks()
meta = versions()
rows = []
real_prep = pm.gemv_x_prep
for fmt, N, K in (("int4_k_stack", 8192, 8192), ("int4_k_stack", 4096, 4096), ("int4_k_stack", 4096, 14336),
                  ("gptq", 8192, 8192)):
    _, leaves, lay = zoo_weight(fmt, N, K)
    x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
    ref = pm.packed_mm_reference(x, leaves, lay, K, N).float().cuda()
    cfgs = [c for c in dm._packed_candidates(1, N, K, 132, lay) if isinstance(c, pm.PackedGemv)]
    for cfg in cfgs:
        err = lambda o: ((o.float() - ref).norm() / ref.norm()).item()
        pm.gemv_x_prep = real_prep
        e_full = err(pm.gemv(x, leaves, lay, K, N, cfg))
        t_full = triton.testing.do_bench_cudagraph(lambda: pm.gemv(x, leaves, lay, K, N, cfg), rep=50,
                                                   return_mode="median") * 1e3
        t_prep = t_gemv = ""
        if cfg.xpre:
            word_i32, p, order = pm._words(lay, leaves[lay.code])
            xp, xc, _ = pm.prep_x(x, lay, p, order, cfg.BLOCK_K, False)
            t_prep = triton.testing.do_bench_cudagraph(lambda: pm.prep_x(x, lay, p, order, cfg.BLOCK_K, False), rep=50,
                                                       return_mode="median") * 1e3
            pm.gemv_x_prep = lambda *a, **k: (xp, xc, None)
            e_g = err(pm.gemv(x, leaves, lay, K, N, cfg))
            assert abs(e_g - e_full) < 1e-6, (e_g, e_full)
            t_gemv = triton.testing.do_bench_cudagraph(lambda: pm.gemv(x, leaves, lay, K, N, cfg), rep=50,
                                                       return_mode="median") * 1e3
            pm.gemv_x_prep = real_prep
        r = dict(**meta, format=fmt, shape=f"{N}x{K}", config=str(cfg), us_call=round(t_full, 2),
                 us_prep_alone=t_prep if t_prep == "" else round(t_prep, 2),
                 us_gemv_on_prepared_x=t_gemv if t_gemv == "" else round(t_gemv, 2), rel_err=f"{e_full:.2e}")
        r["git_sha"] = "4a03248"
        rows.append(r)
        print(fmt, N, K, str(cfg)[10:90], r["us_call"], r["us_prep_alone"], r["us_gemv_on_prepared_x"], r["rel_err"], flush=True)
with open(os.path.join(os.environ["OUT"], "gemv_xpre_split.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader(); w.writerows(rows)
