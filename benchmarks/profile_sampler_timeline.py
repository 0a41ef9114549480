"""When each part of the sampler's step 2 runs: %globaltimer stamps written from inside the kernels.

    python benchmarks/profile_sampler_timeline.py [--bs 1,256] [--reps 200] [--csv OUT.csv]

A copy of fusekern/kernels/sampler.py (up to its custom-op section) gets stamps inserted (each waits for
a value computed at that point, so it is taken once that value is ready) and is imported as its own
module; the whole sampler is captured in a CUDA graph and replayed. Reported per stamp: the median over
replays of its time after step 1's first CTA started (step 1: its CTAs' first start and last end;
step 2: row 0's CTA). Stamps cost a few instructions and a store each: the timeline is close to, not
equal to, the shipped kernel's.
"""
from __future__ import annotations

import argparse

import torch

from bench_common import RowWriter, versions, warm_up_clocks
from profile_sampler_steps import load_variant

V, T, K, P = 128256, 0.8, 50, 0.9
STEP1 = 1 << 16  # step 1's stamps start here in the buffer: 2 per CTA
STAMP = '''

@triton.jit
def _stamp(buf, i, dep):
    """Writes %globaltimer (ns) to buf[i] once dep (a 32-bit scalar) is ready."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [dep.to(tl.int32)], dtype=tl.int64,
                                  is_pure=False, pack=1)
    tl.store(buf.to(tl.pointer_type(tl.int64)) + i, t)

'''
# (text after which a stamp goes, the stamp's line): step 2's stamps at row * 16 + index
EDITS = [
    ("    seed = tl.load(seed_ptr)\n",
     "    _stamp(noise_ptr, tl.where(FINISH, row * 16, STEP1 + 2 * (row * C + tl.program_id(1))), row)\n"),
    ("            tl.extra.cuda.gdc_wait()\n", "            _stamp(noise_ptr, row * 16 + 1, row)\n"),
    ("        bad = (flags & 1) != 0\n", "        _stamp(noise_ptr, row * 16 + 2, raw_t + n_valid)\n"),
    ("                pivot = tl.maximum(lo, MIN_KEY).to(tl.int32)\n",
     "                _stamp(noise_ptr, row * 16 + 3, pivot)\n"),
    ("        n_kept = tl.sum(kept.to(tl.int32), axis=0)\n", "        _stamp(noise_ptr, row * 16 + 4, n_kept)\n"),
    ("            kidx = _unpack_token(kept_cand)\n",
     "            _stamp(noise_ptr, row * 16 + 5, tl.max(kidx, axis=0))\n"),
    ("    tl.store(out_ptr + row, token)\n", "    _stamp(noise_ptr, row * 16 + 6, token.to(tl.int32))\n"),
    ("            tl.store(thr_ptr + at, t_c)\n", "            _stamp(noise_ptr, STEP1 + 2 * at + 1, t_c)\n"),
]
NAMES = ["entry", "after_wait", "chunks_reduced", "pivot", "kept_counted", "kept_loaded", "token"]


KERNELS = "\n# ----------------------------------------------------------------------------- kernels\n"
VARIANT = [
    (KERNELS, KERNELS + f"STEP1 = tl.constexpr({STEP1})" + STAMP),
    ("seed, noise if noise is not None else f32,", "seed, noise if noise is not None else STAMPS.view(torch.float32),"),
] + [(anchor, anchor + line) for anchor, line in EDITS]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--bs", default="1,256")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    warm_up_clocks()
    meta = versions()
    out = RowWriter(args.csv)
    mod = load_variant("timeline", VARIANT)
    seed = torch.tensor([7], device="cuda")
    for B in map(int, args.bs.split(",")):
        g = torch.Generator().manual_seed(B)
        logits = (torch.randn(B, V, generator=g) * 3).to("cuda", torch.bfloat16)
        buf = torch.zeros(STEP1 + 2 * B * 64, dtype=torch.int64, device="cuda")
        mod.STAMPS = buf  # the launcher passes it where the noise would go (no noise: HAS_NOISE stays off)
        mod.sample_triton(logits, T, K, P, seed=seed)  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mod.sample_triton(logits, T, K, P, seed=seed)
        rows = []
        for _ in range(args.reps):
            buf.zero_()
            graph.replay()
            torch.cuda.synchronize()
            rows.append(buf.cpu())
        stamps = torch.stack(rows)  # [reps, n]
        s1 = stamps[:, STEP1:STEP1 + 2 * B * 64].view(args.reps, -1, 2)
        used = s1[:, :, 0] > 0
        start = torch.where(used, s1[:, :, 0], torch.iinfo(torch.int64).max).amin(1)
        end1 = torch.where(used, s1[:, :, 1], 0).amax(1)
        t = {"step1_end": (end1 - start)}
        for i, name in enumerate(NAMES):
            if bool((stamps[:, i] > 0).all()):  # "after_wait" only where step 2 is a dependent launch
                t[name] = stamps[:, i] - start
        med = {k: float(v.double().median()) for k, v in t.items()}
        for k, v in med.items():
            out.write(dict(**meta, B=B, V=V, stamp=k, ns_after_step1_start=round(v)))
        print(f"B={B}: " + "  ".join(f"{k} {v / 1e3:.2f}" for k, v in med.items()) + "  (us after step 1 starts)",
              flush=True)
    out.close()


if __name__ == "__main__":
    main()
