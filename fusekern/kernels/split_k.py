"""Split-K summed inside the launch: the last of a tile's programs adds the partials.

Each of a column tile's SPLIT_K programs writes its fp32 partial to a workspace ``[SPLIT_K, M, N]`` and counts
itself in on the tile's counter (``split_counters``: one buffer per device and stream, zero between launches);
the program that counts last reads every partial back in split order (deterministic), resets the counter for
the next launch and finishes the tile. No reduction kernel, no second launch. Used by the tile kernels whose
accumulator is one tensor (GEMV, ``int4_mma``, ``int4_mma_n``, ``fp4_mma``, ``fp8_mma``); the ``mma.sync``
kernels hold theirs as per-lane fragments and keep their own copy of the same steps (``int4_mma_sync.finish``).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_partials(part, ws_ptr, offs, split_stride, pid_k, mask, cnt, SPLIT_K: tl.constexpr):
    """Write this program's fp32 ``part`` and count in at ``cnt``. offs: the tile's elements within one split
    of the workspace; split_stride: elements from one split to the next (M * N; 64-bit where SPLIT_K * M * N
    may pass 2**31: the caller's choice, 32-bit offsets cost fewer registers). Returns (last, total): whether
    this program counted last, and then the sum of every split's partial (``part`` otherwise)."""
    tl.store(ws_ptr + (pid_k * split_stride + offs), part, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the count (release below)
    last = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    if last:
        part = tl.zeros_like(part)
        for s in range(SPLIT_K):  # L2 reads (.cg): the partials were written by other SMs
            part += tl.load(ws_ptr + (s * split_stride + offs), mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
    return last, part
