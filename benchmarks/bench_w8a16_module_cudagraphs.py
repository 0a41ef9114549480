"""W8A16 as an nn.Module (weights are buffers), N = K = 8192: default vs reduce-overhead (CUDA graphs)."""
import torch, torch.nn.functional as F, triton.testing
from torch import nn
import fusekern


class QLinear(nn.Module):
    def __init__(self, n, k):
        super().__init__()
        self.w = nn.Buffer(torch.randint(-128, 128, (n, k), dtype=torch.int8))
        self.s = nn.Buffer(torch.rand(n, dtype=torch.bfloat16) * 0.01)

    def forward(self, x):
        return F.linear(x, self.w.to(x.dtype)) * self.s


m = QLinear(8192, 8192).cuda()
for M in (1, 16, 2048):
    x = torch.randn(M, 8192, device="cuda", dtype=torch.bfloat16)
    ref = m(x).float()
    for name, kw in [("stock default", {}), ("fusekern default", {"backend": "fusekern"}),
                     ("stock reduce-overhead", {"mode": "reduce-overhead"}),
                     ("fusekern reduce-overhead", {"backend": "fusekern", "mode": "reduce-overhead"})]:
        torch._dynamo.reset()
        fusekern.reset_match_report()
        g = torch.compile(m, **kw)
        for _ in range(3):
            out = g(x)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        us = triton.testing.do_bench(lambda: g(x), warmup=25, rep=200, return_mode="median") * 1e3
        print(f"M={M:5d} {name:26s} {us:8.1f} us  rel_err vs eager {err:.1e}  fired {dict(fusekern.match_report().fired())}", flush=True)
