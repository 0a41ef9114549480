"""Where the sampler's step 1 spends its time: step 1 alone, timed with parts of it cut out.

    python benchmarks/profile_sampler_steps.py [--bs 1,32,256] [--step 1|2] [--csv OUT.csv]

Each variant is a copy of fusekern/kernels/sampler.py (up to its custom-op section) with text replaced,
imported as its own module (its own Triton kernels and caches), and its step-1 launch alone
(``step1_only``) timed in a CUDA graph (``do_bench_cudagraph``, median; the variants' results are wrong
by design, only their time counts):
- ``full``: step 1 as shipped;  ``no_write``: without writing the candidates (nor any search);
- ``no_topk``: the threshold is the chunk's largest key instead of the k_c-th largest group maximum;
- ``pass1``: the first pass alone (no top-k, no writes). ``amax`` is torch.amax over the rows: a read floor.
It also reports how many chunks still overflow their slots after the searches (their rows take step 2's
slow path).

``--step 2`` times the whole sampler (both launches) with parts of step 2 cut out instead (and reports a
variant whose tokens differ from the shipped kernel's under the same seed): ``no_pdl``
(step 2 launched after step 1 ends, not as a programmatic dependent launch), ``pdl`` (one at every
batch size), ``noinline_finish`` and ``noinline_chunks`` (step 2's or step 1's body as a function of its
own, not inlined), ``finish_1_warps`` / ``finish_2_warps`` / ``finish_4_warps`` /
``finish_16_warps`` (step 2's CTA size), ``pivot_exit`` (the pivot's search stops at a point with exactly
k candidates at or above it; ``pivot_exit_1_warp`` with step 2 on one warp), ``fan_1`` / ``fan_2`` / ``fan_4`` / ``fan_16`` (points per round
of the top-k pivot's search: 1 is a binary search), ``no_pivot`` (no pivot search: the pivot is the chunks'
threshold), ``no_compact`` (the kept tokens are not moved into the small
block through the slots), ``vector_cand_loads`` (sampler-7's vectorized load of the candidates, which
the move had to re-lay out three times; sampler-8 loads them one per lane), ``no_race`` (no Philox
draws: the score is x), ``no_slow`` (without the exact slow path's code, never taken here), ``no_slow_big`` (nor the path for a kept set too large for the small
block: how much the code not run costs). ``step1`` is step 1 alone,
``top_k_only`` the full sampler without top-p, ``before`` benchmarks/_sampler_before.py where present.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

import torch
import triton.testing

from bench_common import RowWriter, versions, warm_up_clocks

V, T, K, P = 128256, 0.8, 50, 0.9
SRC = os.path.join(os.path.dirname(__file__), "..", "fusekern", "kernels", "sampler.py")
TOPK = "    best = tl.topk(gmax, KC)  # descending\n"
WRITE_START, WRITE_END = "    flag = kmax >= t\n", "    return t, n, top, nan\n"
NO_TOPK = (TOPK, "    best = tl.zeros((KC,), tl.int32) + top\n")
NO_WRITE = ((WRITE_START, WRITE_END), "    n = k_c\n")
VARIANTS = {"full": [], "no_write": [NO_WRITE], "no_topk": [NO_TOPK], "pass1": [NO_TOPK, NO_WRITE]}
SLOW = """        if not exact:
            best, m = _finish_row(logits_ptr, row, V, stride_row, temperature, k, top_p, min_p, seed,
                                  noise_ptr, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, HAS_NOISE, KEY_BITS, ROW_BLOCK)
"""
BIG = """            best, exact = _filter_and_race(cx, ckey, cidx, kept, exact, restricted, m, z_row, T, top_p, min_p,
                                           seed, row, V, noise_ptr, HAS_TOP_P, HAS_MIN_P, HAS_NOISE, False,
                                           KEY_BITS, DTYPE)
"""
PIVOT = """                lo = _kth_largest_in(ckey, tl.minimum(k, n_valid), tl.maximum(T.to(tl.int64), MIN_KEY) - 1,
                                     _key_of(m, DTYPE).to(tl.int64) + 1, PIVOT_FAN, KEY_BITS)
"""


def fan(n: int):
    return [("PIVOT_FAN=pivot_fan,", f"PIVOT_FAN={n},")]


def finish_warps(n: int):
    """Step 2's CTA on n warps, its slow path's row steps 256 tokens a warp (2048 on 1 warp spilled)."""
    return [("num_warps=finish_warps or finish_warps_for(key_bits)", f"num_warps=finish_warps or {n}"),
            ("ROW_BLOCK=min(2048, block)", f"ROW_BLOCK=min({256 * n}, block)")]


# the pivot's search ends at a point with exactly k candidates at or above it: every point in
# (v_k+1, v_k] keeps the same tokens, so the remaining rounds would not change the kept set
PIVOT_EXIT = ("            lo, hi = lo + ((hi - lo) * n_ok) // (FAN + 1), tl.where(n_ok < FAN, lo + ((hi - lo) * (n_ok + 1)) // (FAN + 1), hi)\n",
              "            lo, hi = lo + ((hi - lo) * n_ok) // (FAN + 1), tl.where(n_ok < FAN, lo + ((hi - lo) * (n_ok + 1)) // (FAN + 1), hi)\n"
              "            if FAN == 1:\n"
              "                hi = tl.where(count == k, lo + 1, hi)\n")


STEP2_VARIANTS = {
    "full": [],
    "no_pdl": [("    pdl = uses_pdl(B, dev)\n", "    pdl = False\n")],
    "pdl": [("    pdl = uses_pdl(B, dev)\n", "    pdl = supports_pdl(dev)\n")],
    "finish_4_warps": [("num_warps=finish_warps or finish_warps_for(key_bits)", "num_warps=finish_warps or 4")],
    "finish_16_warps": [("num_warps=finish_warps or finish_warps_for(key_bits)", "num_warps=finish_warps or 16")],
    "fan_1": fan(1),
    "fan_2": fan(2),
    "fan_4": fan(4),
    "fan_16": fan(16),
    "noinline_finish": [("@triton.jit\ndef _finish(", "@triton.jit(noinline=True)\ndef _finish(")],
    "noinline_chunks": [("@triton.jit\ndef _chunk_candidates(", "@triton.jit(noinline=True)\ndef _chunk_candidates(")],
    "no_pivot": [(PIVOT, "                lo = T.to(tl.int64)\n")],
    "no_compact": [("            tl.store(cand_ptr + own, cand, mask=kept)\n", "")],
    # sampler-7's vector load of the candidates: the merge's tensors then need three layout conversions
    # through shared memory to reach the kept tokens' scatter (167 -> 172 barriers in the SASS)
    "vector_cand_loads": [("        cj = row.to(tl.int64) * C * SLOTS + j * (V > 0).to(tl.int64)\n",
                           "        cj = row.to(tl.int64) * C * SLOTS + j\n")],
    "finish_1_warps": finish_warps(1),
    "finish_2_warps": finish_warps(2),
    "pivot_exit": [PIVOT_EXIT],
    "pivot_exit_1_warp": [PIVOT_EXIT] + finish_warps(1),
    "no_race": [("score = _gumbel_score(x, seed, row, idx, V, noise_ptr, HAS_NOISE)", "score = x")],
    "no_slow": [(SLOW, "")],
    "no_slow_big": [(SLOW, ""), (BIG, "            best = tl.full((), -1, tl.int64)\n")],
}


def load_variant(name: str, edits):
    """sampler.py up to its custom-op section with each (old, new) edit made, imported as its own module.
    old is a text that occurs exactly once, or a (start, end) pair of such texts: the span from start up
    to (not including) end."""
    src = open(SRC).read()
    src = src[:src.index("# ----------------------------------------------------------------------------- custom op")]
    for old, new in edits:
        anchors = old if isinstance(old, tuple) else (old,)
        for text in anchors:
            if src.count(text) != 1:
                raise SystemExit(f"variant {name}: the text is gone from (or repeated in) sampler.py: {text!r}")
        if isinstance(old, tuple):
            old = src[src.index(old[0]):src.index(old[1])]
        if src.count(old) != 1:
            raise SystemExit(f"variant {name}: the text to replace is gone from (or repeated in) sampler.py: {old!r}")
        src = src.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), f"sampler_{name}.py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"sampler_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--bs", default="1,32,256")
    ap.add_argument("--step", type=int, default=1, choices=(1, 2))
    ap.add_argument("--variants", default=None, help="comma-separated names (default: all of the step's)")
    args = ap.parse_args()
    warm_up_clocks()
    meta = versions()
    out = RowWriter(args.csv)
    seed = torch.tensor([7], device="cuda")
    variants = VARIANTS if args.step == 1 else STEP2_VARIANTS
    names = args.variants.split(",") if args.variants else list(variants)
    mods = {name: load_variant(name, variants[name]) for name in dict.fromkeys(["full"] + names)}
    for B in map(int, args.bs.split(",")):
        g = torch.Generator().manual_seed(B)
        logits = (torch.randn(B, V, generator=g) * 3).to("cuda", torch.bfloat16)
        _, cnt, cand = mods["full"].sample_triton(logits, T, K, P, seed=seed, step1_only=True)
        overflow, chunks = int((cnt > cand.shape[-1]).sum()), cnt.numel()

        def bench(fn):
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3

        if args.step == 1:
            times = {"amax": bench(lambda: torch.amax(logits, dim=-1))}
            for name, mod in mods.items():
                times[name] = bench(lambda: mod.sample_triton(logits, T, K, P, seed=seed, step1_only=True))
        else:
            full = mods["full"]
            times = {"step1": bench(lambda: full.sample_triton(logits, T, K, P, seed=seed, step1_only=True)),
                     "top_k_only": bench(lambda: full.sample_triton(logits, T, K, None, seed=seed))}
            try:
                import _sampler_before as before
                times["before"] = bench(lambda: before.sample_triton(logits, T, K, P, seed=seed))
            except ImportError:
                pass
            want = full.sample_triton(logits, T, K, P, seed=seed)
            for name, mod in mods.items():
                times[name] = bench(lambda: mod.sample_triton(logits, T, K, P, seed=seed))
                if not torch.equal(mod.sample_triton(logits, T, K, P, seed=seed), want):
                    print(f"B={B} {name}: tokens differ from full's (same seed)", flush=True)
        for name, us in times.items():
            out.write(dict(**meta, B=B, V=V, step=args.step, variant=name, us=round(us, 2), chunks=chunks,
                           overflowed=overflow))
        print(f"B={B:4d} chunks {chunks:5d} overflowed {overflow:4d}  " +
              "  ".join(f"{k} {v:7.2f}" for k, v in times.items()), flush=True)
    out.close()


if __name__ == "__main__":
    main()
