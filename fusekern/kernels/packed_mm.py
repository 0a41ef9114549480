"""Hand-tuned GEMMs for the packed formats fusekern recognizes: ``out = x @ W (+ bias)``.

W is never written (except by the large-M path): each kernel reads the user's packed words as they
are and decodes them in registers. What the kernels read and how is a ``PackedLayout``
(``fusekern.patterns.decode.layout``), proven equal to the user's decode program before it is used.

Read top to bottom: decode helpers -> GEMV (small M, CUDA cores) -> swap-AB tensor-core GEMM (M up to
64) -> decode-once kernel (large M, then cuBLAS) -> launchers -> reference.

Why these kernels are faster than the generated ones (``decode_mm``), per weight value:
- Each code word is loaded once and all its values unpacked from the register (a 1-byte code leaf that
  is contiguous along K is read as 32-bit words: four bytes per load lane).
- Integer fields become floats without a convert instruction (Hopper converts int->float at a quarter
  of the FMA rate): ``field | 0x4B000000`` is the float ``2**23 + field``, and one subtraction removes
  ``2**23`` and the zero point together.
- E2M1 decodes in registers: the sign and the three exponent/mantissa bits are moved into an fp16's
  bit positions (a value 2**14 too small, folded into the scale), so no table is read from memory.
- The group scale is applied once per word (GEMV) or once per K tile (tensor cores), not per value:
  within a group ``sum_k (q - z) s x = s sum_k (q - z) x``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusekern.kernels import replay
from fusekern.kernels.int4_mma import Int4Mma, int4_mma, layout_fits as int4_mma_fits
from fusekern.kernels.int4_mma_n import Int4MmaN, int4_mma_n, layout_fits as int4_mma_n_fits
from fusekern.kernels.int4_mma_sync import Int4MmaSync, int4_mma_sync
from fusekern.kernels.fp4_mma import Fp4Mma, fp4_mma, layout_fits as fp4_mma_fits
from fusekern.kernels.fp4_mma_sync import Fp4MmaSync, fp4_mma_sync, layout_fits as fp4_mma_sync_fits
from fusekern.kernels.fp8_mma import Fp8Mma, fp8_mma, layout_fits as fp8_mma_fits
from fusekern.kernels.intmath import cdiv, needs_i64
from fusekern.kernels.leaf_cache import LeafCache
from fusekern.kernels.split_counters import split_counters
from fusekern.kernels.split_k import add_partials
from fusekern.patterns.decode.formats import AWQ_ORDER
from fusekern.patterns.decode.layout import PackedLayout, leaf_strides

# float bits of 2**23: OR-ing an integer < 2**23 into the mantissa gives the float 2**23 + it
MAGIC_F = tl.constexpr(8388608.0)
E2M1_SCALE = tl.constexpr(16384.0)  # the fp16-bits trick yields E2M1 values divided by 2**14

FP8 = (torch.float8_e4m3fn,)
# inline PTX cannot run in Triton's CPU interpreter: the kernels then use plain operations
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
VALUE_CODES = {"uint": 0, "int": 1, "fp8": 2, "e2m1": 3}
ZERO_CODES = {"": 0, "const": 1, "int": 2, "float": 3, "packed": 4}


# ----------------------------------------------------------------------------- decode helpers


@triton.jit
def _field(words, shift, BITS: tl.constexpr):
    """Bits [shift, shift + BITS) of each word, as an int32 in [0, 2**BITS)."""
    return (words >> shift) & ((1 << BITS) - 1)


@triton.jit
def _value(words, shift, VALUE: tl.constexpr, BITS: tl.constexpr):
    """One value per word from the field at ``shift``, as fp32; integers come back as ``2**23 + field``
    (``2**23 + 128 + byte`` for signed bytes), E2M1 as its value / 2**14."""
    if VALUE == 2:  # fp8 e4m3: bytes, or one byte of an int32 word
        if words.dtype == tl.int32:
            words = _field(words, shift, BITS).to(tl.uint8)
        return words.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif VALUE == 3:  # E2M1 -> fp16 bits: sign to bit 15, exponent and mantissa to bits 9..11
        f = _field(words, shift, BITS)
        h = ((f & 7) << 9) | ((f & 8) << 12)
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    elif VALUE == 1:  # a signed byte: flip its sign bit to read it as byte + 128
        f = _field(words, shift, BITS) ^ 0x80
        return (f | 0x4B000000).to(tl.float32, bitcast=True)
    else:
        f = _field(words, shift, BITS)
        return (f | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _offset(VALUE: tl.constexpr):
    """What ``_value`` adds to an integer value (removed with the zero point)."""
    if VALUE == 1:
        return MAGIC_F + 128.0
    elif VALUE == 0:
        return MAGIC_F
    else:
        return 0.0


@triton.jit
def _group_load(ptr, kk, nn, mask, GK: tl.constexpr, GN: tl.constexpr, sk, sn):
    """Element [kk // GK, nn // GN] of a scale / zero leaf (strides sk, sn along its k and n dims)."""
    return tl.load(ptr + (kk // GK) * sk + (nn // GN) * sn, mask=mask, other=0)


@triton.jit
def _scale_of(s, SCALE: tl.constexpr):
    if SCALE == 2:  # E8M0: the exponent byte placed in a float's exponent field (0 -> 2**-127)
        e = s.to(tl.int32)
        return tl.where(e == 0, 5.877471754111438e-39, (e << 23).to(tl.float32, bitcast=True))
    elif SCALE == 3:  # fp8 e4m3, read as bytes
        return s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return s.to(tl.float32)


@triton.jit
def _zero_of(z_ptr, kz, n, mask, ZERO: tl.constexpr, ZERO_VALUE: tl.constexpr, GK: tl.constexpr, GN: tl.constexpr,
             ZPW: tl.constexpr, ZORDER: tl.constexpr, BITS: tl.constexpr, szk, szn):
    """The zero point (plus its constant offset) of the group holding [kz, n], as fp32."""
    if ZERO == 1:
        return tl.zeros(n.shape, dtype=tl.float32) + ZERO_VALUE
    elif ZERO == 4:  # packed ZPW per word along n
        zw = tl.load(z_ptr + (kz // GK) * szk + (n // (GN * ZPW)) * szn, mask=mask, other=0)
        z = _field(zw, ((ZORDER >> (4 * ((n // GN) % ZPW))) & 15) * BITS, BITS)
        return z.to(tl.float32) + ZERO_VALUE
    else:
        return _group_load(z_ptr, kz, n, mask, GK, GN, szk, szn).to(tl.float32) + ZERO_VALUE


@triton.jit
def _zero_loaded(zp, n, ZERO: tl.constexpr, ZERO_VALUE: tl.constexpr, GN: tl.constexpr, ZPW: tl.constexpr,
                 ZORDER: tl.constexpr, BITS: tl.constexpr):
    """``_zero_of`` with the pointers to each column's zero (or zero word) formed by the caller."""
    if ZERO == 1:
        return tl.zeros(n.shape, dtype=tl.float32) + ZERO_VALUE
    elif ZERO == 4:
        z = _field(tl.load(zp), ((ZORDER >> (4 * ((n // GN) % ZPW))) & 15) * BITS, BITS)
        return z.to(tl.float32) + ZERO_VALUE
    else:
        return tl.load(zp).to(tl.float32) + ZERO_VALUE


@triton.jit
def _zero_sub(v, z_ptr, kk, nn, mask, ZERO: tl.constexpr, ZERO_VALUE: tl.constexpr, VALUE: tl.constexpr,
              GK: tl.constexpr, GN: tl.constexpr, ZPW: tl.constexpr, ZORDER: tl.constexpr, BITS: tl.constexpr,
              szk, szn):
    """``v - offset - zero``: the decoded value before scaling (one subtraction for integer zeros)."""
    if ZERO == 0:
        return v - _offset(VALUE)
    z = _zero_of(z_ptr, kk, nn, mask, ZERO, ZERO_VALUE, GK, GN, ZPW, ZORDER, BITS, szk, szn)
    if ZERO == 3:  # float zero points: subtract the offset first (exact), then the zero
        return (v - _offset(VALUE)) - z
    else:  # constant or integer zero points: offset + zero is exact in fp32
        return v - (z + _offset(VALUE))


@triton.jit
def _k_tiles(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles [t0, t1) of split ``pid_k``: contiguous runs of tiles, one per split."""
    tiles = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(tiles, SPLIT_K)
    t0 = pid_k * per
    return t0, tl.minimum(t0 + per, tiles)


@triton.jit
def _tile_scale(s_ptr, k0, offs_n, N, GK: tl.constexpr, GN: tl.constexpr, ssk, ssn, SCALE: tl.constexpr):
    """The ``[1, BLOCK_N]`` scale row of the group holding k0 (a tile inside one group)."""
    return _scale_of(_group_load(s_ptr, k0 + tl.zeros((1, 1), dtype=tl.int32), offs_n[None, :], offs_n[None, :] < N,
                                 GK, GN, ssk, ssn), SCALE)


@triton.jit
def _gemv_store(out, g_ptr, bias_ptr, out_ptr, pid_k, m, offs_n, N, stride_os, stride_om, stride_on,
                HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A GEMV program's epilogue, its K slice's partial row stored at ``out[pid_k]``."""
    _gemv_epilogue(out, g_ptr, bias_ptr, out_ptr + pid_k * stride_os, m, offs_n, N, stride_om, stride_on,
                   HAS_GLOBAL, HAS_BIAS)


@triton.jit
def _offset2(a, b, sa, sb, I64: tl.constexpr):
    """``a * sa + b * sb``, in 64 bits with I64."""
    if I64:
        return a.to(tl.int64) * sa + b.to(tl.int64) * sb
    else:
        return a * sa + b * sb


@triton.jit
def _tile(q_ptr, z_ptr, s_ptr, k0, n0, offs_k, offs_n, sqk, sqn, szk, szn, ssk, ssn, K, N, KW,
          BITS: tl.constexpr, P: tl.constexpr, ORDER: tl.constexpr, VALUE: tl.constexpr, PACK_N: tl.constexpr,
          ZERO: tl.constexpr, ZERO_VALUE: tl.constexpr, ZPW: tl.constexpr,
          ZORDER: tl.constexpr, SCALE: tl.constexpr, GK: tl.constexpr, GN: tl.constexpr, APPLY_SCALE: tl.constexpr,
          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, I64: tl.constexpr = False):
    """The decoded ``[BLOCK_K, BLOCK_N]`` tile (fp32) at rows ``offs_k``, columns ``offs_n``: zero point
    removed; the scale applied when APPLY_SCALE (else the caller applies it per tile). I64: the codes' offsets
    in 64 bits (a code leaf whose last element lies 2**31 or more past its first: ``needs_i64``)."""
    k = offs_k[:, None]
    n = offs_n[None, :]
    mask = (k < K) & (n < N)
    if P == 1:
        words = tl.load(q_ptr + _offset2(k, n, sqk, sqn, I64), mask=mask, other=0)
        if VALUE != 2:
            words = words.to(tl.int32)
        if VALUE == 1:
            v = ((words + 128) | 0x4B000000).to(tl.float32, bitcast=True)
        else:
            v = _value(words, 0, VALUE, BITS)
    elif PACK_N:
        BNW: tl.constexpr = BLOCK_N // P
        nw = n0 // P + tl.arange(0, BNW)
        words = tl.load(q_ptr + _offset2(k, nw[None, :], sqk, sqn, I64), mask=(k < K) & (nw[None, :] < KW),
                        other=0).to(tl.int32)
        pos = tl.arange(0, P)
        shifts = ((ORDER >> (4 * pos)) & 15) * BITS
        v = _value(words[:, :, None], shifts[None, None, :], VALUE, BITS)
        v = tl.reshape(v, (BLOCK_K, BLOCK_N))
    else:
        BKW: tl.constexpr = BLOCK_K // P
        kw = k0 // P + tl.arange(0, BKW)
        words = tl.load(q_ptr + _offset2(kw[:, None], n, sqk, sqn, I64), mask=(kw[:, None] < KW) & (n < N),
                        other=0).to(tl.int32)
        pos = tl.arange(0, P)
        shifts = ((ORDER >> (4 * pos)) & 15) * BITS
        v = _value(words[:, None, :], shifts[None, :, None], VALUE, BITS)
        v = tl.reshape(v, (BLOCK_K, BLOCK_N))
    if VALUE == 3:  # E2M1 at its true value: a tile rounded to fp16 after scaling must not underflow
        v = v * E2M1_SCALE
    v = _zero_sub(v, z_ptr, k, n, mask, ZERO, ZERO_VALUE, VALUE, GK, GN, ZPW, ZORDER, BITS, szk, szn)
    if APPLY_SCALE:
        if SCALE != 0:
            v = v * _scale_of(_group_load(s_ptr, k, n, mask, GK, GN, ssk, ssn), SCALE)
    return v


# ----------------------------------------------------------------------------- GEMV (small M)


@triton.jit
def _move(w, FROM: tl.constexpr, TO: tl.constexpr):
    """``w`` shifted so that bit FROM lands on bit TO."""
    if TO > FROM:
        return w << (TO - FROM)
    elif TO < FROM:
        return w >> (FROM - TO)
    else:
        return w


@triton.jit
def _int_value(w, hi, SHIFT: tl.constexpr, VALUE: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """The integer field at SHIFT of every word as fp32, offset removed (a signed byte's +128 included).

    The field is OR-ed, still at its bit position E, into the mantissa of 2**(23 - E), whose last bit is
    worth 2**-E: the float is 2**(23 - E) + field exactly, with no shift and no convert instruction.
    Fields that would reach the exponent bits are read from ``hi = w >> 12``. One subtraction follows."""
    LOW: tl.constexpr = SHIFT + BITS <= 23
    E: tl.constexpr = SHIFT if LOW else SHIFT - 12
    if LOW:
        src = w
    else:
        src = hi
    f = _and_or(src, ((1 << BITS) - 1) << E, (150 - E) << 23, ASM).to(tl.float32, bitcast=True)
    OFF: tl.constexpr = 128.0 if VALUE == 1 else 0.0
    return f - (8388608.0 / (1 << E) + OFF)


@triton.jit
def _and_or(w, AND: tl.constexpr, OR: tl.constexpr, ASM: tl.constexpr):
    """``(w & AND) | OR`` as one LOP3 (ptxas emits two when both constants are immediates)."""
    if ASM:
        return tl.inline_asm_elementwise(f"lop3.b32 $0, $1, {AND}, {OR}, 0xEA;", "=r,r", [w], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return (w & AND) | OR


@triton.jit
def _int_biased(w, SHIFT: tl.constexpr, BITS: tl.constexpr, XMANT: tl.constexpr, ASM: tl.constexpr):
    """The integer field at SHIFT of every word as the fp32 ``2**(23 - E) + field``, and that bias: the
    field is moved to bit E and OR-ed into the mantissa of 2**(23 - E). 4-bit fields go to bit 15 or
    19 (one shift per pair of fields); bytes to bit 8 when x's mantissa allows it (one PRMT: the byte
    and 2**15's exponent byte, picked by a selector), else to bit 15."""
    E: tl.constexpr = (15 + SHIFT % 8) if BITS == 4 else (8 if XMANT <= 8 else 15)
    if ASM and BITS == 8 and E == 8:
        v = tl.inline_asm_elementwise(f"prmt.b32 $0, $1, 71, {0x4505 + (SHIFT // 8) * 16};", "=r,r", [w],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        v = _and_or(_move(w, SHIFT, E), ((1 << BITS) - 1) << E, (150 - E) << 23, ASM)
    return v.to(tl.float32, bitcast=True), 8388608.0 / (1 << E)


@triton.jit
def _e2m1_value(w, SHIFT: tl.constexpr):
    """The E2M1 field at SHIFT of every word as fp32, divided by 2**14: its exponent and mantissa go to
    an fp16's bits 9..11 and its sign to bit 15."""
    h = (_move(w, SHIFT, 9) & 0x0E00) | (_move(w, SHIFT + 3, 15) & 0x8000)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_pair(w, F: tl.constexpr):
    """E2M1 fields F and F + 4 of 32-bit words (bits 4F and 4F + 16) as two fp32 tensors, divided by
    2**14: both are placed in one f16x2 register (4 instructions for 2 values), then widened."""
    # a: exponent/mantissa bits moved to bits 9..11 (and 25..27); b: the sign bit moved to bit 15 (and 31)
    if F == 3:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 a; .reg .b16 l, u; shr.b32 a, $2, 3; and.b32 a, a, 0x0E000E00; "
            "lop3.b32 a, $2, 0x80008000, a, 0xEA; mov.b32 {l, u}, a; cvt.f32.f16 $0, l; cvt.f32.f16 $1, u; }",
            "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            f"{{ .reg .b32 a, b; .reg .b16 l, u; shl.b32 a, $2, {9 - 4 * F}; and.b32 a, a, 0x0E000E00; "
            f"shl.b32 b, $2, {12 - 4 * F}; lop3.b32 a, b, 0x80008000, a, 0xEA; mov.b32 {{l, u}}, a; "
            "cvt.f32.f16 $0, l; cvt.f32.f16 $1, u; }",
            "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _fp8_quad(w):
    """The four fp8 e4m3 bytes of 32-bit words (byte 0 first) as fp32: two f16x2 converts, then widens."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, b; .reg .b16 l, u, h0, h1, h2, h3; mov.b32 {l, u}, $4; cvt.rn.f16x2.e4m3x2 a, l; "
        "cvt.rn.f16x2.e4m3x2 b, u; mov.b32 {h0, h1}, a; mov.b32 {h2, h3}, b; cvt.f32.f16 $0, h0; "
        "cvt.f32.f16 $1, h1; cvt.f32.f16 $2, h2; cvt.f32.f16 $3, h3; }",
        "=r,=r,=r,=r,r", [w], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _x_at(x_row, kbase, J: tl.constexpr, stride_xk, K, EVEN: tl.constexpr):
    """x[kbase + J] as fp32 ([BKW]: one k per word row)."""
    if EVEN:
        return tl.load(x_row + (kbase + J) * stride_xk).to(tl.float32)
    else:
        return tl.load(x_row + (kbase + J) * stride_xk, mask=kbase + J < K, other=0).to(tl.float32)


@triton.jit
def _word_dot(words, x_row, kbase, stride_xk, K, KPOS: tl.constexpr, P: tl.constexpr, VALUE: tl.constexpr,
              BITS: tl.constexpr, ZERO: tl.constexpr, XMANT: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
    """``(sum_f value_f * x[k_f], sum_f x[k_f])`` over the P fields of every word ([BKW, BLOCK_N] and
    [BKW]); field f (bits [f * BITS, (f + 1) * BITS)) holds k = word * P + ((KPOS >> 4 f) & 15). The sum
    of x is formed for zero points. Offsets are removed; E2M1 values come out divided by 2**14. XMANT:
    x's significant bits (8 bf16, 11 fp16, 0 for fp32: products then need exact operands)."""
    part = tl.zeros(words.shape, dtype=tl.float32)
    xsum = tl.zeros((words.shape[0],), dtype=tl.float32)
    # (zero points need the sum of x: the general branch forms it)
    if VALUE == 3 and ASM and P == 8 and ZERO == 0:  # E2M1, fields paired into f16x2 registers
        for f in tl.static_range(4):
            lo, up = _e2m1_pair(words, f)
            part += lo * _x_at(x_row, kbase, (KPOS >> (4 * f)) & 15, stride_xk, K, EVEN)[:, None]
            part += up * _x_at(x_row, kbase, (KPOS >> (4 * f + 16)) & 15, stride_xk, K, EVEN)[:, None]
    elif VALUE <= 1 and XMANT > 0 and P > 1 and (BITS == 4 or BITS == 8):
        # Integers, with x in 16 bits: FMA the biased float 2**(23 - E) + q straight into the sum (no
        # subtraction per value) and remove sum_f 2**(23 - E) x_f per word row afterwards. Exact products:
        # the float has 24 - E significant bits and x XMANT, so E >= XMANT keeps them within fp32's 24.
        # A large E keeps the bias small next to q (2**(23 - E) / q), so the subtraction loses little.
        csum = tl.zeros((words.shape[0],), dtype=tl.float32)
        for f in tl.static_range(P):
            xj = _x_at(x_row, kbase, (KPOS >> (4 * f)) & 15, stride_xk, K, EVEN)
            v, bias = _int_biased(words, f * BITS, BITS, XMANT, ASM)
            part += v * xj[:, None]
            csum += xj * bias
            xsum += xj
        if VALUE == 1:  # a signed byte was read as byte + 128
            csum += 128.0 * xsum
        part -= csum[:, None]
    elif VALUE == 2 and ASM and P == 4 and ZERO == 0:  # fp8 bytes of an int32 word, two at a time
        v0, v1, v2, v3 = _fp8_quad(words)
        part += v0 * _x_at(x_row, kbase, KPOS & 15, stride_xk, K, EVEN)[:, None]
        part += v1 * _x_at(x_row, kbase, (KPOS >> 4) & 15, stride_xk, K, EVEN)[:, None]
        part += v2 * _x_at(x_row, kbase, (KPOS >> 8) & 15, stride_xk, K, EVEN)[:, None]
        part += v3 * _x_at(x_row, kbase, (KPOS >> 12) & 15, stride_xk, K, EVEN)[:, None]
    else:
        hi = words >> 12
        for f in tl.static_range(P):
            xj = _x_at(x_row, kbase, (KPOS >> (4 * f)) & 15, stride_xk, K, EVEN)
            if VALUE == 2:  # fp8: bytes, or one byte of an int32 word
                w = words
                if words.dtype == tl.int32:
                    w = ((words >> (f * BITS)) & 255).to(tl.uint8)
                v = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            elif VALUE == 3:
                v = _e2m1_value(words, f * BITS)
            else:
                v = _int_value(words, hi, f * BITS, VALUE, BITS, ASM)
            part += v * xj[:, None]
            if ZERO != 0:
                xsum += xj
    return part, xsum


@triton.jit
def _gemv_finish(out, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, pid_n, pid_k, m, M, offs_n, N, stride_om,
                 stride_on, HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """A GEMV program's epilogue; split K: the last of a row tile's programs sums the partials (``split_k``,
    one counter per row and column tile)."""
    if SPLIT_K > 1:
        last, out = add_partials(out, ws_ptr, m.to(tl.int64) * N + offs_n, tl.cast(M, tl.int64) * N, pid_k,
                                 offs_n < N, cnt_ptr + m * tl.num_programs(0) + pid_n, SPLIT_K)
        if last:
            _gemv_epilogue(out, g_ptr, bias_ptr, out_ptr, m, offs_n, N, stride_om, stride_on, HAS_GLOBAL,
                           HAS_BIAS)
    else:
        _gemv_epilogue(out, g_ptr, bias_ptr, out_ptr, m, offs_n, N, stride_om, stride_on, HAS_GLOBAL, HAS_BIAS)


@triton.jit
def _gemv_epilogue(out, g_ptr, bias_ptr, out_ptr, m, offs_n, N, stride_om, stride_on,
                   HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Global scale, bias, store of the finished row."""
    if HAS_GLOBAL:
        out = out * tl.load(g_ptr).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + offs_n * stride_on, out.to(out_ptr.dtype.element_ty),
             mask=offs_n < N)


@triton.jit
def _load_words(qp, kw, n, sqk, sqn, KW, nmask, EVEN: tl.constexpr, I64: tl.constexpr):
    """The [BKW, BLOCK_N] code words (64-bit offsets where the leaf reaches 2**31 elements or more)."""
    off = _offset2(kw[:, None], n, sqk, sqn, I64)
    if EVEN:
        return tl.load(qp + off)
    else:
        return tl.load(qp + off, mask=(kw[:, None] < KW) & nmask, other=0)


@triton.jit
def packed_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, KW,
    stride_xm, stride_xk,
    # the leaves' strides (elements; the codes' in words) are compile-time constants: see HOIST below
    sqk: tl.constexpr, sqn: tl.constexpr, ssk: tl.constexpr, ssn: tl.constexpr, szk: tl.constexpr,
    szn: tl.constexpr, stride_om, stride_on,
    BITS: tl.constexpr, P: tl.constexpr, KPOS: tl.constexpr, VALUE: tl.constexpr, WORD_I32: tl.constexpr,
    ZERO: tl.constexpr, ZERO_VALUE: tl.constexpr, ZPW: tl.constexpr, ZORDER: tl.constexpr,
    SCALE: tl.constexpr, GK: tl.constexpr, GN: tl.constexpr, HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC_K: tl.constexpr,
    ASM: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr,
):
    """One row of ``x @ W`` for BLOCK_N columns over one K slice: ``gemv_program`` for this program."""
    gemv_program(tl.program_id(0), tl.program_id(0), tl.program_id(1), tl.program_id(2),
                 x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, KW,
                 stride_xm, stride_xk, sqk, sqn, ssk, ssn, szk, szn, stride_om, stride_on,
                 BITS, P, KPOS, VALUE, WORD_I32, ZERO, ZERO_VALUE, ZPW, ZORDER, SCALE, GK, GN, HAS_GLOBAL,
                 HAS_BIAS, SPLIT_K, BLOCK_N, BLOCK_K, VEC_K, ASM, EVEN, I64)


@triton.jit
def gemv_program(
    pid_n, pid_count, pid_k, m,
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, KW,
    stride_xm, stride_xk, sqk, sqn, ssk, ssn, szk, szn, stride_om, stride_on,
    BITS: tl.constexpr, P: tl.constexpr, KPOS: tl.constexpr, VALUE: tl.constexpr, WORD_I32: tl.constexpr,
    ZERO: tl.constexpr, ZERO_VALUE: tl.constexpr, ZPW: tl.constexpr, ZORDER: tl.constexpr,
    SCALE: tl.constexpr, GK: tl.constexpr, GN: tl.constexpr, HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC_K: tl.constexpr,
    ASM: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr,
):
    """One row of ``x @ W`` for BLOCK_N columns over one K slice, weights packed along K (or unpacked).

    The tile is ``[BLOCK_K / P, BLOCK_N]`` words and every step stays in the layout the words were loaded
    in (no trip through shared memory): each field of all words at once multiplies its k's x, a
    per-row vector broadcast along the thread's columns, so x is loaded and converted once per k for all
    the columns a thread holds. Per word: ``sum_f q_f x_f - z * sum_f x_f``, times the scale (a word's
    values share one group: GK % P == 0; whole-tile groups load one scale row). Without VEC_K,
    K-contiguous words are read one per thread so that a thread holds several columns (x reuse) rather
    than several words of one column. (Loading the next tile's words before decoding this one did not
    help: benchmarks/results/h200/gemv_sweep.csv.) EVEN: whole tiles (K % BLOCK_K == 0 == N % BLOCK_N), no masks.
    pid_n: the column tile; pid_count: the program's split-K counter along axis 0 (pid_n, or its tile in a
    group's launch: ``packed_gemv_group``)."""
    BKW: tl.constexpr = BLOCK_K // P
    XMANT: tl.constexpr = 8 if x_ptr.dtype.element_ty == tl.bfloat16 else (
        11 if x_ptr.dtype.element_ty == tl.float16 else 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n = offs_n[None, :]
    nmask = n < N
    PER_TILE: tl.constexpr = GK % BLOCK_K == 0  # one scale row per tile
    t0, t1 = _k_tiles(pid_k, K, BLOCK_K, SPLIT_K)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    if WORD_I32:
        qp = q_ptr.to(tl.pointer_type(tl.int32))
    else:
        qp = q_ptr
    acc = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
    ar = tl.arange(0, BKW)
    if not VEC_K:
        ar = tl.max_contiguous(ar, 1)
    # Whole tiles, one scale row per tile (HOIST): each leaf's address is a base that the loop advances by
    # one scalar per tile plus offsets fixed before the loop, in 64 bits: with the strides compile-time
    # constants, ptxas then folds a thread's offsets into the loads as immediates (sm_90a SASS of the
    # demo's o projection: 303 instructions per iteration against 337, 56 registers against 96).
    # (n0 + ln) // G == n0 // G + ln // G for the tile's columns when G divides BLOCK_N or BLOCK_N divides G,
    # for the scales' G = GN and the packed zeros' G = GN * ZPW alike
    GROUPS_ALIGN: tl.constexpr = ((BLOCK_N % GN == 0) or (GN % BLOCK_N == 0)) and (
        (BLOCK_N % (GN * ZPW) == 0) or ((GN * ZPW) % BLOCK_N == 0))
    HOIST: tl.constexpr = EVEN and PER_TILE and GROUPS_ALIGN
    if HOIST:
        n0 = (pid_n * BLOCK_N).to(tl.int64)
        ln = tl.arange(0, BLOCK_N)[None, :].to(tl.int64)
        q_base = qp + n0 * sqn
        q_off = ln * sqn + ar[:, None].to(tl.int64) * sqk
        s_base = s_ptr + (n0 // GN) * ssn
        s_off = (ln // GN) * ssn
        z_base = z_ptr + (n0 // (GN * ZPW)) * szn
        z_off = (ln // (GN * ZPW)) * szn
    for t in range(t0, t1):
        kw = t * BKW + ar
        if HOIST:
            words = tl.load((q_base + tl.cast(t, tl.int64) * (BKW * sqk)) + q_off)
        else:
            words = _load_words(qp, kw, n, sqk, sqn, KW, nmask, EVEN, I64)
        if VALUE != 2 or WORD_I32:
            words = words.to(tl.int32)
        if VALUE == 1:  # signed bytes read as byte + 128: flip every byte's sign bit once per word
            if P == 1:
                words = words + 128
            else:
                words = words ^ -2139062144  # 0x80808080
        kbase = kw * P
        part, xsum = _word_dot(words, x_row, kbase, stride_xk, K, KPOS, P, VALUE, BITS, ZERO, XMANT, ASM, EVEN)
        if PER_TILE:
            kz = t * BLOCK_K + tl.zeros((1, 1), dtype=tl.int32)
            zmask = nmask
        else:
            kz = kbase[:, None]
            zmask = (kw[:, None] < KW) & nmask
        if EVEN:  # constant-true masks fold away
            zmask = tl.full(zmask.shape, 1, tl.int1)
        if HOIST:
            g = tl.cast((t * BLOCK_K) // GK, tl.int64)  # the tile's group row
            if ZERO != 0:
                part -= _zero_loaded(z_base + g * szk + z_off, n, ZERO, ZERO_VALUE, GN, ZPW, ZORDER, BITS) \
                    * xsum[:, None]
            if SCALE != 0:
                acc += part * _scale_of(tl.load(s_base + g * ssk + s_off), SCALE)
            else:
                acc += part
        else:
            if ZERO != 0:
                part -= _zero_of(z_ptr, kz, n, zmask, ZERO, ZERO_VALUE, GK, GN, ZPW, ZORDER, BITS, szk, szn) \
                    * xsum[:, None]
            if SCALE != 0:
                acc += part * _scale_of(_group_load(s_ptr, kz, n, zmask, GK, GN, ssk, ssn), SCALE)
            else:
                acc += part
    out = tl.sum(acc, axis=0)
    if VALUE == 3:
        out = out * E2M1_SCALE
    _gemv_finish(out, g_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, pid_count, pid_k, m, M, offs_n, N, stride_om,
                 stride_on, HAS_GLOBAL, HAS_BIAS, SPLIT_K)


@triton.jit
def packed_gemv_n_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr,
    M, N, K, KW,
    stride_xm, stride_xk, sqk, sqn, ssk, ssn, szk, szn, stride_os, stride_om, stride_on,
    BITS: tl.constexpr, P: tl.constexpr, ORDER: tl.constexpr, VALUE: tl.constexpr, WORD_I32: tl.constexpr,
    ZERO: tl.constexpr, ZERO_VALUE: tl.constexpr, ZPW: tl.constexpr, ZORDER: tl.constexpr,
    SCALE: tl.constexpr, GK: tl.constexpr, GN: tl.constexpr, HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, I64: tl.constexpr = False,
):
    """The GEMV for weights packed along N (AWQ): each word holds P adjacent columns (KW: words per k)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    PER_TILE: tl.constexpr = GK % BLOCK_K == 0
    t0, t1 = _k_tiles(pid_k, K, BLOCK_K, SPLIT_K)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for t in range(t0, t1):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        v = _tile(q_ptr, z_ptr, s_ptr, k0, pid_n * BLOCK_N, offs_k, offs_n, sqk, sqn, szk, szn, ssk, ssn, K, N, KW,
                  BITS, P, ORDER, VALUE, True, ZERO, ZERO_VALUE, ZPW, ZORDER, SCALE, GK, GN,
                  not PER_TILE, BLOCK_K, BLOCK_N, I64)
        xk = tl.load(x_row + offs_k * stride_xk, mask=offs_k < K, other=0).to(tl.float32)
        if PER_TILE and SCALE != 0:
            acc += v * _tile_scale(s_ptr, k0, offs_n, N, GK, GN, ssk, ssn, SCALE) * xk[:, None]
        else:
            acc += v * xk[:, None]
    _gemv_store(tl.sum(acc, axis=0), g_ptr, bias_ptr, out_ptr, pid_k, m, offs_n, N, stride_os, stride_om, stride_on,
                HAS_GLOBAL, HAS_BIAS)


# ----------------------------------------------------------------------------- tensor cores (M <= 64)


@triton.jit
def packed_dot_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr,
    M, N, K, KW,
    stride_xm, stride_xk, sqk, sqn, ssk, ssn, szk, szn, stride_os, stride_om, stride_on,
    BITS: tl.constexpr, P: tl.constexpr, ORDER: tl.constexpr, VALUE: tl.constexpr,
    PACK_N: tl.constexpr, ZERO: tl.constexpr, ZERO_VALUE: tl.constexpr, ZPW: tl.constexpr, ZORDER: tl.constexpr,
    SCALE: tl.constexpr, GK: tl.constexpr, GN: tl.constexpr, HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    I64: tl.constexpr = False,
):
    """Swap-AB tensor-core GEMM: ``out^T[BLOCK_N, BLOCK_M] += W^T x^T``, so N fills the MMA's 64-row side
    when M is small. The decoded tile (zero removed: small integers, exact in bf16 / fp16) goes to the
    MMA unscaled and the group scale multiplies the tile's product (groups of at least BLOCK_K), or the
    scale is applied to the tile first (smaller groups)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    PER_TILE: tl.constexpr = GK % BLOCK_K == 0
    t0, t1 = _k_tiles(pid_k, K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(t0, t1):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        v = _tile(q_ptr, z_ptr, s_ptr, k0, pid_n * BLOCK_N, offs_k, offs_n, sqk, sqn, szk, szn, ssk, ssn, K, N, KW,
                  BITS, P, ORDER, VALUE, PACK_N, ZERO, ZERO_VALUE, ZPW, ZORDER, SCALE, GK, GN,
                  not PER_TILE, BLOCK_K, BLOCK_N, I64)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None] * stride_xk,
                     mask=(offs_m[None, :] < M) & (offs_k[:, None] < K), other=0)
        if IEEE:
            d = tl.dot(tl.trans(v), xt.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(tl.trans(v.to(xt.dtype)), xt)
        if PER_TILE and SCALE != 0:
            acc += d * tl.trans(_tile_scale(s_ptr, k0, offs_n, N, GK, GN, ssk, ssn, SCALE))
        else:
            acc += d
    out = tl.trans(acc)
    if HAS_GLOBAL:
        out = out * tl.load(g_ptr).to(tl.float32)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n[None, :], mask=offs_n[None, :] < N, other=0).to(tl.float32)
    dst = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- decode once (large M)


@triton.jit
def packed_decode_kernel(
    w_ptr, q_ptr, s_ptr, z_ptr, g_ptr, N, K, KW,
    sqk, sqn, ssk, ssn, szk, szn, stride_wk, stride_wn,
    BITS: tl.constexpr, P: tl.constexpr, ORDER: tl.constexpr, VALUE: tl.constexpr,
    PACK_N: tl.constexpr, ZERO: tl.constexpr, ZERO_VALUE: tl.constexpr, ZPW: tl.constexpr, ZORDER: tl.constexpr,
    SCALE: tl.constexpr, GK: tl.constexpr, GN: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, I64: tl.constexpr = False,
):
    """The weight ``W[k, n]`` written once in the activation dtype (cuBLAS then multiplies)."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    v = _tile(q_ptr, z_ptr, s_ptr, k0, tl.program_id(1) * BLOCK_N, offs_k, offs_n, sqk, sqn, szk, szn, ssk, ssn,
              K, N, KW, BITS, P, ORDER, VALUE, PACK_N, ZERO, ZERO_VALUE, ZPW, ZORDER, SCALE, GK, GN,
              True, BLOCK_K, BLOCK_N, I64)
    if HAS_GLOBAL:
        v = v * tl.load(g_ptr).to(tl.float32)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    dst = w_ptr + offs_k[:, None].to(tl.int64) * stride_wk + offs_n[None, :].to(tl.int64) * stride_wn
    tl.store(dst, v.to(w_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class PackedGemv:
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int
    num_warps: int
    num_stages: int = 3
    vec_k: bool = False  # K-contiguous words: vector loads along K (else one word per thread, x reused)


@dataclass(frozen=True)
class PackedDot:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int
    num_warps: int
    num_stages: int = 3


@dataclass(frozen=True)
class PackedDequant:
    BLOCK_K: int = 64
    BLOCK_N: int = 128
    num_warps: int = 4


def dequant_config(lay: PackedLayout) -> PackedDequant:
    """The decode-once tile for a layout: long along K where the codes' last dim is K (FP8 and int8 rows,
    MXFP4 / NVFP4 bytes), where both the loads and the [N, K] writes run along K. H200, M = 2048 shapes of
    issue 4 (``benchmarks/results/h200/dequant_sweep_tn.csv``): 512 x 16 took FP8 54.5 -> 52.0 and MXFP4
    48.9 -> 44.7 µs at 8192 x 8192 (4096 x 14336: 48.6 -> 46.3, 43.5 -> 39.8) against 64 x 128, and was
    13-20% slower on GPTQ's [K/8, N] words, which keep 64 x 128."""
    return PackedDequant(512, 16, 4) if lay.code_dims and lay.code_dims[-1] == "k" else PackedDequant()


def fits(lay: PackedLayout, cfg) -> bool:
    """Can ``cfg``'s tile read this layout? The tile must hold whole words, and a word's values must
    share one scale group (the GEMV scales per word)."""
    if isinstance(cfg, (Int4Mma, Int4MmaSync)):
        return int4_mma_fits(lay)
    if isinstance(cfg, Int4MmaN):
        return int4_mma_n_fits(lay)
    if isinstance(cfg, Fp4Mma):
        return fp4_mma_fits(lay)
    if isinstance(cfg, Fp4MmaSync):
        return fp4_mma_sync_fits(lay)
    if isinstance(cfg, Fp8Mma):
        return fp8_mma_fits(lay)
    bk, bn = cfg.BLOCK_K, cfg.BLOCK_N
    if lay.pack_axis == "K" and bk % lay.per_word:
        return False
    if lay.pack_axis == "N" and bn % lay.per_word:
        return False
    if isinstance(cfg, PackedGemv) and lay.pack_axis != "N":
        p = _words(lay)[1]
        if bk % p or lay.group_k % p:  # the GEMV scales a word's values together: one group per word
            return False
    return True


def _words(lay: PackedLayout, q: torch.Tensor | None = None, anywhere: bool = False):
    """(read as int32 words?, values per loaded word, field order) for the GEMV: 1-byte codes contiguous
    along K are read four bytes at a time. anywhere: as if q started 4-byte aligned (what q's program
    allows, wherever its storage lies)."""
    if lay.pack_axis == "N" or lay.bits * lay.per_word != 8:
        return False, lay.per_word, lay.order
    if q is not None:
        kdim = lay.code_dims.index("k")
        if q.stride(kdim) != 1 or q.shape[kdim] % 4 or (q.data_ptr() % 4 and not anywhere) \
                or any(st % 4 for d, st in enumerate(q.stride()) if d != kdim and q.shape[d] > 1):
            return False, lay.per_word, lay.order
    p = lay.per_word
    if 4 * p > 8:  # field orders are encoded 4 bits per field, 8 fields at most
        return False, p, lay.order
    order = tuple((j // p) * p + lay.order[j % p] for j in range(4 * p))
    return True, 4 * p, order


def _encode(order) -> int:
    return sum(int(o) << (4 * j) for j, o in enumerate(order))


_ARGS = LeafCache()


def _common(lay: PackedLayout, leaves, K: int, N: int, word_i32: bool):
    """Pointer and stride arguments, and constexprs, shared by the launchers. Strides and constexprs are
    derived once per leaf set (the cache holds no tensor: it must not keep a dropped model's weights)."""
    meta = _ARGS.get((lay, K, N, word_i32), leaves)
    if meta is None:
        meta = _ARGS.put((lay, K, N, word_i32), leaves, _meta(lay, leaves, K, N, word_i32))
    return (_ptrs(lay, leaves), *meta)


def _ptrs(lay: PackedLayout, leaves) -> tuple:
    """The code, scale, zero and global leaves; fp8 codes and scales as bytes, bitcast in the kernel. An
    absent leaf is the code leaf as passed (bytes for fp8): its loads are never run, but Triton still
    compiles them, and an fp8 pointer typed the dummy zero's ``other=0`` into a compile error (every
    tensor-core and decode config of the fp8 formats failed to compile on the H200)."""
    q = leaves[lay.code]
    if q.dtype in FP8:
        q = q.view(torch.uint8)
    s = leaves[lay.scale] if lay.scale >= 0 else q
    if s.dtype in FP8:
        s = s.view(torch.uint8)
    z = leaves[lay.zero_leaf] if lay.zero_leaf >= 0 else q
    g = leaves[lay.glob] if lay.glob >= 0 else q
    return q, s, z, g


def _meta(lay: PackedLayout, leaves, K: int, N: int, word_i32: bool):
    q = leaves[lay.code]
    s = leaves[lay.scale] if lay.scale >= 0 else None
    z = leaves[lay.zero_leaf] if lay.zero_leaf >= 0 else None
    sqk, sqn = leaf_strides(q, lay.code_dims)
    if word_i32:  # K-contiguous bytes read as int32 words (``_words`` checked the strides)
        sqk, sqn = 1, sqn // 4
    kw = K // lay.per_word if lay.pack_axis == "K" else (N // lay.per_word if lay.pack_axis == "N" else K)
    if word_i32:
        kw //= 4
    ssk, ssn = leaf_strides(s, lay.scale_dims)
    szk, szn = leaf_strides(z, lay.zero_dims)
    return (kw, sqk, sqn, ssk, ssn, szk, szn), _constexprs(lay, s is not None and s.dtype in FP8)


@functools.lru_cache(maxsize=1024)
def _constexprs(lay: PackedLayout, fp8_scale: bool) -> dict:
    """The kernels' constexprs for a layout, built once (the op runs per token)."""
    scale_code = 0 if lay.scale < 0 else (2 if lay.scale_enc == "e8m0" else 3 if fp8_scale else 1)
    return dict(BITS=lay.bits, VALUE=VALUE_CODES[lay.value], ZERO=ZERO_CODES[lay.zero],
                ZERO_VALUE=float(lay.zero_value), ZPW=lay.zero_per_word, ZORDER=_encode(lay.zero_order or (0,)),
                SCALE=scale_code, GK=lay.group_k, GN=lay.group_n, HAS_GLOBAL=lay.glob >= 0)


def gemv(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: PackedGemv, bias=None,
         workspace: torch.Tensor | None = None, record=None) -> torch.Tensor:
    """``x [M, K] @ W + bias`` with the GEMV (one program per row, column tile and K slice). record: called
    with a ``replay.Replay`` of this call (weights packed along K, no workspace given)."""
    M = x.shape[0]
    if lay.pack_axis == "N":
        return _gemv_n(x, leaves, lay, K, N, cfg, bias, workspace)
    words = _ARGS.get((lay, "words"), leaves)
    if words is None:
        words = _ARGS.put((lay, "words"), leaves, _words(lay, leaves[lay.code]))
    word_i32, p, order = words
    ptrs, (kw, sqk, sqn, ssk, ssn, szk, szn), consts = _common(lay, leaves, K, N, word_i32)
    tiles_n = cdiv(N, cfg.BLOCK_N)
    if cfg.SPLIT_K > 1:
        ws = workspace if workspace is not None else \
            torch.empty((cfg.SPLIT_K, M, N), device=x.device, dtype=torch.float32)
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
        cnt = split_counters(x.device, M * tiles_n)
    else:
        out = workspace[0] if workspace is not None else torch.empty((M, N), device=x.device, dtype=x.dtype)
        ws = cnt = out
    has_bias = bias is not None
    rec = record is not None and workspace is None
    launch = replay.launch(packed_gemv_kernel, (tiles_n, cfg.SPLIT_K, M), (
        x, *ptrs, bias if has_bias else x, out, ws, cnt, M, N, K, kw,
        x.stride(0), x.stride(1), sqk, sqn, ssk, ssn, szk, szn, out.stride(0), out.stride(1)), dict(
        P=p, KPOS=_kpos(order), WORD_I32=word_i32, HAS_BIAS=has_bias, SPLIT_K=cfg.SPLIT_K,
        BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, VEC_K=cfg.vec_k, ASM=not _INTERPRET,
        EVEN=K % cfg.BLOCK_K == 0 and N % cfg.BLOCK_N == 0, I64=needs_i64(leaves[lay.code]),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts), rec)
    if rec and launch.replayable:
        record(replay.split_k_replay(launch, M, N, x.dtype, cfg.SPLIT_K, None if has_bias else replay.X))
    return out


@functools.lru_cache(maxsize=256)
def _kpos(order) -> int:
    return _encode(_inverse(order))


def _inverse(order) -> tuple:
    """Field -> position along K, from position -> field."""
    inv = [0] * len(order)
    for j, f in enumerate(order):
        inv[f] = j
    return tuple(inv)


def _gemv_n(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: PackedGemv, bias=None,
            workspace: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMV for weights packed along N: split-K partial sums reduced after the kernel."""
    M = x.shape[0]
    ptrs, (kw, sqk, sqn, ssk, ssn, szk, szn), consts = _common(lay, leaves, K, N, False)
    out = _workspace(x, N, cfg.SPLIT_K, workspace)
    has_bias = bias is not None and cfg.SPLIT_K == 1
    packed_gemv_n_kernel[(cdiv(N, cfg.BLOCK_N), cfg.SPLIT_K, M)](
        x, *ptrs, bias if has_bias else x, out, M, N, K, kw,
        x.stride(0), x.stride(1), sqk, sqn, ssk, ssn, szk, szn, out.stride(0), out.stride(1), out.stride(2),
        P=lay.per_word, ORDER=_encode(lay.order), WORD_I32=False, HAS_BIAS=has_bias, SPLIT_K=cfg.SPLIT_K,
        BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, I64=needs_i64(leaves[lay.code]), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **consts)
    return reduce_split_k(out, bias, x.dtype, cfg.SPLIT_K)


def dot(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg: PackedDot, bias=None,
        workspace: torch.Tensor | None = None, record=None) -> torch.Tensor:
    """``x [M, K] @ W + bias`` on tensor cores (swap-AB). record: called with a ``replay.Replay`` of this
    call (no workspace given)."""
    M = x.shape[0]
    ptrs, (kw, sqk, sqn, ssk, ssn, szk, szn), consts = _common(lay, leaves, K, N, False)
    out = _workspace(x, N, cfg.SPLIT_K, workspace)
    has_bias = bias is not None and cfg.SPLIT_K == 1
    grid = (cdiv(N, cfg.BLOCK_N), cfg.SPLIT_K, cdiv(M, cfg.BLOCK_M))
    rec = record is not None and workspace is None
    launch = replay.launch(packed_dot_kernel, grid, (
        x, *ptrs, bias if has_bias else x, out, M, N, K, kw,
        x.stride(0), x.stride(1), sqk, sqn, ssk, ssn, szk, szn, out.stride(0), out.stride(1), out.stride(2)), dict(
        P=lay.per_word, ORDER=_encode(lay.order), PACK_N=lay.pack_axis == "N",
        HAS_BIAS=has_bias, SPLIT_K=cfg.SPLIT_K, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        IEEE=x.dtype == torch.float32, I64=needs_i64(leaves[lay.code]), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **consts), rec)
    if rec and launch.replayable:
        sk = cfg.SPLIT_K
        record(replay.Replay(launch, {"x_ptr": replay.X, "out_ptr": 0, **({} if has_bias else {"bias_ptr": replay.X})},
                             [(tuple(out.shape), out.dtype)],
                             lambda x, bufs, bias: reduce_split_k(bufs[0], bias, x.dtype, sk)))
    return reduce_split_k(out, bias, x.dtype, cfg.SPLIT_K)


def decode_weight(leaves, lay: PackedLayout, K: int, N: int, dtype: torch.dtype,
                  cfg: PackedDequant = PackedDequant(), record=None) -> torch.Tensor:
    """The weight ``[K, N]`` in ``dtype``, written once, as the transpose of an ``[N, K]`` buffer (so cuBLAS runs
    ``x @ w`` as "TN"). record: called with the ``replay.Launch``.

    Why [N, K]: the decode writes along K, where the packed words hold their values, and ran 1.1-1.5x faster
    so than writing [K, N] rows (H200, M = 2048 shapes of issue 4: GPTQ 8192 x 8192 71.0 -> 49.9 µs, MXFP4
    73.2 -> 48.9, FP8 59.7 -> 54.5), while cuBLAS took the same time within 1% either way
    (``benchmarks/proto/dequant_sweep.py``, ``benchmarks/results/h200/dequant_sweep.csv``)."""
    ptrs, (kw, sqk, sqn, ssk, ssn, szk, szn), consts = _common(lay, leaves, K, N, False)
    w = torch.empty((N, K), device=leaves[lay.code].device, dtype=dtype).t()
    grid = (cdiv(K, cfg.BLOCK_K), cdiv(N, cfg.BLOCK_N))
    launch = replay.launch(packed_decode_kernel, grid, (
        w, *ptrs, N, K, kw, sqk, sqn, ssk, ssn, szk, szn, w.stride(0), w.stride(1)), dict(
        P=lay.per_word, ORDER=_encode(lay.order), PACK_N=lay.pack_axis == "N",
        BLOCK_K=cfg.BLOCK_K, BLOCK_N=cfg.BLOCK_N, I64=needs_i64(leaves[lay.code]), num_warps=cfg.num_warps,
        **consts), record is not None)
    if record is not None and launch.replayable:
        record(launch)
    return w


def _workspace(x: torch.Tensor, N: int, split_k: int, given: torch.Tensor | None) -> torch.Tensor:
    """Where a GEMV / tensor-core config writes: ``[SPLIT_K, M, N]``, fp32 partial sums when split."""
    if given is not None:
        return given
    return torch.empty((split_k, x.shape[0], N), device=x.device, dtype=torch.float32 if split_k > 1 else x.dtype)


def reduce_split_k(out: torch.Tensor, bias, dtype: torch.dtype, split_k: int) -> torch.Tensor:
    """``out[0]``, or the split-K partial sums over the first dim plus the bias, in ``dtype``."""
    if split_k == 1:
        return out[0]
    res = out.sum(0)  # a fixed order: deterministic
    if bias is not None:
        res = res + bias.float()
    return res.to(dtype)


def packed_mm(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, cfg, bias=None,
              workspace: torch.Tensor | None = None, record=None) -> torch.Tensor:
    """Run one config (GEMV, tensor-core tile, a register-decoded int4 tensor-core kernel, or decode +
    cuBLAS). A bias other than a contiguous [N] vector is added after the kernel, in fp32. workspace: the
    ``[SPLIT_K, M, N]`` buffer a GEMV or tensor-core config writes (tests pass one full of NaN). record:
    called with a ``replay.Replay`` of the whole call (GEMV along K, tensor-core tile, int4_mma(_n, _sync), decode +
    cuBLAS), not with a workspace given or a bias added after the kernel."""
    if bias is not None and not (bias.dim() == 1 and bias.shape[0] == N and bias.stride(0) == 1):
        return (packed_mm(x, leaves, lay, K, N, cfg, workspace=workspace).float() + bias.float()).to(x.dtype)
    if isinstance(cfg, PackedGemv):
        return gemv(x, leaves, lay, K, N, cfg, bias, workspace, record)
    if isinstance(cfg, PackedDot):
        return dot(x, leaves, lay, K, N, cfg, bias, workspace, record)
    if isinstance(cfg, Int4Mma):
        return int4_mma(x, leaves, lay, K, N, cfg, bias, workspace, record)
    if isinstance(cfg, Int4MmaN):
        return int4_mma_n(x, leaves, lay, K, N, cfg, bias, workspace, record)
    if isinstance(cfg, Int4MmaSync):
        return int4_mma_sync(x, leaves, lay, K, N, cfg, bias, workspace, record)
    if isinstance(cfg, Fp4Mma):
        return fp4_mma(x, leaves, lay, K, N, cfg, bias, workspace, record)
    if isinstance(cfg, Fp4MmaSync):
        return fp4_mma_sync(x, leaves, lay, K, N, cfg, bias, workspace, record)
    if isinstance(cfg, Fp8Mma):
        return fp8_mma(x, leaves, lay, K, N, cfg, bias, workspace, record)
    launches = []
    w = decode_weight(leaves, lay, K, N, x.dtype, cfg, launches.append if record is not None else None)
    if launches:
        record(replay.Replay(launches[0], {"w_ptr": 0}, [((N, K), x.dtype)], _matmul_tail))
    return _matmul_tail(x, [w.t()], bias)


def _matmul_tail(x: torch.Tensor, bufs, bias):
    """cuBLAS on the decoded weight ``bufs[0]`` ([N, K]), then the bias in fp32 (the decode + matmul path, and
    its replay)."""
    out = x @ bufs[0].t()
    if bias is not None:
        out = (out.float() + bias.float()).to(x.dtype)
    return out


# ----------------------------------------------------------------------------- reference


def packed_mm_reference(x: torch.Tensor, leaves, lay: PackedLayout, K: int, N: int, bias=None) -> torch.Tensor:
    """float64: the layout's weight (``PackedLayout.weight_at``), then the matmul."""
    w = lay.weight_at([t.cpu() for t in leaves], torch.arange(K), torch.arange(N))
    out = x.cpu().to(torch.float64) @ w
    if bias is not None:
        out = out + bias.cpu().to(torch.float64)
    return out


# ----------------------------------------------------------------------------- builds for the report

_SEQ8 = tuple(range(8))
# The layouts ``derive_layout`` finds for these zoo formats (tests/test_packed_mm.py derives them all),
# with the leaf pointer types the kernels see (fp8 leaves are passed as bytes).
REPORT_LAYOUTS = {
    "gptq": (PackedLayout(0, ("k", "n"), 4, 8, "K", _SEQ8, "uint", 2, ("k", "n"), "float", 128, 1, "packed", 1,
                          ("k", "n"), 8, _SEQ8), ("*i32", "*bf16", "*i32")),
    "int4_k_stack": (PackedLayout(0, ("n", "k"), 4, 2, "K", (0, 1), "uint", 1, ("n", "k"), "float", 128, 1, "int", 2,
                                  ("n", "k")), ("*u8", "*bf16", "*u8")),
    "awq": (PackedLayout(0, ("k", "n"), 4, 8, "N", AWQ_ORDER, "uint", 2, ("k", "n"), "float", 128, 1, "packed", 1,
                         ("k", "n"), 8, AWQ_ORDER), ("*i32", "*bf16", "*i32")),
    "mxfp4": (PackedLayout(0, ("n", "k"), 4, 2, "K", (0, 1), "e2m1", 1, ("n", "k"), "e8m0", 32, 1),
              ("*u8", "*u8", "*u8")),
    "nvfp4": (PackedLayout(0, ("n", "k"), 4, 2, "K", (0, 1), "e2m1", 1, ("n", "k"), "fp8", 16, 1, glob=2),
              ("*u8", "*u8", "*u8")),
    "fp8_channel": (PackedLayout(0, ("n", "k"), 8, 1, "", (0,), "fp8", 1, ("n",), "float", 8192, 1),
                    ("*u8", "*fp32", "*u8")),
    "int8_channel": (PackedLayout(0, ("n", "k"), 8, 1, "", (0,), "int", 1, ("n",), "float", 8192, 1),
                     ("*i8", "*fp32", "*i8")),
}
REPORT_MS = (1, 16)


def _contiguous_strides(dims: tuple, rows_k: int, cols_n: int) -> tuple[int, int]:
    """(k, n) strides of a contiguous scale or zero leaf with these dims ([rows_k, cols_n] for ("k", "n")),
    as a launch derives them: the GEMV compiles its leaf strides in."""
    shape = {"k": rows_k, "n": cols_n}
    strides, step = {}, 1
    for d in reversed(dims):
        strides[d] = step
        step *= shape[d]
    return strides.get("k", 0), strides.get("n", 0)


def aot_builds():
    """The packed kernels for the report's formats at N = K = 8192: every GEMV and tensor-core config
    the dispatcher offers at M = 1 and 16, and the decode-once kernel."""
    from fusekern.kernels import decode_mm as dm
    from fusekern.kernels.catalog import TritonBuild

    N = K = 8192
    builds = []
    for name, (lay, (qt, st, zt)) in REPORT_LAYOUTS.items():
        scale_code = 0 if lay.scale < 0 else (2 if lay.scale_enc == "e8m0" else 3 if lay.scale_enc == "fp8" else 1)
        consts = dict(BITS=lay.bits, VALUE=VALUE_CODES[lay.value], ZERO=ZERO_CODES[lay.zero],
                      ZERO_VALUE=float(lay.zero_value), ZPW=lay.zero_per_word,
                      ZORDER=_encode(lay.zero_order or (0,)), SCALE=scale_code, GK=lay.group_k, GN=lay.group_n,
                      HAS_GLOBAL=lay.glob >= 0)
        word_i32, p, order = _words(lay)
        kw = (K // lay.per_word if lay.pack_axis == "K" else N // lay.per_word if lay.pack_axis == "N" else K)
        seen = set()
        for M in REPORT_MS:
            for cfg in dm._packed_candidates(M, N, K, 132, lay):
                if cfg in seen or isinstance(cfg, (Int4Mma, Int4MmaN, Int4MmaSync, Fp4Mma, Fp4MmaSync, Fp8Mma)):  # (their modules' aot_builds have those)
                    continue
                seen.add(cfg)
                ssk, ssn = _contiguous_strides(lay.scale_dims, -(-K // lay.group_k), -(-N // lay.group_n))
                szk, szn = _contiguous_strides(lay.zero_dims, -(-K // lay.group_k),
                                               -(-N // (lay.group_n * lay.zero_per_word)))
                common = dict(q_ptr=qt, s_ptr=st, z_ptr=zt, g_ptr="*fp32", N=N, K=K, sqk=N if lay.code_dims[0] == "k" else 1,
                              sqn=1 if lay.code_dims[0] == "k" else kw, ssk=ssk, ssn=ssn, szk=szk, szn=szn)
                if isinstance(cfg, PackedDequant):
                    args = dict(w_ptr="*bf16", KW=kw, stride_wk=1, stride_wn=K, **common)  # ([N, K]: decode_weight)
                    builds.append(TritonBuild("packed_decode", f"{name} BLOCK_K={cfg.BLOCK_K} BLOCK_N={cfg.BLOCK_N} "
                                              f"w{cfg.num_warps} [{N}x{K}]", packed_decode_kernel, args,
                                              dict(consts, P=lay.per_word, ORDER=_encode(lay.order),
                                                   PACK_N=lay.pack_axis == "N", BLOCK_K=cfg.BLOCK_K,
                                                   BLOCK_N=cfg.BLOCK_N), cfg.num_warps, 1))
                    continue
                out_t = "*fp32" if cfg.SPLIT_K > 1 else "*bf16"
                args = dict(x_ptr="*bf16", bias_ptr="*bf16", out_ptr=out_t, M=M, KW=kw, stride_xm=K, stride_xk=1,
                            stride_os=M * N, stride_om=N, stride_on=1, **common)
                if isinstance(cfg, PackedGemv):
                    if word_i32:
                        args.update(KW=kw // 4, sqn=args["sqn"] // 4)
                    ce = dict(consts, P=p, WORD_I32=word_i32, HAS_BIAS=False,
                              SPLIT_K=cfg.SPLIT_K, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K)
                    if lay.pack_axis == "N":
                        kernel = packed_gemv_n_kernel
                        ce.update(ORDER=_encode(order))
                    else:
                        kernel = packed_gemv_kernel
                        args = {k: v for k, v in args.items() if k != "stride_os"}
                        args.update(out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
                        ce.update(KPOS=_kpos(order), VEC_K=cfg.vec_k, ASM=True,
                                  EVEN=K % cfg.BLOCK_K == 0 and N % cfg.BLOCK_N == 0, I64=False)
                    label = f"{name} BLOCK_N={cfg.BLOCK_N} BLOCK_K={cfg.BLOCK_K} SPLIT_K={cfg.SPLIT_K}"
                    kname = "packed_gemv"
                else:
                    kernel = packed_dot_kernel
                    ce = dict(consts, P=lay.per_word, ORDER=_encode(lay.order),
                              PACK_N=lay.pack_axis == "N", HAS_BIAS=False, SPLIT_K=cfg.SPLIT_K, BLOCK_M=cfg.BLOCK_M,
                              BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, IEEE=False)
                    label = (f"{name} BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} BLOCK_K={cfg.BLOCK_K} "
                             f"SPLIT_K={cfg.SPLIT_K}")
                    kname = "packed_dot"
                builds.append(TritonBuild(kname, f"{label} w{cfg.num_warps} s{cfg.num_stages} [{M}x{N}x{K}]",
                                          kernel, args, ce, cfg.num_warps, cfg.num_stages))
    return builds
