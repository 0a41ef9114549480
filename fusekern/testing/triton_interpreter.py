"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) compute bf16 kernels correctly.

Triton 3.6's interpreter keeps bf16 values as their raw uint16 bits. Two of its paths then work on
the bits as if they were integers: integer -> bf16 casts (``astype(uint16)``) and ``tl.dot`` on bf16
operands (``np.matmul`` of the bit patterns). Both give garbage (seen: int8 -> bf16 gave NaN, a
16x16 bf16 dot was off by 1e10). Its fp32 -> bf16 cast truncates, where the GPU rounds to nearest
even (seen: errors of one bf16 ulp on half the values). This module patches those paths, going
through float32 and rounding exactly as the GPU does, so bf16 kernels can be checked on CPU.

Only the interpreter is touched; compiled kernels never see this.
"""
from __future__ import annotations

import functools


@functools.cache
def patch_bf16_support() -> bool:
    """Patch the interpreter once per process. Returns False when Triton has no interpreter."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    builder_cls = getattr(interp, "InterpreterBuilder", None)
    convert = getattr(interp, "_convert_float", None)
    if builder_cls is None or convert is None:
        return False

    def bf16_to_f32(data):
        return convert(data, tl.bfloat16, tl.float32, None).view(np.float32)

    def f32_to_bf16_rne(data):
        bits = data.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = np.isnan(data)
        out = rounded.astype(np.uint16)
        out[nan] = 0x7FC0
        return out

    orig_cast = builder_cls.cast_impl
    orig_dot = builder_cls.create_dot

    def cast_impl(self, src, dst_type):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if dst_ty == tl.bfloat16 and src_ty != tl.bfloat16:
            as_f32 = np.ascontiguousarray(src.data.astype(np.float32))  # ints and fp16 are exact in fp32
            return interp.TensorHandle(f32_to_bf16_rne(as_f32), tl.bfloat16)
        if src_ty == tl.bfloat16 and dst_ty != tl.bfloat16 and dst_ty != tl.float32:
            data = bf16_to_f32(src.data).astype(interp._get_np_dtype(dst_type))
            return interp.TensorHandle(data, dst_ty)
        return orig_cast(self, src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a_data = bf16_to_f32(a.data) if a.dtype.scalar == tl.bfloat16 else a.data.astype(np.float32)
            b_data = bf16_to_f32(b.data) if b.dtype.scalar == tl.bfloat16 else b.data.astype(np.float32)
            out = np.matmul(a_data, b_data, dtype=np.float32).astype(d.data.dtype) + d.data
            return interp.TensorHandle(out, d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    # The create_*_to_* casts call self.cast_impl at run time, so replacing it covers them.
    builder_cls.cast_impl = cast_impl
    builder_cls.create_dot = create_dot
    return True
