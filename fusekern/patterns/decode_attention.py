"""Decode attention over a 16-bit KV cache: SDPA with a few query rows per KV head, masked or not.

The attention of a quantized model's decode step reads a bf16 / fp16 cache. Inductor hands SDPA to the
library kernels (cuDNN, flash, efficient), which give each (batch, head) one program padded to a
64- or 128-row query tile; with one query row per head that leaves most SMs idle (the demo's layer: ~8 us
for 1 MB of K / V on the H200), and a bool mask first becomes a bias tensor in a kernel of its own.

This rewrite reads the SDPA ops the same way ``fp8_kv_attention`` does (after it: an fp8 cache is that
rewrite's) and replaces those whose K and V (through a GQA expansion) are in q's 16-bit dtype, whose
query rows per KV head ((Hq / Hkv) * Lq) fit one program, with no dropout, not causal and a constant
scale, with one ``fusekern::decode_attention`` call (split-KV, one launch). The mask is passed as the
graph has it: a bool ``attn_mask``, or the bias inductor makes of one (``where(mask, 0, c)``: c = -inf on
the CPU, the dtype's finite minimum on CUDA), read by the kernel where it lies. (Walking that bias back to
the bool saved its small kernel, ~0.4 us at the demo's B = 1 on the H200, but then the op's SDPA path had
to rebuild it: at B = 16, where PyTorch's SDPA is the faster, that cost more than the graph it replaced.)
Prefill (many query rows) keeps the library kernel, and on CUDA the op runs PyTorch's SDPA for shapes where
that measured faster, so the rewrite costs no more than the graph's own SDPA plus the op's dispatch.
"""
from __future__ import annotations

import math

import torch
from torch.fx import Graph, Node

from fusekern.kernels import decode_attention as kernel
from fusekern.kernels import device_info
from fusekern.kernels.fp8_kv_attention import MAX_ROWS
from fusekern.patterns.registry import register_rewrite
from fusekern.patterns.scale_folding import Decline, _Emitter, _erase_dead, _is, _known, _val
from fusekern.patterns.scale_folding_attention import SDPA_OPS, decode_sdpa

NAME = "decode_attention"


def _check_mask(mask, shape: list) -> None:
    """Decline a mask the kernel cannot read (a bool or float tensor broadcastable to ``shape``)."""
    if mask is None:
        return
    mv = _val(mask)
    if mv is None:
        raise Decline("a mask that is not a tensor")
    if mv.dtype != torch.bool and not mv.dtype.is_floating_point:
        raise Decline(f"a {mv.dtype} mask")
    if mv.dim() > 4 or not all(_known(m == 1) or _known(m == w) for m, w in zip(reversed(mv.shape),
                                                                                 reversed(shape))):
        raise Decline(f"a mask of shape {tuple(mv.shape)} that does not broadcast to {tuple(shape)}")


def plan_and_replace(graph: Graph, n: Node) -> str:
    args, q, qv, scale, out, k_x, v_x, _, gqa = decode_sdpa(n)
    mask = args.get("attn_mask", args.get("attn_bias"))
    B, Hq, Lq, _ = qv.shape
    kv, vv = _val(k_x), _val(v_x)
    if kv is None or vv is None or kv.dtype != qv.dtype or vv.dtype != qv.dtype:
        raise Decline(f"K / V are not in q's dtype {qv.dtype} ({None if kv is None else kv.dtype}, "
                      f"{None if vv is None else vv.dtype})")
    if not isinstance(Hq, int) or not isinstance(Lq, int) or not isinstance(kv.shape[1], int):
        raise Decline("symbolic head counts or query length")
    if (Hq // kv.shape[1]) * Lq > MAX_ROWS:
        raise Decline(f"{(Hq // kv.shape[1]) * Lq} query rows per KV head: prefill, not decode "
                      f"(the kernel holds at most {MAX_ROWS})")
    tensors = [q, k_x, v_x] + ([mask] if isinstance(mask, Node) else [])
    devices = {_val(t).device for t in tensors if _val(t) is not None}
    if len(devices) != 1 or qv.device.type not in ("cpu", "cuda"):
        raise Decline(f"q, K / V and mask on {sorted(map(str, devices))}")
    if (reason := device_info.unsupported(qv.device)) is not None:
        raise Decline(reason)
    if _val(out).dtype != qv.dtype:
        raise Decline(f"the attention output is {_val(out).dtype}, q is {qv.dtype}")
    _check_mask(mask, [B, Hq, Lq, kv.shape[2]])  # (symbolic sizes compared without guards, before the kernel's check)
    with qv.fake_mode:
        try:
            kernel._check_inputs(qv, kv, vv, _val(mask) if isinstance(mask, Node) else None)
        except ValueError as e:
            raise Decline(str(e).removeprefix("decode_attention: ")) from None
    emit = _Emitter(graph, out, qv.fake_mode, [q, k_x, v_x])
    fused = emit(kernel.decode_attention_op.default, q, k_x, v_x, mask, scale, -math.inf)
    out.replace_all_uses_with(fused)
    _erase_dead(graph, [out, n, *gqa])
    parts = [f"{qv.dtype} K/V".replace("torch.", "")]
    if Hq != kv.shape[1]:
        parts.append(f"GQA {Hq // kv.shape[1]}")
    if mask is not None:
        parts.append("bool mask" if _val(mask).dtype == torch.bool else "additive bias")
    return ", ".join(parts)


def rewrite_decode_attention(graph: Graph) -> int:
    from fusekern.compiler_pass.report import record_note, record_rejection

    fired = 0
    for n in [n for n in graph.nodes if _is(n, *SDPA_OPS)]:
        try:
            note = plan_and_replace(graph, n)
        except Decline as why:
            record_rejection(NAME, n, str(why))
            continue
        record_note(NAME, n.name, note)
        fired += 1
    return fired


register_rewrite(
    NAME, rewrite_decode_attention, family="scale_folding", stage="post_grad", kernel_version=kernel.KERNEL_VERSION,
    description="SDPA at decode (Hq / Hkv * Lq <= 64 query rows per KV head) over a 16-bit KV cache, GQA, a "
                "bool mask or additive bias: split-KV decode attention, the bool mask read as it is",
)
