"""Greedy decoding with a token mask, fused: ``argmax`` of ``logits / T`` with banned tokens at ``-inf``.

The original graph (issue 5, pattern 4) copies the logits, divides by the temperature, writes ``-inf``
onto the banned or draft tokens (``scatter``, ``x[:, ids] = -inf`` or ``masked_fill``) and takes the
argmax. ``masked_argmax`` reads each logit once; at small batch a row is split over many programs.

Semantics are the original graph's, run eagerly, bit for bit:
- ``logits / T`` is divided in fp32 and rounded to the logits' dtype, as eager bf16 / fp16 division is
  (so ties created by the rounding break the same way);
- ties go to the lowest index, as ``torch.argmax``; a row of ``-inf`` gives 0;
- a NaN is the maximum (``torch.argmax`` returns the first NaN);
- banned ids may be negative (counted from the end, as indexing does); a banned id outside the row
  makes the graph raise, the kernel ignores it.

Read top to bottom: kernel -> launcher -> reference -> custom op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusekern.compiler_pass import direct_calls
from fusekern.kernels import replay
from fusekern.kernels.device_info import sm_count
from fusekern.kernels.intmath import cdiv, next_power_of_2
from fusekern.kernels.layout_replay import call_key, output_slots, record_if_direct, recorder
from fusekern.kernels.split_counters import split_counters

KERNEL_VERSION = "masked_argmax-6"
LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _chunk_argmax(x_row, t, banned_ptr, mask_ptr, row, lo, hi, V, n_banned, stride_bb, stride_bj, stride_mb,
                  stride_mv, HAS_T: tl.constexpr, HAS_BANNED: tl.constexpr, HAS_MASK: tl.constexpr,
                  DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """(max, its lowest index, the first NaN's index or V) of logits [lo, hi) after the temperature and
    the masks. Every lane keeps a running best (strictly greater wins: lanes see increasing indices),
    reduced across lanes once at the end. With HAS_BANNED each element is compared with every banned id
    (the slow path: only for a chunk whose winner is banned)."""
    lanes = tl.arange(0, BLOCK)
    best_v = tl.full((BLOCK,), -float("inf"), tl.float32)
    best_i = lo + lanes
    nan_i = tl.full((BLOCK,), 0, tl.int32) + V
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        valid = offs < hi
        x = tl.load(x_row + offs, mask=valid, other=0).to(tl.float32)
        if HAS_T:  # correctly rounded fp32 division, then the logits' dtype: eager's rounding
            x = tl.math.div_rn(x, tl.zeros_like(x) + t).to(DTYPE).to(tl.float32)
        if HAS_MASK:
            m = tl.load(mask_ptr + row * stride_mb + offs * stride_mv, mask=valid, other=0)
            x = tl.where(m != 0, -float("inf"), x)
        if HAS_BANNED:
            for j in range(n_banned):
                b = tl.load(banned_ptr + row * stride_bb + j * stride_bj).to(tl.int32)
                x = tl.where(offs == tl.where(b < 0, b + V, b), -float("inf"), x)
        nan_i = tl.minimum(nan_i, tl.where((x != x) & valid, offs, V))
        better = (x > best_v) & valid  # NaN compares false; an equal later value does not win
        best_v = tl.where(better, x, best_v)
        best_i = tl.where(better, offs, best_i)
    v = tl.max(best_v, axis=0)
    i = tl.min(tl.where(best_v == v, best_i, 2147483647), axis=0)
    return v, i, tl.min(nan_i, axis=0)


@triton.jit
def _max_and_min(a0, a1, b0, b1):
    return tl.maximum(a0, b0), tl.minimum(a1, b1)


@triton.jit
def masked_argmax_kernel(
    x_ptr, t_ptr, t_scalar, banned_ptr, mask_ptr, out_ptr, ws_v_ptr, ws_i_ptr, cnt_ptr,
    V, CHUNK, SPLIT, n_banned, stride_x, stride_t, stride_bb, stride_bj, stride_mb, stride_mv,
    HAS_T: tl.constexpr, T_TENSOR: tl.constexpr, HAS_BANNED: tl.constexpr, HAS_MASK: tl.constexpr,
    DTYPE: tl.constexpr, BLOCK: tl.constexpr, SPLIT_ROWS: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
    ROUND_T: tl.constexpr = False,
):
    """Program (row, part) finds the argmax of the row's chunk [part * CHUNK, (part + 1) * CHUNK). With
    SPLIT_ROWS (SPLIT > 1 programs per row) the last of a row's programs to finish combines the chunks
    in order (lower chunks win ties, the first NaN wins), so a row spreads over many SMs at small batch
    in one launch. SPLIT is a runtime value: a new batch size does not compile a new kernel."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    if T_TENSOR:
        t = tl.load(t_ptr + row * stride_t).to(tl.float32)
        if ROUND_T:  # (CUDA eager casts a tensor T to the quotient's dtype before dividing)
            t = t.to(DTYPE).to(tl.float32)
    else:
        t = t_scalar
    lo = part * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    # Banned ids are few: find the chunk's winner without them, and only if a banned id is that winner
    # (or the first NaN) run the chunk again with every element compared against the ids.
    v, i, nan_i = _chunk_argmax(x_row, t, banned_ptr, mask_ptr, row, lo, hi, V, n_banned, stride_bb, stride_bj,
                                stride_mb, stride_mv, HAS_T, False, HAS_MASK, DTYPE, BLOCK)
    if HAS_BANNED:
        hit = i < 0  # False
        for j in range(n_banned):
            b = tl.load(banned_ptr + row * stride_bb + j * stride_bj).to(tl.int32)
            b = tl.where(b < 0, b + V, b)
            hit = hit | (b == i) | (b == nan_i)
        if hit:
            v, i, nan_i = _chunk_argmax(x_row, t, banned_ptr, mask_ptr, row, lo, hi, V, n_banned, stride_bb,
                                        stride_bj, stride_mb, stride_mv, HAS_T, True, HAS_MASK, DTYPE, BLOCK)
    if not SPLIT_ROWS:
        tl.store(out_ptr + row, tl.where(nan_i < V, nan_i, i).to(tl.int64))
    else:
        slot = row * SPLIT + part
        tl.store(ws_v_ptr + slot, v)
        tl.store(ws_i_ptr + 2 * slot, i)
        tl.store(ws_i_ptr + 2 * slot + 1, nan_i)
        tl.debug_barrier()  # the chunk's result is written before the count (release below)
        if tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            # The largest value, ties to the lowest token: the first chunk holding it, as chunks in order with
            # strictly greater winning (each chunk's token is its lowest); a row of -inf gives chunk 0's start,
            # token 0. As one max over (order-preserving key of the value, complement of the token) and one
            # min over the chunks' first NaNs, in one reduction; SPLIT_BLOCK chunks at a time, their loads in
            # flight together (one chunk per iteration made SPLIT dependent round trips to L2: 63 at B = 1).
            best = tl.full((), -(2**63), tl.int64)
            first_nan = tl.full((), 0, tl.int32) + V
            lanes = tl.arange(0, SPLIT_BLOCK)
            for s0 in range(0, SPLIT, SPLIT_BLOCK):
                at = row * SPLIT + s0 + lanes
                here = s0 + lanes < SPLIT
                vs = tl.load(ws_v_ptr + at, mask=here, other=-float("inf"), cache_modifier=".cg")
                is_ = tl.load(ws_i_ptr + 2 * at, mask=here, other=V, cache_modifier=".cg")
                nans = tl.load(ws_i_ptr + 2 * at + 1, mask=here, other=V, cache_modifier=".cg")
                bits = tl.where(vs == 0.0, 0.0, vs).to(tl.int32, bitcast=True)  # -0 ties +0, as compared
                key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # ordered as the floats (no NaN here)
                packed = (key.to(tl.int64) << 32) | (0xFFFFFFFF - is_.to(tl.int64))
                top, nan_s = tl.reduce((packed, nans), 0, _max_and_min)
                best = tl.maximum(best, top)
                first_nan = tl.minimum(first_nan, nan_s)
            best_i = (0xFFFFFFFF - (best & 0xFFFFFFFF)).to(tl.int32)
            tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")
            tl.store(out_ptr + row, tl.where(first_nan < V, first_nan, best_i).to(tl.int64))


def split_for(B: int, device: torch.device) -> int:
    """Programs per row by default: about two per SM over the batch (before the cap at one block each)."""
    return cdiv(2 * sm_count(device), max(B, 1))


def warps_for(B: int, device: torch.device) -> int:
    """Warps per program: 8 while rows are fewer than SMs (each program reads a few blocks of a split row),
    4 from there (whole rows, or halves, loop over many blocks). H200 sweeps at 2048-token blocks, default
    split: B = 1 / 8 / 32 4.86 / 5.72 / 11.41 us with 8 against 5.20 / 6.12 / 12.05 with 4
    (`greedy_mask_warps.csv`); B = 256 / 512 48.4 / 90.8 with 4 against 60.1 / 107.4 with 8
    (`greedy_mask_sweep.csv`). Neither spills on Triton 3.6 or 3.9."""
    return 8 if B < sm_count(device) else 4


def check_args(logits: torch.Tensor, temperature=None, banned: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> None:
    """ValueError / TypeError for arguments the op does not take (every path checks the same). Banned ids are
    not range-checked (that would read them back from the GPU on every call): ids outside [-V, V) ban nothing,
    where ``scatter`` would raise."""
    if logits.dim() != 2:
        raise ValueError(f"masked_argmax: logits must be [B, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in _TL:
        raise TypeError(f"masked_argmax: logits must be bf16/fp16/fp32, got {logits.dtype}")
    B, V = logits.shape
    if B > 0 and V == 0:
        raise ValueError("masked_argmax: an empty vocabulary (V == 0) has no argmax")
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point() or not (temperature.numel() == 1 or tuple(temperature.shape) == (B, 1)):
            raise ValueError(f"masked_argmax: temperature must be a float tensor of one value or [B, 1] = [{B}, 1], "
                             f"got {temperature.dtype} {tuple(temperature.shape)}")
        if quotient_dtype(logits, temperature) not in _TL:
            raise TypeError(f"masked_argmax: logits / temperature would be {quotient_dtype(logits, temperature)} "
                            f"({logits.dtype} logits, {temperature.dtype} temperature); the op rounds the quotient "
                            "to bf16 / fp16 / fp32")
    elif temperature is not None and not isinstance(temperature, (int, float)):
        raise TypeError(f"masked_argmax: temperature must be a number or a tensor, got {type(temperature).__name__}")
    if banned is not None:
        if banned.dtype not in (torch.int32, torch.int64) or banned.dim() not in (1, 2) or \
                (banned.dim() == 2 and banned.shape[0] not in (1, B)):
            raise ValueError(f"masked_argmax: banned must be int32 / int64 ids [n] or [B, n] (B = {B}), got "
                             f"{banned.dtype} {tuple(banned.shape)}")
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() not in (1, 2) or mask.shape[-1] != V or \
                (mask.dim() == 2 and mask.shape[0] not in (1, B)):
            raise ValueError(f"masked_argmax: mask must be bool [V] or [B, V] = [{B}, {V}], got {mask.dtype} "
                             f"{tuple(mask.shape)}")
    _check_devices(logits, temperature, banned, mask)


def quotient_dtype(logits: torch.Tensor, temperature) -> torch.dtype:
    """The dtype of eager's ``logits / temperature``, which the op's argmax reads (rounded to it): a
    temperature tensor of a wider float with a dimension promotes the logits (fp16 logits, fp32 T [B, 1]:
    fp32); a 0-d one or a number does not (torch's promotion)."""
    if temperature is None:
        return logits.dtype
    return torch.result_type(logits, temperature)


def _check_devices(logits, temperature, banned, mask) -> None:
    """Every tensor on the logits' device (a temperature may be one value on the CPU)."""
    for name, t in (("temperature", temperature), ("banned", banned), ("mask", mask)):
        if isinstance(t, torch.Tensor) and t.device != logits.device and not (name == "temperature" and t.numel() == 1
                                                                            and t.device.type == "cpu"):
            raise ValueError(f"masked_argmax: {name} is on {t.device}, logits on {logits.device}")


def masked_argmax_triton(logits: torch.Tensor, temperature=None, banned: torch.Tensor | None = None,
                         mask: torch.Tensor | None = None, block: int = 2048, split: int | None = None,
                         warps: int | None = None, record=None) -> torch.Tensor:
    """One token per row of ``logits [B, V]``; ``temperature``: None, a number, or a tensor with one
    value (0-d / [1]) or one per row ([B, 1]), divided as eager divides on the logits' device: the quotient
    rounded to eager's dtype (``quotient_dtype``), and on CUDA a tensor T of another dtype first cast to it (a
    CPU 0-d T is a number, as eager reads a CPU scalar); ``banned``: int ids ``[B, n]``, or ``[1, n]`` / ``[n]``
    (every row); ``mask``: bool ``[B, V]`` or ``[V]``, True = banned. split: programs per row (default: enough
    for about two per SM); warps: of each program (default: see warps_for). record: called with a
    ``layout_replay.LayoutReplay`` of the launch where it can replay (the op's)."""
    check_args(logits, temperature, banned, mask)
    given = (logits, temperature, banned, mask)
    quotient = quotient_dtype(logits, temperature)  # (before a CPU temperature becomes a number)
    if isinstance(temperature, torch.Tensor) and temperature.device != logits.device:
        temperature = float(temperature.item())  # one value on the CPU (check_args): a kernel argument
        record = None  # (a value read from a tensor: a replay would keep this call's)
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    t_tensor = isinstance(temperature, torch.Tensor)
    t = temperature.reshape(-1) if t_tensor else logits
    stride_t = 0 if not t_tensor or t.numel() == 1 else t.stride(0)  # (a column of a wider tensor: not 1)
    if banned is not None:
        b2 = banned if banned.dim() == 2 else banned.reshape(1, -1)
        sbb, sbj, n_banned = (b2.stride(0) if b2.shape[0] > 1 else 0), b2.stride(1), b2.shape[1]
    else:
        b2, sbb, sbj, n_banned = logits, 0, 0, 0
    if mask is not None:
        m2 = (mask if mask.dim() == 2 else mask.reshape(1, -1)).view(torch.uint8)
        smb, smv = (m2.stride(0) if m2.shape[0] > 1 else 0), m2.stride(1)
    else:
        m2, smb, smv = logits, 0, 0
    block = min(block, next_power_of_2(V))
    blocks = cdiv(V, block)
    if split is None:
        most = split_for(1, logits.device)  # the most programs a row gets by default (batch 1)
        split = split_for(B, logits.device)
    else:
        most = split
    split = max(1, min(split, blocks))
    # chunks the combine reads at once: a bound that does not depend on the batch (no compile per B)
    split_block = min(next_power_of_2(max(1, min(most, blocks))), 1024)
    chunk = cdiv(blocks, split) * block
    split = cdiv(V, chunk)  # no empty chunk
    if split > 1:
        ws_v = torch.empty(B * split, dtype=torch.float32, device=logits.device)
        ws_i = torch.empty(2 * B * split, dtype=torch.int32, device=logits.device)
        cnt = split_counters(logits.device, B)
    else:
        ws_v = ws_i = cnt = out
    launch = replay.launch(masked_argmax_kernel, (B, split), (
        logits, t, float(temperature) if temperature is not None and not t_tensor else 1.0, b2, m2, out,
        ws_v, ws_i, cnt, V, chunk, split, n_banned, logits.stride(0), stride_t, sbb, sbj, smb, smv),
        dict(HAS_T=temperature is not None, T_TENSOR=t_tensor, HAS_BANNED=banned is not None,
             HAS_MASK=mask is not None, DTYPE=_TL[quotient], BLOCK=block,
             ROUND_T=t_tensor and temperature.dtype != quotient and logits.is_cuda, SPLIT_ROWS=split > 1,
             SPLIT_BLOCK=split_block, num_warps=warps or warps_for(B, logits.device)), record is not None)
    # slots: each input's own address, or the output where an input is absent (as above)
    sources = {"x_ptr": 0, "t_ptr": 1 if t_tensor else 0, "banned_ptr": 2 if banned is not None else 0,
               "mask_ptr": 3 if mask is not None else 0, **output_slots(split > 1, ("ws_v_ptr", "ws_i_ptr"))}
    record_if_direct(record, [(launch, sources)], given, (out, ws_v, ws_i) if split > 1 else (out,))
    return out


def masked_argmax_reference(logits: torch.Tensor, temperature=None, banned: torch.Tensor | None = None,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """The original graph in plain PyTorch: scatter -inf onto a copy of ``logits / T``, then argmax."""
    x = logits.clone() if temperature is None else logits / temperature
    if banned is not None:
        ids = (banned if banned.dim() == 2 else banned.reshape(1, -1)).expand(x.shape[0], -1)  # [1, n]: every row
        ids = torch.where(ids < 0, ids + x.shape[-1], ids)
        x = x.scatter(-1, ids.long(), float("-inf"))
    if mask is not None:
        x = x.masked_fill(mask, float("-inf"))
    return x.argmax(dim=-1)


# ----------------------------------------------------------------------------- custom op

torch.library.define(
    "fusekern::masked_argmax",
    "(Tensor logits, Tensor? temperature, float temperature_scalar, Tensor? banned, Tensor? mask) -> Tensor",
)


def _temperature(temperature, temperature_scalar):
    if temperature is not None:
        return temperature
    return None if temperature_scalar == 1.0 else temperature_scalar


_REPLAYS: dict = {}  # the call's layouts (layout_replay.call_key) -> the kernel launch to replay


def _masked_argmax_cuda(logits, temperature, temperature_scalar, banned, mask):
    """Calls after the first with the same layouts replay its launch (``layout_replay``)."""
    tensors = (logits, temperature, banned, mask)
    key = call_key(tensors, temperature_scalar)
    rep = _REPLAYS.get(key)
    if rep is not None:
        return rep(tensors, key[-1])
    return masked_argmax_triton(logits, _temperature(temperature, temperature_scalar), banned, mask,
                                record=recorder(_REPLAYS, key))


torch.library.impl("fusekern::masked_argmax", "CUDA")(_masked_argmax_cuda)  # (kept callable: tests, direct_calls)
direct_calls.register(torch.ops.fusekern.masked_argmax.default, _masked_argmax_cuda)


@torch.library.impl("fusekern::masked_argmax", "CPU")
def _masked_argmax_cpu(logits, temperature, temperature_scalar, banned, mask):
    check_args(logits, temperature, banned, mask)
    return masked_argmax_reference(logits, _temperature(temperature, temperature_scalar), banned, mask)


@torch.library.register_fake("fusekern::masked_argmax")
def _masked_argmax_fake(logits, temperature, temperature_scalar, banned, mask):
    if logits.dim() != 2:
        raise ValueError(f"masked_argmax: logits must be [B, V], got shape {tuple(logits.shape)}")
    _check_devices(logits, temperature, banned, mask)  # (a call mixing devices with meta dispatches here)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


masked_argmax = torch.ops.fusekern.masked_argmax


def aot_builds():
    """bf16 logits at V = 128256: with a per-row temperature and banned ids, and with a bool mask."""
    from fusekern.kernels.catalog import TritonBuild

    V = 128256
    base = dict(x_ptr="*bf16", t_ptr="*bf16", t_scalar=1.0, banned_ptr="*i64", mask_ptr="*u8", out_ptr="*i64",
                ws_v_ptr="*fp32", ws_i_ptr="*i32", cnt_ptr="*i32", V=V, CHUNK=4096, SPLIT=32, n_banned=8, stride_x=V,
                stride_t=1, stride_bb=8, stride_bj=1, stride_mb=V, stride_mv=1)
    out = []
    for label, flags in (("T tensor + banned ids", dict(HAS_T=True, T_TENSOR=True, HAS_BANNED=True, HAS_MASK=False)),
                         ("T scalar + bool mask", dict(HAS_T=True, T_TENSOR=False, HAS_BANNED=False, HAS_MASK=True))):
        for warps in (8, 4):  # small batches, large ones (warps_for)
            out.append(TritonBuild("masked_argmax", f"bf16 V={V} BLOCK=2048 rows split {label} {warps} warps",
                                   masked_argmax_kernel, base,
                                   dict(flags, DTYPE=tl.bfloat16, BLOCK=2048, SPLIT_ROWS=True, SPLIT_BLOCK=64), warps, 3))
    return out
