"""Fused top-k sampler: temperature -> top-k mask -> softmax -> exponential race, in a few passes.

``tokens[b] = argmax_i over kept i of p_i / q_i`` with ``p = softmax(x)``, ``q ~ Exp(1)`` and
``x = (logits[b] / T[b])`` rounded to the logits' dtype (as the graph being replaced computes it);
kept: ``x_i >= v_k``, the k-th largest ``x`` of the row (ties kept, as ``torch.where(x < pivot, -inf, x)``).

No sort. The k-th largest value is found by a radix select over an order-preserving integer key of x
(16 bits for bf16/fp16, 32 for fp32), one byte per pass: pass p builds a 256-bin histogram of the
p-th byte of the keys that share the prefix the earlier passes fixed. Each pass is one launch over
(rows x chunks) so a single row still spreads over many SMs; each CTA writes its own partial histogram
(no atomics, no zeroing), and the next pass sums the partials of its row. The race pass then draws
Philox uniforms per (row, token), forms the Gumbel score ``x - log(-log u)`` (the race ``p/q`` in the log
domain: softmax's normalizer does not change the argmax) for kept tokens, and each chunk writes its best
(score, index) packed into one int64; a last small kernel picks the row's best chunk.

Read top to bottom: heuristics -> Triton kernels -> launcher -> reference -> custom op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusekern.kernels.device_info import sm_count

KERNEL_VERSION = "sampler-1"

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BINS = 256  # one byte of the key per pass


# ----------------------------------------------------------------------------- heuristics


def chunks_per_row(B: int, V: int, sms: int, block: int) -> int:
    """Enough CTAs in all to cover the SMs twice, but no chunk smaller than one block."""
    return max(1, min(triton.cdiv(V, block), triton.cdiv(2 * sms, B)))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _f32_key(x):
    """Order-preserving unsigned key of fp32 values, as int64 in [0, 2**32)."""
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _scaled(logits_ptr, row, offs, mask, stride_row, temperature):
    """x = logits / T rounded to the logits' dtype (as fp32), and its order-preserving key.

    Keys are 16 bits for bf16/fp16 and 32 for fp32; -0 is made +0 first so that equal floats get
    equal keys (torch compares -0 == +0).
    """
    raw = tl.load(logits_ptr + row * stride_row + offs, mask=mask, other=0.0)
    rounded = (raw.to(tl.float32) / temperature).to(raw.dtype)
    x = tl.where(rounded == 0.0, 0.0, rounded.to(tl.float32))
    if raw.dtype == tl.float32:
        key = _f32_key(x)
    else:
        bits = x.to(raw.dtype).to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
        key = tl.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000)
    return x, key


@triton.jit
def _row_params(temp_ptr, temperature, stride_t, topk_ptr, top_k, stride_k, row, V,
                TEMP_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr):
    """This row's temperature and top-k (clamped to [1, V]): from tensors (stride 0: one value for all
    rows) or scalar arguments."""
    if TEMP_PER_ROW:
        temperature = tl.load(temp_ptr + row * stride_t).to(tl.float32)
    if K_PER_ROW:
        top_k = tl.load(topk_ptr + row * stride_k).to(tl.int32)
    return temperature, tl.minimum(tl.maximum(top_k, 1), V)


@triton.jit
def _walk(hist_ptr, row, k, B, C, PASS: tl.constexpr):
    """The key prefix fixed by passes < PASS and the rank of the k-th largest inside that prefix.

    hist_ptr: [PASSES, B, C, BINS] int32 partial histograms.
    """
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), dtype=tl.int64)
    rank = k
    for p in tl.static_range(PASS):
        h = tl.zeros((256,), dtype=tl.int32)
        base = hist_ptr + ((p * B + row) * C) * 256
        for c in range(0, C):
            h += tl.load(base + c * 256 + bins)
        at_or_above = tl.cumsum(h, axis=0, reverse=True)  # keys with this byte >= bin
        digit = tl.max(tl.where(at_or_above >= rank, bins, 0), axis=0)
        rank -= tl.sum(tl.where(bins > digit, h, 0), axis=0)
        prefix = prefix * 256 + digit
    return prefix, rank


@triton.jit(do_not_specialize=["top_k"])  # a new top-k value must not compile a new variant
def _histogram_pass_kernel(
    logits_ptr, temp_ptr, temperature, stride_t, topk_ptr, top_k, stride_k, hist_ptr,
    B, V, C, span, stride_row,
    TEMP_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr,
    KEY_BITS: tl.constexpr, PASS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature, k = _row_params(temp_ptr, temperature, stride_t, topk_ptr, top_k, stride_k, row, V,
                                 TEMP_PER_ROW, K_PER_ROW)
    prefix, rank = _walk(hist_ptr, row, k, B, C, PASS)
    SHIFT: tl.constexpr = KEY_BITS - 8 * (PASS + 1)
    h = tl.zeros((256,), dtype=tl.int32)
    start = chunk * span
    for off in range(start, tl.minimum(start + span, V), BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = (offs < V) & (offs < start + span)
        _, key = _scaled(logits_ptr, row, offs, mask, stride_row, temperature)
        sel = mask & ((key >> (SHIFT + 8)) == prefix)
        h += tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=sel)
    tl.store(hist_ptr + ((PASS * B + row) * C + chunk) * 256 + tl.arange(0, 256), h)


@triton.jit(do_not_specialize=["top_k"])
def _race_pass_kernel(
    logits_ptr, temp_ptr, temperature, stride_t, topk_ptr, top_k, stride_k, seed_ptr, noise_ptr, hist_ptr, best_ptr,
    B, V, C, span, stride_row,
    TEMP_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr,
    PASSES: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature, k = _row_params(temp_ptr, temperature, stride_t, topk_ptr, top_k, stride_k, row, V,
                                 TEMP_PER_ROW, K_PER_ROW)
    pivot, _ = _walk(hist_ptr, row, k, B, C, PASSES)  # the full key of the k-th largest x
    seed = tl.load(seed_ptr)
    best = tl.full((), -1, dtype=tl.int64)
    nan_seen = tl.zeros((), dtype=tl.int32)
    start = chunk * span
    for off in range(start, tl.minimum(start + span, V), BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = (offs < V) & (offs < start + span)
        x, key = _scaled(logits_ptr, row, offs, mask, stride_row, temperature)
        nan_seen += tl.sum((mask & ((x != x) | (x == float("inf")))).to(tl.int32), axis=0)
        kept = mask & (key >= pivot)
        if tl.sum(kept.to(tl.int32), axis=0) > 0:  # top-k leaves most blocks without a candidate
            if HAS_NOISE:  # test mode: the caller's exponential draws q [B, V]
                q = tl.load(noise_ptr + row.to(tl.int64) * V + offs, mask=kept, other=1.0)
            else:
                q = -tl.log(tl.rand(seed, row.to(tl.int64) * V + offs))
            score = x - tl.log(q)  # argmax p/q with q ~ Exp(1), in the log domain (a Gumbel race)
            # Pack (order-preserving 31-bit score key, inverted index): max picks the best score, then
            # the smallest index (argmax's tie rule).
            skey = _f32_key(score) >> 1
            packed = (skey << 32) | (0xFFFFFFFF - offs.to(tl.int64))
            best = tl.maximum(best, tl.max(tl.where(kept, packed, -1), axis=0))
    # A NaN or +inf anywhere makes the original softmax all-NaN (inf - inf, NaN sum) and its argmax token 0.
    best = tl.where(nan_seen > 0, 0x7FFFFFFFFFFFFFFF, best)
    tl.store(best_ptr + row * C + chunk, best)


@triton.jit
def _pick_kernel(best_ptr, out_ptr, C, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    best = tl.max(tl.load(best_ptr + row * C + offs, mask=offs < C, other=-1), axis=0)
    token = tl.where(best == 0x7FFFFFFFFFFFFFFF, 0, 0xFFFFFFFF - (best & 0xFFFFFFFF))
    tl.store(out_ptr + row, token)


# ----------------------------------------------------------------------------- launcher


def _row_arg(value, B: int, device, what: str, cast):
    """(tensor, stride, scalar) for a kernel parameter given as a number or a tensor of 1 or B values.

    A number, or one value in a CPU tensor (a tensorified Python scalar), becomes the scalar argument:
    no device copy, no recompile when it changes. Otherwise the tensor is read with stride 0 or 1.
    """
    if not isinstance(value, torch.Tensor):
        return None, 0, cast(value)
    if value.numel() not in (1, B):
        raise ValueError(f"sample_top_k: {what} must be a number or hold 1 or B={B} values, "
                         f"got shape {tuple(value.shape)}")
    if value.numel() == 1 and value.device.type == "cpu" and device.type != "cpu":
        return None, 0, cast(value.item())
    if value.device != device:
        raise ValueError(f"sample_top_k: {what} is on {value.device}, logits on {device}")
    flat = value.reshape(-1)
    return flat, (flat.stride(0) if flat.numel() > 1 else 0), cast(1)


def sample_top_k_triton(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int | torch.Tensor,
    seed: torch.Tensor,
    *,
    noise: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block: int = 2048,
    chunks: int | None = None,
) -> torch.Tensor:
    """Sample one token per row of ``logits`` [B, V]; returns int64 [B].

    ``temperature`` > 0 and ``top_k`` (clamped to [1, V]) are numbers or per-row tensors of B values
    (numbers are kernel arguments: changing them neither recompiles nor launches a fill); ``seed`` is an
    int64 tensor of one element (draw it from torch's generator: ``torch.randint`` reproduces under
    ``torch.manual_seed`` and advances on every CUDA-graph replay). Runs on CUDA, and on CPU under
    TRITON_INTERPRET=1. ``noise`` (test mode): exponential draws [B, V] used instead of Philox, so the
    result can be compared exactly with the reference given the same draws.
    """
    if logits.dim() != 2:
        raise ValueError(f"sample_top_k: logits must be [B, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"sample_top_k: logits must be bf16/fp16/fp32, got {logits.dtype}")
    if seed.numel() != 1 or seed.dtype != torch.int64:
        raise ValueError(f"sample_top_k: seed must be one int64 value, got {seed.dtype} {tuple(seed.shape)}")
    B, V = logits.shape
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    elif out.shape != (B,) or out.dtype != torch.int64:
        raise ValueError(f"sample_top_k: out must be int64 ({B},), got {out.dtype} {tuple(out.shape)}")
    if B == 0:
        return out
    if V == 0:
        raise ValueError("sample_top_k: cannot sample from an empty vocabulary (V == 0)")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temp, stride_t, t_scalar = _row_arg(temperature, B, logits.device, "temperature", float)
    topk, stride_k, k_scalar = _row_arg(top_k, B, logits.device, "top_k", lambda k: int(min(max(k, 1), 2**31 - 1)))
    key_bits = 32 if logits.dtype == torch.float32 else 16
    passes = key_bits // 8
    C = chunks or chunks_per_row(B, V, sm_count(logits.device), block)
    span = triton.cdiv(triton.cdiv(V, C), block) * block
    C = triton.cdiv(V, span)
    hist = torch.empty((passes, B, C, BINS), dtype=torch.int32, device=logits.device)
    best = torch.empty((B, C), dtype=torch.int64, device=logits.device)
    params = (logits, temp if temp is not None else logits, t_scalar, stride_t,
              topk if topk is not None else logits, k_scalar, stride_k)
    flags = dict(TEMP_PER_ROW=temp is not None, K_PER_ROW=topk is not None)
    common = (B, V, C, span, logits.stride(0))
    if noise is not None and (noise.shape != (B, V) or noise.dtype != torch.float32 or not noise.is_contiguous()):
        raise ValueError(f"sample_top_k: noise must be contiguous float32 {(B, V)}")
    for p in range(passes):
        _histogram_pass_kernel[(B, C)](*params, hist, *common, **flags, KEY_BITS=key_bits, PASS=p,
                                        BLOCK=block, num_warps=8)
    _race_pass_kernel[(B, C)](*params, seed, noise if noise is not None else hist, hist, best, *common, **flags,
                              PASSES=passes, HAS_NOISE=noise is not None, BLOCK=block, num_warps=8)
    _pick_kernel[(B,)](best, out, C, BLOCK_C=triton.next_power_of_2(C), num_warps=1)
    return out


# ----------------------------------------------------------------------------- builds for the report


def aot_builds():
    """Every sampler kernel at V = 128256 for bf16 and fp32 logits, B = 1 (63 chunks per row), scalar
    temperature and top-k. The kernels loop over blocks with only scalars live across the loop: they
    have no rematerialization modes."""
    from fusekern.kernels.catalog import TritonBuild

    B, V, block = 1, 128256, 2048
    C = chunks_per_row(B, V, 132, block)
    span = triton.cdiv(triton.cdiv(V, C), block) * block
    C = triton.cdiv(V, span)
    builds = []
    for dtype, key_bits in (("bf16", 16), ("fp32", 32)):
        params = dict(logits_ptr=f"*{dtype}", temp_ptr=f"*{dtype}", temperature=0.8, stride_t=0,
                      topk_ptr=f"*{dtype}", top_k=50, stride_k=0)
        common = dict(B=B, V=V, C=C, span=span, stride_row=V)
        flags = dict(TEMP_PER_ROW=False, K_PER_ROW=False, BLOCK=block)
        for p in range(key_bits // 8):
            builds.append(TritonBuild(
                "sampler_histogram", f"{dtype} PASS={p} BLOCK={block} w8", _histogram_pass_kernel,
                dict(params, hist_ptr="*i32", **common), dict(flags, KEY_BITS=key_bits, PASS=p), num_warps=8))
        builds.append(TritonBuild(
            "sampler_race", f"{dtype} PASSES={key_bits // 8} BLOCK={block} w8", _race_pass_kernel,
            dict(params, seed_ptr="*i64", noise_ptr="*i32", hist_ptr="*i32", best_ptr="*i64", **common),
            dict(flags, PASSES=key_bits // 8, HAS_NOISE=False), num_warps=8))
    builds.append(TritonBuild("sampler_pick", f"BLOCK_C={triton.next_power_of_2(C)} w1", _pick_kernel,
                              dict(best_ptr="*i64", out_ptr="*i64", C=C),
                              dict(BLOCK_C=triton.next_power_of_2(C)), num_warps=1))
    return builds


# ----------------------------------------------------------------------------- reference


def sample_top_k_reference(logits, temperature, top_k, q: torch.Tensor) -> torch.Tensor:
    """The gpt-fast chain in float64 with given exponential noise ``q`` [B, V] (the race's draws).

    x is rounded to the logits' dtype after the division, as the original graph does; the mask keeps
    ties with the k-th largest; a row containing NaN or +inf gives token 0 (the original's softmax is all
    NaN there, and argmax returns the first NaN).
    """
    B, V = logits.shape
    temp = temperature if isinstance(temperature, torch.Tensor) else torch.tensor([temperature])
    temp = temp.reshape(-1, 1).to(torch.float32).cpu()  # [1, 1] or [B, 1]
    x = (logits.cpu().float() / temp).to(logits.dtype).double()
    k = top_k if isinstance(top_k, torch.Tensor) else torch.tensor([top_k])
    k = k.reshape(-1).cpu().long().clamp(1, V).expand(B)
    pivot = torch.stack([x[b].topk(int(k[b])).values[-1] for b in range(B)]).unsqueeze(-1)
    masked = torch.where(x < pivot, float("-inf"), x)
    probs = torch.softmax(masked, dim=-1)
    tokens = torch.argmax(probs / q.cpu().double(), dim=-1)
    return torch.where((torch.isnan(x) | (x == float("inf"))).any(-1), 0, tokens)


def sample_top_k_torch(logits, temperature, top_k, seed: torch.Tensor) -> torch.Tensor:
    """The same sampler in plain PyTorch (fp32), noise from a generator seeded by ``seed``: the CPU path."""
    B, V = logits.shape
    g = torch.Generator(device=logits.device).manual_seed(int(seed.reshape(-1)[0]))
    q = torch.empty((B, V), dtype=torch.float32, device=logits.device).exponential_(1, generator=g)
    temp = temperature.reshape(-1, 1).float() if isinstance(temperature, torch.Tensor) else float(temperature)
    x = (logits.float() / temp).to(logits.dtype).float()
    k = top_k.reshape(-1, 1).long() if isinstance(top_k, torch.Tensor) else torch.tensor([[top_k]])
    k = k.clamp(1, V).to(logits.device).expand(B, 1)
    pivot = x.topk(int(k.max()), dim=-1).values.gather(-1, k - 1)
    score = torch.where(x < pivot, float("-inf"), x) - torch.log(q)
    tokens = torch.argmax(score, dim=-1)
    return torch.where((torch.isnan(x) | (x == float("inf"))).any(-1), 0, tokens)


# ----------------------------------------------------------------------------- custom op
# Plain dispatcher API (define + per-device impl + fake), as for w8a16_linear: custom_op's Python
# wrappers cost more CPU per call than this kernel runs. Inference only (no autograd kernel).

torch.library.define(
    "fusekern::sample_top_k",
    "(Tensor logits, Tensor? temperature, float temperature_scalar, Tensor? top_k, SymInt top_k_scalar, "
    "Tensor seed) -> Tensor",
)


def _unpack(temperature, temperature_scalar, top_k, top_k_scalar):
    return (temperature if temperature is not None else temperature_scalar,
            top_k if top_k is not None else top_k_scalar)


@torch.library.impl("fusekern::sample_top_k", "CUDA")
def _sample_top_k_cuda(logits, temperature, temperature_scalar, top_k, top_k_scalar, seed):
    """One token per row: temperature -> top-k -> softmax -> exponential race, fused."""
    t, k = _unpack(temperature, temperature_scalar, top_k, top_k_scalar)
    return sample_top_k_triton(logits, t, k, seed)


@torch.library.impl("fusekern::sample_top_k", "CPU")
def _sample_top_k_cpu(logits, temperature, temperature_scalar, top_k, top_k_scalar, seed):
    t, k = _unpack(temperature, temperature_scalar, top_k, top_k_scalar)
    return sample_top_k_torch(logits, t, k, seed)


@torch.library.register_fake("fusekern::sample_top_k")
def _sample_top_k_fake(logits, temperature, temperature_scalar, top_k, top_k_scalar, seed):
    if logits.dim() != 2:
        raise ValueError(f"sample_top_k: logits must be [B, V], got shape {tuple(logits.shape)}")
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


sample_top_k = torch.ops.fusekern.sample_top_k
