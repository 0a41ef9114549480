"""Decode attention over a 16-bit KV cache, with GQA and an optional mask: split-KV, one launch.

The graph it replaces (``reference_decode_attention``)::

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    # q [B, Hq, Lq, D] bf16 / fp16; k, v [B, Hkv, S, D] in q's dtype; Lq small (a decode step)
    # mask: None, bool (True = attend) or an additive float bias, broadcastable to [B, Hq, Lq, S]

Why: at decode the query is one row per head, and the library kernels (cuDNN's and flash's fprop) give
each (batch, head) one program that pads the row to a 64- or 128-row tile and walks the whole cache:
the demo's layer (B = 1, 32 heads over 8 KV heads, S = 256) spends ~8 us there on the H200 for 1 MB of
K / V, and inductor adds a kernel that turns the bool mask into a bf16 bias first.

Design: ``fp8_kv_attention``'s split-KV program with 16-bit tiles. A program owns all query rows of one
KV head (the G = Hq / Hkv heads times Lq, padded to ROWS >= 16 for the tensor cores) and one chunk of
the sequence, so each K / V byte is read once; the last program of a KV head to finish merges the
chunks' partials (same workspace, counters and merge). The mask is read where it lies (bool as bytes,
or the bias in its own dtype, broadcast dims at stride 0): no [B, Hq, Lq, S] copy. A bool mask's False
entries add ``masked_value``: -inf (SDPA's bool semantics), or the finite minimum that inductor's CUDA
lowering writes into the bias it makes of a bool mask (-65536 for bf16), so a rewritten graph computes
what the bias did. (Not reading the tokens no row attends to, with the mask tile loaded first and the K /
V loads predicated on it, was slower on the H200 even with half the tokens masked: 82.9 against 69.6 us
at B = 8 over 8k tokens, since the loads then wait on the mask and are not pipelined.)

Where this kernel is slower than the library's (a long cache at B = 1, where one KV head's merge of 64
partials is the tail, or B = 16 over 256 tokens on the H200), the CUDA op runs PyTorch's SDPA instead:
the op times both on the first call of a shape and keeps the faster (``_choose``).

Fully masked rows (with -inf): softmax over nothing. PyTorch's SDPA (math and CPU flash paths) returns 0
there, and so does this kernel: a chunk with no live token leaves an empty partial (max -inf, sum 0), the
merge skips it, and a row whose sum is 0 is written as 0.

Input contract (checked, ``ValueError`` otherwise): q, k, v 4-D of one dtype, bf16 or fp16; k and v of
one shape [B, Hkv, S, D], S >= 1, D in {64, 128, 256}, unit-stride last dim; Hq a multiple of Hkv;
(Hq / Hkv) * Lq <= 64 query rows per KV head; the mask bool or floating, broadcastable to
[B, Hq, Lq, S]; one device.

Read top to bottom: heuristics -> kernel -> launcher -> builds -> reference -> custom op.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusekern.compiler_pass import direct_calls
from fusekern.kernels import replay
from fusekern.kernels.layout_replay import OUT, call_key, output_slots, record_if_direct, recorder
from fusekern.kernels.device_info import sm_count
from fusekern.kernels.intmath import next_power_of_2
from fusekern.kernels.fp8_kv_attention import (
    LOG2E, Q_DTYPES, _merge_splits, _query_rows, check_decode_shapes, padded_rows, split_chunk, split_plan,
)

# Bumped whenever the kernel or its heuristics change; part of the compiler passes' cache key.
KERNEL_VERSION = "decode_attention-5"

MASK_NONE, MASK_BOOL, MASK_BIAS = 0, 1, 2

# ----------------------------------------------------------------------------- heuristics

TILE_BYTES = 8192  # one K (or V) tile, as in fp8_kv_attention: BLOCK_S * D * 2 bytes
NUM_WARPS = 4
NUM_STAGES = 3  # 3 x 16 KiB of K + V tiles in shared memory: four programs fit on an SM
CTAS_PER_SM_WANTED = 4
SPLIT_FREE_CTAS_PER_SM = 2  # from two programs per SM on, splitting only adds merge traffic
MIN_SPLIT_TOKENS = 64  # two tiles: shorter chunks spend more on their prologue and partial than on K / V
MAX_SPLITS = 64


def block_tokens(head_dim: int, rows: int) -> int:
    """BLOCK_S: tokens per tile, a TILE_BYTES K tile for 16 query rows (64 tokens at D = 64, 32 at 128,
    16 at 256), fewer for more rows (more scores and operands in registers)."""
    return max(16, TILE_BYTES // (2 * head_dim) * 16 // rows)


def kv_splits(batch_heads: int, seq_len: int, sms: int) -> int:
    """Chunks per (batch, KV head) sequence: about CTAS_PER_SM_WANTED programs per SM in one wave, none
    shorter than MIN_SPLIT_TOKENS; 1 when the batch alone gives every SM SPLIT_FREE_CTAS_PER_SM programs."""
    if batch_heads >= SPLIT_FREE_CTAS_PER_SM * sms:
        return 1
    wanted = max(1, CTAS_PER_SM_WANTED * sms // batch_heads)
    return max(1, min(wanted, seq_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _log2_units(bias):
    """A bias in log2 units (as the scores are). Finite stays finite: a mask of finfo.min (Hugging Face's)
    times log2(e) would overflow to -inf, and a row masked that way everywhere averages V in SDPA
    instead of giving 0. -inf and NaN stay as they are (a NaN in the bias makes the row NaN, as in SDPA; the
    clamp alone turned it into the largest negative float, masking the token silently)."""
    scaled = tl.minimum(tl.maximum(bias * 1.4426950408889634, -3.4028234663852886e38), 3.4028234663852886e38)
    return tl.where((bias == -float("inf")) | (bias != bias), bias, scaled)


@triton.jit
def _attend_chunk16(q_ptr, q_offs, real, m_ptr, m_offs, k_head, v_head, lo, hi, qk_scale, masked, stride_ks,
                    stride_vs, stride_ms, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
                    MASK: tl.constexpr):
    """Online softmax of the program's rows against tokens [lo, hi) of one KV head: (acc, max, sum) with
    scores in log2 units, acc not yet divided by the sum. A row with no live token so far keeps max
    -inf, sum 0 and acc 0 (its reference max is taken as 0, so no -inf - -inf)."""
    d = tl.arange(0, D)
    q = tl.load(q_ptr + q_offs[:, None] + d[None, :], mask=real[:, None], other=0.0)
    m_i = tl.full((ROWS,), -float("inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    for start in tl.range(lo, hi, BLOCK_S):
        tok = start + tl.arange(0, BLOCK_S)
        live = tok < hi
        keep = real[:, None] & live[None, :]
        k = tl.load(k_head + tok[:, None] * stride_ks + d[None, :], mask=live[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        if MASK == 1:  # bool (as bytes): True attends, False adds ``masked`` (-inf, or the graph's finite min)
            mv = tl.load(m_ptr + m_offs[:, None] + tok[None, :] * stride_ms, mask=keep, other=0)
            scores = tl.where(mv != 0, scores, scores + masked)
        elif MASK == 2:  # additive bias in its own dtype, in log2 units like the scores
            bias = tl.load(m_ptr + m_offs[:, None] + tok[None, :] * stride_ms, mask=keep, other=0.0).to(tl.float32)
            scores = scores + _log2_units(bias)
        scores = tl.where(keep, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head + tok[:, None] * stride_vs + d[None, :], mask=live[:, None], other=0.0)
        # p in two 16-bit parts (hi + lo: ~16 significant bits, bf16 alone keeps 8): the second MMA is free
        # in a kernel bound by reading K / V, and halves the error that rounding p adds to the output
        p_hi = p.to(v.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        acc = tl.dot(p_lo, v, tl.dot(p_hi, v, acc * alpha[:, None]))
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr, cnt_ptr,
    S, CHUNK, SPLITS, HKV, G, LQ, qk_scale, masked,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mh, stride_ml, stride_ms,
    stride_ob, stride_oh, stride_ol,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT: tl.constexpr, MASK: tl.constexpr,
):
    """Program (b * HKV + kv_head, split): all G * LQ query rows of the KV head against tokens
    [split * CHUNK, min((split + 1) * CHUNK, S)); with SPLIT the last program of a KV head to finish merges
    the partials (``fp8_kv_attention``'s workspace and merge). m_ptr / stride_m*: the mask viewed as
    [B, Hq, Lq, S] (stride 0 where broadcast); unused for MASK 0."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    kv_head = bh % HKV
    NR = G * LQ

    q_offs, real = _query_rows(bh, HKV, G, LQ, stride_qb, stride_qh, stride_ql, ROWS)
    m_offs, _ = _query_rows(bh, HKV, G, LQ, stride_mb, stride_mh, stride_ml, ROWS)
    k_head = k_ptr + b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + b.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, S)
    acc, m_i, l_i = _attend_chunk16(q_ptr, q_offs, real, m_ptr, m_offs, k_head, v_head, lo, hi, qk_scale,
                                    masked, stride_ks, stride_vs, stride_ms, D, ROWS, BLOCK_S, MASK)
    o_offs, _ = _query_rows(bh, HKV, G, LQ, stride_ob, stride_oh, stride_ol, ROWS)
    d = tl.arange(0, D)
    if not SPLIT:
        out = tl.where((l_i == 0)[:, None], 0.0, acc / l_i[:, None])  # (no live token: 0; a NaN sum stays NaN)
        tl.store(out_ptr + o_offs[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=real[:, None])
    else:
        r = tl.arange(0, ROWS)
        slot = (bh * SPLITS + split).to(tl.int64)
        tl.store(ws_acc_ptr + ((slot * NR + r) * D)[:, None] + d[None, :], acc, mask=real[:, None])
        tl.store(ws_ml_ptr + (2 * slot) * NR + r, m_i, mask=real)
        tl.store(ws_ml_ptr + (2 * slot + 1) * NR + r, l_i, mask=real)
        tl.debug_barrier()  # every thread's partial is written before the count (released below)
        if tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            acc, l_sum = _merge_splits(ws_acc_ptr, ws_ml_ptr, bh * SPLITS, SPLITS, NR, r, real, D, ROWS)
            out = tl.where((l_sum == 0)[:, None], 0.0, acc / l_sum[:, None])
            tl.store(out_ptr + o_offs[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=real[:, None])
            tl.atomic_xchg(cnt_ptr + bh, 0, sem="relaxed", scope="gpu")  # ready for the next launch


# ----------------------------------------------------------------------------- launcher


def _check_inputs(q, k, v, mask=None) -> None:
    """ValueError unless the tensors fit the kernel's contract (module docstring)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"decode_attention: q, k, v must be 4-D, got q{tuple(q.shape)} k{tuple(k.shape)} "
                         f"v{tuple(v.shape)}")
    if q.dtype not in Q_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"decode_attention: q, k, v must share one dtype, bf16 or fp16, got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    check_decode_shapes("decode_attention", q, k, v)
    B, Hq, Lq, D = q.shape
    S = k.shape[2]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"decode_attention: k and v need a unit-stride head dim, got strides {k.stride()} and "
                         f"{v.stride()}")
    for name, t in (("k", k), ("v", v)):
        if (S - 1) * abs(t.stride(2)) + D >= 2**31:  # token offsets within one head are int32
            raise ValueError(f"decode_attention: {name}'s token stride {t.stride(2)} overflows int32 at S={S}")
    tensors = [q, k, v]
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"decode_attention: the mask must be a tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise ValueError(f"decode_attention: the mask must be bool (True attends) or a float bias, got "
                             f"{mask.dtype}")
        if mask.dim() > 4 or not all(m in (1, w) for m, w in zip(reversed(mask.shape), (S, Lq, Hq, B))):
            raise ValueError(f"decode_attention: mask{tuple(mask.shape)} does not broadcast to "
                             f"{(B, Hq, Lq, S)}")
        if mask.dim() >= 1 and (S - 1) * abs(mask.stride(-1)) >= 2**31:  # token offsets are int32
            raise ValueError(f"decode_attention: the mask's token stride {mask.stride(-1)} overflows int32 at S={S}")
        tensors.append(mask)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"decode_attention: all tensors must be on one device, got {sorted(map(str, devices))}")


FLT_MAX = 3.4028234663852886e38


def _masked_log2(value: float) -> float:
    """``masked_value`` in the kernel's log2 units: -inf stays, a finite value stays finite."""
    value = float(value)
    if math.isnan(value):
        raise ValueError("decode_attention: masked_value is NaN")
    return value if math.isinf(value) and value < 0 else max(-FLT_MAX, min(FLT_MAX, value * LOG2E))


def _mask_view(mask, shape):
    """(the mask as a [B, Hq, Lq, S] view the kernel reads, MASK code): bool as uint8 bytes."""
    if mask is None:
        return None, MASK_NONE
    view = mask.expand(shape)
    if mask.dtype == torch.bool:
        return view.view(torch.uint8), MASK_BOOL
    return view, MASK_BIAS


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     sm_scale: float | None = None, *, masked_value: float = -math.inf,
                     num_splits: int | None = None) -> torch.Tensor:
    """``softmax(q @ k^T * sm_scale + mask) @ v`` with GQA (as SDPA with ``enable_gqa``), [B, Hq, Lq, D].

    mask: None, bool (True attends, False adds ``masked_value``: with -inf a fully masked row gives 0, as
    SDPA does) or a float bias, broadcastable to [B, Hq, Lq, S]. sm_scale: 1 / sqrt(D) by default.
    ``num_splits``: chunks per sequence (default: ``kv_splits``)."""
    _check_inputs(q, k, v, mask)
    return _launch(q, k, v, mask, sm_scale, masked_value, num_splits)


def _launch(q, k, v, mask, sm_scale, masked_value, num_splits=None, record=None) -> torch.Tensor:
    """``decode_attention`` on inputs already checked (the op checks once per call, then times or runs).
    record: called with an ``layout_replay.LayoutReplay`` of this launch where it can replay."""
    given = (q, k, v, mask)  # (q may be replaced by a contiguous copy below: then nothing is recorded)
    B, Hq, Lq, D = q.shape
    _, Hkv, S, _ = k.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    out = torch.empty((B, Hq, Lq, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    G = Hq // Hkv
    rows = G * Lq
    block = block_tokens(D, padded_rows(rows))
    if num_splits is None:
        num_splits = kv_splits(B * Hkv, S, sm_count(q.device))
    chunk, splits, ws_acc, ws_ml, cnt = split_plan(out, Hkv, S, rows, block, num_splits)
    mv, code = _mask_view(mask, (B, Hq, Lq, S))
    m_arg, m_strides = (out, (0, 0, 0, 0)) if mv is None else (mv, mv.stride())
    launch = replay.launch(decode_attention_kernel, (B * Hkv, splits), (
        q, k, v, m_arg, out, ws_acc, ws_ml, cnt,
        S, chunk, splits, Hkv, G, Lq, float(sm_scale) * LOG2E, _masked_log2(masked_value),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *m_strides,
        out.stride(0), out.stride(1), out.stride(2)),
        dict(D=D, ROWS=padded_rows(rows), BLOCK_S=block, SPLIT=splits > 1, MASK=code,
             num_warps=NUM_WARPS, num_stages=NUM_STAGES), record is not None)
    split = splits > 1
    sources = {"q_ptr": 0, "k_ptr": 1, "v_ptr": 2, "m_ptr": 3 if mv is not None else OUT,
               **output_slots(split, ("ws_acc_ptr", "ws_ml_ptr"))}
    record_if_direct(record, [(launch, sources)], given, (out, ws_acc, ws_ml) if split else (out,))
    return out


# ----------------------------------------------------------------------------- builds

# (label, B, Hq, Hkv, Lq, S, D, dtype, mask code): the demo's layer first
SHIPPED_SHAPES = (
    ("demo B=1, inductor's bias", 1, 32, 8, 1, 256, 128, "*bf16", MASK_BIAS),
    ("demo B=64 bool mask", 64, 32, 8, 1, 256, 128, "*bf16", MASK_BOOL),
    ("long context, no mask", 8, 32, 8, 1, 8192, 128, "*bf16", MASK_NONE),
    ("fp16 bias, GQA 8 Lq 4", 4, 64, 8, 4, 4096, 128, "*fp16", MASK_BIAS),
    ("D=64", 8, 32, 8, 1, 4096, 64, "*bf16", MASK_NONE),
    ("D=256", 8, 16, 8, 1, 4096, 256, "*bf16", MASK_NONE),
)


def aot_builds():
    """The kernel at the demo's shapes (the bf16 bias inductor makes of its bool mask, split; a bool mask,
    not split), a long context, an fp16 bias with 32 rows per program, and D = 64 / 256."""
    from fusekern.kernels.catalog import TritonBuild

    builds = []
    for label, B, Hq, Hkv, Lq, S, D, dt, code in SHIPPED_SHAPES:
        rows = padded_rows((Hq // Hkv) * Lq)
        block = block_tokens(D, rows)
        chunk, splits = split_chunk(S, kv_splits(B * Hkv, S, 132), block)
        m_ptr = {MASK_NONE: dt, MASK_BOOL: "*u8", MASK_BIAS: dt}[code]
        args = dict(
            q_ptr=dt, k_ptr=dt, v_ptr=dt, m_ptr=m_ptr, out_ptr=dt, ws_acc_ptr="*fp32", ws_ml_ptr="*fp32",
            cnt_ptr="*i32", S=S, CHUNK=chunk, SPLITS=splits, HKV=Hkv, G=Hq // Hkv, LQ=Lq,
            qk_scale=D ** -0.5 * LOG2E, masked=-65536.0 * LOG2E,
            stride_qb=Hq * Lq * D, stride_qh=Lq * D, stride_ql=D,
            stride_kb=Hkv * S * D, stride_kh=S * D, stride_ks=D,
            stride_vb=Hkv * S * D, stride_vh=S * D, stride_vs=D,
            # a [Lq, S] mask broadcast over batch and heads, as the demo's causal rows are
            stride_mb=0, stride_mh=0, stride_ml=S if code else 0, stride_ms=1 if code else 0,
            stride_ob=Hq * Lq * D, stride_oh=Lq * D, stride_ol=D,
        )
        constexprs = dict(D=D, ROWS=rows, BLOCK_S=block, SPLIT=splits > 1, MASK=code)
        config = (f"{label}: {dt[1:]} D={D} ROWS={rows} BLOCK_S={block} splits={splits} mask={code} "
                  f"w{NUM_WARPS} s{NUM_STAGES} [B={B} Hq={Hq} Hkv={Hkv} Lq={Lq} S={S}]")
        builds.append(TritonBuild("decode_attention", config, decode_attention_kernel, args, constexprs,
                                  NUM_WARPS, NUM_STAGES))
    return builds


# ----------------------------------------------------------------------------- reference


def _bias_of(mask, masked_value: float, dtype):
    """The additive bias a mask stands for (None without one): a bool mask's False entries add masked_value."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, masked_value).to(dtype)
    return mask.to(dtype)


def _math(q, k, v, mask, sm_scale, dtype, masked_value: float = -math.inf):
    B, Hq, _, D = q.shape
    G = Hq // k.shape[1]
    k = k.to(dtype).repeat_interleave(G, dim=1)
    v = v.to(dtype).repeat_interleave(G, dim=1)
    scores = (q.to(dtype) @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D) if sm_scale is None else sm_scale)
    bias = _bias_of(mask, masked_value, dtype)
    if bias is not None:
        scores = scores + bias
    # a row with nothing to attend to gives 0 (SDPA's math and CPU flash paths do the same)
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return p @ v


def reference_decode_attention(q, k, v, mask=None, sm_scale=None, masked_value: float = -math.inf) -> torch.Tensor:
    """The graph being replaced, in float64 (not rounded to q's dtype: a test measures the kernel's error)."""
    return _math(q, k, v, mask, sm_scale, torch.float64, masked_value)


def torch_attention(q, k, v, mask, sm_scale, masked_value: float = -math.inf) -> torch.Tensor:
    """The same attention through PyTorch's SDPA (the library kernels): the op's path where those are faster."""
    if mask is not None and mask.dtype == torch.bool and not (math.isinf(masked_value) and masked_value < 0):
        mask = torch.where(mask, 0.0, masked_value).to(q.dtype)  # the graph's own bias
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale,
                                                            enable_gqa=q.shape[1] != k.shape[1])


# ----------------------------------------------------------------------------- custom op
# The plain dispatcher API, as for the other kernels. Inference-only: no autograd kernel.

torch.library.define(
    "fusekern::decode_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor? mask, float sm_scale, float masked_value) -> Tensor",
)

_choice: dict = {}  # (layouts with the KV length bucketed, mask value, device) -> True: this kernel, False: SDPA
_CHOICE_MAX = 4096


def _layout(t, kv_dim: int | None):
    """A tensor's layout for the choice, with the KV length (dim ``kv_dim``: the last dim of a mask, dim 2 of K
    and V; None for q) in its power-of-two bucket: a cache that grows by a token a step would otherwise be timed
    again every step. Other dims stay exact, also where one happens to equal the KV length."""
    if t is None:
        return None
    shape = list(t.shape)
    if kv_dim is not None:
        shape[kv_dim] = next_power_of_2(shape[kv_dim])
    return tuple(shape), t.stride(-1), t.is_contiguous(), t.dtype


def _choose(q, k, v, mask, sm_scale, masked_value) -> bool:
    """Whether this kernel beats PyTorch's SDPA here: both timed on the first call of a shape (GPU time, K
    / V out of L2, as a decode step reads them), the answer kept per shape class (the KV length's power-of-two
    bucket) and device. While a CUDA graph is captured nothing can be timed: a shape not yet measured runs
    PyTorch's SDPA (never slower than the graph the rewrite replaced)."""
    key = (_layout(q, None), _layout(k, 2), _layout(v, 2), _layout(mask, -1), masked_value, q.device)
    if key in _choice:
        return _choice[key]
    if torch.cuda.is_current_stream_capturing():
        return False
    from fusekern.kernels.decode_mm import _gpu_time

    ours = _gpu_time(lambda: _launch(q, k, v, mask, sm_scale, masked_value), device=q.device)
    theirs = _gpu_time(lambda: torch_attention(q, k, v, mask, sm_scale, masked_value), device=q.device)
    if len(_choice) >= _CHOICE_MAX:
        _choice.clear()
    _choice[key] = ours < theirs
    return _choice[key]


_REPLAYS: dict = {}  # the call's layouts (layout_replay.call_key) -> the kernel launch to replay


def _decode_attention_cuda(q, k, v, mask, sm_scale, masked_value=-math.inf):
    """Calls after the first with the same layouts replay its launch (``layout_replay``)."""
    key = call_key((q, k, v, mask), sm_scale, masked_value)
    rep = _REPLAYS.get(key)
    if rep is not None:
        return rep((q, k, v, mask), key[-1])
    _check_inputs(q, k, v, mask)
    if _choose(q, k, v, mask, sm_scale, masked_value):
        return _launch(q, k, v, mask, sm_scale, masked_value, record=recorder(_REPLAYS, key))
    # contiguous, as the fake declares: SDPA's output follows q's layout (a q transposed from [B, Lq, H, D], as
    # projections leave it, gives a non-contiguous [B, H, Lq, D] for Lq > 1, which inductor's code would misread)
    return torch_attention(q, k, v, mask, sm_scale, masked_value).contiguous()


torch.library.impl("fusekern::decode_attention", "CUDA")(_decode_attention_cuda)  # (kept callable: tests, direct_calls)
direct_calls.register(torch.ops.fusekern.decode_attention.default, _decode_attention_cuda)


@torch.library.impl("fusekern::decode_attention", "CPU")
def _decode_attention_cpu(q, k, v, mask, sm_scale, masked_value=-math.inf):
    """fp32 math (the CPU path is correct, not fast)."""
    _check_inputs(q, k, v, mask)
    return _math(q, k, v, mask, sm_scale, torch.float32, masked_value).to(q.dtype)


@torch.library.register_fake("fusekern::decode_attention")
def _decode_attention_fake(q, k, v, mask, sm_scale, masked_value=-math.inf):
    _check_inputs(q, k, v, mask)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


decode_attention_op = torch.ops.fusekern.decode_attention

