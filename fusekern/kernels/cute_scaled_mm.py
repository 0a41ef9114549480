"""Scaled GEMM for Hopper (sm_90a) in the CuTe DSL, with a composable epilogue.

    out[m, n] = cast( (sum_k a[m, k] * b[n, k]) * row[m] * col[n] + bias[n] + residual[m, n] )

a [M, K] and b [N, K] are both K-major (row-major), fp8 e4m3 / bf16 / fp16; fp32 accumulation and fp32
epilogue math; every epilogue input is optional.

Design
------
* Warp specialization. One producer warpgroup (only its first warp works) issues TMA loads of A and B
  tiles into an ``ab_stage``-deep shared-memory ring guarded by mbarriers (``PipelineTmaAsync``);
  ``tile_m / 64`` consumer warpgroups (1 or 2) run WGMMA on the ring and then the epilogue. The producer
  gives its registers away (``setmaxnreg``) so the consumers can hold a 128x256 fp32 accumulator.
* Persistent tiles. The grid is ``min(#tiles, #SMs)`` CTAs (the SM count is a runtime argument, so one
  build serves any Hopper part); each CTA walks output tiles with ``StaticPersistentTileScheduler``.
* Runtime shapes. The compiled kernel takes raw pointers, M, N, K and the row strides as runtime
  values and builds its tensors itself, so a new batch size never recompiles. TMA zero-fills
  out-of-bounds loads (M, N and K tails) and clips out-of-bounds stores (the output goes through a
  TMA store); epilogue loads clamp their indices so they never leave the tensors.
* Composable epilogue. After the main loop the accumulator is walked in slices (one TMA-store
  sub-tile each). Each piece (row scale, col scale, bias, residual) is a small function applied per
  element of a slice and enabled by a compile-time flag: whether that tensor was ``None`` when the
  kernel was compiled. There is one kernel body; a combination of flags is one specialization.
* Rematerialization. The epilogue re-derives its tile's coordinates from the scheduler (block index
  and tiles done) instead of keeping the origin of the tile live across the K loop.
* Compile once. ``cute.compile`` runs once per specialization (``KernelConfig``) and the result is
  kept in ``_COMPILED``; calls never re-trace. A call writes its pointers and integers straight into
  the compiled function's argument slots (``_Marshal``; the DSL's own per-call conversion of 22
  arguments cost ~57 µs of host time). ``aot_compile_sm90a`` builds the same specializations for sm_90a on a machine without a
  GPU and reads their registers and spills.
* DeepSeek-style 128x128 block scales (fp8 only), a compile-time flag of the same kernel
  (``KernelConfig.block_scaled``):

      out[m, n] = cast( sum_kb a_block[m, kb] * b_block[n // 128, kb] * (a[m, kb] . b[n, kb]) * row[m]
                        * col[n] + bias[n] + residual[m, n] )

  a_block is fp32 [M, ceil(K/128)] or [1, ceil(K/128)] (one row, broadcast over M; an expanded row of
  stride 0 is passed as one row), b_block fp32 [ceil(N/128), ceil(K/128)] (an expanded one likewise,
  both row indices are clamped to the last row); both take any row stride (0 included)
  and need a unit K-block stride (a one-column matrix may have any). The K tile is 128, one scale
  block, and the WGMMAs are at most 128 columns wide, so b_block is one scalar per WGMMA and K block.
  "Promotion": each K tile's WGMMAs write a fresh fp32 fragment (ACCUMULATE off on its first K step),
  which is folded into the main accumulator with one FMA per register, scaled by a_block of the
  register's row times the b_block scalar. Two tiles:
  - 128x128 (64x128 for M <= 64): two fragments alternate, so the next K tile's WGMMAs are in flight
    while one is folded (``wait_group(1)``); the accumulator and two 64x128 fragments are 192 registers
    per consumer thread. Each tile's scales are loaded (a few KiB, L2-resident) one tile ahead.
  - 128x256 (where its waves take less time, ``block_scaled_heuristics``): the accumulator of a 64x256 slab is 128
    registers, and the WGMMAs are 64 wide: a K block's four 64-column quarters go into two 32-register
    fragments in turn, and one quarter is folded while the next one's WGMMAs run. Half the A bytes per FLOP
    of 128x128: on an H100 at M = 4096, N = K = 7168, 1073-1078 TFLOP/s against 942-944 for 128x128 in a
    CUDA graph (``benchmarks/proto/block_scaled_rescale_probe.py``,
    ``benchmarks/results/h100/block_scaled_quarters_probe_6852fd7.csv``). Its K loop runs in passes of
    straight-line code with no WGMMA in flight between them (``_mainloop_block_scaled_quarters``).
  M-tail rows and a one-row a_block both come from clamping the a_block row index to its last row, an
  N tail's b_block row likewise. The last K block may be partial: TMA zero-fills it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import math
import os
import re
import struct
import subprocess
import threading
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor

try:  # the CuTe DSL is optional: without it `supports` gives the reason and nothing compiles
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.memory
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    _CUTLASS_ERROR: Optional[str] = None
except Exception as exc:  # noqa: BLE001 - any import failure means "kernel unavailable"
    _CUTLASS_ERROR = f"CUTLASS DSL not importable ({type(exc).__name__}: {exc})"


# --------------------------------------------------------------------------------------------------
# Specializations
# --------------------------------------------------------------------------------------------------

_AB_DTYPES = {torch.float8_e4m3fn: "f8e4m3", torch.bfloat16: "bf16", torch.float16: "f16"}
_OUT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_BIAS_DTYPES = _OUT_DTYPES
_TILES = ((64, 64), (64, 128), (128, 128), (128, 256))
_BLOCK_TILES = ((64, 128), (128, 128), (128, 256))  # block-scaled: WGMMAs of at most 128 columns (``_atom_n``)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Everything that selects one compiled kernel (the cache key)."""

    ab: str  # "f8e4m3" | "bf16" | "f16"
    out: str  # "bf16" | "f16" | "f32"
    tile_m: int  # 64 (one consumer warpgroup) or 128 (two)
    tile_n: int  # 64, 128 or 256
    has_row: bool = False
    has_col: bool = False
    bias: Optional[str] = None  # bias dtype, None when there is no bias
    has_residual: bool = False
    # DeepSeek-style 128x128 block scales (a_block / b_block): fp8 only, a tile of _BLOCK_TILES, K tile 128.
    block_scaled: bool = False

    @property
    def name(self) -> str:
        parts = [f"{self.ab}_{self.out}_{self.tile_m}x{self.tile_n}"]
        parts += [flag for flag, on in (("row", self.has_row), ("col", self.has_col)) if on]
        if self.bias:
            parts.append(f"bias{self.bias}")
        if self.has_residual:
            parts.append("res")
        if self.block_scaled:
            parts.append("block128")
        return "_".join(parts)


def heuristics(m: int, n: int, num_sms: int = 132) -> tuple[int, int]:
    """(tile_m, tile_n) for an M x N output.

    Hopper's WGMMA has no M below 64, so a small batch takes a 64-row tile (one consumer warpgroup);
    when the N tiles alone cannot fill the SMs, a narrower N tile makes more CTAs. Large problems take
    128x256 (two consumer warpgroups, 128 accumulator registers each) when that still gives every SM
    a tile, else 128x128.
    """
    if m <= 64:
        return (64, 64) if math.ceil(n / 128) < num_sms else (64, 128)
    if math.ceil(m / 128) * math.ceil(n / 256) >= num_sms:
        return 128, 256
    return 128, 128


# What a 128x256 block-scaled tile costs against a 128x128 one: 1.76x the time for twice the work (H100, N = K =
# 7168: 1.75x at M = 4096, 390-392 against 446-447 us for 7 and 14 waves, and 1.77x at M = 2048, 222-225 against
# 220-221 us for 4 and 7 waves; benchmarks/results/h100/block_scaled_quarters_probe_6852fd7.csv).
WIDE_BLOCK_TILE_COST = 1.76

# K blocks per pass of the 128x256 block-scaled loop's straight-line code (``_quarter_blocks``): it drains the
# warpgroup's WGMMA queue once per pass. Four per pass ran 7.5-8.5% faster than one at M = 4096, N = K = 7168
# (384-387 against 413-421 us in a CUDA graph, H100, three alternating rounds; the same bits; at M = 2048, on the
# 128x128 tile, within 1%: benchmarks/proto/probe_blocks_per_pass.py, benchmarks/results/h100/
# blocks_per_pass_probe_8ef1d74.csv). More than one only where the epilogue reads no row or column scale and no
# residual and writes 16 bits (``blocks_per_pass``), else one: with four, CUDA 13.4's ptxas (Triton 3.9's, what CI reads
# spills with) spills 8 bytes for each such 128x256 specialization tried (bf16 / f16 output, bf16 / f32 bias, row
# and column, residual) and an fp32 output spills 104 bytes even bare (CUDA 12.9's: 180); at two the bare bf16
# one spills 24. Every pass count gives the same bits. Eight per pass (what ships) ran 1.5-2% faster than four
# (378-382 against 386-387 us, three alternating rounds, H100, benchmarks/results/h100/
# blocks_per_pass_probe_48_a886f53.csv; the GPU tests ran the loop at eight) and builds the bare bf16 epilogue
# without spills under both ptxas.
BLOCKS_PER_PASS = 8


def blocks_per_pass(config: "KernelConfig") -> int:
    """K blocks per pass of the 128x256 block-scaled loop for this specialization (see BLOCKS_PER_PASS)."""
    bare = not (config.has_row or config.has_col or config.has_residual)
    return BLOCKS_PER_PASS if bare and config.out != "f32" else 1


def block_scaled_heuristics(m: int, n: int, num_sms: int = 132) -> tuple[int, int]:
    """(tile_m, tile_n) for block-scaled fp8.

    64x128 for a small batch (one consumer warpgroup). Otherwise 128x256 where its waves of tiles, each
    ``WIDE_BLOCK_TILE_COST`` times a 128x128 tile, take less time than 128x128's waves, else 128x128. On an H100
    the wide tile won at M = 4096 (7 waves against 14; 390-392 against 446-447 us, N = K = 7168) and lost at
    M = 2048 (4 against 7; 222-225 against 220-221 us) and at 1100 x 1664 x 1408 (one wave each; 11.9-12.0
    against 8.7 us).
    """
    if m <= 64:
        return 64, 128
    rows = math.ceil(m / 128)
    narrow_waves = math.ceil(rows * math.ceil(n / 128) / num_sms)
    wide_waves = math.ceil(rows * math.ceil(n / 256) / num_sms)
    return (128, 256) if wide_waves * WIDE_BLOCK_TILE_COST < narrow_waves else (128, 128)


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------

_INT32_MAX = 2**31 - 1


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, _FakeTensor) or t.is_meta


def _check_kmajor_operand(name: str, t: torch.Tensor) -> Optional[str]:
    """A or B: 2-D, unit K stride, 16-byte aligned rows (TMA needs both)."""
    if t.dim() != 2:
        return f"{name} must be 2-D, got {t.dim()}-D"
    if t.stride(1) != 1:
        return f"{name} is not K-major (stride {tuple(t.stride())})"
    if (t.stride(0) * t.element_size()) % 16 != 0:
        return f"{name}'s row stride is not a multiple of 16 bytes"
    if t.stride(0) < t.shape[1]:  # (an expanded row, or one row whose stride is 0: a TMA map's row stride here)
        return f"{name}'s rows overlap (row stride {t.stride(0)} < K = {t.shape[1]})"
    if (t.shape[1] * t.element_size()) % 16 != 0:
        return f"K * element size of {name} is not a multiple of 16 bytes"
    if not _is_fake(t) and t.data_ptr() % 16 != 0:
        return f"{name}'s base pointer is not 16-byte aligned"
    return None


def _check_vector(name: str, t: torch.Tensor, length: int, dtypes) -> Optional[str]:
    if t.dtype not in dtypes:
        return f"{name} dtype {t.dtype} not supported"
    if t.dim() != 1 or t.shape[0] != length:
        return f"{name} must have shape [{length}], got {tuple(t.shape)}"
    if t.stride(0) != 1:
        return f"{name} must be contiguous"
    return None


def _check_epilogue(m, n, out_dtype, row, col, bias, residual) -> Optional[str]:
    if row is not None and (reason := _check_vector("row", row, m, (torch.float32,))):
        return reason
    if col is not None and (reason := _check_vector("col", col, n, (torch.float32,))):
        return reason
    if bias is not None and (reason := _check_vector("bias", bias, n, tuple(_BIAS_DTYPES))):
        return reason
    if residual is not None:
        if residual.dtype != out_dtype:
            return f"residual dtype {residual.dtype} must equal out_dtype {out_dtype}"
        if residual.dim() != 2 or tuple(residual.shape) != (m, n):
            return f"residual must have shape [{m}, {n}], got {tuple(residual.shape)}"
        if residual.stride(1) != 1:
            return "residual needs a unit last stride"
    return None


def _check_device(tensors) -> Optional[str]:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return f"tensors on several devices: {sorted(map(str, devices))}"
    device = devices.pop()
    if device.type != "cuda":
        return f"tensors are on {device.type}, not CUDA"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if capability != (9, 0):
        return f"needs sm_90 (Hopper), device is sm_{''.join(map(str, capability))}"
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


SCALE_BLOCK = 128  # the K (and N) width of one block scale


def _check_block_scales(a, b, a_block, b_block) -> Optional[str]:
    """a_block fp32 [M or 1, ceil(K/128)], b_block fp32 [ceil(N/128), ceil(K/128)], unit last stride.

    Any row stride (0 included: an expanded row) is accepted; a one-column scale may have any strides.
    """
    if a_block is None or b_block is None:
        return "block scales need both a_block and b_block"
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        return f"block scales need fp8 e4m3 a and b, got {a.dtype}/{b.dtype}"
    if a.dim() != 2 or b.dim() != 2:
        return "a and b must be 2-D"
    m, k = a.shape
    n = b.shape[0]
    kb = math.ceil(k / SCALE_BLOCK)
    nb = math.ceil(n / SCALE_BLOCK)
    for name, t, rows in (("a_block", a_block, (m, 1)), ("b_block", b_block, (nb,))):
        if t.dtype != torch.float32:
            return f"{name} dtype {t.dtype} not supported (float32 block scales only)"
        if t.dim() != 2 or t.shape[1] != kb or t.shape[0] not in rows:
            want = " or ".join(f"[{r}, {kb}]" for r in rows)
            return (f"{name} must have shape {want} (128x128 blocks: ceil(K/128) = {kb} K blocks), "
                    f"got {tuple(t.shape)}")
        if t.stride(1) != 1 and t.shape[1] != 1:
            return f"{name} needs a unit last stride (stride {tuple(t.stride())})"
        if not _is_fake(t) and t.data_ptr() % 4 != 0:
            return f"{name}'s base pointer is not 4-byte aligned"
    return None


def _supports(a, b, row, col, bias, residual, out_dtype, a_block, b_block) -> Optional[str]:
    if _CUTLASS_ERROR is not None:
        return _CUTLASS_ERROR
    if a_block is not None or b_block is not None:
        if reason := _check_block_scales(a, b, a_block, b_block):
            return reason
    if a.dtype not in _AB_DTYPES or b.dtype != a.dtype:
        return f"a/b dtypes {a.dtype}/{b.dtype} not supported (both fp8 e4m3, bf16 or fp16)"
    if out_dtype not in _OUT_DTYPES:
        return f"out_dtype {out_dtype} not supported (bf16, fp16, fp32)"
    for name, t in (("a", a), ("b", b)):
        if reason := _check_kmajor_operand(name, t):
            return reason
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        return f"K mismatch: a is {tuple(a.shape)}, b is {tuple(b.shape)}"
    if k == 0 or n == 0:
        return "empty K or N"
    if max(m, n, k) > _INT32_MAX:
        return "a dimension exceeds 2**31 - 1 (CuTe layouts are 32-bit)"
    if (n * out_dtype.itemsize) % 16 != 0:
        return "N * output element size is not a multiple of 16 bytes (TMA store rows)"
    if reason := _check_epilogue(m, n, out_dtype, row, col, bias, residual):
        return reason
    present = [t for t in (a, b, row, col, bias, residual, a_block, b_block) if t is not None]
    return _check_device(present)


def supports(a, b, *, row=None, col=None, bias=None, residual=None, out_dtype, a_block=None,
             b_block=None) -> Optional[str]:
    """None when ``cute_scaled_mm`` handles these arguments, else a short reason.

    Works on CPU, meta and fake tensors and never raises. For fake tensors the base pointers are
    unknown, so their alignment is checked only when the kernel is called.
    """
    try:
        key = _supports_key(out_dtype, (a, b, row, col, bias, residual, a_block, b_block))
        if key is not None:
            known = _SUPPORTED.get(key, _UNKNOWN)  # (one lookup: another thread may clear the memo)
            if known is not _UNKNOWN:
                return known
        reason = _supports(a, b, row, col, bias, residual, out_dtype, a_block, b_block)
        if key is not None:
            if len(_SUPPORTED) >= 4096:  # (bounded: one entry per argument signature seen)
                _SUPPORTED.clear()
            _SUPPORTED[key] = reason
        return reason
    except Exception as exc:  # noqa: BLE001 - e.g. symbolic sizes that cannot be decided
        return f"cannot check arguments ({type(exc).__name__}: {exc})"


_SUPPORTED: dict = {}  # _supports_key -> the answer: the op asks per call with the same arguments
_UNKNOWN = object()


def _supports_key(out_dtype, tensors):
    """What every check of ``_supports`` reads of the arguments (dtype, shape, strides, device, and the
    base pointer's alignment to 16 bytes, the most any check asks), or None for fake / meta tensors
    (no address: never memoized). Checking took about 10 µs a call; the key about 3."""
    key = [out_dtype]
    for t in tensors:
        if t is None:
            key.append(None)
            continue
        if _is_fake(t):
            return None
        try:
            align = t.data_ptr() % 16
        except Exception:  # noqa: BLE001 - no storage to point at (a tensor subclass): checked, not memoized
            return None
        key.append((t.dtype, t.shape, t.stride(), t.device, align))
    return tuple(key)


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def reference_scaled_mm(a, b, *, row=None, col=None, bias=None, residual=None, out_dtype,
                        a_block=None, b_block=None) -> torch.Tensor:
    """The semantics in plain PyTorch, computed in float64 (block scales included)."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    if a_block is not None or b_block is not None:
        acc = _block_scaled_product(a64, b64, a_block, b_block)
    else:
        acc = a64 @ b64.T
    if row is not None:
        acc = acc * row.to(torch.float64)[:, None]
    if col is not None:
        acc = acc * col.to(torch.float64)[None, :]
    if bias is not None:
        acc = acc + bias.to(torch.float64)[None, :]
    if residual is not None:
        acc = acc + residual.to(torch.float64)
    return acc.to(out_dtype)


def _block_scaled_product(a64, b64, a_block, b_block, block: int = 128):
    """sum over 128-wide K blocks kb of (a[:, kb] @ b[:, kb].T) * a_block[m, kb] * b_block[n // 128, kb]."""
    m, k = a64.shape
    n = b64.shape[0]
    ones_a = torch.ones(m, math.ceil(k / block), dtype=torch.float64, device=a64.device)
    ones_b = torch.ones(math.ceil(n / block), math.ceil(k / block), dtype=torch.float64, device=a64.device)
    sa = ones_a if a_block is None else a_block.to(torch.float64)
    sb = ones_b if b_block is None else b_block.to(torch.float64)
    sb_rows = sb.repeat_interleave(block, dim=0)[:n]  # [N, KB]
    acc = torch.zeros(m, n, dtype=torch.float64, device=a64.device)
    for kb in range(math.ceil(k / block)):
        part = a64[:, kb * block:(kb + 1) * block] @ b64[:, kb * block:(kb + 1) * block].T
        acc += part * sa[:, kb:kb + 1] * sb_rows[:, kb][None, :]
    return acc


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------

if _CUTLASS_ERROR is None:
    _CUTE_DTYPES = {
        "f8e4m3": cutlass.Float8E4M3FN,
        "bf16": cutlass.BFloat16,
        "f16": cutlass.Float16,
        "f32": cutlass.Float32,
    }
    _CUTE_OF_TORCH = {torch.float8_e4m3fn: cutlass.Float8E4M3FN, torch.bfloat16: cutlass.BFloat16,
                      torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}

    class _ScaledMmKernel:
        """One specialization of the warp-specialized persistent scaled GEMM (see module docstring)."""

        threads_per_warpgroup = 128
        blocks_per_pass: Optional[int] = None  # K blocks per pass of the 128x256 block-scaled loop; None: blocks_per_pass()
        producer_registers = 40  # the TMA warpgroup only computes addresses
        consumer_registers = 232  # 2 x 128 x 232 + 128 x 40 <= 64K registers per SM
        cluster_n = 1  # CTAs of a cluster along N that share the A tile (a probe's multicast mixin sets 2)
        smem_bytes = 232448 - 1024  # sm_90 opt-in shared memory, less the mbarrier area

        def __init__(self, config: KernelConfig):
            # (64x256 would build too, but no heuristic picks it and no GPU test has run it)
            if config.block_scaled and (config.ab != "f8e4m3" or (config.tile_m, config.tile_n) not in _BLOCK_TILES):
                raise ValueError(f"block-scaled kernels are fp8 with a 64x128, 128x128 or 128x256 tile, not {config}")
            self.config = config
            self.ab_dtype = _CUTE_DTYPES[config.ab]
            self.out_dtype = _CUTE_DTYPES[config.out]
            self.acc_dtype = cutlass.Float32
            self.num_consumers = config.tile_m // 64  # one 64-row WGMMA slab per consumer warpgroup
            self.num_threads = (1 + self.num_consumers) * self.threads_per_warpgroup
            self.num_mma_threads = self.num_consumers * self.threads_per_warpgroup
            self.epilogue_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)

        # ---- static setup (host side, trace time) ------------------------------------------------

        def _setup_tiles(self):
            cfg = self.config
            k_major = cute.nvgpu.warpgroup.OperandMajorMode.K
            self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype, self.ab_dtype, k_major, k_major, self.acc_dtype,
                (self.num_consumers, 1, 1), tiler_mn=(64, self._atom_n()),
            )
            # Four WGMMA K-steps per stage: K tile 64 for 16-bit inputs, 128 for fp8.
            tile_k = cute.size(self.tiled_mma.shape_mnk, mode=[2]) * 4
            self.tile_mnk = (cfg.tile_m, cfg.tile_n, tile_k)
            # TMA-store sub-tile: all rows of the tile, 32 columns (one slice of the accumulator).
            self.epi_tile = (cfg.tile_m, min(32, cfg.tile_n))
            self.epi_stage = 4 if self.out_dtype.width == 16 else 2
            ab_bytes = (cfg.tile_m + cfg.tile_n) * tile_k * self.ab_dtype.width // 8
            epi_bytes = self.epi_tile[0] * self.epi_tile[1] * self.out_dtype.width // 8 * self.epi_stage
            self.ab_stage = min(8, (self.smem_bytes - epi_bytes) // ab_bytes)
            self.a_smem_staged = self._staged_smem_layout((cfg.tile_m, tile_k), self.ab_dtype, self.ab_stage)
            self.b_smem_staged = self._staged_smem_layout((cfg.tile_n, tile_k), self.ab_dtype, self.ab_stage)
            self.epi_smem_staged = self._staged_smem_layout(self.epi_tile, self.out_dtype, self.epi_stage)

        def _blocks_per_pass(self) -> int:
            """K blocks per pass of the 128x256 block-scaled loop (a trace-time constant)."""
            return self.blocks_per_pass if self.blocks_per_pass is not None else blocks_per_pass(self.config)

        def _atom_n(self) -> int:
            """N of one WGMMA. The whole tile for plain tiles; block-scaled tiles use WGMMAs at most 128 wide
            (one b_block scalar each), and the 128x256 one 64-wide ones: its C partition then has one N step per
            64-column quarter (``_mainloop_block_scaled_quarters``)."""
            cfg = self.config
            if not cfg.block_scaled:
                return cfg.tile_n
            return SCALE_BLOCK if cfg.tile_n <= SCALE_BLOCK else SCALE_BLOCK // 2

        @staticmethod
        def _staged_smem_layout(tile_shape, dtype, stages):
            """Swizzled (rows, contiguous, stage) layout for a row-major tile, as WGMMA/TMA want it."""
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, tile_shape[1]), dtype
            )
            return cute.tile_to_shape(atom, cute.append(tile_shape, stages), order=(0, 1, 2))

        # ---- host entry ----------------------------------------------------------------------------

        @cute.jit
        def __call__(
            self,
            pA: cute.Pointer,
            pB: cute.Pointer,
            pD: cute.Pointer,
            pRow: Optional[cute.Pointer],
            pCol: Optional[cute.Pointer],
            pBias: Optional[cute.Pointer],
            pRes: Optional[cute.Pointer],
            pSA: Optional[cute.Pointer],
            pSB: Optional[cute.Pointer],
            m: cutlass.Int32,
            n: cutlass.Int32,
            k: cutlass.Int32,
            lda16: cutlass.Int64,
            ldb16: cutlass.Int64,
            ldd16: cutlass.Int64,
            ld_res: cutlass.Int64,
            sa_rows: cutlass.Int32,
            ld_sa: cutlass.Int64,
            sb_rows: cutlass.Int32,
            ld_sb: cutlass.Int64,
            num_sms: cutlass.Int32,
            stream: cuda.CUstream,
        ):
            """Raw pointers, sizes and row strides in, tensors built here: a call marshals a few integers
            (about 1 us per pointer) instead of DLPack tensors (about 9 us each). A, B and D row strides
            arrive in 16-byte units (``lda16``: TMA needs 16-byte rows, and this way the compiler knows
            it); the residual's and the block scales' in elements."""
            ab_per_16 = 128 // self.ab_dtype.width
            out_per_16 = 128 // self.out_dtype.width
            mA = _matrix(pA, m, k, lda16 * ab_per_16)
            mB = _matrix(pB, n, k, ldb16 * ab_per_16)
            mD = _matrix(pD, m, n, ldd16 * out_per_16)
            mRow = _vector(pRow, m)
            mCol = _vector(pCol, n)
            mBias = _vector(pBias, n)
            mRes = _matrix(pRes, m, n, ld_res)
            k_blocks = cute.ceil_div(k, SCALE_BLOCK)
            mSA = _matrix(pSA, sa_rows, k_blocks, ld_sa)
            mSB = _matrix(pSB, sb_rows, k_blocks, ld_sb)
            self._launch(mA, mB, mD, mRow, mCol, mBias, mRes, mSA, mSB, num_sms, stream)

        @cute.jit
        def _launch(self, mA, mB, mD, mRow, mCol, mBias, mRes, mSA, mSB, num_sms, stream):
            self._setup_tiles()  # MMA atoms need the target arch: only known inside the compile
            tile_mk = (self.tile_mnk[0], self.tile_mnk[2])
            tile_nk = (self.tile_mnk[1], self.tile_mnk[2])
            g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, mA, cute.slice_(self.a_smem_staged, (None, None, 0)), tile_mk)
            tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, mB, cute.slice_(self.b_smem_staged, (None, None, 0)), tile_nk)
            tma_d, tma_mD = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mD,
                cute.slice_(self.epi_smem_staged, (None, None, 0)), self.epi_tile)

            tiles = cute.zipped_divide(mD, tiler=(self.tile_mnk[0], self.tile_mnk[1]))
            tiles_mn = tiles[(0, (None, None))].shape
            sched_params = self._scheduler_params(tiles_mn)
            grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, num_sms)

            @cute.struct
            class SharedStorage:
                ab_barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
                sA: cute.struct.Align[
                    cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_staged)], 1024]
                sB: cute.struct.Align[
                    cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_staged)], 1024]
                sD: cute.struct.Align[
                    cute.struct.MemRange[self.out_dtype, cute.cosize(self.epi_smem_staged)], 1024]

            self.shared_storage = SharedStorage
            self.kernel(
                tma_a, tma_mA, tma_b, tma_mB, tma_d, tma_mD, mD,
                mRow, mCol, mBias, mRes, mSA, mSB, self.tiled_mma, sched_params,
                self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
            ).launch(grid=grid, block=[self.num_threads, 1, 1], cluster=(1, 1, 1),
                     min_blocks_per_mp=1, stream=stream)

        # The order in which a CTA's persistent loop visits output tiles: along M, one N column of tiles
        # after another (swizzle 1), or in bands of ``swizzle_size`` tiles (along M or N) that share operands.
        swizzle_size = 1
        raster_along_m = True

        def _scheduler_params(self, tiles_mn):
            return utils.PersistentTileSchedulerParams((*tiles_mn, 1), (1, 1, 1), swizzle_size=self.swizzle_size,
                                                       raster_along_m=self.raster_along_m)

        # ---- device kernel -------------------------------------------------------------------------

        @cute.kernel
        def kernel(
            self,
            tma_a: cute.CopyAtom,
            mA: cute.Tensor,
            tma_b: cute.CopyAtom,
            mB: cute.Tensor,
            tma_d: cute.CopyAtom,
            mD_tma: cute.Tensor,
            mD: cute.Tensor,
            mRow: Optional[cute.Tensor],
            mCol: Optional[cute.Tensor],
            mBias: Optional[cute.Tensor],
            mRes: Optional[cute.Tensor],
            mSA: Optional[cute.Tensor],
            mSB: Optional[cute.Tensor],
            tiled_mma: cute.TiledMma,
            sched_params: utils.PersistentTileSchedulerParams,
            a_smem_staged: cute.ComposedLayout,
            b_smem_staged: cute.ComposedLayout,
            epi_smem_staged: cute.ComposedLayout,
        ):
            # Layouts built on the host side arrive as arguments: IR values cannot cross into the kernel.
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            warpgroup = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_d)

            storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
            ab_pipeline = self._make_ab_pipeline(storage.ab_barriers.data_ptr(), a_smem_staged, b_smem_staged)
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, self.cluster_n), is_relaxed=True)
            sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
            sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
            sD = storage.sD.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, self.cluster_n))

            if warpgroup == 0:
                cute.arch.setmaxregister_decrease(self.producer_registers)
                if warp_idx == 0:
                    self._produce(ab_pipeline, tma_a, mA, tma_b, mB, sA, sB, sched_params)
            else:
                cute.arch.setmaxregister_increase(self.consumer_registers)
                self._consume(ab_pipeline, tiled_mma, sA, sB, sD, mA, tma_d, mD_tma, mD,
                              mRow, mCol, mBias, mRes, mSA, mSB, sched_params, tidx, warp_idx)

        def _make_ab_pipeline(self, barrier_ptr, a_smem_staged, b_smem_staged):
            """Full/empty mbarrier ring: TMA transaction bytes complete 'full', consumer warps 'empty'."""
            tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_staged, (None, None, 0)))
            tx_bytes += cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=barrier_ptr,
                num_stages=self.ab_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                # a stage is refilled once the consumers of every CTA of the cluster (all receive its A) release it
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.cluster_n * self.num_consumers * 4),
                tx_count=tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, self.cluster_n, 1)),
                defer_sync=True,
            )

        # ---- producer: TMA loads --------------------------------------------------------------------

        @cute.jit
        def _produce(self, ab_pipeline, tma_a, mA, tma_b, mB, sA, sB, sched_params):
            gA = cute.local_tile(mA, (self.tile_mnk[0], self.tile_mnk[2]), (None, None))  # (bM,bK,RM,RK)
            gB = cute.local_tile(mB, (self.tile_mnk[1], self.tile_mnk[2]), (None, None))  # (bN,bK,RN,RK)
            one_cta = cute.make_layout(1)
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a, 0, one_cta, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
            tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                tma_b, 0, one_cta, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
            k_tiles = cute.size(gA, mode=[3])

            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            while work.is_valid_tile:
                tile = work.tile_idx
                tAgA_tile = tAgA[(None, tile[0], None)]
                tBgB_tile = tBgB[(None, tile[1], None)]
                state.reset_count()
                for _k in range(k_tiles):
                    ab_pipeline.producer_acquire(state)
                    full = ab_pipeline.producer_get_barrier(state)
                    cute.copy(tma_a, tAgA_tile[(None, state.count)], tAsA[(None, state.index)], tma_bar_ptr=full)
                    cute.copy(tma_b, tBgB_tile[(None, state.count)], tBsB[(None, state.index)], tma_bar_ptr=full)
                    ab_pipeline.producer_commit(state)
                    state.advance()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            ab_pipeline.producer_tail(state)

        # ---- consumers: WGMMA main loop + epilogue -----------------------------------------------------

        @cute.jit
        def _consume(self, ab_pipeline, tiled_mma, sA, sB, sD, mA, tma_d, mD_tma, mD,
                     mRow, mCol, mBias, mRes, mSA, mSB, sched_params, tidx, warp_idx):
            mma_tidx = tidx - self.threads_per_warpgroup
            thr_mma = tiled_mma.get_slice(mma_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            tile_mn = (self.tile_mnk[0], self.tile_mnk[1])
            acc_shape = thr_mma.partition_C(cute.make_identity_tensor(tile_mn)).shape
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            k_tiles = cute.ceil_div(mA.shape[1], self.tile_mnk[2])
            frags = None
            tCcAcc = None
            if cutlass.const_expr(self.config.block_scaled):
                tCcAcc = thr_mma.partition_C(cute.make_identity_tensor(tile_mn))  # (row, col) per register
                if cutlass.const_expr(self.config.tile_n == SCALE_BLOCK):
                    # The two fragments K blocks' WGMMAs alternate between; each is scaled into `acc`.
                    frags = (cute.make_rmem_tensor(acc_shape, self.acc_dtype),
                             cute.make_rmem_tensor(acc_shape, self.acc_dtype))
                else:
                    # 64 registers (what a 128-column fragment takes), used as two 64-column fragments.
                    pair_shape = thr_mma.partition_C(
                        cute.make_identity_tensor((self.tile_mnk[0], SCALE_BLOCK))).shape
                    frags = (cute.make_rmem_tensor(pair_shape, self.acc_dtype),)

            # Register -> shared copy of one epilogue slice (stmatrix for 16-bit outputs).
            r2s = self._make_r2s_copy(tiled_mma)
            thr_r2s = r2s.get_slice(mma_tidx)
            tRS_sD = thr_r2s.partition_D(sD)  # (R2S, R2S_M, R2S_N, stage)
            tRS_acc = r2s.retile(acc)
            # Coordinates (inside the slice) of each register of a slice: what the epilogue pieces index.
            tRS_coord = thr_r2s.partition_S(cute.make_identity_tensor(self.epi_tile))
            slice_shape = cute.shape(thr_r2s.partition_S(sD))[:3]
            slice_f32 = cute.make_rmem_tensor(slice_shape, self.acc_dtype)
            slice_out = cute.make_rmem_tensor(slice_shape, self.out_dtype)
            store_pipeline = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
            )

            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            while work.is_valid_tile:
                if cutlass.const_expr(self.config.block_scaled and self.config.tile_n == SCALE_BLOCK):
                    read_state, release_state = self._mainloop_block_scaled(
                        ab_pipeline, tiled_mma, tCrA, tCrB, acc, frags, tCcAcc, k_tiles,
                        read_state, release_state, mSA, mSB, work.tile_idx)
                elif cutlass.const_expr(self.config.block_scaled):
                    read_state, release_state = self._mainloop_block_scaled_quarters(
                        ab_pipeline, tiled_mma, tCrA, tCrB, acc, frags[0], tCcAcc, k_tiles,
                        read_state, release_state, mSA, mSB, work.tile_idx)
                else:
                    read_state, release_state = self._mainloop(
                        ab_pipeline, tiled_mma, tCrA, tCrB, acc, k_tiles, read_state, release_state)
                # Rematerialize: the tile's coordinates come back from the scheduler here, after the
                # K loop, rather than living in registers through it.
                tile = sched.get_current_work().tile_idx
                self._epilogue(tile, acc, tRS_acc, tRS_coord, slice_f32, slice_out, r2s, tRS_sD, sD,
                               tma_d, mD_tma, mD, mRow, mCol, mBias, mRes, store_pipeline,
                               sched.num_tiles_executed, warp_idx)
                sched.advance_to_next_work()
                work = sched.get_current_work()
            store_pipeline.producer_tail()

        @cute.jit
        def _mainloop(self, ab_pipeline, tiled_mma, tCrA, tCrB, acc, k_tiles, read_state, release_state):
            """acc = sum over K tiles, one WGMMA batch kept in flight while the next stage is awaited.

            Returns the advanced pipeline states: the caller's loop must carry the new values.
            """
            read_state.reset_count()
            release_state.reset_count()
            acc.fill(0.0)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.fence()
            # First K tile: nothing older to release yet.
            ab_pipeline.consumer_wait(read_state)
            self._mma_stage(tiled_mma, tCrA, tCrB, acc, read_state.index)
            cute.nvgpu.warpgroup.commit_group()
            read_state.advance()
            for _k in range(1, k_tiles):
                ab_pipeline.consumer_wait(read_state)
                self._mma_stage(tiled_mma, tCrA, tCrB, acc, read_state.index)
                cute.nvgpu.warpgroup.commit_group()
                # At most this batch in flight: the previous stage has been read and can be refilled.
                cute.nvgpu.warpgroup.wait_group(1)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                read_state.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            return read_state, release_state

        @cute.jit
        def _mainloop_block_scaled(self, ab_pipeline, tiled_mma, tCrA, tCrB, acc, frags, tCcAcc, k_tiles,
                                   read_state, release_state, mSA, mSB, tile):
            """acc = sum over K blocks kb of a_block[m, kb] * b_block[tile_n, kb] * (WGMMA product of kb).

            "Promotion": each 128-deep K tile is one scale block. Its WGMMAs write a fresh fragment
            (ACCUMULATE off on the first K step), which is then folded into ``acc`` with one FMA per
            register, scaled by a_block of the register's row times the b_block scalar. Two fragments
            alternate: block kb + 1's WGMMAs are issued into one before block kb's fragment (the other)
            is awaited (``wait_group(1)``) and folded, so the FMAs run while the tensor cores work. The
            scales of block kb + 1 are loaded from global memory (L2-resident) into registers before its
            WGMMAs are issued and used one block later, so no instruction waits on their latency before
            an issue (H200, M = 4096, N = K = 7168: waiting for each block before folding it and loading
            its scales right before the fold ran at ~1000 TFLOP/s). The loop is unrolled by two so each
            fragment and scale buffer is a fixed set of registers; the last block is peeled after it.
            """
            read_state.reset_count()
            release_state.reset_count()
            acc.fill(0.0)
            f0, f1 = frags
            # Registers of one accumulator row share a scale: group them at trace time (the grouping
            # is the same for every thread of the WGMMA C layout; thread 0 gives it statically).
            slot_of, slot_rep = _row_slots(tiled_mma, (self.tile_mnk[0], self.tile_mnk[1]))
            sa_last = mSA.shape[0] - 1  # 0 for a one-row (broadcast) a_block; clamps M-tail rows
            row0 = tile[0] * self.tile_mnk[0]
            sa_rows = [cutlass.min(row0 + tCcAcc[rep][0], sa_last) for rep in slot_rep]
            # tile_n == 128: one b_block row per N tile (clamped: an expanded b_block arrives as one row)
            sb_rows = [cutlass.min(tile[1], mSB.shape[0] - 1)]
            # Raw scales of two blocks: [buffer, (a_block per row slot..., b_block)]
            scales = cute.make_rmem_tensor((2, len(slot_rep) + 1), cutlass.Float32)

            self._load_scales(scales, 0, mSA, mSB, sa_rows, sb_rows, 0)
            self._issue_block(ab_pipeline, tiled_mma, tCrA, tCrB, f0, read_state)
            read_state.advance()
            # blocks 0 .. 2 * pairs - 1 folded here; each iteration issues the next two
            pairs = (k_tiles - 1) // 2
            for p in range(pairs):
                kb = 2 * p
                self._load_scales(scales, 1, mSA, mSB, sa_rows, sb_rows, kb + 1)
                self._issue_block(ab_pipeline, tiled_mma, tCrA, tCrB, f1, read_state)
                read_state.advance()
                cute.nvgpu.warpgroup.wait_group(1)  # block kb (f0) done, kb + 1 in flight
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                self._fold(acc, f0, scales, 0, slot_of)
                self._load_scales(scales, 0, mSA, mSB, sa_rows, sb_rows, kb + 2)
                self._issue_block(ab_pipeline, tiled_mma, tCrA, tCrB, f0, read_state)
                read_state.advance()
                cute.nvgpu.warpgroup.wait_group(1)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                self._fold(acc, f1, scales, 1, slot_of)
            # f0 holds block 2 * pairs (in flight); one more block remains when k_tiles is even
            if 2 * pairs + 1 < k_tiles:
                self._load_scales(scales, 1, mSA, mSB, sa_rows, sb_rows, 2 * pairs + 1)
                self._issue_block(ab_pipeline, tiled_mma, tCrA, tCrB, f1, read_state)
                read_state.advance()
                cute.nvgpu.warpgroup.wait_group(1)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                self._fold(acc, f0, scales, 0, slot_of)
                cute.nvgpu.warpgroup.wait_group(0)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                self._fold(acc, f1, scales, 1, slot_of)
            else:
                cute.nvgpu.warpgroup.wait_group(0)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                self._fold(acc, f0, scales, 0, slot_of)
            return read_state, release_state

        @cute.jit
        def _mainloop_block_scaled_quarters(self, ab_pipeline, tiled_mma, tCrA, tCrB, acc, frag_pair, tCcAcc,
                                            k_tiles, read_state, release_state, mSA, mSB, tile):
            """The 128x256 block-scaled loop, from 64x64 WGMMAs: a K block's four 64-column quarters go into
            two 32-register fragments in turn (``frag_pair``: the 64 registers a 128-column fragment takes),
            and while quarter q's WGMMAs run, quarter q - 1's fragment is folded into the sum,
            ``acc[quarter] += fragment * a_block[row, kb] * b_block[2 * tile[1] + quarter // 2, kb]``
            (``wait_group(1)``), so within a pass this warpgroup's tensor-core queue is never empty. The same
            fold, and so the same bits, as the 128x128 loop.

            The K blocks go ``blocks_per_pass(config)`` at a time through straight-line code (``_quarter_blocks``) that
            starts and ends with no WGMMA in flight; within it each ``wait_group(1)`` follows the commit it
            leaves in flight. That is the structure seen to keep the WGMMAs asynchronous: ptxas serialized every
            WGMMA of the kernel (info C7514) for a loop whose WGMMAs accumulate into the same registers across
            iterations while ordinary instructions touch them between waits, and compiled it clean once each
            iteration ended with none in flight (benchmarks/proto/block_scaled_rescale_probe.py). This loop
            needs the passes too: built with one K block per iteration of a dynamic loop and a quarter's group
            in flight across the loop head, it was serialized the same way (sm_90a build, C7514), though the
            128x128 loop, whose fragments also start afresh every K block, compiles clean so. H100, M = 4096,
            N = K = 7168: 1073-1078 TFLOP/s against 1035-1037 for the previous loop (a half's WGMMAs, a wait for
            them, its fold).
            """
            read_state.reset_count()
            release_state.reset_count()
            quarter = SCALE_BLOCK // 2
            # rows of a quarter's registers (the quarters differ in columns only)
            slot_of, slot_rep = _row_slots(tiled_mma, (self.tile_mnk[0], quarter))
            sa_last = mSA.shape[0] - 1  # 0 for a one-row (broadcast) a_block; clamps M-tail rows
            row0 = tile[0] * self.tile_mnk[0]
            sa_rows = [cutlass.min(row0 + tCcAcc[rep][0], sa_last) for rep in slot_rep]
            sb_last = mSB.shape[0] - 1  # clamps an N tail's block and an expanded b_block (one row)
            sb_rows = [cutlass.min(tile[1] * 2 + h, sb_last) for h in range(2)]
            slots = len(slot_rep)
            # raw scales of blocks kb - 1, kb and kb + 1: [block, (a_block per row slot..., b_block per half)]
            scales = cute.make_rmem_tensor((3, slots + 2), cutlass.Float32)
            self._load_scales(scales, 1, mSA, mSB, sa_rows, sb_rows, 0)
            self._load_scales(scales, 2, mSA, mSB, sa_rows, sb_rows, cutlass.min(1, k_tiles - 1))
            frags = (cute.append_ones(frag_pair[(None, None, 0)], 3), cute.append_ones(frag_pair[(None, None, 1)], 3))
            acc.fill(0.0)
            per_pass = self._blocks_per_pass()
            passes = k_tiles // per_pass
            for p in range(passes):
                read_state, release_state = self._quarter_blocks(
                    ab_pipeline, tiled_mma, tCrA, tCrB, acc, frags, scales, slot_of, slots, mSA, mSB,
                    sa_rows, sb_rows, k_tiles, p * per_pass, per_pass, read_state, release_state)
            for kb in range(passes * per_pass, k_tiles):
                read_state, release_state = self._quarter_blocks(
                    ab_pipeline, tiled_mma, tCrA, tCrB, acc, frags, scales, slot_of, slots, mSA, mSB,
                    sa_rows, sb_rows, k_tiles, kb, 1, read_state, release_state)
            return read_state, release_state

        @cute.jit
        def _quarter_blocks(self, ab_pipeline, tiled_mma, tCrA, tCrB, acc, frags, scales, slot_of, slots, mSA,
                            mSB, sa_rows, sb_rows, k_tiles, first, count: cutlass.Constexpr, read_state,
                            release_state):
            """K blocks first .. first + count - 1 in straight-line code, with no WGMMA in flight on entry and
            on exit. On entry scales[1] and scales[2] hold blocks first's and first + 1's scales."""
            kmma = cute.size(tCrA, mode=[2])
            for i in cutlass.range_constexpr(count):
                kb = first + i
                ab_pipeline.consumer_wait(read_state)
                for q in cutlass.range_constexpr(4):
                    f = frags[q % 2]
                    cute.nvgpu.warpgroup.fence()  # f was read by the fold two quarters ago
                    # A fresh atom per quarter: its ACCUMULATE field changes inside the loop.
                    mma_atom = cute.make_mma_atom(tiled_mma.op)
                    mma_atom.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                    for kk in cutlass.range_constexpr(kmma):
                        cute.gemm(mma_atom, f, tCrA[(None, None, kk, read_state.index)],
                                  cute.append_ones(tCrB[(None, q, kk, read_state.index)], 2), f)
                        mma_atom.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.commit_group()
                    if cutlass.const_expr(i > 0 or q > 0):
                        cute.nvgpu.warpgroup.wait_group(1)  # the quarter before this one is done
                        if cutlass.const_expr(q == 0):
                            ab_pipeline.consumer_release(release_state)  # block kb - 1's stage is read
                            release_state.advance()
                            self._fold_quarter(acc, frags[1], 3, scales, 0, slots, slot_of)
                        else:
                            self._fold_quarter(acc, frags[(q - 1) % 2], q - 1, scales, 1, slots, slot_of)
                self._shift_scales(scales)
                self._load_scales(scales, 2, mSA, mSB, sa_rows, sb_rows, cutlass.min(kb + 2, k_tiles - 1))
                read_state.advance()
            self._drain(ab_pipeline, release_state)
            self._fold_quarter(acc, frags[1], 3, scales, 0, slots, slot_of)  # the last block's last quarter
            return read_state, release_state

        @cute.jit
        def _shift_scales(self, scales):
            """Three blocks' scales, one block on: scales[0] = scales[1], scales[1] = scales[2]."""
            for j in cutlass.range_constexpr(cute.size(scales, mode=[1])):
                scales[0, j] = scales[1, j]
                scales[1, j] = scales[2, j]

        @cute.jit
        def _drain(self, ab_pipeline, release_state):
            """Wait for every WGMMA in flight, then release the stage the last of them read."""
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()

        @cute.jit
        def _fold_quarter(self, acc, f, q, scales, buf, slots, slot_of):
            """acc[quarter q] += f * a_block of the register's row * b_block of the quarter's half, both from
            scales[buf]."""
            scale = [scales[buf, j] * scales[buf, slots + q // 2] for j in range(slots)]
            acc_q = acc[(None, 0, q)]
            f_v = f[(None, 0, 0)]
            for i in cutlass.range_constexpr(cute.size(f_v)):
                acc_q[i] = acc_q[i] + f_v[i] * scale[slot_of[i]]

        @cute.jit
        def _issue_block(self, ab_pipeline, tiled_mma, tCrA, tCrB, frag, read_state):
            """Wait for the stage, then issue one K block's WGMMAs into ``frag`` (a fresh sum) and commit."""
            ab_pipeline.consumer_wait(read_state)
            cute.nvgpu.warpgroup.fence()  # frag was read by the previous fold's FMAs
            # A fresh atom per K block: its ACCUMULATE field changes inside the dynamic loop.
            mma_atom = cute.make_mma_atom(tiled_mma.op)
            mma_atom.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            for kk in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                coord = (None, None, kk, read_state.index)
                cute.gemm(mma_atom, frag, tCrA[coord], tCrB[coord], frag)
                mma_atom.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()

        @cute.jit
        def _load_scales(self, scales, buf, mSA, mSB, sa_rows, sb_rows, kb):
            """Block kb's a_block (one per accumulator row the thread owns), then its b_block (one per 128
            columns of the tile), into scales[buf]."""
            for j in cutlass.range_constexpr(len(sa_rows)):
                scales[buf, j] = mSA[sa_rows[j], kb]
            for h in cutlass.range_constexpr(len(sb_rows)):
                scales[buf, len(sa_rows) + h] = mSB[sb_rows[h], kb]

        @cute.jit
        def _fold(self, acc, frag, scales, buf, slot_of):
            """acc += frag * (a_block of the register's row * b_block), one FMA per register."""
            n = cute.size(scales, mode=[1]) - 1
            scale = [scales[buf, j] * scales[buf, n] for j in range(n)]
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] + frag[i] * scale[slot_of[i]]

        @cute.jit
        def _mma_stage(self, tiled_mma, tCrA, tCrB, acc, stage):
            for kk in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                coord = (None, None, kk, stage)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)

        def _make_r2s_copy(self, tiled_mma):
            store_op = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.out_dtype, self.acc_dtype)
            stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.out_dtype)
            return cute.make_tiled_copy_S(store_op, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))

        # ---- epilogue --------------------------------------------------------------------------------

        @cute.jit
        def _epilogue(self, tile, acc, tRS_acc, tRS_coord, slice_f32, slice_out, r2s, tRS_sD, sD,
                      tma_d, mD_tma, mD, mRow, mCol, mBias, mRes, store_pipeline, tiles_done, warp_idx):
            """Walk the accumulator slice by slice: epilogue pieces, cast, registers -> smem -> TMA store."""
            gD = cute.local_tile(mD_tma, (self.tile_mnk[0], self.tile_mnk[1]), (tile[0], tile[1]))
            gD_slices = cute.zipped_divide(gD, self.epi_tile)  # ((epiM, epiN), (slicesM, slicesN))
            bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_slices)
            num_slices = cute.size(gD_slices, mode=[1])
            slice_grid = cute.make_layout(gD_slices.shape[1], stride=(gD_slices.shape[1][1], 1))
            slice_size = cute.size(slice_f32)
            rows, cols = mD.shape[0], mD.shape[1]
            tile_row0 = tile[0] * self.tile_mnk[0]
            tile_col0 = tile[1] * self.tile_mnk[1]
            for s in cutlass.range_constexpr(num_slices):
                for v in cutlass.range_constexpr(slice_size):
                    slice_f32[v] = tRS_acc[s * slice_size + v]
                slice_mn = slice_grid.get_hier_coord(s)
                row0 = tile_row0 + slice_mn[0] * self.epi_tile[0]
                col0 = tile_col0 + slice_mn[1] * self.epi_tile[1]
                self._visit_slice(slice_f32, tRS_coord, row0, col0, rows, cols, mRow, mCol, mBias, mRes)
                slice_out.store(slice_f32.load().to(self.out_dtype))

                buffer = (tiles_done * num_slices + s) % self.epi_stage
                cute.copy(r2s, slice_out, tRS_sD[(None, None, None, buffer)])
                # Make the generic-proxy smem writes visible to the TMA (async proxy) before it reads.
                cute.arch.fence_proxy("async.shared", space="cta")
                self.epilogue_barrier.arrive_and_wait()
                if warp_idx == 4:  # first consumer warp issues the store
                    cute.copy(tma_d, bSG_sD[(None, buffer)], bSG_gD[(None, slice_mn)])
                    store_pipeline.producer_commit()
                    store_pipeline.producer_acquire()
                self.epilogue_barrier.arrive_and_wait()

        @cute.jit
        def _visit_slice(self, frag, coords, row0, col0, rows, cols, mRow, mCol, mBias, mRes):
            """Apply the enabled epilogue pieces to every fp32 value of one accumulator slice.

            Out-of-range rows/columns (tile tails) read a clamped, valid index; the TMA store clips them.
            """
            for i in cutlass.range_constexpr(cute.size(frag)):
                coord = coords[i]
                m = cutlass.min(row0 + coord[0], rows - 1)
                n = cutlass.min(col0 + coord[1], cols - 1)
                value = frag[i]
                value = _scale_by_row(value, mRow, m)
                value = _scale_by_col(value, mCol, n)
                value = _add_bias(value, mBias, n)
                value = _add_residual(value, mRes, m, n)
                frag[i] = value

    def _matrix(ptr, rows, cols, row_stride):
        """A row-major [rows, cols] view of ``ptr``, or None (an absent epilogue input) for None."""
        if ptr is None:
            return None
        return cute.make_tensor(ptr, cute.make_layout((rows, cols), stride=(row_stride, 1)))

    def _vector(ptr, length):
        if ptr is None:
            return None
        return cute.make_tensor(ptr, cute.make_layout((length,), stride=(1,)))

    def _row_slots(tiled_mma, tile_mn):
        """(slot of each accumulator register, one register index per slot): registers grouped by row."""
        coords = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_mn))
        rows = [coords[i][0] for i in range(cute.size(coords))]
        distinct = sorted(set(rows))
        slot_of = [distinct.index(r) for r in rows]
        slot_rep = [rows.index(r) for r in distinct]
        return slot_of, slot_rep

    # Epilogue pieces. Each is a no-op at trace time when its tensor is None (the compile-time flag),
    # so a specialization contains exactly the pieces it was compiled with.

    def _scale_by_row(value, mRow, m):
        return value if mRow is None else value * mRow[m]

    def _scale_by_col(value, mCol, n):
        return value if mCol is None else value * mCol[n]

    def _add_bias(value, mBias, n):
        return value if mBias is None else value + mBias[n].to(cutlass.Float32)

    def _add_residual(value, mRes, m, n):
        return value if mRes is None else value + mRes[m, n].to(cutlass.Float32)


# --------------------------------------------------------------------------------------------------
# Compilation and cache
# --------------------------------------------------------------------------------------------------

_COMPILED: dict = {}  # (KernelConfig, arch) -> compiled kernel
_COMPILE_LOCK = threading.Lock()


# The kernel's runtime arguments after the nine pointers: (name, bytes). Order and widths as in
# ``_ScaledMmKernel.__call__``; the stream handle comes last.
_INT_ARGS = (("m", 4), ("n", 4), ("k", 4), ("lda16", 8), ("ldb16", 8), ("ldd16", 8), ("ld_res", 8),
             ("sa_rows", 4), ("ld_sa", 8), ("sb_rows", 4), ("ld_sb", 8), ("num_sms", 4))


def _fake_arguments(config: KernelConfig, distinct: bool = False):
    """Placeholders with the same runtime/static structure as the arguments `run_supported` passes:
    pointers (None for an absent epilogue input: a compile-time flag), then runtime integers. With
    ``distinct``, every pointer and integer gets its own value (what `_Marshal.learn` looks for)."""
    ab, out = _CUTE_DTYPES[config.ab], _CUTE_DTYPES[config.out]
    f32 = cutlass.Float32
    count = iter(range(1, 100))

    def _fake_pointer(dtype, align):
        address = next(count) << 20 if distinct else 1 << 20
        return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)

    pointers = (
        _fake_pointer(ab, 16),
        _fake_pointer(ab, 16),
        _fake_pointer(out, 16),
        _fake_pointer(f32, 4) if config.has_row else None,
        _fake_pointer(f32, 4) if config.has_col else None,
        _fake_pointer(_CUTE_DTYPES[config.bias], _CUTE_DTYPES[config.bias].width // 8) if config.bias else None,
        _fake_pointer(out, out.width // 8) if config.has_residual else None,
        _fake_pointer(f32, 4) if config.block_scaled else None,  # a_block
        _fake_pointer(f32, 4) if config.block_scaled else None,  # b_block
    )
    if distinct:
        return (*pointers, *_sentinels(), cuda.CUstream(_STREAM_SENTINEL))
    ints = [(cutlass.Int32 if width == 4 else cutlass.Int64)(132 if name == "num_sms" else 1)
            for name, width in _INT_ARGS]
    return (*pointers, *ints, make_fake_stream())


def _compile(config: KernelConfig, options: Optional[str] = None):
    return _compile_kernel(config, options)[0]


def _compile_kernel(config: KernelConfig, options: Optional[str] = None):
    """(compiled function, the traced kernel object: its launch facts, e.g. the shared-memory layout)."""
    kernel = _ScaledMmKernel(config)
    if options is None:
        return cute.compile(kernel, *_fake_arguments(config)), kernel
    return cute.compile(kernel, *_fake_arguments(config), options=options), kernel


def compiled_kernel(config: KernelConfig):
    """The compiled kernel for ``config``, compiled on first use (thread-safe)."""
    key = (config, "native")
    fn = _COMPILED.get(key)
    if fn is None:
        with _COMPILE_LOCK:
            fn = _COMPILED.get(key)
            if fn is None:
                fn = _COMPILED[key] = _compile(config)
    return fn


def cache_size() -> int:
    return len(_COMPILED)


# --------------------------------------------------------------------------------------------------
# Launch without the DSL's per-call argument conversion
# --------------------------------------------------------------------------------------------------


class _Marshal:
    """Launches one compiled kernel from plain Python ints.

    A compiled DSL function passes each runtime argument to its C entry as the address of a slot holding
    the value (a device pointer, an integer, the stream handle). Converting the Python arguments into
    those slots costs about 57 us per call for this kernel's 22 arguments (``generate_execution_args``,
    measured on the host), more than the launch itself. This class learns the slot order once, from the
    DSL's own conversion of distinct sentinel values, keeps one set of ctypes slots per thread, and per
    call writes the values and hands the slot addresses to ``run_compiled_program``. If the learned
    layout is not exactly the expected one, ``learn`` returns None and calls go through the DSL's own
    path; the same for a DSL other than the version this was written against (4.8) and for a compiled
    function of another class (another compiler backend, whose ``run_compiled_program`` takes Python
    arguments, not slot addresses).
    """

    def __init__(self, fn, widths: list[int]):
        self.fn = fn
        self.widths = widths  # bytes of each slot, in launch order
        # every value in one 8-byte slot (a 4-byte argument in its low half: little-endian), written by
        # one struct.pack_into per call
        self.format = "<" + "".join("q" if w == 8 else "i4x" for w in widths)
        self.local = threading.local()

    @classmethod
    def learn(cls, fn, config: KernelConfig) -> Optional["_Marshal"]:
        try:
            if not cutlass.__version__.startswith("4.8.") or type(fn).__name__ != "CudaDialectJitCompiledFunction" \
                    or getattr(fn, "total_added_arguments", 0) != 0:
                return None
            args = _fake_arguments(config, distinct=True)
            pointers = sum(a is not None for a in args[:9])
            exe_args, _keep = fn.generate_execution_args(*args)
            expected = [((j + 1) << 20, 8) for j in range(pointers)]
            expected += [(v, w) for v, (_, w) in zip(_sentinels(), _INT_ARGS)] + [(_STREAM_SENTINEL, 8)]
            if len(exe_args) != len(expected):
                return None
            for arg, (value, width) in zip(exe_args, expected):
                address = arg if isinstance(arg, int) else arg.value
                slot = ctypes.c_int32 if width == 4 else ctypes.c_int64
                if slot.from_address(address).value != value:
                    return None
            return cls(fn, [w for _, w in expected])
        except Exception as e:  # noqa: BLE001 - any surprise: the DSL's own call path still works
            logging.getLogger("fusekern").info("cute_scaled_mm: argument fast path off (%s: %s)", type(e).__name__, e)
            return None

    def _state(self):
        """This thread's slots (one buffer) and, once the DSL has launched through them, the packed
        argument array its executor built for them and the executor's C entry."""
        state = getattr(self.local, "state", None)
        if state is None:
            buffer = ctypes.create_string_buffer(8 * len(self.widths))
            base = ctypes.addressof(buffer)
            state = self.local.state = [buffer, [base + 8 * i for i in range(len(self.widths))], None]
        return state

    def __call__(self, values: list[int]) -> None:
        state = self._state()
        struct.pack_into(self.format, state[0], 0, *values)
        direct = state[2]
        if direct is not None:
            # The executor's entry called with the packed array of this thread's fixed slot addresses:
            # what ``run_compiled_program`` does after re-packing the addresses (a ctypes conversion per
            # argument) under a lock, every call (about 24 us of host time per launch altogether, git 5534c4f).
            entry, packed, executor = direct
            entry(packed)
            if executor._has_cuda_result and executor.cuda_result.value != 0:
                raise RuntimeError(f"cute_scaled_mm: launch failed (CUDA error {executor.cuda_result.value})")
            return
        self.fn.run_compiled_program(state[1])  # creates the DSL's executor on the first launch
        state[2] = self._direct(state[1])

    def _direct(self, addresses: list[int]):
        """(C entry, packed arguments, executor) for later launches, or None (calls keep going through
        ``run_compiled_program``) when the executor is not the one this was written against."""
        executor = getattr(self.fn, "_default_executor", None)
        pack = getattr(executor, "_get_invoke_packed_args_func", None)
        entry = getattr(executor, "capi_func", None)
        if pack is None or entry is None or not hasattr(executor, "_has_cuda_result"):
            return None
        built = pack(addresses)  # the executor's per-thread array: copied, so that its own calls may reuse it
        packed = (ctypes.c_void_p * len(built))()
        ctypes.memmove(packed, built, ctypes.sizeof(built))
        return entry, packed, executor


_STREAM_SENTINEL = 0x7770


def _sentinels() -> list[int]:
    """Distinct values, those of 8-byte arguments with a non-zero high word (a 4-byte slot would lose it)."""
    return [1001 + j + ((j + 1) << 32 if width == 8 else 0) for j, (_, width) in enumerate(_INT_ARGS)]


_MARSHALS: dict = {}  # KernelConfig -> _Marshal, or None where the fast path is off


def _marshal(config: KernelConfig):
    if config not in _MARSHALS:
        fn = compiled_kernel(config)  # before the lock: compiled_kernel takes it too
        with _COMPILE_LOCK:
            if config not in _MARSHALS:
                _MARSHALS[config] = None if os.environ.get("FUSEKERN_CUTE_FAST_ARGS", "1") == "0" \
                    else _Marshal.learn(fn, config)
    return _MARSHALS[config]


# --------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------

_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:  # a benign race: both writers store the same value
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]




def _pointer(t: Optional[torch.Tensor], align: int):
    """The tensor's data pointer as a CuTe gmem pointer (None stays None: an absent epilogue input)."""
    if t is None:
        return None
    return make_ptr(_CUTE_OF_TORCH[t.dtype], t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def config_for(a, b, *, row=None, col=None, bias=None, residual=None, out_dtype, num_sms=132,
               block_scaled=False) -> KernelConfig:
    if block_scaled:
        tile_m, tile_n = block_scaled_heuristics(a.shape[0], b.shape[0], num_sms)
    else:
        tile_m, tile_n = heuristics(a.shape[0], b.shape[0], num_sms)
    return KernelConfig(
        ab=_AB_DTYPES[a.dtype], out=_OUT_DTYPES[out_dtype], tile_m=tile_m, tile_n=tile_n,
        has_row=row is not None, has_col=col is not None,
        bias=None if bias is None else _BIAS_DTYPES[bias.dtype], has_residual=residual is not None,
        block_scaled=block_scaled,
    )


def _scales_for_kernel(t: torch.Tensor) -> torch.Tensor:
    """A block-scale matrix as the kernel loads it: unit last stride, a real row stride.

    A one-row or expanded (row stride 0) a_block or b_block becomes one row: the kernel clamps both row
    indices to the last row, so every row / N tile reads row 0. A one-column matrix gets a unit column
    stride.
    These are views (same storage, same elements read), never copies.
    """
    rows, cols = t.shape
    if rows == 1 or t.stride(0) == 0:
        return t.as_strided((1, cols), (max(cols, 1), t.stride(1) if cols > 1 else 1))
    if cols == 1 and t.stride(1) != 1:
        return t.as_strided((rows, 1), (t.stride(0), 1))
    return t


def cute_scaled_mm(a, b, *, row=None, col=None, bias=None, residual=None, out_dtype, a_block=None,
                   b_block=None) -> torch.Tensor:
    """out = cast((a @ b.T) * row[:, None] * col[None, :] + bias + residual), fp32 accumulation.

    With ``a_block`` / ``b_block`` (fp8 only) the product is DeepSeek's 128x128 block-scaled one:
    sum over K blocks kb of a_block[m, kb] * b_block[n // 128, kb] * (a[m, kb-block] . b[n, kb-block]).
    Raises ValueError, with the reason, for arguments the kernel does not take (see ``supports``).
    """
    reason = supports(a, b, row=row, col=col, bias=bias, residual=residual, out_dtype=out_dtype,
                      a_block=a_block, b_block=b_block)
    if reason is not None:
        raise ValueError(f"cute_scaled_mm: unsupported arguments: {reason}")
    return run_supported(a, b, row, col, bias, residual, out_dtype, a_block, b_block)


_PLANS: dict = {}  # what a launch needs beyond the tensors' addresses, per problem key (``_plan``)


def _plan(a, b, row, col, bias, residual, out_dtype, block_scaled: bool):
    """(config, compiled kernel, marshal or None, CUDA device index) for these arguments, derived once
    per key (M, N, the dtypes, which epilogue inputs, the device): the op runs per token with the same
    ones, and building the config and looking it up twice cost several µs a call."""
    key = (a.shape[0], b.shape[0], a.dtype, out_dtype, row is None, col is None,
           None if bias is None else bias.dtype, residual is None, block_scaled, a.device)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 4096:  # (one per batch size seen: bounded)
            _PLANS.clear()
        num_sms = _sm_count(a.device)
        config = config_for(a, b, row=row, col=col, bias=bias, residual=residual, out_dtype=out_dtype,
                            num_sms=num_sms, block_scaled=block_scaled)
        index = a.device.index if a.device.index is not None else torch.cuda.current_device()
        plan = _PLANS[key] = (config, compiled_kernel(config), _marshal(config), index, num_sms)
    return plan


def run_supported(a, b, row, col, bias, residual, out_dtype, a_block, b_block) -> torch.Tensor:
    """``cute_scaled_mm`` for arguments ``supports`` has accepted (callers that checked already: the
    scaled_mm op's dispatch), without checking them again."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_scaled = a_block is not None
    config, kernel, marshal, index, num_sms = _plan(a, b, row, col, bias, residual, out_dtype, block_scaled)
    if block_scaled:
        a_block, b_block = _scales_for_kernel(a_block), _scales_for_kernel(b_block)
        sa_rows, ld_sa, sb_rows, ld_sb = a_block.shape[0], a_block.stride(0), b_block.shape[0], b_block.stride(0)
    else:
        sa_rows = ld_sa = sb_rows = ld_sb = 1
    tensors = (a, b, out, row, col, bias, residual, a_block, b_block)
    ints = (m, n, k,
            a.stride(0) * a.element_size() // 16, b.stride(0) * b.element_size() // 16, n * out.element_size() // 16,
            1 if residual is None else residual.stride(0),
            sa_rows, ld_sa, sb_rows, ld_sb, num_sms)
    stream = torch._C._cuda_getCurrentRawStream(index)  # (torch.cuda.current_stream builds a Stream object)
    if marshal is not None:
        marshal([t.data_ptr() for t in tensors if t is not None] + list(ints) + [stream])
        return out
    aligns = (16, 16, 16, 4, 4, None if bias is None else bias.element_size(),
              None if residual is None else residual.element_size(), 4, 4)
    kernel(*(_pointer(t, al) for t, al in zip(tensors, aligns)), *ints, cuda.CUstream(stream))
    return out


# --------------------------------------------------------------------------------------------------
# Ahead-of-time builds for sm_90a (no GPU needed)
# --------------------------------------------------------------------------------------------------


def shipped_configs() -> list[KernelConfig]:
    """The representative specializations built and checked in CI.

    Every tile shape with the fp8 row+col+bias epilogue (the W8A8 linear), every input dtype and
    output dtype at 128x128, and the remaining epilogue flags (bf16 col+residual, the bare GEMM); the
    block-scaled fp8 GEMM (DeepSeek linear) bare at each of its tiles and with a row+col+bias epilogue at
    128x128 and 128x256.
    """
    configs = [KernelConfig("f8e4m3", "bf16", tm, tn, has_row=True, has_col=True, bias="bf16")
               for tm, tn in _TILES]
    configs += [
        KernelConfig("bf16", "bf16", 128, 128, has_col=True, has_residual=True),
        KernelConfig("bf16", "bf16", 128, 256, has_col=True, has_residual=True),
        KernelConfig("bf16", "bf16", 64, 128),
        KernelConfig("f16", "f16", 128, 128, has_row=True, bias="f32"),
        KernelConfig("bf16", "f32", 128, 128, has_row=True, has_col=True, bias="f32", has_residual=True),
        KernelConfig("f8e4m3", "f16", 128, 256, has_col=True, has_residual=True),
        KernelConfig("f8e4m3", "bf16", 128, 128, block_scaled=True),
        KernelConfig("f8e4m3", "bf16", 64, 128, block_scaled=True),
        KernelConfig("f8e4m3", "bf16", 128, 128, has_row=True, has_col=True, bias="bf16", block_scaled=True),
        KernelConfig("f8e4m3", "bf16", 128, 256, block_scaled=True),
        KernelConfig("f8e4m3", "f16", 128, 256, has_row=True, has_col=True, bias="f32", block_scaled=True),
    ]
    return configs


def _tool(name: str) -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


def read_resources(cubin: str, ptx: Optional[str] = None) -> dict:
    """Registers, stack and local memory (cuobjdump -res-usage) and spill bytes (ptxas -v on the PTX).

    Registers are the allocation ptxas made for the whole kernel; at run time ``setmaxnreg`` moves
    registers from the producer to the consumer warpgroups.
    """
    info: dict = {}
    cuobjdump = _tool("cuobjdump")
    if cuobjdump:
        text = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True).stdout
        if match := re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text):
            info.update(registers=int(match[1]), stack=int(match[2]), shared=int(match[3]), local=int(match[4]))
    # The DSL writes PTX 8.8: Triton's ptxas-blackwell (CUDA 12.9) reads it, its plain ptxas does not.
    ptxas = _tool("ptxas-blackwell") or _tool("ptxas")
    if ptxas and ptx and os.path.exists(ptx):
        result = subprocess.run([ptxas, "-v", "-arch=sm_90a", ptx, "-o", os.devnull],
                                capture_output=True, text=True)
        stores = [int(x) for x in re.findall(r"(\d+) bytes spill stores", result.stderr)]
        loads = [int(x) for x in re.findall(r"(\d+) bytes spill loads", result.stderr)]
        if stores or loads:
            info.update(spill_stores=sum(stores), spill_loads=sum(loads))
            # info C7514: ptxas made every WGMMA wait for the previous one (ordinary instructions touch WGMMA
            # registers where it cannot prove the WGMMAs writing them are done)
            info.update(wgmma_serialized="C7514" in result.stderr)
    return info


def aot_builds() -> list:
    """The shipped specializations as register-report entries (``fusekern.kernels.catalog``); none without
    the CuTe DSL."""
    from fusekern.kernels.catalog import CuteBuild

    if _CUTLASS_ERROR is not None:
        return []
    return [CuteBuild(kernel="cute_scaled_mm", config=c.name, cute_config=c) for c in shipped_configs()]


def aot_compile_sm90a(out_dir: str, configs: Optional[list[KernelConfig]] = None) -> list[dict]:
    """Build every shipped specialization for sm_90a (no GPU needed) into ``out_dir``.

    Returns one dict per build: name, config, cubin and ptx paths, the resources read back, and whether
    the launch's argument fast path (``_Marshal``) recognised the compiled function's argument slots.
    """
    if _CUTLASS_ERROR is not None:
        raise RuntimeError(_CUTLASS_ERROR)
    results = []
    for config in configs or shipped_configs():
        build_dir = os.path.abspath(os.path.join(out_dir, config.name))
        os.makedirs(build_dir, exist_ok=True)  # the DSL does not create its dump directory
        fn, kernel = _compile_kernel(config, options=f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir={build_dir}")
        cubins = [os.path.join(build_dir, f) for f in sorted(os.listdir(build_dir)) if f.endswith(".cubin")]
        ptxs = [os.path.join(build_dir, f) for f in sorted(os.listdir(build_dir)) if f.endswith(".ptx")]
        fast_args = _Marshal.learn(fn, config) is not None
        del fn
        entry = {"name": config.name, "config": dataclasses.asdict(config),
                 "cubin": cubins[0] if cubins else None, "ptx": ptxs[0] if ptxs else None,
                 "fast_args": fast_args, "threads": kernel.num_threads,
                 "dynamic_shared": kernel.shared_storage.size_in_bytes()}
        if entry["cubin"]:
            entry.update(read_resources(entry["cubin"], entry["ptx"]))
        results.append(entry)
    return results
