"""The demo: a small decoder MLP stack with int8 weights, compiled by stock inductor and by fusekern.

    python -m fusekern demo [--device cpu|cuda]

Prints the match report, the equivalence of both compiled outputs against eager, and their times.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    """A linear layer with int8 weights and one scale per output channel, written as users write it."""

    def __init__(self, d_in: int, d_out: int, gen: torch.Generator):
        super().__init__()
        self.weight = nn.Buffer(torch.randint(-127, 128, (d_out, d_in), generator=gen, dtype=torch.int8))
        self.scale = nn.Buffer(torch.rand(d_out, generator=gen) * (2.0 / (127 * d_in**0.5)) + 1e-4)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)


class MLPBlock(nn.Module):
    def __init__(self, d: int, d_ff: int, gen: torch.Generator):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.gate, self.up, self.down = Int8Linear(d, d_ff, gen), Int8Linear(d, d_ff, gen), Int8Linear(d_ff, d, gen)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Stack(nn.Module):
    def __init__(self, d: int, d_ff: int, layers: int, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(MLPBlock(d, d_ff, gen) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _time_us(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    times = []
    for _ in range(10):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main(device: str | None = None) -> int:
    import fusekern
    from fusekern.testing import rel_err

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        d, d_ff, layers, tokens = 4096, 14336, 4, (1, 16)  # Llama-3-8B-shaped MLPs
    else:
        d, d_ff, layers, tokens = 256, 704, 2, (1, 16)
    print(f"fusekern demo on {device}: {layers} MLP blocks, d={d}, d_ff={d_ff}, int8 weights, bf16 activations",
          flush=True)
    model = Stack(d, d_ff, layers).to(device=device, dtype=torch.bfloat16)  # int8 buffers stay int8
    fusekern.reset_match_report()
    stock = torch.compile(model)
    fused = torch.compile(model, backend="fusekern")
    ok = True
    for m in tokens:
        x = torch.randn(m, d, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            print(f"  M={m}: compiling stock inductor and fusekern ...", flush=True)
            ref = model(x)
            out_stock, out_fused = stock(x), fused(x)
            err_stock, err_fused = rel_err(out_stock, ref), rel_err(out_fused, ref)
            t_eager = _time_us(lambda: model(x), device)
            t_stock = _time_us(lambda: stock(x), device)
            t_fused = _time_us(lambda: fused(x), device)
        ok &= err_fused < 1e-2
        print(f"  M={m}: rel_err vs eager: stock {err_stock:.2e}, fusekern {err_fused:.2e}  "
              f"({'equivalent' if err_fused < 1e-2 else 'MISMATCH'} at bf16 tolerance 1e-2)")
        print(f"  M={m}: time eager {t_eager:9.1f} us | stock torch.compile {t_stock:9.1f} us | "
              f"fusekern {t_fused:9.1f} us | speed-up over stock {t_stock / t_fused:5.2f}x")
    print(fusekern.match_report())
    return 0 if ok else 1
