"""Rematerialization hints for Triton kernels: re-read the block index where it is used.

A kernel that computes its tile offsets from ``tl.program_id`` before the main loop and uses them again in
the epilogue keeps them (or the index) live in registers across the whole loop. CUTLASS avoids that by
re-reading ``blockIdx`` at the point of use (``RematerializeBlockIdxX`` in index_remat.h): an S2R costs a
few cycles, a register held through the loop costs occupancy or a spill.

In Triton, ``tl.program_id`` lowers to a pure read of ``%ctaid`` that LLVM merges with the first read, so
writing it twice gives one read. ``block_index`` issues the read as a volatile ``mov`` from ``%ctaid``
that the compiler can neither merge nor hoist: the epilogue really recomputes its offsets. Under the
Triton interpreter (no PTX) it is ``tl.program_id``.

Kernels with a main loop take two constexpr flags, set from a config's mode by ``remat_flags``:
- mode ``off``: offsets computed once before the loop and kept; pointer tensors advanced each iteration.
- mode ``epilogue`` (REMAT_EPILOGUE): the epilogue (after the loop) re-reads the block index and
  recomputes its offsets.
- mode ``full`` (also REMAT_LOOP): the loop carries one scalar k plus loop-invariant 32-bit tile
  offsets, forming the addresses at each load, instead of 64-bit pointer tensors.
Register allocation does not respond to them monotonically (measured: each mode wins somewhere and loses
somewhere), so each config names its mode, chosen by measurement: ``python -m fusekern.kernels.report``
for registers and spills, ``benchmarks/bench_remat.py`` for time on the GPU.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

REMAT_MODES = ("off", "epilogue", "full")


def remat_flags(mode: str) -> dict[str, bool]:
    """The kernel constexprs for a config's rematerialization mode."""
    if mode not in REMAT_MODES:
        raise ValueError(f"unknown rematerialization mode {mode!r}; expected one of {REMAT_MODES}")
    return dict(REMAT_EPILOGUE=mode != "off", REMAT_LOOP=mode == "full")


# Read like Triton reads it: when kernels are decorated.
INTERPRETING: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def block_index(axis: tl.constexpr):
    """The block index along ``axis`` (0, 1 or 2), read from ``%ctaid`` here, not reused from earlier."""
    if INTERPRETING:
        return tl.program_id(axis)
    elif axis == 0:
        return tl.inline_asm_elementwise("mov.u32 $0, %ctaid.x;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    elif axis == 1:
        return tl.inline_asm_elementwise("mov.u32 $0, %ctaid.y;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("mov.u32 $0, %ctaid.z;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
