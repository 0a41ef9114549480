"""Dequant -> matmul family: int8 weights with one scale per output channel (W8A16).

The forms users write for ``y = x @ (w_int8 * s[:, None]).T (+ b)``, each a pattern (the first that
matches a subgraph wins, so forms with a bias come before their bias-free twins):

    F.linear(x, w.to(x.dtype)) * s + b         scale after the matmul, then bias
    F.linear(x, w.to(x.dtype)) * s             scale after the matmul
    F.linear(x, w.to(x.dtype) * s[:, None], b) dequantize before the matmul (s in x's dtype)
    F.linear(x, w.to(x.dtype) * s[:, None])
    F.linear(x, w.to(x.dtype) * s2d)           s2d of shape [N, 1]
    F.linear(x, (w.to(s.dtype) * s[:, None]).to(x.dtype))   fp32 scale, cast after

``x @ w.T`` and ``torch.matmul`` lower to the same ATen graph as ``F.linear``, and the 3-D variants
(``[B, M, K]`` activations) are traced too, so all of those forms match. Every match becomes one
``fusekern::w8a16_linear`` call. A candidate is declined (the graph stays as written, and the match
report says why) unless: w is int8 and 2-D, x is fp16/bf16, the scale holds exactly one value per
output channel along the right axis, the bias one per output channel, all on one device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fusekern.kernels import device_info
from fusekern.kernels import w8a16_linear as kernel
from fusekern.patterns.registry import register_pattern, register_rewrite
from fusekern.patterns.spec import T
from fusekern.patterns.spec import known as _known

ACT = (torch.bfloat16, torch.float16)
FLOAT = (torch.float32, torch.float16, torch.bfloat16)
# bind_specs=False: the checks below decide which inputs fire (wider than the traced specs: [1, N] and [1, 1, N]
# scales, fp16 scales) and tests/test_w8a16_patterns.py proves those forms.
COMMON = dict(family="dequant_matmul", kernel_version=kernel.KERNEL_VERSION, bind_specs=False)


def _common_reason(v) -> str | None:
    x, w = v["x"], v["w"]
    if w.dtype != torch.int8:
        return f"weight dtype {w.dtype} is not int8"
    if w.dim() != 2:
        return f"weight has {w.dim()} dims, not 2"
    if x.dtype not in ACT:
        return f"activation dtype {x.dtype} is not fp16/bf16"
    if x.dim() < 2:
        return "activation is 1-D"
    if not _known(x.shape[-1] == w.shape[1]):
        return f"K of x ({x.shape[-1]}) and w ({w.shape[1]}) differ"
    devices = {t.device for t in v.values() if isinstance(t, torch.Tensor)}
    if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
        return f"inputs on devices {sorted(map(str, devices))}"
    return device_info.unsupported(next(iter(devices)))


def _per_channel_reason(t, n, what: str, max_dims: int) -> str | None:
    """t must hold one value per output channel along its last axis: [N], [1, N], [1, 1, N]..."""
    if not isinstance(t, torch.Tensor):
        return f"{what} is the number {t!r}, not a tensor of one value per output channel"
    if not t.dtype.is_floating_point:
        return f"{what} dtype {t.dtype} is not floating point"
    if t.dim() > max_dims or t.dim() == 0:
        return f"{what} of shape {tuple(t.shape)} does not broadcast as one value per output channel"
    if not (_known(t.shape[-1] == n) and _known(t.numel() == n)):
        return f"{what} of shape {tuple(t.shape)} is not one value per output channel (N={n})"
    return None


def check_scale_after(v) -> str | None:
    reason = _common_reason(v)
    if reason is None:
        reason = _per_channel_reason(v["s"], v["w"].shape[0], "scale", v["x"].dim())
    if reason is None and "b" in v:
        reason = _per_channel_reason(v["b"], v["w"].shape[0], "bias", v["x"].dim())
    return reason


def _scale_before_reason(v, dims: int, cast: bool = False) -> str | None:
    """Dequantize-before forms: s is [N] where the search indexes it (``s[:, None]``, dims 1), [N, 1] where
    it multiplies the weight as it is (dims 2). The matcher matches the ops, not the shapes: a [K] scale
    times the weight scales input channels (along K), which is a different product even where N == K.
    ``cast``: the form casts the scaled weight to x's dtype, so the scale's dtype may differ from x's."""
    reason = _common_reason(v)
    if reason is not None:
        return reason
    s, n = v["s"], v["w"].shape[0]
    if not isinstance(s, torch.Tensor):
        return f"scale is the number {s!r}, not one value per output channel"
    if not s.dtype.is_floating_point:
        return f"scale dtype {s.dtype} is not floating point"
    if not cast and s.dtype != v["x"].dtype:
        # The matmul then takes x and a weight of another dtype: eager raises (FakeTensor's mm does not
        # check, so the graph reaches the pass), and the fused kernel would return a result instead.
        return f"scale dtype {s.dtype} is not the activation's {v['x'].dtype} (eager's matmul raises)"
    if "b" in v and isinstance(v["b"], torch.Tensor) and v["b"].dtype != v["x"].dtype:
        return f"bias dtype {v['b'].dtype} is not the activation's {v['x'].dtype} (eager's addmm raises)"
    want = (n,) if dims == 1 else (n, 1)
    if s.dim() != dims or not all(_known(a == b) for a, b in zip(s.shape, want)):
        return f"scale of shape {tuple(s.shape)} is not one value per output channel ({want})"
    if "b" in v:
        return _per_channel_reason(v["b"], n, "bias", 1)
    return None


def check_scale_before(v) -> str | None:
    """``w.to(dt) * s[:, None]`` forms: s is [N]."""
    return _scale_before_reason(v, 1)


def check_scale_column(v) -> str | None:
    """``w.to(dt) * s`` form: s is [N, 1] (one value per row of w)."""
    return _scale_before_reason(v, 2)


def check_scale_before_cast(v) -> str | None:
    """``(w.to(s.dtype) * s[:, None]).to(x.dtype)`` form: s is [N], in any float dtype."""
    return _scale_before_reason(v, 1, cast=True)


def _fused(x, w, s, b, out_dtype):
    n, k = w.shape
    x2, s, b = x.reshape(-1, k), s.reshape(n), None if b is None else b.reshape(n)
    if x.is_cuda and x.dtype in ACT and all(isinstance(d, int) for d in (*x2.shape, *w.shape)):
        # The shape is fixed in this graph: choose the kernel now and let inductor emit its launches. (M may be
        # fixed while N or K are not, e.g. dynamic=True with the weight an input: the choice needs all three.)
        y = kernel.traced_for_inductor(x2, w, s, b, out_dtype)
    else:
        # Symbolic M (dispatch by M at run time) or CPU: the registered op.
        y = torch.ops.fusekern.w8a16_linear(x2, w, s, b, out_dtype)
    return y.reshape(*x.shape[:-1], n)


def _after_dtype(*tensors) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


# -- scale after the matmul --------------------------------------------------------------------

SCALE_AFTER_INPUTS = dict(
    x=T("M", "K", dtype="act", batch_dims=(0, 1)),
    w=T("N", "K", dtype=torch.int8),
    s=T("N", dtype="scale", positive=True),
)


def _w8a16_scale_bias_search(x, w, s, b):
    return F.linear(x, w.to(x.dtype)) * s + b


def _w8a16_scale_bias_replace(x, w, s, b):
    return _fused(x, w, s, b, _after_dtype(x, s, b))


register_pattern(
    "w8a16_linear_scale_bias", _w8a16_scale_bias_search, _w8a16_scale_bias_replace,
    inputs=dict(SCALE_AFTER_INPUTS, b=T("N", dtype="act")),
    dtypes={"act": ACT, "scale": (torch.float32, torch.bfloat16)},
    check=check_scale_after, description="F.linear(x, w.to(x.dtype)) * s + b", **COMMON,
)


def _w8a16_scale_search(x, w, s):
    return F.linear(x, w.to(x.dtype)) * s


def _w8a16_scale_replace(x, w, s):
    return _fused(x, w, s, None, _after_dtype(x, s))


register_pattern(
    "w8a16_linear_scale", _w8a16_scale_search, _w8a16_scale_replace,
    inputs=SCALE_AFTER_INPUTS, dtypes={"act": ACT, "scale": (torch.float32, torch.bfloat16)},
    check=check_scale_after, description="F.linear(x, w.to(x.dtype)) * s", **COMMON,
)


# -- dequantize before the matmul ----------------------------------------------------------------

DEQUANT_INPUTS = dict(
    x=T("M", "K", dtype="act", batch_dims=(0, 1)),
    w=T("N", "K", dtype=torch.int8),
    s=T("N", dtype="act", positive=True),
)


def _w8a16_dequant_bias_search(x, w, s, b):
    return F.linear(x, w.to(x.dtype) * s[:, None], b)


def _w8a16_dequant_bias_replace(x, w, s, b):
    return _fused(x, w, s, b, x.dtype)


register_pattern(
    "w8a16_dequant_linear_bias", _w8a16_dequant_bias_search, _w8a16_dequant_bias_replace,
    inputs=dict(DEQUANT_INPUTS, b=T("N", dtype="act")), dtypes={"act": ACT},
    check=check_scale_before, description="F.linear(x, w.to(x.dtype) * s[:, None], b)", **COMMON,
)


def _w8a16_dequant_search(x, w, s):
    return F.linear(x, w.to(x.dtype) * s[:, None])


def _w8a16_dequant_replace(x, w, s):
    return _fused(x, w, s, None, x.dtype)


register_pattern(
    "w8a16_dequant_linear", _w8a16_dequant_search, _w8a16_dequant_replace,
    inputs=DEQUANT_INPUTS, dtypes={"act": ACT},
    check=check_scale_before, description="F.linear(x, w.to(x.dtype) * s[:, None])", **COMMON,
)


def _w8a16_dequant_col_search(x, w, s):
    return F.linear(x, w.to(x.dtype) * s)


register_pattern(
    "w8a16_dequant_linear_col_scale", _w8a16_dequant_col_search, _w8a16_dequant_replace,
    inputs=dict(DEQUANT_INPUTS, s=T("N", 1, dtype="act", positive=True)), dtypes={"act": ACT},
    check=check_scale_column, description="F.linear(x, w.to(x.dtype) * s) with s of shape [N, 1]", **COMMON,
)


def _w8a16_dequant_fp32_search(x, w, s):
    return F.linear(x, (w.to(s.dtype) * s[:, None]).to(x.dtype))


register_pattern(
    "w8a16_dequant_fp32_linear", _w8a16_dequant_fp32_search, _w8a16_dequant_replace,
    inputs=dict(DEQUANT_INPUTS, s=T("N", dtype=torch.float32, positive=True)), dtypes={"act": ACT},
    check=check_scale_before_cast, description="F.linear(x, (w.to(s.dtype) * s[:, None]).to(x.dtype))", **COMMON,
)


# -- any other decode: the structural matcher --------------------------------------------------------
# Runs after the exact patterns above (registration order), so forms with a hand-written kernel keep it.
# (The FX-cache key hashes every fusekern file, so the analysis and kernels these rewrites rely on are in it.)

def _decode_rewrite():
    from fusekern.kernels import decode_mm
    from fusekern.patterns.decode import rewrite

    register_rewrite(
        rewrite.NAME, rewrite.rewrite_decode_matmuls, family="dequant_matmul", stage="post_grad",
        kernel_version=decode_mm.KERNEL_VERSION,
        description="mm / addmm / bmm whose weight is decoded from integer / fp8 / packed codes by "
                    "elementwise, bit, view, cat and table-lookup ops: hand-tuned kernels for known formats, "
                    "a generated fused kernel for the rest",
    )


_decode_rewrite()


def _group_rewrite():
    from fusekern.kernels import decode_mm
    from fusekern.patterns.decode import group

    register_rewrite(
        group.NAME, group.group_decode_matmuls, family="dequant_matmul", stage="post_grad",
        kernel_version=decode_mm.KERNEL_VERSION,
        description="two or three fused decode -> matmuls on the same activation (q / k / v, gate / up), "
                    "same K and packed layout: one call, whose GEMVs run as one launch where measured faster",
    )


_group_rewrite()  # after the structural rewrite: it groups that rewrite's calls
