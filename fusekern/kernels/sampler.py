"""Fused top-k sampler: temperature -> top-k mask -> softmax -> exponential race, in three launches.

``tokens[b] = argmax_i over kept i of p_i / q_i`` with ``p = softmax(x)``, ``q ~ Exp(1)`` and
``x = (logits[b] / T[b])`` rounded to the logits' dtype (as the graph being replaced computes it);
kept: ``x_i >= v_k``, the k-th largest ``x`` of the row (ties kept, as ``torch.where(x < pivot, -inf, x)``).

No sort of the row, and one read of it:
1. ``_threshold_kernel`` (a CTA per row): the k-th largest of a strided sample of 4096 logits, t0 (radix
   select in registers: one 256-bin histogram per key byte). The
   sample is a subset of the row, so t0 <= v_k: every kept token has x >= t0.
2. ``_collect_kernel`` (several CTAs per row): streams the row once and appends the index of every
   token with x >= t0 to the row's candidate list (about k * V / 4096 of them).
3. ``_finish_kernel`` (a CTA per row): radix-selects v_k exactly among the candidates, draws a Philox
   uniform per kept candidate and takes the best Gumbel score ``x - log(-log u)`` (the race ``p / q`` in
   the log domain: softmax's normalizer does not change the argmax). A row whose candidates overflow
   the list takes an exact slow path over its row in the same kernel (radix select, then the race).
Comparisons use an order-preserving integer key of x (16 bits for bf16/fp16, 32 for fp32).

Read top to bottom: heuristics -> Triton kernels -> launcher -> builds -> reference -> custom op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusekern.kernels.device_info import sm_count

KERNEL_VERSION = "sampler-1"

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- heuristics

SAMPLE = 4096  # strided sample of a row used to bound the k-th largest from below
MIN_KEY = tl.constexpr(-(2**31))  # no key is below it: a threshold that selects everything


def chunks_per_row(B: int, V: int, sms: int, block: int) -> int:
    """Enough CTAs in all to cover the SMs twice, but no chunk smaller than one block."""
    return max(1, min(triton.cdiv(V, block), triton.cdiv(2 * sms, B)))


def row_split(B: int, V: int, sms: int, block: int) -> tuple[int, int]:
    """(chunks, span): each row cut into chunks of ``span`` tokens, a whole number of blocks each."""
    span = triton.cdiv(triton.cdiv(V, chunks_per_row(B, V, sms, block)), block) * block
    return triton.cdiv(V, span), span


def block_slots(B: int) -> bool:
    """Reserve candidate slots per block (small batch) rather than per candidate (H200 measurement)."""
    return B <= 32


def sample_size(V: int) -> int:
    return min(SAMPLE, triton.next_power_of_2(V))


def candidate_capacity(V: int, top_k: int | None) -> int:
    """Candidate slots per row: about 2x the expected number of candidates (k * V / sample size), at
    most 8192 (the finish kernel holds them in one CTA) and no more than the vocabulary needs."""
    expected = (top_k if top_k is not None else 64) * V / sample_size(V)
    return int(min(max(triton.next_power_of_2(int(2 * expected)), 1024), 8192, triton.next_power_of_2(V)))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _scaled(logits_ptr, row, offs, mask, stride_row, temperature):
    """x = logits / T rounded to the logits' dtype (as fp32), and an order-preserving int32 key of x.

    Keys: [0, 65536) for bf16/fp16, signed for fp32 (``bits ^ ((bits >> 31) & 0x7FFFFFFF)``); -0 is made
    +0 first so that equal floats get equal keys (torch compares -0 == +0).
    """
    raw = tl.load(logits_ptr + row * stride_row + offs, mask=mask, other=0.0)
    rounded = tl.div_rn(raw.to(tl.float32), temperature).to(raw.dtype)  # IEEE division, as torch divides
    x = tl.where(rounded == 0.0, 0.0, rounded.to(tl.float32))
    if raw.dtype == tl.float32:
        bits = x.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    else:
        bits = x.to(raw.dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
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
def _kth_largest(key, valid, k, KEY_BITS: tl.constexpr):
    """The k-th largest of the valid keys (1 <= k <= their count), by radix select in registers: one
    256-bin histogram per key byte (tl.sort of 4096 keys in one CTA measured ~90 us on the H200)."""
    bins = tl.arange(0, 256)
    ukey = key.to(tl.int64) + (2**31 if KEY_BITS == 32 else 0)  # unsigned order
    prefix = tl.zeros((), dtype=tl.int64)
    rank = k
    for p in tl.static_range(KEY_BITS // 8):
        shift = KEY_BITS - 8 * (p + 1)
        sel = valid & ((ukey >> (shift + 8)) == prefix)
        h = tl.histogram(((ukey >> shift) & 255).to(tl.int32), 256, mask=sel)
        at_or_above = tl.cumsum(h, axis=0, reverse=True)  # keys with this byte >= bin
        digit = tl.max(tl.where(at_or_above >= rank, bins, 0), axis=0)
        rank -= tl.sum(tl.where(bins > digit, h, 0), axis=0)
        prefix = prefix * 256 + digit
    return (prefix - (2**31 if KEY_BITS == 32 else 0)).to(tl.int32)


@triton.jit
def _gumbel_score(x, seed, row, offs, V, noise_ptr, mask, HAS_NOISE: tl.constexpr):
    """log(p / q) up to a per-row constant, q ~ Exp(1) drawn per (row, token): the exponential race."""
    if HAS_NOISE:  # test mode: the caller's exponential draws q [B, V]
        q = tl.load(noise_ptr + row.to(tl.int64) * V + offs, mask=mask, other=1.0)
    else:
        q = -tl.log(tl.rand(seed, row.to(tl.int64) * V + offs))
    return x - tl.log(q)


@triton.jit
def _pack(score, offs):
    """(score, index) as one int64 whose max is the best score, then the smallest index (argmax's rule)."""
    bits = score.to(tl.int32, bitcast=True)
    skey = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2**31  # order-preserving, in [0, 2**32)
    return ((skey >> 1) << 32) | (0xFFFFFFFF - offs.to(tl.int64))


@triton.jit(do_not_specialize=["top_k"])  # a new top-k value must not compile a new variant
def _threshold_kernel(
    logits_ptr, temp_ptr, temperature, stride_t, topk_ptr, top_k, stride_k,
    thr_ptr, count_ptr, flag_ptr, V, stride_row, step,
    TEMP_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr, SAMPLE: tl.constexpr, KEY_BITS: tl.constexpr,
):
    """t0 = the k-th largest key of a strided sample of the row: a lower bound of the row's k-th largest."""
    row = tl.program_id(0)
    temperature, k = _row_params(temp_ptr, temperature, stride_t, topk_ptr, top_k, stride_k, row, V,
                                 TEMP_PER_ROW, K_PER_ROW)
    j = tl.arange(0, SAMPLE)
    offs = j * step
    mask = offs < V
    _, key = _scaled(logits_ptr, row, offs, mask, stride_row, temperature)
    n = tl.sum(mask.to(tl.int32), axis=0)
    t0 = _kth_largest(key, mask, tl.minimum(k, n), KEY_BITS)
    t0 = tl.where(k <= n, t0, MIN_KEY)
    tl.store(thr_ptr + row, t0)
    tl.store(count_ptr + row, 0)
    tl.store(flag_ptr + row, 0)


@triton.jit
def _collect_kernel(
    logits_ptr, temp_ptr, temperature, stride_t, thr_ptr, count_ptr, flag_ptr, cand_ptr,
    V, span, stride_row, CAP,
    TEMP_PER_ROW: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Append the index of every token with key >= t0 to the row's candidate list, and flag rows holding
    NaN or +inf. Slots come from one atomic per candidate, or (BLOCK_SLOTS) one per block plus a prefix
    sum: measured faster up to B = 32 (51.5 against 60.5 us for the sampler at B = 32), slower above
    (231 against 204 us at B = 256): ``block_slots``."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if TEMP_PER_ROW:
        temperature = tl.load(temp_ptr + row * stride_t).to(tl.float32)
    t0 = tl.load(thr_ptr + row)
    bad = tl.zeros((BLOCK,), dtype=tl.int1)
    start = chunk * span
    for off in range(start, tl.minimum(start + span, V), BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < V
        x, key = _scaled(logits_ptr, row, offs, mask, stride_row, temperature)
        bad |= mask & ((x != x) | (x == float("inf")))
        sel = mask & (key >= t0)
        if BLOCK_SLOTS:  # reserve the block's slots with one atomic, place candidates by a prefix sum
            n = tl.sum(sel.to(tl.int32), axis=0)
            if n > 0:
                slot = tl.atomic_add(count_ptr + row, n, sem="relaxed") + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.store(cand_ptr + row.to(tl.int64) * CAP + slot, offs, mask=sel & (slot < CAP))
        else:  # one atomic per candidate
            slot = tl.atomic_add(count_ptr + row + offs * 0, 1, mask=sel, sem="relaxed")
            tl.store(cand_ptr + row.to(tl.int64) * CAP + slot, offs, mask=sel & (slot < CAP))
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.atomic_max(flag_ptr + row, 1, sem="relaxed")


@triton.jit
def _race_candidates(logits_ptr, row, temperature, k, seed, noise_ptr, cand_ptr, count, V, stride_row, CAP,
                     HAS_NOISE: tl.constexpr, CAP_BLOCK: tl.constexpr, KEY_BITS: tl.constexpr):
    """Fast path: v_k is the k-th largest key among the candidates; the race runs over them only."""
    j = tl.arange(0, CAP_BLOCK)
    valid = j < count
    offs = tl.load(cand_ptr + row.to(tl.int64) * CAP + j, mask=valid, other=0)
    x, key = _scaled(logits_ptr, row, offs, valid, stride_row, temperature)
    pivot = _kth_largest(key, valid, k, KEY_BITS)
    kept = valid & (key >= pivot)
    score = _gumbel_score(x, seed, row, offs, V, noise_ptr, kept, HAS_NOISE)
    return tl.max(tl.where(kept, _pack(score, offs), -1), axis=0)


@triton.jit
def _race_row(logits_ptr, row, temperature, k, seed, noise_ptr, V, stride_row,
              HAS_NOISE: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Slow path: radix select of v_k over unsigned keys (key + 2**31 for fp32), one byte per pass over
    the whole row, then the race over the row."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), dtype=tl.int64)
    rank = k
    for p in tl.static_range(KEY_BITS // 8):
        shift = KEY_BITS - 8 * (p + 1)
        h = tl.zeros((256,), dtype=tl.int32)
        for off in range(0, V, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            mask = offs < V
            _, key = _scaled(logits_ptr, row, offs, mask, stride_row, temperature)
            ukey = key.to(tl.int64) + (2**31 if KEY_BITS == 32 else 0)
            sel = mask & ((ukey >> (shift + 8)) == prefix)
            h += tl.histogram(((ukey >> shift) & 255).to(tl.int32), 256, mask=sel)
        at_or_above = tl.cumsum(h, axis=0, reverse=True)  # keys with this byte >= bin
        digit = tl.max(tl.where(at_or_above >= rank, bins, 0), axis=0)
        rank -= tl.sum(tl.where(bins > digit, h, 0), axis=0)
        prefix = prefix * 256 + digit
    pivot = prefix - (2**31 if KEY_BITS == 32 else 0)
    best = tl.full((), -1, dtype=tl.int64)
    for off in range(0, V, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < V
        x, key = _scaled(logits_ptr, row, offs, mask, stride_row, temperature)
        kept = mask & (key.to(tl.int64) >= pivot)
        score = _gumbel_score(x, seed, row, offs, V, noise_ptr, kept, HAS_NOISE)
        best = tl.maximum(best, tl.max(tl.where(kept, _pack(score, offs), -1), axis=0))
    return best


@triton.jit(do_not_specialize=["top_k"])
def _finish_kernel(
    logits_ptr, temp_ptr, temperature, stride_t, topk_ptr, top_k, stride_k,
    seed_ptr, noise_ptr, count_ptr, flag_ptr, cand_ptr, out_ptr, V, stride_row, CAP,
    TEMP_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr, HAS_NOISE: tl.constexpr,
    CAP_BLOCK: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """The exact k-th largest among the candidates, then the race among the kept ones; one row per CTA.

    A row whose candidates overflowed the list (flat logits, top-k near V, no top-k at all) takes the
    exact slow path over its whole row instead: a radix select, one key byte per pass, then the race.
    Both paths draw the same uniform for a token (Philox at row * V + token), so they sample the same.
    """
    row = tl.program_id(0)
    temperature, k = _row_params(temp_ptr, temperature, stride_t, topk_ptr, top_k, stride_k, row, V,
                                 TEMP_PER_ROW, K_PER_ROW)
    seed = tl.load(seed_ptr)
    count = tl.load(count_ptr + row)
    if count <= CAP:
        best = _race_candidates(logits_ptr, row, temperature, k, seed, noise_ptr, cand_ptr, count, V, stride_row,
                                CAP, HAS_NOISE, CAP_BLOCK, KEY_BITS)
    else:
        best = _race_row(logits_ptr, row, temperature, k, seed, noise_ptr, V, stride_row, HAS_NOISE, KEY_BITS, BLOCK)
    # A NaN or +inf anywhere makes the original softmax all-NaN (inf - inf, NaN sum) and its argmax token 0.
    token = tl.where(tl.load(flag_ptr + row) != 0, 0, 0xFFFFFFFF - (best & 0xFFFFFFFF))
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
    capacity: int | None = None,
) -> torch.Tensor:
    """Sample one token per row of ``logits`` [B, V]; returns int64 [B].

    ``temperature`` > 0 and ``top_k`` (clamped to [1, V]) are numbers or tensors of 1 or B values
    (numbers are kernel arguments: changing them neither recompiles nor launches a fill); ``seed`` is an
    int64 tensor of one element (draw it from torch's generator: ``torch.randint`` reproduces under
    ``torch.manual_seed`` and advances on every CUDA-graph replay). Runs on CUDA, and on CPU under
    TRITON_INTERPRET=1. ``noise`` (test mode): exponential draws [B, V] used instead of Philox, so the
    result can be compared exactly with the reference given the same draws. ``capacity``: candidate
    slots per row (tests force the slow path with a small one).
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
    if V >= 2**31 // 2:
        raise ValueError(f"sample_top_k: V = {V} is too large for 32-bit token offsets")
    if noise is not None and (noise.shape != (B, V) or noise.dtype != torch.float32 or not noise.is_contiguous()):
        raise ValueError(f"sample_top_k: noise must be contiguous float32 {(B, V)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temp, stride_t, t_scalar = _row_arg(temperature, B, logits.device, "temperature", float)
    topk, stride_k, k_scalar = _row_arg(top_k, B, logits.device, "top_k", lambda k: int(min(max(k, 1), 2**31 - 1)))
    cap = capacity or candidate_capacity(V, None if topk is not None else k_scalar)
    C, span = row_split(B, V, sm_count(logits.device), block)
    key_bits = 32 if logits.dtype == torch.float32 else 16
    ints = torch.empty((3, B), dtype=torch.int32, device=logits.device)  # threshold, count, flag per row
    cand = torch.empty((B, cap), dtype=torch.int32, device=logits.device)
    temp_arg = (temp if temp is not None else logits, t_scalar, stride_t)
    k_arg = (topk if topk is not None else logits, k_scalar, stride_k)
    _threshold_kernel[(B,)](logits, *temp_arg, *k_arg, ints[0], ints[1], ints[2], V, logits.stride(0),
                            max(1, V // sample_size(V)), TEMP_PER_ROW=temp is not None,
                            K_PER_ROW=topk is not None, SAMPLE=sample_size(V), KEY_BITS=key_bits, num_warps=8)
    _collect_kernel[(B, C)](logits, *temp_arg, ints[0], ints[1], ints[2], cand, V, span, logits.stride(0), cap,
                            TEMP_PER_ROW=temp is not None, BLOCK_SLOTS=block_slots(B), BLOCK=block, num_warps=8)
    _finish_kernel[(B,)](logits, *temp_arg, *k_arg, seed, noise if noise is not None else cand, ints[1], ints[2],
                         cand, out, V, logits.stride(0), cap, TEMP_PER_ROW=temp is not None,
                         K_PER_ROW=topk is not None, HAS_NOISE=noise is not None, CAP_BLOCK=triton.next_power_of_2(cap),
                         KEY_BITS=key_bits, BLOCK=block, num_warps=8)
    return out


# ----------------------------------------------------------------------------- builds for the report


def aot_builds():
    """The sampler's kernels at V = 128256, B = 1, top-k 50, scalar temperature, bf16 and fp32 logits.
    Their loops carry only scalars across iterations: they have no rematerialization modes."""
    from fusekern.kernels.catalog import TritonBuild

    B, V, block, k = 1, 128256, 2048, 50
    _, span = row_split(B, V, 132, block)
    cap = candidate_capacity(V, k)
    builds = []
    for dtype, key_bits in (("bf16", 16), ("fp32", 32)):
        temp = dict(logits_ptr=f"*{dtype}", temp_ptr=f"*{dtype}", temperature=0.8, stride_t=0)
        topk = dict(topk_ptr=f"*{dtype}", top_k=k, stride_k=0)
        rows = dict(count_ptr="*i32", flag_ptr="*i32", V=V, stride_row=V)
        builds.append(TritonBuild(
            "sampler_threshold", f"{dtype} SAMPLE={SAMPLE} w8", _threshold_kernel,
            dict(temp, **topk, thr_ptr="*i32", **rows, step=V // SAMPLE),
            dict(TEMP_PER_ROW=False, K_PER_ROW=False, SAMPLE=SAMPLE, KEY_BITS=key_bits), num_warps=8))
        builds.append(TritonBuild(
            "sampler_collect", f"{dtype} BLOCK={block} w8", _collect_kernel,
            dict(temp, thr_ptr="*i32", cand_ptr="*i32", span=span, CAP=cap, **rows),
            dict(TEMP_PER_ROW=False, BLOCK_SLOTS=block_slots(B), BLOCK=block), num_warps=8))
        builds.append(TritonBuild(
            "sampler_finish", f"{dtype} CAP={cap} BLOCK={block} w8", _finish_kernel,
            dict(temp, **topk, seed_ptr="*i64", noise_ptr="*i32", cand_ptr="*i32", out_ptr="*i64", CAP=cap, **rows),
            dict(TEMP_PER_ROW=False, K_PER_ROW=False, HAS_NOISE=False, CAP_BLOCK=cap, KEY_BITS=key_bits,
                 BLOCK=block), num_warps=8))
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
