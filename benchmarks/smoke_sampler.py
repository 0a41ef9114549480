"""Step-by-step GPU smoke run of the fused sampler (each step prints as it finishes)."""
import sys
import time

import torch

from fusekern.kernels import sampler as S

V = 128256
seed = torch.tensor([1], device="cuda")


def step(name, fn):
    t = time.time()
    r = fn()
    torch.cuda.synchronize()
    print(f"{name}: {time.time() - t:.2f}s {r if r is not None else ''}", flush=True)


def check(B, dtype, **params):
    logits = (torch.randn(B, V, device="cuda") * 3).to(dtype)
    q = torch.empty(B, V, device="cuda").exponential_(1)
    out = S.sample_triton(logits, 0.8, seed=seed, noise=q, **params)
    return "ok" if out.cpu().tolist() == S.sample_reference(logits, 0.8, q=q, **params).tolist() else "WRONG"


logits = torch.randn(1, V, device="cuda", dtype=torch.bfloat16) * 3
step("compile+run B=1 top-k", lambda: S.sample_triton(logits, 0.8, 50, seed=seed).item())
step("run again", lambda: S.sample_triton(logits, 0.8, 50, seed=seed).item())
for B in (1, 256):
    for params in (dict(top_k=50, top_p=0.9), dict(top_p=0.9), dict(top_k=50, min_p=0.1), dict()):
        step(f"check B={B} {params}", lambda: check(B, torch.bfloat16, **params))
if "--time" in sys.argv:
    import triton.testing
    for B in (1, 8, 32, 256, 512):
        x = torch.randn(B, V, device="cuda", dtype=torch.bfloat16) * 3
        variants = [dict()] + [dict(block=b) for b in (2048, 4096, 8192, 16384, 32768)]
        variants += [dict(block=8192, warps=4)]
        for v in variants:
            fn = lambda: S.sample_triton(x, 0.8, 50, 0.9, seed=seed, **v)
            fn()
            us = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
            print(f"B={B} {v}: {us:.1f} us", flush=True)
        for params in (dict(top_k=50), dict(top_p=0.9), dict(min_p=0.1), dict()):
            fn = lambda: S.sample_triton(x, 0.8, seed=seed, **params)
            fn()
            us = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
            print(f"B={B} {params}: {us:.1f} us", flush=True)
