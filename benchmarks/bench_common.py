"""Shared by the benchmark scripts: clock warm-up and CSV output."""
from __future__ import annotations

import csv
import os

import torch
import triton.testing


def warm_up_clocks(device: str = "cuda") -> None:
    """Bring the SM clock up before the first timing (the card idles at a low clock)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    triton.testing.do_bench(lambda: a @ a, warmup=200, rep=300)


def write_csv(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
