"""Decode attention of the demo (32 heads, 8 KV heads, d = 128, a 256-slot cache, boolean mask): K / V
expanded with repeat_interleave against SDPA's enable_gqa, eager and stock-compiled, CUDA-graph medians.

    python benchmarks/proto/probe_gqa_attention.py
"""
import torch
import torch.nn.functional as F
import triton.testing


def expand(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1),
                                          attn_mask=mask)


def gqa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def main():
    for B in (1, 16, 64):
        q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, 8, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        mask = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril()[torch.tensor([8], device="cuda")]
        ref = expand(q, k, v, mask).float()
        for name, fn in (("expand", expand), ("gqa", gqa)):
            for mode, f in (("eager", fn), ("stock", torch.compile(fn))):
                got = f(q, k, v, mask).float()
                err = ((got - ref).norm() / ref.norm()).item()
                us = triton.testing.do_bench_cudagraph(lambda: f(q, k, v, mask), return_mode="median") * 1e3
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    f(q, k, v, mask)
                    torch.cuda.synchronize()
                kernels = [e.key[:60] for e in prof.key_averages() if e.device_type.name == "CUDA"]
                print(f"B={B:3d} {name:6s} {mode:5s} {us:7.1f} us rel_err {err:.1e} kernels {kernels}", flush=True)


if __name__ == "__main__":
    main()
