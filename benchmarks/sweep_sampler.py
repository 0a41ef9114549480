"""Sweep of the fused sampler's launch shapes (issue 5's setting: V = 128256, bf16, T 0.8, top-k 50, top-p 0.9).

    python benchmarks/sweep_sampler.py [--csv OUT.csv] [--bs 1,8,32,256,512] [--profile] [--default-only]
                                       [--block-warps 4096:8,8192:16]

``--block-warps``: instead of the grid below, the default span and slots with each block:warps pair (tokens
per step of a chunk and warps of its CTA; sub and gather follow the launcher's heuristics).

With benchmarks/_sampler_before.py present (an older sampler.py without its custom-op section, untracked)
its default launch is timed in the same run for an A/B comparison.

Every config is first checked exactly: with injected exponential noise its tokens must equal the float64
reference's (sampler.sample_reference). Then the Philox path is timed in a CUDA graph
(``do_bench_cudagraph``, median). ``--profile`` adds each batch's default config split into its two
launches (torch.profiler kernel times). A config that fails to compile is recorded with its error.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.testing

from bench_common import RowWriter, versions, warm_up_clocks
from fusekern.kernels import sampler as S

V, T, K, P = 128256, 0.8, 50, 0.9


def configs(B: int, warps: int):
    """CTAs per row (the span), candidate slots per chunk and steps gathered at once (2048-token steps on
    the default's warps, 4 tokens per thread in the passes that re-read a chunk)."""
    grid = {1: ((12, 16, 24, 32), (64, 128), (None,)), 8: ((8, 12, 16, 24), (64, 128), (None,)),
            32: ((8, 16), (64, 128), (None, 16)), 256: ((3, 4, 6), (128,), (8, 16, 32)),
            512: ((1, 2, 3), (128,), (8, 16))}
    ctas_list, slots_list, gathers = grid.get(B, ((1, 2, 4), (128,), (None,)))
    for ctas, slots, gather in itertools.product(ctas_list, slots_list, gathers):
        span = S.cdiv(S.cdiv(V, ctas), 2048) * 2048
        cfg = dict(block=2048, warps=warps, span=span, sub=S.sub_block(warps), slots=slots)
        yield cfg if gather is None else dict(cfg, gather=gather)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--bs", default="1,8,32,256,512")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--default-only", action="store_true", help="time the shipped heuristics' config only")
    ap.add_argument("--block-warps", default=None, help="block:warps pairs at the default span and slots")
    args = ap.parse_args()
    warm_up_clocks()
    meta = versions()
    out = RowWriter(args.csv)
    seed = torch.tensor([7], device="cuda")
    try:
        import _sampler_before as before
    except ImportError:
        before = None
    for B in map(int, args.bs.split(",")):
        g = torch.Generator().manual_seed(B)
        logits = (torch.randn(B, V, generator=g) * 3).to("cuda", torch.bfloat16)
        q = torch.empty(B, V).exponential_(1, generator=g).cuda()
        want = S.sample_reference(logits, T, K, P, q=q).tolist()
        block = S.chunk_block(B, V)
        span = S.chunk_span(B, V, block, torch.cuda.get_device_properties(0).multi_processor_count)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        warps = S.chunk_warps(block, 16, B * triton.cdiv(V, span), sms)
        default = dict(block=block, warps=warps, span=span, sub=min(S.sub_block(warps), block),
                       slots=S.slots_for(S.keys_per_chunk(K, block), triton.cdiv(V, span), K))
        best = None
        if args.block_warps:
            others = [dict(default, block=int(b), warps=int(w), sub=min(S.sub_block(int(w)), int(b)))
                      for b, w in (pair.split(":") for pair in args.block_warps.split(","))]
        else:
            others = [] if args.default_only else list(configs(B, warps))
        for cfg in [default, *others]:
            try:
                got = S.sample_triton(logits, T, K, P, seed=seed, noise=q, **cfg).tolist()
                exact = got == want
                us = triton.testing.do_bench_cudagraph(lambda: S.sample_triton(logits, T, K, P, seed=seed, **cfg),
                                                       rep=100, return_mode="median") * 1e3
                err = ""
            except Exception as e:  # a config that does not compile or fit: recorded, the sweep goes on
                exact, us, err = False, float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            tag = "default" if cfg is default else ""
            out.write(dict(**meta, B=B, V=V, block=cfg["block"], warps=cfg["warps"], span=cfg["span"],
                           slots=cfg["slots"], sub=cfg["sub"], gather=cfg.get("gather", ""), tag=tag,
                           median_us=round(us, 2), exact=exact, error=err))
            print(f"B={B:4d} {str(cfg):72s} {us:8.2f} us  {'exact' if exact else 'MISMATCH ' + err} {tag}",
                  flush=True)
            if exact and (best is None or us < best[0]):
                best = (us, cfg)
        print(f"B={B}: best {best}", flush=True)
        if before is not None:  # the previous kernel (benchmarks/_sampler_before.py, untracked), same run
            us = triton.testing.do_bench_cudagraph(lambda: before.sample_triton(logits, T, K, P, seed=seed),
                                                   rep=100, return_mode="median") * 1e3
            exact = before.sample_triton(logits, T, K, P, seed=seed, noise=q).tolist() == want
            out.write(dict(**meta, B=B, V=V, block=0, warps=0, span=0, slots=0, sub=0, gather="", tag="before",
                           median_us=round(us, 2), exact=exact, error=""))
            print(f"B={B:4d} before {us:8.2f} us {'exact' if exact else 'MISMATCH'}", flush=True)
        if args.profile:
            fn = lambda: S.sample_triton(logits, T, K, P, seed=seed)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            times = [ev.device_time for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA
                     and "_sample_kernel" in ev.name]
            step1, step2 = sorted(times[0::2])[len(times) // 4], sorted(times[1::2])[len(times) // 4]
            print(f"   profile B={B}: step 1 {step1:.2f} us, step 2 {step2:.2f} us (medians)", flush=True)
    out.close()


if __name__ == "__main__":
    main()
