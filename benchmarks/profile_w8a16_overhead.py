"""Where does the compiled fusekern call spend time at M=1? Profile + CUDA-graph timings."""
import torch, torch.nn.functional as F, triton.testing
import fusekern
from fusekern.kernels import w8a16_linear as k

def f(x, w, s):
    return F.linear(x, w.to(x.dtype)) * s

x = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
w = torch.randint(-128, 128, (8192, 8192), device="cuda", dtype=torch.int8)
s = torch.rand(8192, device="cuda", dtype=torch.bfloat16) * 0.01
fk = torch.compile(f, backend="fusekern")
fk(x, w, s)
op = lambda: torch.ops.fusekern.w8a16_linear(x, w, s, None, torch.bfloat16)
raw = lambda: k.w8a16_linear_triton(x, w, s, None, torch.bfloat16)
for name, fn in [("compiled", lambda: fk(x, w, s)), ("custom_op", op), ("launcher", raw)]:
    fn(); torch.cuda.synchronize()
    import time
    t = time.perf_counter()
    for _ in range(200):
        fn()
    cpu_us = (time.perf_counter() - t) / 200 * 1e6
    torch.cuda.synchronize()
    print(f"{name:10s} cpu-side per call {cpu_us:7.1f} us   do_bench {triton.testing.do_bench(fn, return_mode='median')*1e3:7.1f} us")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        fk(x, w, s)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
for mode_name, kw in [("stock reduce-overhead", {}), ("fusekern reduce-overhead", {"backend": "fusekern"})]:
    torch._dynamo.reset()
    g = torch.compile(f, mode="reduce-overhead", **kw)
    for _ in range(3):
        g(x, w, s)
    print(mode_name, round(triton.testing.do_bench(lambda: g(x, w, s), return_mode="median") * 1e3, 1), "us")
