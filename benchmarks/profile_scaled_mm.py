"""Where the time of a compiled W8A8 linear goes: compiled graph vs the op vs its kernels (H200).

    python benchmarks/profile_scaled_mm.py [--cute]

``--cute``: only the host cost of the CuTe DSL kernel's call path (checks, pointers, launch), on a
product small enough that the GPU keeps up with the host.
"""
from __future__ import annotations

import time

import torch
import triton.testing

from bench_scaled_mm import w8a8_rowwise
from fusekern.kernels import scaled_mm as S

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def cute_host():
    from fusekern.kernels import cute_scaled_mm as C

    M, N, K = 128, 1024, 1024
    a = torch.randn(M, K, device="cuda").to(E4M3)
    b = torch.randn(N, K, device="cuda").to(E4M3)
    row, col = torch.rand(M, device="cuda"), torch.rand(N, device="cuda")
    sa = torch.rand(M, K // 128, device="cuda")
    sb = torch.rand(N // 128, K // 128, device="cuda")
    a_big = a.repeat(32, 1)  # M = 4096: the op sends FP8 to the CuTe kernel from there
    variants = {
        "cute_scaled_mm rowwise": lambda: C.cute_scaled_mm(a, b, row=row, col=col, out_dtype=BF16),
        "run_supported rowwise": lambda: C.run_supported(a, b, row, col, None, None, BF16, None, None),
        "supports() alone": lambda: C.supports(a, b, row=row, col=col, out_dtype=BF16),
        "cute_scaled_mm block": lambda: C.cute_scaled_mm(a, b, out_dtype=BF16, a_block=sa, b_block=sb),
        "scaled_mm op (CuTe route)": lambda: S.scaled_mm(a_big, b, None, None, None, None, None, None,
                                                        0, 0, BF16),
        "torch.empty alone": lambda: torch.empty(M, N, dtype=BF16, device="cuda"),
    }
    # the launch itself: the compiled function's own entry (``run_compiled_program``, which re-packs the
    # slot addresses under a lock) against the marshal's direct call of the executor's entry
    C.run_supported(a, b, row, col, None, None, BF16, None, None)
    config, _kernel, marshal, _index, _sms = C._plan(a, b, row, col, None, None, BF16, False)
    if marshal is not None:
        out = torch.empty(M, N, dtype=BF16, device="cuda")  # (alive while the launches write it)
        values = [t.data_ptr() for t in (a, b, out, row, col)] + \
            [M, N, K, K // 16, K // 16, N * 2 // 16, 1, 1, 1, 1, 1, C._sm_count(a.device),
             torch.cuda.current_stream().cuda_stream]
        variants["launch: marshal, direct entry"] = lambda: marshal(values)
        variants["launch: run_compiled_program"] = lambda: marshal.fn.run_compiled_program(marshal._state()[1])
    for name, f in variants.items():
        print(f"{name:32s} host {host_us(f, 2000):7.1f} us/call")


def main():
    import sys

    if "--cute" in sys.argv:
        return cute_host()
    N = K = 8192
    for M in (16, 2048):
        x8 = torch.randn(M, K, device="cuda").to(E4M3)
        w8 = torch.randn(N, K, device="cuda").to(E4M3)
        sx, sw = torch.rand(M, 1, device="cuda") + 0.1, torch.rand(N, 1, device="cuda") + 0.1
        torch._dynamo.reset()
        comp = torch.compile(w8a8_rowwise, backend="fusekern", dynamic=False)
        comp(x8, w8, sx, sw)
        row, col = sx.view(M), sw.view(N)
        variants = {
            "compiled": lambda: comp(x8, w8, sx, sw),
            "op": lambda: S.scaled_mm(x8, w8, row, col, None, None, None, None, 0, 0, BF16),
            "triton": lambda: S.scaled_mm_triton(x8, w8, row, col, out_dtype=BF16),
        }
        for name, f in variants.items():
            us = triton.testing.do_bench(f, return_mode="median") * 1e3
            g = triton.testing.do_bench_cudagraph(f, return_mode="median") * 1e3
            print(f"M={M} {name:10s} do_bench {us:8.1f} us  cudagraph {g:8.1f} us  host {host_us(f):7.1f} us/call")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                comp(x8, w8, sx, sw)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
