"""The activation rows of an integer GEMV, prepared once per call instead of once per column tile.

The CUDA-core GEMV (``packed_mm.gemv_program``) multiplies each code, read as the biased float
``2**(23 - E) + q``, by its x in fp32 and removes ``sum 2**(23 - E) x`` afterwards. Done inside the
GEMV, every program converts its x from 16 bits and sums those biases per word row, again for each of
its column tiles: on the sm_90a build of the demo's o projection that is 24 of a thread's ~300 loop
instructions per 64 values, and with K-vector tiles (a thread holding eight words of one column) it is
one conversion per value. Here one small launch does it for all programs, per K tile of the GEMV's
config:

- ``xp[m, t * BLOCK_K + f * BKW + r]``: x at the k of field f of the tile's word row r, in fp32 (tile-
  major, then field, then row: a thread's words of one field read adjacent floats, at offsets fixed at
  compile time from one base per tile);
- ``xc[m, 2 t]``: the tile's bias sum ``sum_k 2**(23 - E_k) x_k`` (plus ``128 sum x`` for signed codes,
  read as code + 128), ``xc[m, 2 t + 1]``: ``sum_k x_k``, which the zero point multiplies.

The GEMV then subtracts ``(xc[2t] + z * xc[2t + 1]) * s`` once per column and tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusekern.kernels import replay


def bias_exponent(shift: int, bits: int, xmant: int) -> int:
    """E: the bit a field at ``shift`` is moved to inside the mantissa of ``2**(23 - E)`` (the GEMV's
    ``packed_mm._int_biased``; its bias is ``2**(23 - E)``): 4-bit fields to bit 15 or 19, bytes to bit 8
    when x has at most 8 significant bits (bf16), else to bit 15."""
    if bits == 4:
        return 15 + shift % 8
    return 8 if xmant <= 8 else 15


@triton.jit
def gemv_x_prep_kernel(x_ptr, xp_ptr, xc_ptr, K, stride_xm, stride_xk,
                       P: tl.constexpr, KPOS: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr,
                       XMANT: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per (row, K tile): the tile's x permuted to field order in fp32, and its two sums."""
    m = tl.program_id(0)
    t = tl.program_id(1)
    BKW: tl.constexpr = BLOCK_K // P
    f = tl.arange(0, P)[:, None]
    r = tl.arange(0, BKW)[None, :]
    k = (t * BKW + r) * P + ((KPOS >> (4 * f)) & 15)  # field f of word row r holds this k
    x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + k.to(tl.int64) * stride_xk).to(tl.float32)
    tl.store(xp_ptr + m.to(tl.int64) * K + t * BLOCK_K + f * BKW + r, x)
    if BITS == 4:
        e = 15 + (f * BITS) % 8
    else:
        e = tl.zeros_like(f) + (8 if XMANT <= 8 else 15)
    bias = (1 << (23 - e)).to(tl.float32)
    xsum = tl.sum(tl.sum(x, axis=1), axis=0)
    csum = tl.sum(tl.sum(x * bias, axis=1), axis=0)
    if SIGNED:
        csum += 128.0 * xsum
    nt = K // BLOCK_K
    tl.store(xc_ptr + (m * nt + t) * 2, csum)
    tl.store(xc_ptr + (m * nt + t) * 2 + 1, xsum)


def gemv_x_prep(x: torch.Tensor, K: int, P: int, KPOS: int, BITS: int, signed: bool, BLOCK_K: int,
                record: bool = False):
    """``(xp [M, K], xc [M, K // BLOCK_K, 2], launch)`` for ``x [M, K]`` (bf16 or fp16, K a multiple of
    BLOCK_K); launch: the recorded ``replay.Launch`` when ``record``, else None."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemv_x_prep: x must be bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != K or K % BLOCK_K or BLOCK_K % P:
        raise ValueError(f"gemv_x_prep: x must be [M, {K}] with K a multiple of BLOCK_K = {BLOCK_K} "
                         f"(and BLOCK_K of P = {P}); got {tuple(x.shape)}")
    M = x.shape[0]
    xp = torch.empty((M, K), device=x.device, dtype=torch.float32)
    xc = torch.empty((M, K // BLOCK_K, 2), device=x.device, dtype=torch.float32)
    launch = replay.launch(gemv_x_prep_kernel, (M, K // BLOCK_K), (x, xp, xc, K, x.stride(0), x.stride(1)), dict(
        P=P, KPOS=KPOS, BITS=BITS, SIGNED=signed, XMANT=8 if x.dtype == torch.bfloat16 else 11, BLOCK_K=BLOCK_K,
        num_warps=1), record)
    return xp, xc, launch


def gemv_x_prep_reference(x: torch.Tensor, K: int, P: int, KPOS: int, BITS: int, signed: bool, BLOCK_K: int):
    """``gemv_x_prep``'s ``(xp, xc)`` in float64 (the sums exact for the test's comparison)."""
    M = x.shape[0]
    bkw = BLOCK_K // P
    pos = [(KPOS >> (4 * f)) & 15 for f in range(P)]
    xmant = 8 if x.dtype == torch.bfloat16 else 11
    xd = x.double()
    xp = torch.empty((M, K), dtype=torch.float64, device=x.device)
    xc = torch.empty((M, K // BLOCK_K, 2), dtype=torch.float64, device=x.device)
    bias = torch.tensor([2.0 ** (23 - bias_exponent(f * BITS, BITS, xmant)) for f in range(P)],
                        dtype=torch.float64, device=x.device)
    for t in range(K // BLOCK_K):
        rows = t * bkw + torch.arange(bkw, device=x.device)
        ks = rows[None, :] * P + torch.tensor(pos, device=x.device)[:, None]  # [P, bkw]
        vals = xd[:, ks]  # [M, P, bkw]
        xp[:, t * BLOCK_K:(t + 1) * BLOCK_K] = vals.reshape(M, BLOCK_K)
        xs = vals.sum(dim=(1, 2))
        xc[:, t, 0] = (vals * bias[None, :, None]).sum(dim=(1, 2)) + (128.0 * xs if signed else 0.0)
        xc[:, t, 1] = xs
    return xp, xc
