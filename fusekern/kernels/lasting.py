"""Tensors kept for the whole process (decode tables, split-K counters), allocated outside CUDA graph pools.

Inductor's CUDA graphs warm a graph up with every allocation of the current thread routed to the graph's
private memory pool (``torch._inductor.cudagraph_trees._use_cuda_memory_pool_manager``). A tensor that kernels
keep reading across calls must not live there: the pool's blocks are freed and handed out again as the graph
tree checkpoints its state, and the kept tensor would be overwritten. ``lasting`` makes such a tensor on a
helper thread, whose allocations go to the device's default pool, and waits for it to be written.
"""
from __future__ import annotations

import concurrent.futures

import torch

_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusekern-lasting")


def lasting(make, device: torch.device) -> torch.Tensor:
    """``make()``, a new tensor on ``device``, allocated outside any CUDA graph pool of this thread and written
    before this returns. While this thread's stream is captured (nothing may synchronize then) it is made here,
    as before: the ops make these on a shape's first call, which runs before capture."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make()

    def run():
        with torch.cuda.device(device):
            t = make()
            torch.cuda.current_stream().synchronize()
            return t

    return _THREAD.submit(run).result()
