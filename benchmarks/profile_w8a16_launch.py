"""CPU cost per call of the W8A16 launcher and custom op (cProfile), M = 1, N = K = 8192."""
import cProfile, pstats, time
import torch
from fusekern.kernels import w8a16_linear as k

x = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
w = torch.randint(-128, 128, (8192, 8192), device="cuda", dtype=torch.int8)
s = torch.rand(8192, device="cuda", dtype=torch.bfloat16) * 0.01
cfg = k.select_config(1, 8192, 8192)
out = torch.empty(1, 8192, device="cuda", dtype=torch.bfloat16)
bare = lambda: k._w8a16_gemm_kernel[(128,)](x, w, s, s, out, 1, 8192, 8192, *x.stride(), *w.stride(), 1, 1, *out.stride(),
                                            HAS_BIAS=False, EVEN_K=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=8,
                                            num_warps=4, num_stages=4)
fns = {"bare triton launch": bare,
       "launcher": lambda: k.w8a16_linear_triton(x, w, s, None, torch.bfloat16),
       "custom_op": lambda: torch.ops.fusekern.w8a16_linear(x, w, s, None, torch.bfloat16),
       "torch.empty": lambda: torch.empty(1, 8192, device="cuda", dtype=torch.bfloat16)}
for name, fn in fns.items():
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        fn()
    dt = (time.perf_counter() - t) / 2000 * 1e6
    torch.cuda.synchronize()
    print(f"{name:20s} {dt:7.1f} us CPU per call", flush=True)
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    torch.ops.fusekern.w8a16_linear(x, w, s, None, torch.bfloat16)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
