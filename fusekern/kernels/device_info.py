"""Per-device facts that launch heuristics need, read once and cached (thread-safe)."""
from __future__ import annotations

import os
import threading

import torch

_lock = threading.Lock()
_sm_counts: dict[int, int] = {}

# Used where no CUDA device is present (the Triton interpreter, CPU tests): an H200's count.
DEFAULT_SM_COUNT = 132


def sm_count(device: torch.device | str | int | None = None) -> int:
    """Number of SMs of a CUDA device (the current one by default), cached per device index."""
    if isinstance(device, torch.device) and device.index is not None:  # the per-launch fast path
        count = _sm_counts.get(device.index)
        if count is not None and device.type == "cuda":
            return count
    if not torch.cuda.is_available():
        return DEFAULT_SM_COUNT
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return DEFAULT_SM_COUNT
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = _sm_counts.get(index)
    if count is None:
        with _lock:
            count = _sm_counts.get(index)
            if count is None:
                count = torch.cuda.get_device_properties(index).multi_processor_count
                _sm_counts[index] = count
    return count


# The oldest GPU fusekern's kernels are built for: bf16 tensor cores and conversions (Ampere). FP8
# conversions and MMAs need sm_89 (Ada, Hopper); TMA and packed bf16 multiplies (``mul.rn.bf16x2``) sm_90.
MIN_CAPABILITY = (8, 0)
FP8_CAPABILITY = (8, 9)
HOPPER = (9, 0)

_capabilities: dict[int, tuple[int, int]] = {}


def capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, cached per index; None where kernels do not run on a GPU (CPU, the
    Triton interpreter) or no driver answers (compiling on a machine without a GPU, for Hopper)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        cap = _capabilities.get(index)
        if cap is None:
            cap = _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    except (RuntimeError, AssertionError):  # no driver / CUDA not compiled in
        return None
    return cap


def unsupported(device: torch.device, fp8: bool = False) -> str | None:
    """Why fusekern's kernels cannot run on ``device`` (None: they can). Patterns decline with this reason,
    so the original graph stays. fp8: the replacement converts or multiplies FP8 values."""
    if device.type not in ("cpu", "cuda"):
        return f"tensors on {device} (fusekern runs on CPU and CUDA)"
    cap = capability(device)
    if cap is None:
        return None
    if cap < MIN_CAPABILITY:
        return f"a GPU of sm_{cap[0]}{cap[1]}, older than sm_80 (fusekern's kernels need bf16 tensor cores)"
    if fp8 and cap < FP8_CAPABILITY:
        return f"FP8 values on a GPU of sm_{cap[0]}{cap[1]}, older than sm_89 (no FP8 conversions or MMAs)"
    return None


def supports_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch (Hopper and later, compiled
    kernels: a dependent grid starts while the one before it finishes, and waits for its results with
    ``griddepcontrol.wait``). False on CPU and under the Triton interpreter."""
    cap = capability(device)
    return cap is not None and cap >= HOPPER
