"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) compute bf16 kernels correctly.

Triton 3.6's interpreter keeps bf16 values as their raw uint16 bits. Two of its paths then work on
the bits as if they were integers: integer -> bf16 casts (``astype(uint16)``) and ``tl.dot`` on bf16
operands (``np.matmul`` of the bit patterns). Both give garbage (seen: int8 -> bf16 gave NaN, a
16x16 bf16 dot was off by 1e10). Its fp32 -> bf16 cast truncates, where the GPU rounds to nearest
even (seen: errors of one bf16 ulp on half the values), and its bf16 -> fp32 conversion misreads
subnormals (1e-39 as 4.4e-39). This module patches those paths, going
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
    if builder_cls is None:
        return False

    def bf16_to_f32(data):
        # exact: bf16 is fp32's upper half
        return (np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)

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
        if src_ty == tl.bfloat16 and dst_ty != tl.bfloat16:
            f32 = bf16_to_f32(src.data)
            np_dst = np.dtype(interp._get_np_dtype(dst_type))
            if dst_ty.is_floating() and np_dst.kind != "f":  # fp8, held as bits: the interpreter's cast from fp32
                return orig_cast(self, interp.TensorHandle(f32, tl.float32), dst_type)
            return interp.TensorHandle(f32 if dst_ty == tl.float32 else f32.astype(np_dst), dst_ty)
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


# Triton's own tl.sort / tl.topk, kept by patch_fast_sort (tests compare against them)
ORIGINAL_SORT: dict = {}


@functools.cache
def patch_fast_sort() -> bool:
    """Run ``tl.sort`` / ``tl.topk`` in the interpreter with numpy's sort instead of Triton's bitonic network.

    The interpreter executes the network op by op, with an element-by-element Python loop for each
    ``xor_sum`` inside it: one sort of a 1024-wide block took seconds, and the sampler's tests spent
    most of their time there (a CI run over its time limit). The values a sort returns are unique
    wherever no two values compare equal with different bits, so numpy's sort gives the network's exact
    result there. It does not where floats hold NaN or -0.0 (the network places them by position) or
    where the interpreter keeps a float type as raw bits (bf16, the fp8 types: their integer order is not
    the float order): those calls run the original network. Only the interpreter is touched; compiled kernels never see this.
    Returns False when Triton has no interpreter (nothing patched).
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    if not isinstance(tl.sort, interp.InterpretedFunction) or not isinstance(tl.topk, interp.InterpretedFunction):
        return False  # not interpreting (Triton imported before TRITON_INTERPRET was set)
    orig_sort, orig_topk = tl.sort, tl.topk
    ORIGINAL_SORT.update(sort=orig_sort, topk=orig_topk)
    unwrap = tl.core._unwrap_if_constexpr

    def numpy_sortable(x):
        if not x.type.is_block():
            return None
        data = x.handle.data
        if x.dtype.is_floating() and (data.dtype.kind != "f" or np.isnan(data).any()
                                      or (np.signbit(data) & (data == 0)).any()):
            return None
        return data

    def last_dim(x, dim):
        dim = unwrap(dim)
        last = len(x.shape) - 1
        if dim is not None and dim not in (last, -1):
            return None  # Triton refuses it: let the original say so
        return last

    def wrap(x, data):
        ty = tl.core.block_type(x.dtype, list(data.shape))
        return tl.core.tensor(interp.TensorHandle(np.ascontiguousarray(data), x.dtype), ty)

    def sort(x, dim=None, descending=tl.core.CONSTEXPR_0):
        data = numpy_sortable(x)
        if data is None or last_dim(x, dim) is None:
            return orig_sort(x, dim=dim, descending=descending)
        out = np.sort(data, axis=-1)
        return wrap(x, out[..., ::-1] if unwrap(descending) else out)

    def topk(x, k, dim=None, descending=True):
        data, kk = numpy_sortable(x), unwrap(k)
        if data is None or last_dim(x, dim) is None or not unwrap(descending) or not isinstance(kk, int) \
                or kk <= 0 or kk & (kk - 1) or kk > data.shape[-1]:
            # (Triton 3.6's topk has no ``descending``)
            return orig_topk(x, k, dim=dim) if unwrap(descending) else orig_topk(x, k, dim=dim, descending=descending)
        return wrap(x, np.sort(data, axis=-1)[..., ::-1][..., :kk])

    for module in (tl, tl.standard):
        module.sort, module.topk = sort, topk
    tl.tensor.sort = lambda self, dim=None, descending=tl.core.CONSTEXPR_0: sort(self, dim, descending)
    tl.tensor.topk = lambda self, k, dim=None, descending=True: topk(self, k, dim, descending)
    return True


@functools.cache
def patch_nested_calls() -> bool:
    """Skip the interpreter's re-patching of ``triton.language`` on every call of a @triton.jit helper.

    A kernel launch patches the language modules its globals hold (``_patch_lang``) and restores them
    when it ends; each call of a helper function inside it patches them again (a walk of every member
    of ``tl``, ``tl.tensor`` and ``tl.math``), with the same interpreter builder, and drops what it
    saved. Where the launch running now has already patched every module the helper sees, that call
    changes nothing, so it is skipped; a helper that sees another module is patched as before. This was
    a third of the sampler kernel's interpreted time. Returns False where Triton's interpreter is not
    laid out as expected (nothing patched).
    """
    import inspect
    import threading

    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    orig_patch, executor = getattr(interp, "_patch_lang", None), getattr(interp, "GridExecutor", None)
    if orig_patch is None or executor is None or not hasattr(interp, "_LangPatchScope"):
        return False
    orig_call = executor.__call__
    state = threading.local()

    def langs_of(fn):
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        patched = getattr(state, "patched", None)
        if patched is None:  # outside a launch: as before
            return orig_patch(fn)
        langs = langs_of(fn)
        if langs <= patched:
            return interp._LangPatchScope()  # nothing to restore: callers of a helper drop it anyway
        state.patched = patched | langs
        return orig_patch(fn)

    def call(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = frozenset() if outer is None else outer
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    interp._patch_lang = patch_lang
    executor.__call__ = call
    return True
