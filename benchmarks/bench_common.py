"""Shared by the benchmark scripts: clock warm-up, cold calls, timing and CSV output."""
from __future__ import annotations

import csv
import os
import subprocess
import time

import torch
import triton.testing


def warm_up_clocks(device: str = "cuda") -> None:
    """Bring the SM clock up before the first timing (the card idles at a low clock)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    triton.testing.do_bench(lambda: a @ a, warmup=200, rep=300)


# The floors: the bytes a call must move over the DRAM bandwidth a kernel can reach, or its FLOPs over the dense
# tensor-core peak, whichever is longer. The H200's bandwidth is the baselines' 4.3 TB/s (a copy measured 4.22,
# read + write; the spec says 4.8), kept fixed so that every H200 table divides by the same number. On any other
# GPU the scripts measure a copy's rate once per run (an H100 SXM's spec is 3.35 TB/s: dividing its times by the
# H200's rate understated its floors by a fifth). Every CSV row records the rate used (floor_TBps).
H200_BANDWIDTH = 4.3e12
BF16_PEAK = 989e12   # dense bf16 tensor-core FLOP/s, H100 SXM and H200 (spec)
FP8_PEAK = 1979e12   # dense FP8
_bandwidth: dict[str, float] = {}


def floor_bandwidth() -> float:
    """Bytes per second for the floors on this machine's GPU (the H200's fixed figure where there is none)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "H200 (no GPU here)"
    if "H200" in name:
        return H200_BANDWIDTH
    if name not in _bandwidth:
        _bandwidth[name] = measured_copy_bandwidth()
        print(f"floors: {name} copies at {_bandwidth[name] / 1e12:.2f} TB/s (read + write), measured", flush=True)
    return _bandwidth[name]


def measured_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Read + write bytes per second of a device-to-device copy of ``nbytes`` (median of do_bench)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


COLD_BYTES = 120_000_000  # twice the H200's 60 MB L2 (as PyTorch reports it)


def copies_for_cold(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` and enough clones of them that cycling through the copies reads more than ``COLD_BYTES``:
    each call then reads its weight from DRAM, as a decoder's layers do (``do_bench_cudagraph`` repeats one
    call, so a weight that fits L2 is otherwise partly read from it)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    n = max(2, -(-COLD_BYTES // max(nbytes, 1)))
    return [list(tensors)] + [[t.clone() for t in tensors] for _ in range(n - 1)]


def cycling(calls: list):
    """One function that runs ``calls[0]``, ``calls[1]``, ... in turn (a CUDA graph captures them in turn)."""
    state = [len(calls) - 1]

    def fn():
        state[0] = (state[0] + 1) % len(calls)
        return calls[state[0]]()
    return fn


def write_csv(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


class RowWriter:
    """CSV rows written as they are measured (a run cut short by a timeout keeps what it measured);
    the first row's keys are the header. Without a path it writes nothing."""

    def __init__(self, path: str | None):
        self.file = open(path, "w", newline="") if path else None
        self.writer = None

    def write(self, row: dict) -> None:
        if self.file is None:
            return
        if self.writer is None:
            self.writer = csv.DictWriter(self.file, fieldnames=list(row))
            self.writer.writeheader()
        self.writer.writerow(row)
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def per_call_us(f, args, calls: int, warmup: int = 0) -> float:
    """Host wall time per call of back-to-back calls, after ``warmup`` calls (host-bound work: the GPU queue
    never drains)."""
    for _ in range(warmup):
        f(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def git_sha() -> str:
    """The commit measured: $FUSEKERN_GIT_SHA (the device copy has no .git) or the HEAD of this checkout (the
    benchmarks' own, whatever the working directory), with ``+dirty`` where tracked code differs from it (not the
    results: a script writing its committed CSV would otherwise mark its own rows dirty)."""
    if os.environ.get("FUSEKERN_GIT_SHA"):
        return os.environ["FUSEKERN_GIT_SHA"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ":(top,exclude)benchmarks/results"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def versions() -> dict:
    """GPU and library versions for every CSV row."""
    import triton

    try:
        from importlib.metadata import version

        cutlass_dsl = version("nvidia-cutlass-dsl")
    except Exception:
        cutlass_dsl = "absent"
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cutlass_dsl=cutlass_dsl, git_sha=git_sha(), floor_TBps=round(floor_bandwidth() / 1e12, 3))


def check_and_time(fn, ref: torch.Tensor, rep: int = 50, timed=None) -> tuple[float, float | str]:
    """(relative error of ``fn()`` against ``ref``, median µs of ``do_bench_cudagraph(timed or fn)``) for one
    config of a sweep (``timed``: e.g. ``cycling`` calls over cold copies of the weight); a config that does
    not compile or fit gives (nan, "n/a (ErrorName...)")."""
    try:
        got = fn().float()
        err = ((got - ref).norm() / ref.norm()).item()
        return err, triton.testing.do_bench_cudagraph(timed or fn, rep=rep, return_mode="median") * 1e3
    except Exception as e:
        return float("nan"), f"n/a ({type(e).__name__}: {str(e)[:80]})"


def check_and_time_both(fn, ref: torch.Tensor) -> tuple[float, float, float]:
    """(relative error of ``fn()`` against ``ref``, median µs of ``do_bench`` (launch path included), median
    µs of ``do_bench_cudagraph`` (GPU time)) for one variant of a benchmark; raises what ``fn`` raises."""
    got = fn().float()
    err = ((got - ref).norm() / ref.norm()).item()
    us = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    us_graph = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    return err, us, us_graph
