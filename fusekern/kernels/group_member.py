"""What the grouped launches share on the device: which member a program serves.

A grouped launch (``packed_gemv_group``, ``int4_mma_sync_group``, ``int4_mma_group``, ``fp8_mma_group``) runs two
or three weights that multiply the same x in one grid: member 0 owns column tiles [0, T1), member 1 [T1, T2),
member 2 [T2, tiles). Each program picks its member's width, pointers and offsets with ``pick``.
"""
import triton
import triton.language as tl


@triton.jit
def pick(in1, in2, v0, v1, v2):
    """v0, v1 or v2 for a program of member 0, 1 or 2 (in1: member >= 1, in2: member 2)."""
    return tl.where(in2, v2, tl.where(in1, v1, v0))
