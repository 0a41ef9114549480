"""Weight decodes as users write them: every format issue 3 names, and variants of the same format.

Each ``Case`` has a function ``fn(x, *weights)`` in plain PyTorch (dequantize, then ``F.linear`` or
``@``), a ``make(K, N, G, device)`` that draws fresh random packed weights, and the format the
recognizer must report. Tests, the GPU checks and the benchmark all use this one list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
AWQ_SHIFTS = [0, 16, 4, 20, 8, 24, 12, 28]  # AWQ stores nibble j of a word at AWQ_ORDER[j]


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    make: Callable  # (K, N, G, device) -> tuple of weight tensors
    format: str     # what formats.recognize must say
    group: int = 128  # the G the case uses (K must be a multiple of it)
    fires: bool = True  # False: analysed exactly, but the rewrite declines it (measured slower than stock)


def _u8(*shape, device):
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)


def _i32(*shape, device):
    return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device)


def _scale(*shape, device, dtype=torch.bfloat16):
    return (torch.rand(shape, device=device) * 0.02 + 0.005).to(dtype)


# ----------------------------------------------------------------------------- int8

def int8_channel(x, w, s):
    return F.linear(x, (w.to(torch.float32) * s.unsqueeze(1)).to(x.dtype))


def int8_group(x, w, s):
    N, K = w.shape
    g = K // s.shape[1]
    return F.linear(x, (w.view(N, -1, g).to(x.dtype) * s[:, :, None]).view(N, K))


def int8_group_asym(x, w, s, z):
    N, K = w.shape
    g = K // s.shape[1]
    q = w.reshape(N, K // g, g).to(torch.int16) - z.to(torch.int16)[..., None]
    return F.linear(x, (q.to(x.dtype) * s[..., None]).reshape(N, K))


# ----------------------------------------------------------------------------- int4, two per uint8

def int4_k_stack(x, wp, s, z):
    """uint8 [N, K/2], low nibble = even k; scales / zeros [N, K/G] (one of five spellings)."""
    N = wp.shape[0]
    g = wp.shape[1] * 2 // s.shape[1]
    w = torch.stack([wp & 0xF, wp >> 4], dim=-1).view(N, -1)
    return F.linear(x, (w.to(x.dtype) - z.repeat_interleave(g, dim=1)) * s.repeat_interleave(g, dim=1))


def int4_k_cat(x, wp, s, z):
    """The same weight: cat + reshape, cast after the subtraction, broadcasting over groups."""
    N = wp.shape[0]
    g = wp.shape[1] * 2 // s.shape[1]
    w = torch.cat([(wp & 0xF).unsqueeze(-1), (wp >> 4).unsqueeze(-1)], -1).reshape(N, -1, g)
    w = (w.to(torch.float32) - z.float()[:, :, None]).to(x.dtype) * s[:, :, None]
    return F.linear(x, w.reshape(N, -1))


def int4_k_shift_tensor(x, wp, s, z):
    """The same weight: shifts by a tensor, ``x @ w.t()``, unsqueeze instead of [:, :, None]."""
    N = wp.shape[0]
    g = wp.shape[1] * 2 // s.shape[1]
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=wp.device)
    w = (wp.unsqueeze(-1) >> shifts) & 15
    w = w.reshape(N, -1, g).to(x.dtype)
    w = (w - z.unsqueeze(-1)) * s.unsqueeze(-1)
    return x @ w.reshape(N, -1).t()


def int4_k_arange(x, wp, s, z):
    """The same weight: shifts from arange, float32 math, one cast at the end."""
    N = wp.shape[0]
    g = wp.shape[1] * 2 // s.shape[1]
    shifts = torch.arange(0, 8, 4, device=wp.device, dtype=torch.int32)
    w = (wp.to(torch.int32)[:, :, None] >> shifts[None, None, :]) & 0xF
    w = w.view(N, -1, g).float()
    w = (w - z.float().unsqueeze(2)) * s.float().unsqueeze(2)
    return torch.matmul(x, w.view(N, -1).to(x.dtype).T)


def int4_k_sym(x, wp, s):
    """Symmetric: codes minus 8, cast before the subtraction, per-group scales."""
    N = wp.shape[0]
    g = wp.shape[1] * 2 // s.shape[1]
    w = torch.stack([wp & 0xF, wp >> 4], dim=-1).reshape(N, -1, g).to(x.dtype) - 8
    return F.linear(x, (w * s[..., None]).reshape(N, -1))


def int4_n(x, wp, s):
    """uint8 [N/2, K], two output channels per byte (high nibble = odd n), symmetric, [K/G, N] scales."""
    K = wp.shape[1]
    g = K // s.shape[0]
    w = torch.stack([wp & 0xF, wp >> 4], dim=1).reshape(-1, K).to(x.dtype) - 8  # [N, K]
    return F.linear(x, w * s.t().repeat_interleave(g, dim=1))


# ----------------------------------------------------------------------------- GPTQ / AWQ / HQQ

def gptq(x, qweight, qzeros, scales):
    """GPTQ: qweight int32 [K/8, N] (8 along K), qzeros int32 [K/G, N/8] (8 along N), scales [K/G, N]."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    g = K // scales.shape[0]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    w = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(K, N)
    z = ((qzeros[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(-1, N)
    w = (w - z.repeat_interleave(g, dim=0)).to(x.dtype) * scales.repeat_interleave(g, dim=0)
    return x @ w


def gptq_g_idx(x, qweight, qzeros, scales, g_idx):
    """GPTQ as GPTQModel's / AutoGPTQ's torch path writes it: every k's group read from ``g_idx`` [K] (int32),
    ``scales[g_idx] * (w - zeros[g_idx])``. With act-order (desc_act) checkpoints g_idx is a permutation of the
    groups; without, it is k // G, and the code is the same."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 8), shifts.unsqueeze(0))
    zeros = torch.bitwise_and(zeros.to(torch.int16), 15).reshape(scales.shape)
    w = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 8, -1), shifts.unsqueeze(-1))
    w = torch.bitwise_and(w.to(torch.int16), 15).reshape(K, N)
    weights = scales[g_idx.long()] * (w - zeros[g_idx.long()])
    return torch.matmul(x, weights.to(x.dtype))


def gptq_model(x, qweight, qzeros, scales, g_idx, wf_zero, wf_neg):
    """GPTQModel's TorchQuantLinear: as gptq_g_idx, with the shift table held by the module (``wf``, two views
    made once: [1, 8] for the zeros, [8, 1] for the weight), so the graph passes it like a weight."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 8), wf_zero).to(torch.int16)
    zeros = torch.bitwise_and(zeros, 15).reshape(scales.shape)
    w = torch.bitwise_and(torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 8, -1), wf_neg)
                          .to(torch.int16), 15).reshape(K, N)
    return torch.matmul(x, (scales[g_idx.long()] * (w - zeros[g_idx.long()])).to(x.dtype))


def _wf(device):
    wf = torch.arange(0, 32, 4, dtype=torch.int32, device=device)
    return wf.unsqueeze(0).clone(), wf.unsqueeze(-1).clone()


def _act_order(K, G, device):
    """GPTQ act-order's g_idx: the group of every k, in a random order of k (each group G of them)."""
    return (torch.randperm(K) // G).to(torch.int32).to(device)


def awq(x, qweight, qzeros, scales):
    """AWQ: qweight int32 [K, N/8] (8 along N, interleaved), qzeros [K/G, N/8], scales [K/G, N]."""
    K = qweight.shape[0]
    g = K // scales.shape[0]
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int32, device=qweight.device)
    w = ((qweight[:, :, None] >> shifts) & 15).reshape(K, -1)
    z = ((qzeros[:, :, None] >> shifts) & 15).reshape(qzeros.shape[0], -1)
    w = (w - torch.repeat_interleave(z, g, dim=0)).to(x.dtype) * torch.repeat_interleave(scales, g, dim=0)
    return torch.matmul(x, w)


AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ's reorder: column j of 8 is field AWQ_REVERSE_ORDER[j]


def awq_reorder(x, qweight, qzeros, scales):
    """AWQ as AutoAWQ's torch fallback (``dequantize_gemm``) writes it: unpack the eight fields of each word in
    bit order, then put the columns back in order by indexing with a reorder tensor built from arange."""
    K, G = qweight.shape[0], scales.shape[0]
    shifts = torch.arange(0, 32, 4, device=qweight.device)
    w = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    w = w.view(w.shape[0], -1)
    z = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    z = z.view(z.shape[0], -1)
    order = torch.arange(w.shape[-1], dtype=torch.int32, device=qweight.device).view(-1, 8)
    order = order[:, AWQ_REVERSE_ORDER].view(-1)
    w, z = w[:, order] & 15, z[:, order] & 15
    w = (w - z.repeat_interleave(K // G, dim=0)) * scales.repeat_interleave(K // G, dim=0)
    return torch.matmul(x, w.to(x.dtype))


def hqq(x, wq, scale, zero):
    """HQQ-style: uint8 codes [N, K] (4-bit values), float zero and scale per group: (w_q - z) * s."""
    N, K = wq.shape
    g = K // scale.shape[1]
    w = (wq.view(N, -1, g).to(x.dtype) - zero[..., None]) * scale[..., None]
    return F.linear(x, w.view(N, K))


# ----------------------------------------------------------------------------- FP8 weight-only

def fp8_tensor(x, w8, s):
    return F.linear(x, w8.to(x.dtype) * s)


def fp8_channel(x, w8, s):
    return F.linear(x, (w8.float() * s[:, None]).to(x.dtype))


def fp8_block(x, w8, s):
    """128 x 128 blocks: s [N/128, K/128]."""
    N, K = w8.shape
    w = w8.float().view(N // 128, 128, K // 128, 128) * s[:, None, :, None]
    return F.linear(x, w.view(N, K).to(x.dtype))


# ----------------------------------------------------------------------------- FP4 E2M1

def mxfp4(x, codes, e8m0):
    """MXFP4: codes uint8 [N, K/2] (low nibble first), E8M0 scales as uint8 [N, K/32]."""
    N = codes.shape[0]
    table = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)
    w = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], -1).view(N, -1, 32)
    scale = torch.exp2(e8m0.to(torch.float32) - 127)
    return F.linear(x, (w * scale[..., None]).view(N, -1).to(x.dtype))


def nvfp4(x, codes, s_block, s_global):
    """NVFP4: codes uint8 [N, K/2], E4M3 scales [N, K/16], an fp32 global scale (shape [1])."""
    N = codes.shape[0]
    table = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)
    lo, hi = table[(codes & 0xF).int()], table[(codes >> 4).int()]
    w = torch.cat([lo[..., None], hi[..., None]], dim=-1).reshape(N, -1, 16)
    w = w * s_block.to(torch.float32)[..., None] * s_global
    return F.linear(x, w.reshape(N, -1).to(x.dtype))


# ----------------------------------------------------------------------------- no known format

def sign_magnitude_ldexp(x, mant, e):
    """Sign-magnitude int8 mantissas over 8, times 2**e per output channel (ldexp): a format nobody
    registered; it still fuses, through the generated kernel."""
    m = torch.where(mant < 0, -(mant.abs().to(torch.float32)), mant.to(torch.float32)) / 8
    return F.linear(x, torch.ldexp(m, e.to(torch.int32)[:, None]).to(x.dtype))


def _e8m0(*shape, device):
    return torch.randint(118, 124, shape, dtype=torch.uint8, device=device)


def _fp8(*shape, device):
    return (torch.randn(shape, device=device) * 2).to(torch.float8_e4m3fn)


CASES = [
    Case("int8_channel", int8_channel,
         lambda K, N, G, device: (torch.randint(-128, 128, (N, K), dtype=torch.int8, device=device),
                                  _scale(N, device=device, dtype=torch.float32)), "int8"),
    Case("int8_group", int8_group,
         lambda K, N, G, device: (torch.randint(-128, 128, (N, K), dtype=torch.int8, device=device),
                                  _scale(N, K // G, device=device)), "int8"),
    Case("int8_group_asym", int8_group_asym,
         lambda K, N, G, device: (torch.randint(-128, 128, (N, K), dtype=torch.int8, device=device),
                                  _scale(N, K // G, device=device),
                                  torch.randint(-8, 8, (N, K // G), dtype=torch.int8, device=device)), "int8"),
    Case("int4_k_stack", int4_k_stack,
         lambda K, N, G, device: (_u8(N, K // 2, device=device), _scale(N, K // G, device=device),
                                  torch.randint(0, 16, (N, K // G), dtype=torch.uint8, device=device)), "int4"),
    Case("int4_k_cat", int4_k_cat,
         lambda K, N, G, device: (_u8(N, K // 2, device=device), _scale(N, K // G, device=device),
                                  torch.randint(0, 16, (N, K // G), dtype=torch.uint8, device=device)), "int4"),
    Case("int4_k_shift_tensor", int4_k_shift_tensor,
         lambda K, N, G, device: (_u8(N, K // 2, device=device), _scale(N, K // G, device=device),
                                  torch.randint(0, 16, (N, K // G), dtype=torch.uint8, device=device)), "int4"),
    Case("int4_k_arange", int4_k_arange,
         lambda K, N, G, device: (_u8(N, K // 2, device=device), _scale(N, K // G, device=device),
                                  torch.randint(0, 16, (N, K // G), dtype=torch.uint8, device=device)), "int4"),
    Case("int4_k_sym", int4_k_sym,
         lambda K, N, G, device: (_u8(N, K // 2, device=device), _scale(N, K // G, device=device)), "int4"),
    Case("int4_n", int4_n,
         lambda K, N, G, device: (_u8(N // 2, K, device=device), _scale(K // G, N, device=device)), "int4"),
    Case("gptq", gptq,
         lambda K, N, G, device: (_i32(K // 8, N, device=device), _i32(K // G, N // 8, device=device),
                                  _scale(K // G, N, device=device)), "gptq"),
    Case("gptq_act_order", gptq_g_idx,
         lambda K, N, G, device: (_i32(K // 8, N, device=device), _i32(K // G, N // 8, device=device),
                                  _scale(K // G, N, device=device), _act_order(K, G, device)),
         "generic", fires=False),
    Case("gptq_g_idx_sorted", gptq_g_idx,
         lambda K, N, G, device: (_i32(K // 8, N, device=device), _i32(K // G, N // 8, device=device),
                                  _scale(K // G, N, device=device),
                                  (torch.arange(K, device=device) // G).to(torch.int32)), "generic"),
    Case("gptq_model", gptq_model,
         lambda K, N, G, device: (_i32(K // 8, N, device=device), _i32(K // G, N // 8, device=device),
                                  _scale(K // G, N, device=device),
                                  (torch.arange(K, device=device) // G).to(torch.int32), *_wf(device)), "generic"),
    Case("awq", awq,
         lambda K, N, G, device: (_i32(K, N // 8, device=device), _i32(K // G, N // 8, device=device),
                                  _scale(K // G, N, device=device)), "awq"),
    Case("awq_reorder", awq_reorder,
         lambda K, N, G, device: (_i32(K, N // 8, device=device), _i32(K // G, N // 8, device=device),
                                  _scale(K // G, N, device=device)), "awq"),
    Case("hqq", hqq,
         lambda K, N, G, device: (torch.randint(0, 16, (N, K), dtype=torch.uint8, device=device),
                                  _scale(N, K // G, device=device),
                                  (torch.rand(N, K // G, device=device) * 15).to(torch.bfloat16)), "hqq"),
    Case("fp8_tensor", fp8_tensor,
         lambda K, N, G, device: (_fp8(N, K, device=device), _scale(device=device)), "fp8"),
    Case("fp8_channel", fp8_channel,
         lambda K, N, G, device: (_fp8(N, K, device=device), _scale(N, device=device, dtype=torch.float32)), "fp8"),
    Case("fp8_block", fp8_block,
         lambda K, N, G, device: (_fp8(N, K, device=device), _scale(N // 128, K // 128, device=device,
                                                                      dtype=torch.float32)), "fp8"),
    Case("mxfp4", mxfp4,
         lambda K, N, G, device: (_u8(N, K // 2, device=device), _e8m0(N, K // 32, device=device)), "mxfp4", 32),
    Case("nvfp4", nvfp4,
         lambda K, N, G, device: (_u8(N, K // 2, device=device),
                                  (torch.rand(N, K // 16, device=device) + 0.5).to(torch.float8_e4m3fn),
                                  torch.tensor([0.01], device=device)), "nvfp4", 16),
    Case("sign_magnitude_ldexp", sign_magnitude_ldexp,
         lambda K, N, G, device: (torch.randint(-8, 8, (N, K), dtype=torch.int8, device=device),
                                  torch.randint(-4, 4, (N,), dtype=torch.int8, device=device)), "generic"),
]

BY_NAME = {c.name: c for c in CASES}
