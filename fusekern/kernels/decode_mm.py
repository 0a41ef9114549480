"""Generated GEMMs whose weight-load stage is a decode program: ``out = x @ W (+ bias)``.

``W[(b,) k, n]`` is never written to memory: each program's decode (``fusekern.patterns.decode``)
becomes Triton code that loads the packed leaves of one ``[BLOCK_K, BLOCK_N]`` weight tile, decodes it
in registers, and feeds the product. One Python module is generated per program (it is the
specialization: leaf dtypes, shapes and strides are constants in it), written to a cache directory
and imported once per process.

Read top to bottom: configs -> code generation -> launcher -> reference -> custom op.

Paths, chosen at run time by M (so dynamic M works); see ``select_config`` for the measurements:
- M == 1: GEMV. Each program reduces a K-slice for BLOCK_N columns on CUDA cores, accumulating per
  (k, n) and summing once; split-K adds programs when there are too few column tiles to fill the SMs.
- M > 1: the generated ``decode_kernel`` writes the weight once in the activation dtype and cuBLAS
  multiplies.
- Tensor-core tiles (``Config`` with BLOCK_M >= 16, optionally swap-AB) decode inside the GEMM's K loop;
  they are correct and tested but slower than decode + cuBLAS on the H200, so dispatch does not pick them.
- A program of a recognized format comes with a ``PackedLayout``: the hand-tuned kernels of
  ``fusekern.kernels.packed_mm`` (GEMV, swap-AB tensor-core tile, decode + cuBLAS) are then candidates
  too, listed first; the tuner keeps whichever path measures fastest.
- The computation the rewrite replaced, compiled by stock inductor (``decode_mm_stock.StockConfig``), is
  timed with them: where it is the fastest, the op runs it (a replacement never loses to stock).
Split-K partial sums go to an fp32 workspace and are summed in a fixed order (deterministic).
Loads that read one element per aligned block of k (group scales, zero points) load one row per tile.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import logging
import math
import os
import tempfile
from dataclasses import dataclass

import sympy
import torch
import triton
from torch.utils._sympy.functions import FloorDiv, ModularIndexing
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from fusekern.compiler_pass import direct_calls
from fusekern.kernels import int4_mma as im
from fusekern.kernels import int4_mma_n as imn
from fusekern.kernels import int4_mma_sync as ims
from fusekern.kernels import fp4_mma as f4
from fusekern.kernels import fp4_mma_sync as f4s
from fusekern.kernels import decode_mm_stock as stock
from fusekern.kernels import fp8_mma as f8
from fusekern.kernels import packed_mm as pm
from fusekern.kernels import replay, layout_guard
from fusekern.kernels import device_info
from fusekern.kernels.device_info import sm_count
from fusekern.kernels.intmath import cdiv, next_power_of_2
from fusekern.kernels.leaf_cache import LeafCache
from fusekern.patterns.decode.layout import PackedLayout
from fusekern.patterns.decode.program import (
    B, CMP, FP8_DTYPES, K, N, DecodeProgram, Ref, container, is_int,
)

log = logging.getLogger("fusekern")

# Bumped whenever the code generator, kernel template or heuristics change (part of the cache key).
KERNEL_VERSION = "decode_mm-3"

SUPPORTED_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class Config:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int
    SWAP_AB: bool = False  # tensor cores on W^T x^T: N fills the MMA's 64-row side when M is small

    @property
    def use_dot(self) -> bool:
        return self.BLOCK_M >= 16


@dataclass(frozen=True)
class DequantConfig:
    """Large M: decode the weight once into memory (activation dtype), then cuBLAS."""

    BLOCK_K: int = 64
    BLOCK_N: int = 128
    num_warps: int = 4


# M thresholds between the paths: the GEMV for one row; above it the weight is decoded once and cuBLAS
# multiplies. Measured on the H200 (benchmarks/results/h200/decode_mm_sweep.csv, N = K = 8192): the
# generated tensor-core kernels (plain and swap-AB, 16..128-row tiles) ran at 118-2590 us for M = 16 and
# 2.2-41 ms for M = 2048, where decode + cuBLAS took 440-720 us at M = 2048. Triton computes the decode
# in the MMA operand layout, which replicates it across warps; the tiles stay available (explicit
# configs, tested) for part 2's hand-tuned kernels to build on.
GEMV_M_MAX = 1
# The hand-tuned GEMV reads the weight once per row (the rows after the first mostly from L2).
PACKED_GEMV_M_MAX = 4


@functools.lru_cache(maxsize=4096)
def select_config(M: int, N: int, K: int, batch: int = 1, sms: int = 132, layout: str = ""):
    """The launch config for one problem size (dynamic M: chosen per call) when nothing was measured."""
    lay = PackedLayout.from_text(layout) if batch == 1 else None
    if lay is not None:
        return _packed_candidates(M, N, K, sms, lay)[0]  # decode + cuBLAS closes every list
    if M <= GEMV_M_MAX:
        # 32 x 256 tiles at 8 warps: the best or near-best of six shapes on gptq, awq, mxfp4, fp8 blocks
        # and uint8-packed int4 (sweep CSV); 4 warps spilled on one decode.
        tiles = batch * cdiv(N, 32)
        return Config(1, 32, 256, _split_k(tiles, cdiv(K, 256), sms), 1, 8, 3)
    return DequantConfig()


def _packed_candidates(M: int, N: int, K: int, sms: int, lay: PackedLayout,
                       x_dtype: torch.dtype | None = None) -> list:
    """The hand-tuned kernels' configs for a problem size (``fusekern.kernels.packed_mm``): GEMV tiles
    for a few rows, swap-AB tensor-core tiles up to 64 rows, the register-decoded int4 tensor-core kernels
    (int4 along K up to 64 rows, along N up to 16, of bf16; never first: ``select_config``, used where
    nothing can be timed and x's dtype is not known, keeps the kernels of every layout), and their decode +
    cuBLAS at any M.
    x_dtype: None where unknown."""
    out = []
    if M <= PACKED_GEMV_M_MAX:
        if lay.pack_axis == "N":
            # packed along N (AWQ): narrow column tiles and many programs won on the H200
            # (benchmarks/results/h200/packed_mm_sweep.csv, N = K = 8192)
            for bn, bk, warps, per_sm in ((32, 128, 4, 4), (64, 64, 4, 4), (128, 64, 8, 2), (32, 64, 2, 4)):
                out.append(pm.PackedGemv(bn, bk, _split_k(cdiv(N, bn), cdiv(K, bk), sms, per_sm),
                                         warps))
        else:
            # K tiles of 128 and 4-8 programs per SM (split K, reduced in the kernel) won on every format
            # (benchmarks/results/h200/gemv_sweep.csv, N = K = 8192: 56 configs x 6 formats); these five
            # were within 8% of each format's best.
            for bn, warps, per_sm, vec_k in ((64, 4, 8, False), (64, 4, 4, False), (128, 8, 8, False),
                                             (32, 4, 4, False), (64, 4, 4, True)):
                if vec_k and not (lay.bits == 8 and lay.code_dims[-1] == "k"):
                    continue  # vector loads along K won only for 1-byte codes contiguous along K
                sk = _split_k(cdiv(N, bn), cdiv(K, 128), sms, per_sm)
                out.append(pm.PackedGemv(bn, 128, sk, warps, vec_k=vec_k))
            if lay.bits == 8 and lay.code_dims[-1] == "k" and lay.group_k >= 256:
                # 1-byte codes along K with per-channel (or wide-group) scales: 256-deep K tiles on 8 warps, 2
                # programs per SM, 5% faster than the tiles above for FP8 at 8192 x 8192, M = 1 (19.9 against
                # 20.9 µs, a streaming read of the same bytes 18.1: benchmarks/results/h200/fp8_gemv_probe.csv)
                out.append(pm.PackedGemv(64, 256, _split_k(cdiv(N, 64), cdiv(K, 256), sms, 2), 8, vec_k=True))
    if 1 < M <= 64:
        bm = max(16, next_power_of_2(M))
        for bn, bk, warps in ((64, 128, 4), (128, 64, 4), (64, 64, 4)):
            tiles = cdiv(N, bn) * cdiv(M, bm)
            out.append(pm.PackedDot(bm, bn, bk, _split_k(tiles, cdiv(K, bk), sms), warps))
    if M <= im.M_MAX and im.layout_fits(lay) and K % im.GROUP == 0 and N % 8 == 0 \
            and x_dtype in (None, torch.bfloat16):
        # 128-column tiles on 4 warps, 2-4 programs per SM (H200, N = K = 8192, M = 1 and 16:
        # benchmarks/results/h200/gptq_mma_variants.csv, GPTQ), words loaded directly or through TMA 3
        # deep (int4_mma_tma_sweep.csv: TMA 4-21% faster on issue 4's shapes; both timed per shape)
        # (scale_first, for bf16 scales: 128 registers against 167, 2-3% faster on GPTQ and -8% to +3% on
        # two codes per byte in the same sweep; with other scale dtypes the launcher runs it as the plain
        # TMA config, so that one is timed twice)
        # More than 16 rows pad x to 32 or 64 (``im.block_m``): the accumulator grows with it (168-254
        # registers for 128 columns at 64 rows, sm_90a), so 64-column tiles are offered there too.
        widths = (128,) if M <= 16 else (128, 64)
        out += dict.fromkeys(im.Int4Mma(bn, im.split_k_for(N, K, bn, sms, per_sm), 4, tma=tma,
                                        num_stages=3 if tma else 1, scale_first=sf)
                             for bn in widths for tma, sf in ((False, False), (True, False), (True, True))
                             for per_sm in (4, 2))
    if ims.fits(lay, M, K, x_dtype):
        # int4 along K, up to 8 rows, on mma.sync: one 16-column group per warp, or two sharing x; about
        # 4 or 8 programs of 4 warps per SM (H200, M = 1: benchmarks/results/h200/int4_mma_sync_sweep.csv,
        # 2 and 16 per SM were slower on every shape; two groups of words loaded ahead did not help:
        # int4_mma_sync_prefetch_sweep.csv)
        out += dict.fromkeys(dataclasses.replace(c, SPLIT_K=im.split_k_for(N, K, c.BLOCK_N, sms, per_sm))
                             for c in (ims.Int4MmaSync(GROUPS_PER_WARP=1), ims.Int4MmaSync(GROUPS_PER_WARP=2))
                             for per_sm in (8, 4))
    if M <= imn.M_MAX and imn.layout_fits(lay) and K % imn.GROUP == 0 and N % 8 == 0 \
            and x_dtype in (None, torch.bfloat16):
        # int4 packed along N (AWQ) on tensor cores, 256-column tiles, K split for one wave of 2 or 3
        # programs per SM. H200 (benchmarks/results/h200/int4_mma_n_sweep_c8a9946.csv, about 2 per SM:
        # scaling before the MMA won at M = 16 on three of four shapes, the plain tile without the next
        # tile's words loaded ahead on the fourth; int4_mma_n_sweep.csv, 3 per SM: scaling first won at
        # M = 1 on the large shapes, the plain tile at M = 16 and on 4096 x 4096; a 128-register cap for
        # 4 per SM did not help; int4_mma_n_dispatch_2f93f19.csv: TMA words 19.4 against 19.8 us at
        # N = K = 8192, M = 1). TMA needs rows of N / 8 words a multiple of 16 bytes (else it would run
        # the direct-load kernel under another name).
        two, three = imn.split_k_for(N, K, sms, 2), imn.split_k_for(N, K, sms, 3)
        out += dict.fromkeys([imn.Int4MmaN(three, scale_first=True), imn.Int4MmaN(two, scale_first=True),
                              imn.Int4MmaN(two, prefetch=False), imn.Int4MmaN(three, prefetch=False)])
        if N % 32 == 0:
            out.append(imn.Int4MmaN(three, prefetch=False, scale_first=True, tma=True, num_stages=4))
    if f4.fits(lay, M, K, x_dtype):
        # MXFP4 on tensor cores, decoded by an in-register lookup table: int4_mma's 128-column tiles, about 4 or 2
        # programs per SM
        out += dict.fromkeys(f4.Fp4Mma(128, im.split_k_for(N, K, 128, sms, per_sm)) for per_sm in (4, 2))
    if 1 < M and f8.fits(lay, M, K, x_dtype):
        # FP8 (e4m3) and 8-bit integer codes on tensor cores in f16, 2-16 rows (one row: the GEMV is faster for
        # FP8). H200, FP8, M = 16 (benchmarks/results/h200/fp8_dot_probe*.csv): 64-column tiles at about 2
        # programs per SM and 128-column ones at about 1 were the fastest on issue 4's shapes, 4-11% faster than
        # the generic tile (int8 codes: the same tiles, not yet timed on a GPU; the tuner measures them)
        out += dict.fromkeys(f8.Fp8Mma(bn, 128, _split_k(cdiv(N, bn), cdiv(K, 128), sms, per_sm))
                             for bn, per_sm in ((64, 2), (128, 1)))
    if f4s.fits(lay, M, K, x_dtype):
        # FP4 (MXFP4, NVFP4) up to 16 rows on mma.sync, int4_mma_sync's schedule (64 columns on 4 warps).
        # H200 (benchmarks/results/h200/fp4_mma_sync_sweep_*.csv, 2-16 programs per SM, 4 or 8 warps): the
        # fastest had 4 warps and about 8 or 4 programs per SM, at 9-16 rows also 2 (4096 x 4096: the
        # split-K partials grow with the rows)
        out += dict.fromkeys(f4s.Fp4MmaSync(im.split_k_for(N, K, 64, sms, per_sm))
                             for per_sm in ((8, 4) if M <= 8 else (8, 4, 2)))
    out.append(pm.dequant_config(lay))
    return [c for c in out if pm.fits(lay, c)]


def candidates(M: int, N: int, K: int, batch: int = 1, sms: int = 132, layout: str = "",
               x_dtype: torch.dtype | None = None) -> list:
    """What ``tuned_config`` times for a problem size. Each decode favours other tiles (measured on the
    H200 at N = K = 8192: the best GEMV tile was 32x128 / 4 warps for gptq and awq, 64x128 / 8 warps for
    mxfp4 and fp8 blocks, 32x256 / 8 warps for uint8-packed int4), so the first call measures them.
    A program with a packed layout (a known format) adds the hand-tuned kernels' configs first."""
    lay = PackedLayout.from_text(layout) if batch == 1 else None
    packed = _packed_candidates(M, N, K, sms, lay, x_dtype) if lay is not None else []
    return packed + _generated_candidates(M, N, K, batch, sms)


def _generated_candidates(M: int, N: int, K: int, batch: int, sms: int) -> list[Config | DequantConfig]:
    if M == 1:
        out = []
        for bn, bk, warps in ((32, 256, 8), (32, 128, 4), (64, 128, 8)):
            tiles = batch * cdiv(N, bn)
            out.append(Config(1, bn, bk, _split_k(tiles, cdiv(K, bk), sms), 1, warps, 3))
        return out + [DequantConfig()]
    if M <= 64:
        bm = max(16, next_power_of_2(M))
        out = []
        for bk, stages in ((128, 2), (64, 3)):
            tiles = batch * cdiv(N, 64) * cdiv(M, bm)
            out.append(Config(bm, 64, bk, _split_k(tiles, cdiv(K, bk), sms), 1, 4, stages, SWAP_AB=bm <= 32))
        return [DequantConfig(), *out]
    return [DequantConfig()]


def min_capability(cfg, lay: PackedLayout | None = None) -> tuple[int, int]:
    """The oldest GPU (compute capability) whose compiler takes ``cfg``'s kernel for weights of layout ``lay``
    (None: not a known format): TMA descriptors and the FP4 tables' packed bf16 scale multiply
    (``mul.rn.bf16x2``) are taken as Hopper's, FP8 values or E4M3 scales (FP8 formats, NVFP4) need Ada's
    conversions; the rest (bf16 MMAs, ``lop3`` / ``prmt`` decodes) Ampere. (The patterns decline FP8 decodes
    below sm_89 too.)"""
    if isinstance(cfg, (f4.Fp4Mma, f4s.Fp4MmaSync)) or getattr(cfg, "tma", False):
        return device_info.HOPPER
    if (lay is not None and "fp8" in (lay.value, lay.scale_enc)) or (lay is None and isinstance(cfg, f8.Fp8Mma)):
        return device_info.FP8_CAPABILITY  # (fp8_mma on 8-bit integer codes converts no FP8 value)
    return device_info.MIN_CAPABILITY


def runs_on(cfg, device: torch.device, lay: PackedLayout | None = None) -> bool:
    """Whether ``cfg``'s kernel compiles for ``device`` (always on CPU and under the interpreter)."""
    cap = device_info.capability(device)
    return cap is None or cap >= min_capability(cfg, lay)


def device_candidates(M: int, N: int, K: int, batch: int, layout: str, x_dtype: torch.dtype,
                      device: torch.device) -> list:
    """``candidates`` whose kernels compile for ``device``: what ``tuned_config`` times there."""
    lay = PackedLayout.from_text(layout)
    return [c for c in candidates(M, N, K, batch, sm_count(device), layout, x_dtype) if runs_on(c, device, lay)]


def untimed_config(M: int, N: int, K: int, batch: int, layout: str, device: torch.device):
    """``select_config``'s choice where nothing can be timed (a CUDA graph capture), or, where its kernel
    does not compile for ``device``, the first candidate that does."""
    cfg = select_config(M, N, K, batch, sm_count(device), layout)
    if runs_on(cfg, device, PackedLayout.from_text(layout)):
        return cfg
    cands = device_candidates(M, N, K, batch, layout, None, device)
    return cands[0] if cands else cfg


def check_runs_on(cfg, device: torch.device, lay: PackedLayout | None = None) -> None:
    """ValueError where ``cfg``'s kernel does not compile for ``device``."""
    if not runs_on(cfg, device, lay):
        cap, have = min_capability(cfg, lay), device_info.capability(device)
        raise ValueError(f"decode_mm_triton: {type(cfg).__name__} needs sm_{cap[0]}{cap[1]} or newer for this "
                         f"layout, {device} is sm_{have[0]}{have[1]}")


_tuned: dict = {}  # (program, M bucket, batch, device) -> the fastest measured config
timings: dict = {}  # the same keys -> {config: milliseconds} of each candidate timed (benchmarks report them)


def tuned_config(x: torch.Tensor, leaves, text: str, bias, batch: int, M: int, layout: str = ""):
    """The fastest of ``candidates`` and the stock computation (``decode_mm_stock``) for this program and M
    (rounded up to a power of two) whose output agrees with the decode-once path's, measured on the first
    call and cached per device. While a CUDA graph is being captured nothing can be timed: the cached
    choice, or ``select_config``, is used."""
    prog = DecodeProgram.from_text(text)
    bucket = next_power_of_2(M)
    key = (text, layout, bucket, batch, x.device)
    if key in _tuned:
        return _tuned[key]
    cands = device_candidates(bucket, prog.N, prog.K, batch, layout, x.dtype, x.device)
    if stock.enabled():
        cands.append(stock.StockConfig())
    if len(cands) == 1 and not isinstance(cands[0], stock.StockConfig):  # (stock alone is still checked)
        _tuned[key] = cands[0]
        return cands[0]
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return untimed_config(M, prog.N, prog.K, batch, layout, x.device)
    # Each candidate is checked on rows drawn here (the caller's may hold NaN or zeros) against the
    # decode-once path: the generated decode kernel and cuBLAS, one weight in x's dtype of memory.
    probe = torch.randn(x.shape, generator=torch.Generator(x.device).manual_seed(0), device=x.device,
                        dtype=x.dtype)
    try:
        ref = decode_mm_triton(probe, leaves, text, bias, DequantConfig(), layout=layout)
    except Exception as e:  # noqa: BLE001 - nothing to check against: time only, as before the check
        log.warning("fusekern decode_mm: no reference for %s (%s): candidates are timed unchecked", text[:60], e)
        ref = None
    times = timings[key] = {}
    best = fastest_correct(cands, lambda cfg, rows: functools.partial(decode_mm_triton, rows, leaves, text, bias,
                                                                      cfg, layout=layout),
                           x, probe, functools.partial(_gpu_time, device=x.device), ref,
                           f"a {prog.K}x{prog.N} weight", times)
    _tuned[key] = best = best or DequantConfig()
    kernels = [ms for c, ms in times.items() if not isinstance(c, stock.StockConfig)]
    log.info("fusekern decode_mm: a %dx%d weight, %d rows: %s (%.1f us; fastest kernel %.1f us, stock %.1f us)",
             prog.K, prog.N, M, best, 1e3 * times.get(best, float("nan")), 1e3 * min(kernels, default=float("nan")),
             1e3 * times.get(stock.StockConfig(), float("nan")))
    return best


# How far a candidate's output may be from the reference, element by element, against the element's size
# plus the mean size (sums near zero): a few roundings of the output dtype. A wrong decode, or a wrong tile
# or column, is off by its whole size.
AGREEMENT = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-3}


def fastest_correct(cands, run_of, x, probe, time_of, ref: torch.Tensor | None, what: str,
                    times: dict | None = None):
    """The fastest candidate whose output on ``probe`` agrees with ``ref`` (None: none to check against),
    timed on ``x``: ``run_of(cfg, rows)`` gives a call that runs it, ``time_of(run)`` its time. A
    candidate that fails, or whose result is off anywhere (a kernel wrong on this GPU or for these
    leaves), is skipped: measuring must never pick a fast wrong kernel. A config that refuses the input
    (ValueError: its kernel cannot read these leaves) is skipped quietly. ``times``: filled with each timed
    candidate's milliseconds."""
    best, best_ms = None, float("inf")
    if ref is not None:
        ref32 = ref.float()
        bound = AGREEMENT.get(ref.dtype, 1e-3) * (ref32.abs() + ref32.abs().mean())
    for cfg in cands:
        try:
            if ref is not None:
                out = run_of(cfg, probe)()  # compiles
                bad = ~((out.float() - ref32).abs() <= bound)  # NaN too
                if bad.any():
                    log.warning("fusekern decode_mm: %s for %s is off at %d of %d outputs: skipped", cfg, what,
                                int(bad.sum()), bad.numel())
                    continue
            run = run_of(cfg, x)
            run()  # compiles (unchecked)
            ms = time_of(run)
        except ValueError as e:
            log.info("fusekern decode_mm: %s does not take %s: %s", cfg, what, e)
            continue
        except Exception as e:  # a config that does not fit or compile for this device: skip it
            log.warning("fusekern decode_mm: skipping %s for %s: %s", cfg, what, e)
            continue
        if times is not None:
            times[cfg] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best


# Tuning times each launch with the weights out of L2 (COLD_L2): in a model's decode step every weight
# comes from DRAM, since the other layers' weights pass through L2 between two uses of one, while launches
# timed back to back re-read a weight of up to ~50 MB (the H200's L2) partly from L2, and the configs rank
# differently there (an L2 read is not a DRAM read: the q / k / v and o projections are 8-13 MB).
COLD_L2 = True


def _l2_flush_buffer(device: torch.device) -> torch.Tensor | None:
    """Twice the L2 size, from the caching allocator (reused by other tensors once tuning is done); None
    when the memory is not there (the launches are then timed back to back, as without COLD_L2)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
    try:
        return torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)
    except torch.OutOfMemoryError:
        return None


def _gpu_time(run, reps: int = 3, launches: int = 10, device: torch.device | None = None) -> float:
    """Milliseconds of GPU time per ``run()`` on ``device`` (the current one by default): the launches
    queue up behind a device-side sleep, so the events time the kernels, not the Python that launches them
    (a small GEMV runs in less time than its launch takes on the CPU; timing launches picked configs at
    random). With COLD_L2 each launch is timed alone, after a read of twice the L2 size (outside the
    events) has replaced its lines with clean ones, as the other layers' weights leave them in a step."""
    if device is None or device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        flush = _l2_flush_buffer(device) if COLD_L2 else None
        cold = flush is not None
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(launches if cold else 1)]
        times = []
        for _ in range(reps):
            torch.cuda._sleep(12_000_000)  # ~6 ms: the host queues every launch (and flush) before it ends
            if cold:
                for start, end in pairs:
                    flush.max()  # a read: the weights leave L2 and no dirty line is left to write back
                    start.record()
                    run()
                    end.record()
                pairs[-1][1].synchronize()
                times.append(sum(start.elapsed_time(end) for start, end in pairs) / launches)
            else:
                start, end = pairs[0]
                start.record()
                for _ in range(launches):
                    run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / launches)
    return sorted(times)[reps // 2]


def _split_k(tiles: int, k_tiles: int, sms: int, per_sm: int = 2) -> int:
    """Enough K-slices that about ``per_sm`` programs run per SM, each reducing at least two K-tiles."""
    want = cdiv(per_sm * sms, max(tiles, 1))
    return max(1, min(want, 16, k_tiles // 2))


# ----------------------------------------------------------------------------- code generation

_TL = {
    torch.bool: "tl.int1", torch.uint8: "tl.uint8", torch.int8: "tl.int8", torch.int16: "tl.int16",
    torch.int32: "tl.int32", torch.int64: "tl.int64", torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32", torch.float64: "tl.float64",
    torch.float8_e4m3fn: "tl.float8e4nv", torch.float8_e5m2: "tl.float8e5",
}


def tl_dtype(d: torch.dtype) -> str:
    try:
        return _TL[d]
    except KeyError:
        raise NotImplementedError(f"no Triton dtype for {d}") from None


def texpr(e) -> str:
    """An index expression (or condition) as Triton code over the tensors ``b``, ``k``, ``n``."""
    if isinstance(e, int):
        return str(e)
    if isinstance(e, sympy.Symbol):
        return e.name
    if e.is_Integer:
        return str(int(e))
    a = [texpr(x) for x in e.args]
    if isinstance(e, sympy.Add):
        return "(" + " + ".join(a) + ")"
    if isinstance(e, sympy.Mul):
        return "(" + " * ".join(a) + ")"
    if isinstance(e, FloorDiv):
        return f"({a[0]} // {a[1]})"
    if isinstance(e, ModularIndexing):
        inner = a[0] if e.args[1] == 1 else f"({a[0]} // {a[1]})"
        return f"({inner} % {a[2]})"
    if isinstance(e, sympy.Mod):
        return f"({a[0]} % {a[1]})"
    ops = {sympy.StrictLessThan: "<", sympy.LessThan: "<=", sympy.StrictGreaterThan: ">",
           sympy.GreaterThan: ">=", sympy.Equality: "==", sympy.Unequality: "!="}
    if type(e) in ops:
        return f"({a[0]} {ops[type(e)]} {a[1]})"
    if isinstance(e, sympy.And):
        return "(" + " & ".join(a) + ")"
    raise NotImplementedError(f"index expression {e} ({type(e).__name__})")


def _wrap(v: str, d: torch.dtype) -> str:
    """An integer container expression wrapped to dtype d (see program.wrap_int)."""
    if d == torch.bool:
        return f"({v} != 0).to(tl.int32)"
    if d == torch.uint8:
        return f"({v} & 255)"
    if d in (torch.int8, torch.int16):
        s = 32 - 8 * d.itemsize
        return f"(({v} << {s}) >> {s})"
    return v


def _round(v: str, src: torch.dtype, d: torch.dtype) -> str:
    """Container value of dtype ``src`` converted to dtype ``d`` and held in d's container."""
    c = container(d)
    if is_int(d):
        if not is_int(src) and d == torch.bool:  # torch: x != 0 (0.5 is True), not a truncation
            return f"({v} != 0).to({tl_dtype(c)})"
        if not is_int(src):  # float -> integer truncates; uint8 goes through int64 (wrapped below)
            v = f"{v}.to(tl.int64)" if c == torch.int64 or d == torch.uint8 else f"{v}.to(tl.int32)"
        return _wrap(f"{v}.to({tl_dtype(c)})", d)
    if d in (torch.float32, torch.float64):
        return f"{v}.to({tl_dtype(d)})"
    if is_int(src):
        v = f"{v}.to(tl.float32)"
    return f"{v}.to({tl_dtype(d)}).to({tl_dtype(c)})"


_BIN = {"add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^", "shl": "<<", "shr": ">>"}
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def _in_range(e, size: int, ranges: dict) -> bool:
    try:
        r = bound_sympy(sympy.sympify(e), ranges)
        return r.lower >= 0 and r.upper <= size - 1
    except Exception:
        return False


K0 = sympy.Symbol("k0", integer=True, nonnegative=True)


def _k_block(index, prog: DecodeProgram) -> int:
    """The largest power of two p <= 256 such that the index is the same for every k of each aligned
    block of p (checked numerically over all k and a sample of n)."""
    from fusekern.patterns.decode.program import eval_index

    ks = torch.arange(prog.K)[:, None]
    ns = torch.tensor(sorted({*range(min(prog.N, 32)), *range(max(prog.N - 32, 0), prog.N)}))[None, :]
    full = [torch.as_tensor(eval_index(e, {"k": ks, "n": ns, "b": 0})) for e in index]
    for p in (256, 128, 64, 32, 16):
        blocked = [torch.as_tensor(eval_index(e, {"k": (ks // p) * p, "n": ns, "b": 0})) for e in index]
        if all(torch.equal(*torch.broadcast_tensors(f, g)) for f, g in zip(full, blocked)):
            return p
    return 1


def _index(a, size: int, ranges) -> str:
    """An index expression as Triton code, clamped into [0, size) unless its range provably fits there
    (a cat part's index runs outside the part where the part is not selected)."""
    idx = f"({texpr(a)})"
    if not _in_range(a, size, ranges):
        idx = f"tl.minimum(tl.maximum({idx}, 0), {size - 1})"
    return idx


def _row_terms(index, leaf, ranges) -> list[str]:
    """Offset terms of a load at the tile's first k (``k0``): one row of the tile."""
    ranges = {**ranges, K0: ranges[K]}
    return [f"{idx} * {st}" if st != 1 else idx
            for dim, (a, st) in enumerate(zip(index, leaf.stride)) if st
            for idx in [_index(a.subs(K, K0) if isinstance(a, sympy.Basic) else a, leaf.shape[dim], ranges)]]


def decode_source(prog: DecodeProgram) -> str:
    """The body of ``_decode(L0.., k, n, b, wmask, k0, nmask, BLOCK_K)``: the weight tile in its container,
    zero where masked (k0: the tile's first k; nmask: the tile's columns in range)."""
    ranges = {K: ValueRanges(0, prog.K - 1), N: ValueRanges(0, prog.N - 1), B: ValueRanges(0, max(prog.batch - 1, 0))}
    lines = []

    def ref(a, d: torch.dtype) -> str:
        if isinstance(a, Ref):
            return f"v{a.i}"
        if isinstance(a, sympy.Basic):
            return f"({texpr(a)})"
        if isinstance(a, float) and not math.isfinite(a):
            raise NotImplementedError(f"non-finite constant {a} in a decode")
        return f"tl.full((1, 1), {a!r}, {tl_dtype(container(d))})"

    for i, ins in enumerate(prog.instrs):
        d, c = ins.dtype, container(ins.dtype)
        op, args = ins.op, ins.args
        if op == "load":
            leaf = prog.leaves[args[0]]
            terms, conds = [], []
            for dim, (a, st) in enumerate(zip(args[1:], leaf.stride)):
                size = leaf.shape[dim]
                if isinstance(a, Ref):  # a table lookup: wrap negative codes, mask codes out of range
                    idx = f"v{a.i}"
                    if prog.instrs[a.i].dtype not in (torch.uint8, torch.bool):
                        idx = f"tl.where({idx} < 0, {idx} + {size}, {idx})"
                    lines.append(f"i{i}_{dim} = {idx}")
                    idx = f"i{i}_{dim}"
                    conds.append(f"({idx} >= 0) & ({idx} < {size})")
                else:
                    idx = _index(a, size, ranges)
                if st:
                    terms.append(f"{idx} * {st}" if st != 1 else idx)
            offset = " + ".join(terms) or "0"
            per_element = any(isinstance(a, Ref) or ({K, N} & a.free_symbols if isinstance(a, sympy.Basic) else False)
                              for a in args[1:])
            if not per_element:  # one value for the whole tile (a per-tensor scale): a scalar load
                lines.append(f"v{i} = tl.load(L{args[0]} + ({offset}))" + ("" if leaf.dtype == c else f".to({tl_dtype(c)})"))
                continue
            mask = " & ".join(["wmask", *conds])
            # No ``other`` for fp8 (the interpreter cannot cast 0 to fp8); masked lanes are zeroed at the end.
            other = "" if leaf.dtype in FP8_DTYPES else ", other=0"
            conv = "" if leaf.dtype == c else f".to({tl_dtype(c)})"
            load = f"v{i} = tl.load(L{args[0]} + ({offset}), mask={mask}{other}){conv}"
            pk = 1 if conds else _k_block(args[1:], prog)
            if pk > 1:
                # The same element for every k of an aligned block of pk (a group scale, a zero point, a
                # shift table by n): one row per tile when the tile fits in the block, and everything
                # computed from it stays one row too.
                row = " + ".join(_row_terms(args[1:], leaf, ranges))
                lines.append(f"if BLOCK_K <= {pk}:")
                if any(isinstance(a, sympy.Basic) and N in a.free_symbols for a in args[1:]):
                    lines.append(f"    v{i} = tl.load(L{args[0]} + ({row or '0'}), mask=nmask{other}){conv}")
                else:  # one value for the whole tile row (a scale per k block, the same for every n): a scalar
                    lines.append(f"    v{i} = tl.load(L{args[0]} + ({row or '0'})){conv}")
                lines.append("else:")
                lines.append("    " + load)
            else:
                lines.append(load)
            continue
        if op == "index":
            lines.append(f"v{i} = ({texpr(args[0])}).to({tl_dtype(c)})")
        elif op == "const":
            lines.append(f"v{i} = {ref(args[0], d)}")
        elif op == "select":
            lines.append(f"v{i} = tl.where({texpr(args[0])}, {ref(args[1], d)}, {ref(args[2], d)})")
        elif op == "where":
            lines.append(f"v{i} = tl.where({ref(args[0], torch.int32)} != 0, {ref(args[1], d)}, {ref(args[2], d)})")
        elif op == "cast":
            src = prog.instrs[args[0].i].dtype
            lines.append(f"v{i} = {_round(ref(args[0], src), src, d)}")
        elif op == "bitcast":
            src = prog.instrs[args[0].i].dtype
            raw = f"{ref(args[0], src)}.to({tl_dtype(src)}).to({tl_dtype(d)}, bitcast=True)"
            lines.append(f"v{i} = {raw}.to({tl_dtype(c)})" if c != d else f"v{i} = {raw}")
        elif op in CMP:
            lines.append(f"v{i} = ({ref(args[0], None)} {_CMP[op]} {ref(args[1], None)}).to(tl.int32)")
        elif op in _BIN:
            x, y = ref(args[0], d), ref(args[1], d)
            r = f"({x} {_BIN[op]} {y})"
            lines.append(f"v{i} = {_wrap(r, d) if is_int(d) else r}")
        elif op == "div":
            lines.append(f"v{i} = tl.math.div_rn({ref(args[0], d)}, {ref(args[1], d)})")
        elif op in ("max", "min"):  # torch.maximum / minimum propagate NaN (an fp8 code can be one)
            fn = "tl.maximum" if op == "max" else "tl.minimum"
            nan = ", propagate_nan=tl.PropagateNan.ALL" if d.is_floating_point else ""
            lines.append(f"v{i} = {fn}({ref(args[0], d)}, {ref(args[1], d)}{nan})")
        elif op == "neg":
            r = f"(-{ref(args[0], d)})"
            lines.append(f"v{i} = {_wrap(r, d) if is_int(d) else r}")
        elif op == "abs":  # (wrapped: |-128| is -128 in int8, in torch as in the program)
            r = f"tl.abs({ref(args[0], d)})"
            lines.append(f"v{i} = {_wrap(r, d) if is_int(d) else r}")
        elif op == "exp2":
            lines.append(f"v{i} = tl.exp2({ref(args[0], d)})")
        elif op == "not":
            r = f"({ref(args[0], d)} == 0).to(tl.int32)" if d == torch.bool else _wrap(f"(~{ref(args[0], d)})", d)
            lines.append(f"v{i} = {r}")
        else:
            raise NotImplementedError(f"decode op {op}")
    lines.append(f"return tl.where(wmask, v{prog.out}, 0)")
    return "\n".join("    " + ln for ln in lines)


_TEMPLATE = '''"""Generated by fusekern.kernels.decode_mm ({version}) for this decode program:

{program}
"""
import triton
import triton.language as tl


@triton.jit
def _decode({leaf_args}, k, n, b, wmask, k0, nmask, BLOCK_K: tl.constexpr):
{decode}


@triton.jit
def decode_mm_kernel(
    x_ptr, bias_ptr, out_ptr, {leaf_args},
    M, stride_xb, stride_xm, stride_xk, stride_bm, stride_bn,
    stride_os, stride_ob, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    K: tl.constexpr = {K}
    N: tl.constexpr = {N}
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = tl.program_id(2)
    # Grouped tile order: GROUP_M row tiles share each column tile's weight decode in L2.
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % rows
    pid_n = (pid % group) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n = offs_n[None, :]
    x_rows = x_ptr + b.to(tl.int64) * stride_xb + offs_m[:, None].to(tl.int64) * stride_xm
    if USE_DOT:
        if SWAP_AB:
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        # GEMV (BLOCK_M == 1): products accumulate per (k, n) and are summed over k once at the end,
        # not once per K-tile (a cross-thread reduction per tile cost more than the decode).
        acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        k = offs_k[:, None]
        w = _decode({leaf_args}, k, n, b, (k < K) & (n < N), kt * BLOCK_K, n < N, BLOCK_K)
        if USE_DOT:
            a = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0)
            w = w.to(a.dtype)
            if SWAP_AB:
                if IEEE:
                    acc_t = tl.dot(tl.trans(w), tl.trans(a), acc_t, input_precision="ieee")
                else:
                    acc_t = tl.dot(tl.trans(w), tl.trans(a), acc_t)
            elif IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        else:
            a = tl.load(x_rows + offs_k[:, None] * stride_xk, mask=(offs_m[:, None] < M) & (offs_k[:, None] < K), other=0)
            acc2 += a.to(tl.float32) * w.to(a.dtype).to(tl.float32)
    if USE_DOT:
        if SWAP_AB:
            acc = tl.trans(acc_t)
    else:
        acc = tl.sum(acc2, axis=0)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_m[:, None] * stride_bm + offs_n[None, :] * stride_bn, mask=mask, other=0).to(tl.float32)
    out = out_ptr + pid_k * stride_os + b.to(tl.int64) * stride_ob + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
'''


_DECODE_TEMPLATE = '''

@triton.jit
def decode_kernel(out_ptr, {leaf_args}, stride_ob, stride_ok, stride_on, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The decoded weight W[b, k, n] written once (the large-M path: cuBLAS does the GEMM)."""
    K: tl.constexpr = {K}
    N: tl.constexpr = {N}
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(2)
    k = offs_k[:, None]
    n = offs_n[None, :]
    mask = (k < K) & (n < N)
    w = _decode({leaf_args}, k, n, b, mask, tl.program_id(0) * BLOCK_K, n < N, BLOCK_K)
    out = out_ptr + b.to(tl.int64) * stride_ob + k.to(tl.int64) * stride_ok + n * stride_on
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)
'''


def kernel_source(prog: DecodeProgram) -> str:
    leaf_args = ", ".join(f"L{i}" for i in range(len(prog.leaves)))
    program = "\n".join("    " + ln for ln in str(prog).splitlines())
    return _TEMPLATE.format(version=KERNEL_VERSION, program=program, leaf_args=leaf_args,
                            decode=decode_source(prog), K=prog.K, N=prog.N) + _DECODE_TEMPLATE.format(
        leaf_args=leaf_args, K=prog.K, N=prog.N)


def _cache_dir() -> str:
    d = os.environ.get("FUSEKERN_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"fusekern-{os.getuid()}")
    d = os.path.join(d, "decode_mm")
    os.makedirs(d, exist_ok=True)
    return d


@functools.lru_cache(maxsize=256)
def kernel_for(text: str):
    """The generated ``decode_mm_kernel`` for a program's text (written once, imported once)."""
    return module_for(text).decode_mm_kernel


@functools.lru_cache(maxsize=256)
def module_for(text: str):
    """The generated module (``decode_mm_kernel``, ``decode_kernel``) for a program's text."""
    prog = DecodeProgram.from_text(text)
    src = kernel_source(prog)
    digest = hashlib.sha256(src.encode()).hexdigest()[:20]
    path = os.path.join(_cache_dir(), f"decode_mm_{digest}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(src)
        os.replace(tmp, path)  # atomic: concurrent compiles never import a half-written file
    spec = importlib.util.spec_from_file_location(f"fusekern_decode_mm_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- launcher


_LEAVES_OK = LeafCache()  # leaf sets already checked against a program (the checks run per token)


def _check_args(x: torch.Tensor, leaves, prog: DecodeProgram, bias: torch.Tensor | None, text: str = "") -> None:
    """Bad input gets a clear error. text: the program's text, to check a set of real leaf tensors once
    (not given for fake tensors, which have no storage)."""
    want = 3 if prog.batch else 2
    if x.dim() != want:
        raise ValueError(f"decode_mm: x must be {want}-D, got shape {tuple(x.shape)}")
    if x.shape[-1] != prog.K or (prog.batch and x.shape[0] != prog.batch):
        raise ValueError(f"decode_mm: x of shape {tuple(x.shape)} does not fit a weight of shape {list(prog.shape)}")
    if x.dtype != prog.dtype:
        raise ValueError(f"decode_mm: x is {x.dtype} but the decoded weight is {prog.dtype}")
    specs = [prog.leaves[i] for i in prog.taken(len(leaves))]
    if not text:
        _check_leaves(x, leaves, specs)
    elif _LEAVES_OK.get((text, x.device), leaves) is None:
        _check_leaves(x, leaves, specs)
        if any(tuple(t.stride()) != leaf.stride for t, leaf in zip(leaves, specs)):
            raise ValueError("decode_mm_triton: leaf strides differ from the program's; use decode_mm")
        _LEAVES_OK.put((text, x.device), leaves, True)
    out_shape = (*x.shape[:-1], prog.N)
    if bias is not None and (bias.dim() > x.dim() or
                             any(b not in (1, o) for b, o in zip(reversed(bias.shape), reversed(out_shape)))):
        raise ValueError(f"decode_mm: bias of shape {tuple(bias.shape)} does not broadcast to {list(out_shape)}")
    if bias is not None and bias.device != x.device:
        raise ValueError(f"decode_mm: bias is on {bias.device}, x on {x.device}")


def _check_leaves(x: torch.Tensor, leaves, specs) -> None:
    for i, (t, leaf) in enumerate(zip(leaves, specs)):
        if t.dtype != leaf.dtype or tuple(t.shape) != leaf.shape:
            raise ValueError(f"decode_mm: leaf {i} is {t.dtype}{list(t.shape)}, the program reads "
                             f"{leaf.dtype}{list(leaf.shape)}")
        if t.device != x.device:
            raise ValueError(f"decode_mm: leaf {i} is on {t.device}, x on {x.device}")


_stages: dict = {}  # (program, config) -> the pipeline depth that fits in shared memory


def register_cap(cfg) -> int | None:
    """A register cap for 4-warp GEMV launches (BLOCK_M = 1) under Triton >= 3.9 only: its ptxas (run with
    --regAllocOptLevel=2) chose 96 registers and spilled 8 bytes in the nvfp4 M = 1 config; capped at 128
    it keeps everything in registers. Triton 3.6 (the H200's) gets no cap: its builds are unchanged. A cap
    cannot change results; tile configs (M = 16) need more than 128 and spill under it."""
    gemv = getattr(cfg, "BLOCK_M", 0) == 1 and cfg.num_warps == 4
    return 128 if _TRITON_3_9 and gemv else None


_TRITON_3_9 = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9)  # read once, not per launch


def _launch(text: str, cfg: Config, grid, *args, record=None, **kwargs) -> None:
    """Launch with ``cfg.num_stages``, or fewer when a decode's staged loads overflow shared memory
    (the first launch finds out; the depth that fit is remembered for this program and config). record:
    called with the ``replay.Launch`` that ran."""
    key = (text, cfg)
    stages = _stages.get(key, cfg.num_stages)
    while True:
        try:
            launch = replay.launch(kernel_for(text), grid, args,
                                   dict(kwargs, num_stages=stages, maxnreg=register_cap(cfg)), record is not None)
            _stages[key] = stages
            if launch is not None and launch.replayable:
                record(launch)
            return
        except triton.runtime.errors.OutOfResources:
            if stages <= 1:
                raise
            stages -= 1


# The configs that read a packed layout: the kernels that take a workspace (their split-K partials), and the
# weight decoded once for cuBLAS.
_PACKED_TILES = (pm.PackedGemv, pm.PackedDot, im.Int4Mma, imn.Int4MmaN, ims.Int4MmaSync, f4.Fp4Mma, f4s.Fp4MmaSync,
                 f8.Fp8Mma)
_PACKED_CONFIGS = _PACKED_TILES + (pm.PackedDequant,)


def decode_mm_triton(x: torch.Tensor, leaves, text: str, bias: torch.Tensor | None = None,
                     config=None, workspace: torch.Tensor | None = None, layout: str = "", record=None) -> torch.Tensor:
    """``x @ W + bias`` with the weight decoded in the GEMM's load stage (Triton, GPU or interpreter).

    layout: a ``PackedLayout``'s text (a known format): its hand-tuned kernels become candidates.
    workspace: optional ``[SPLIT_K, batch, M, N]`` buffer the kernel writes (tests pass one full of NaN).
    record: called with a ``replay.Replay`` of the whole call (not with a workspace given)."""
    prog = DecodeProgram.from_text(text)
    leaves = prog.bind(leaves, x.device)
    _check_args(x, leaves, prog, bias, text)
    batched = prog.batch > 0
    x3 = x if batched else x.unsqueeze(0)
    Bt, M = x3.shape[0], x3.shape[1]
    cfg = config
    if cfg is None:
        sms = sm_count(x.device) if x.is_cuda else 132
        cfg = tuned_config(x, leaves, text, bias, Bt, M, layout) if x.is_cuda else \
            select_config(M, prog.N, prog.K, Bt, sms, layout)
    if isinstance(cfg, stock.StockConfig):
        try:
            return stock.stock_mm(text, x, leaves, bias)
        except stock.StockUnavailable as e:  # it would compile now (a capture, or a guard its cache misses)
            log.info("fusekern decode_mm: %s; running a kernel", e)
            cfg = untimed_config(M, prog.N, prog.K, Bt, layout, x.device)
    if isinstance(cfg, _PACKED_CONFIGS):
        lay = PackedLayout.from_text(layout)
        if lay is None or batched:
            raise ValueError(f"decode_mm_triton: {type(cfg).__name__} needs a packed layout and a 2-D weight")
        check_runs_on(cfg, x.device, lay)
        ws = None
        if workspace is not None and isinstance(cfg, _PACKED_TILES):
            ws_dtype = torch.float32 if cfg.SPLIT_K > 1 else x.dtype
            if tuple(workspace.shape) != (cfg.SPLIT_K, 1, M, prog.N) or workspace.dtype != ws_dtype \
                    or not workspace.is_contiguous():
                raise ValueError(f"decode_mm_triton: workspace must be a contiguous {ws_dtype}"
                                 f"[{cfg.SPLIT_K}, 1, {M}, {prog.N}]")
            ws = workspace[:, 0]
        try:
            return pm.packed_mm(x, leaves, lay, prog.K, prog.N, cfg, bias, ws, record)
        except Exception as e:  # noqa: BLE001 - see below
            if config is not None or workspace is not None:
                raise
            # chosen per program and M, on another layer's leaves: these do not fit its kernel (ValueError: codes
            # that do not start 4-byte aligned for int4 words, a view at an odd offset of a shared buffer), or a
            # build the tuner never ran for them does not compile or fit; the decode-once path takes any leaves
            # (decode_mm_group falls back the same way)
            (log.info if isinstance(e, ValueError) else log.warning)(
                "fusekern decode_mm: %s failed on this layer's leaves (%s: %s): decoding the weight once", cfg,
                type(e).__name__, e)
            cfg = DequantConfig()
    launches = []
    rec = launches.append if record is not None and workspace is None else None
    if isinstance(cfg, DequantConfig):
        w = decode_weight(leaves, text, x.dtype, cfg, rec)
        tail = functools.partial(_dequant_tail, batched=batched)
        if launches:
            record(replay.Replay(launches[0], {"out_ptr": 0}, [(tuple(w.shape), w.dtype)], tail))
        return tail(x, [w], bias)
    out_dtype = torch.float32 if cfg.SPLIT_K > 1 else x.dtype
    out = workspace if workspace is not None else torch.empty((cfg.SPLIT_K, Bt, M, prog.N), device=x.device, dtype=out_dtype)
    if tuple(out.shape) != (cfg.SPLIT_K, Bt, M, prog.N) or out.dtype != out_dtype:
        raise ValueError(f"decode_mm_triton: workspace must be {out_dtype}[{cfg.SPLIT_K}, {Bt}, {M}, {prog.N}]")
    has_bias = bias is not None and cfg.SPLIT_K == 1
    b2 = bias.expand(M, prog.N) if has_bias else x
    grid = (cdiv(M, cfg.BLOCK_M) * cdiv(prog.N, cfg.BLOCK_N), cfg.SPLIT_K, Bt)
    _launch(text, cfg, grid,
        x3, b2, out, *leaves, M, x3.stride(0), x3.stride(1), x3.stride(2),
        b2.stride(0) if has_bias else 0, b2.stride(1) if has_bias else 0,
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        HAS_BIAS=has_bias, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        SPLIT_K=cfg.SPLIT_K, GROUP_M=cfg.GROUP_M, USE_DOT=cfg.use_dot, IEEE=x.dtype == torch.float32,
        SWAP_AB=cfg.SWAP_AB, num_warps=cfg.num_warps, record=rec,
    )
    tail = functools.partial(_split_k_tail, split_k=cfg.SPLIT_K, batched=batched)
    if launches:
        record(replay.Replay(launches[0], {"x_ptr": replay.X, "out_ptr": 0, **({} if has_bias else {"bias_ptr": replay.X})},
                             [(tuple(out.shape), out.dtype)], tail))
    return tail(x, [out], bias)


def _dequant_tail(x, bufs, bias, batched: bool):
    """cuBLAS on the decoded weight ``bufs[0]`` ([batch or 1, K, N]), then the bias (the decode-once path
    and its replay)."""
    w = bufs[0]
    out = add_bias(torch.matmul(x if batched else x.unsqueeze(0), w if batched else w[0]), bias)
    return out if batched else out[0]


def add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out + bias`` in out's dtype, through fp32 where the bias has another dtype (the decode-once path, and
    the stock fallback that must agree with it)."""
    if bias is None:
        return out
    return (out.float() + bias.float()).to(out.dtype) if bias.dtype != out.dtype else out + bias


def _split_k_tail(x, bufs, bias, split_k: int, batched: bool):
    """The generated GEMM's ``[SPLIT_K, batch, M, N]`` output summed over the splits, plus the bias there."""
    out = pm.reduce_split_k(bufs[0], bias, x.dtype, split_k)
    return out if batched else out[0]


def decode_weight(leaves, text: str, dtype: torch.dtype, cfg: DequantConfig = DequantConfig(),
                  record=None) -> torch.Tensor:
    """The decoded weight ``[batch or 1, K, N]`` in ``dtype``, written once by the generated decode kernel.
    record: called with the ``replay.Launch``."""
    prog = DecodeProgram.from_text(text)
    Bt = max(prog.batch, 1)
    w = torch.empty((Bt, prog.K, prog.N), device=leaves[0].device, dtype=dtype)
    grid = (cdiv(prog.K, cfg.BLOCK_K), cdiv(prog.N, cfg.BLOCK_N), Bt)
    launch = replay.launch(module_for(text).decode_kernel, grid, (w, *leaves, w.stride(0), w.stride(1), w.stride(2)),
                           dict(BLOCK_K=cfg.BLOCK_K, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps), record is not None)
    if record is not None and launch.replayable:
        record(launch)
    return w


# ----------------------------------------------------------------------------- builds for the report

REPORT_FORMATS = ("gptq", "awq", "int4_k_stack", "fp8_block", "mxfp4", "nvfp4")
REPORT_MS = (1, 16, 2048)
_PTR = {torch.uint8: "*u8", torch.int8: "*i8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64",
        torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float8_e4m3fn: "*fp8e4nv",
        torch.float8_e5m2: "*fp8e5", torch.bool: "*i1"}


def report_program(name: str, N: int = 8192, K: int = 8192) -> str:
    """The decode program of a zoo format at N x K, traced without running inductor (fake tensors)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusekern.compiler_pass.canonicalize import canonicalize
    from fusekern.patterns.decode.analysis import analyse, find_cone
    from fusekern.testing.decode_zoo import BY_NAME

    case = BY_NAME[name]
    with FakeTensorMode(allow_non_fake_inputs=True):  # shapes only: nothing is allocated
        ws = [torch.empty(_scaled_shape(t.shape, N, K), dtype=t.dtype) for t in case.make(256, 256, case.group, "cpu")]
        x = torch.empty(2, K, dtype=torch.bfloat16)
    gm = make_fx(case.fn, tracing_mode="fake", decomposition_table=select_decomp_table(),
                 _allow_non_fake_inputs=True)(x, *ws)
    gm.graph.eliminate_dead_code()
    canonicalize(gm.graph)
    mm = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    return analyse(find_cone(mm)).to_text()


def _scaled_shape(shape, N, K):
    """A zoo weight's shape drawn at 256 x 256, scaled to N x K (every zoo dim is N or K over a constant)."""
    return tuple(s * (N // 256) if s > 1 else s for s in shape)


def aot_builds():
    """The generated kernels for a few zoo formats at N = K = 8192, in every config ``tuned_config`` may
    pick for the report's M (each measured candidate, not only the heuristic's)."""
    from fusekern.kernels.catalog import TritonBuild

    builds = []
    for name in REPORT_FORMATS:
        text = report_program(name)
        prog = DecodeProgram.from_text(text)
        leaf_args = {f"L{i}": _PTR[leaf.dtype] for i, leaf in enumerate(prog.leaves)}
        seen = set()
        for M in REPORT_MS:
            for cfg in candidates(M, prog.N, prog.K):
                if cfg in seen:
                    continue
                seen.add(cfg)
                if isinstance(cfg, DequantConfig):
                    args = dict(out_ptr="*bf16", stride_ob=prog.K * prog.N, stride_ok=prog.N, stride_on=1, **leaf_args)
                    builds.append(TritonBuild(
                        "decode_weight", f"{name} BLOCK_K={cfg.BLOCK_K} BLOCK_N={cfg.BLOCK_N} w{cfg.num_warps} "
                        f"[{prog.K}x{prog.N}]", module_for(text).decode_kernel, args,
                        dict(BLOCK_K=cfg.BLOCK_K, BLOCK_N=cfg.BLOCK_N), cfg.num_warps))
                    continue
                args = dict(x_ptr="*bf16", bias_ptr="*bf16", out_ptr="*fp32" if cfg.SPLIT_K > 1 else "*bf16", M=M,
                            stride_xb=M * prog.K, stride_xm=prog.K, stride_xk=1, stride_bm=0, stride_bn=0,
                            stride_os=M * prog.N, stride_ob=M * prog.N, stride_om=prog.N, stride_on=1, **leaf_args)
                constexprs = dict(HAS_BIAS=False, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                                  SPLIT_K=cfg.SPLIT_K, GROUP_M=cfg.GROUP_M, USE_DOT=cfg.use_dot, IEEE=False,
                                  SWAP_AB=cfg.SWAP_AB)
                label = (f"{name} BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} BLOCK_K={cfg.BLOCK_K} "
                         f"SPLIT_K={cfg.SPLIT_K}{' swap-AB' if cfg.SWAP_AB else ''} w{cfg.num_warps} "
                         f"s{cfg.num_stages} [{M}x{prog.N}x{prog.K}]")
                builds.append(TritonBuild("decode_mm", label, kernel_for(text), args, constexprs, cfg.num_warps,
                                          cfg.num_stages, maxnreg=register_cap(cfg)))
    return builds


# ----------------------------------------------------------------------------- reference


def decode_mm_reference(x: torch.Tensor, leaves, text: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch in float64: decode the whole weight (kernel semantics), then matmul."""
    prog = DecodeProgram.from_text(text)
    w = prog.evaluate(prog.bind(leaves, x.device)).to(torch.float64)
    out = x.to(torch.float64) @ w
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- custom op
# Plain dispatcher API (define + per-device impl + fake): see w8a16_linear for why not custom_op.

torch.library.define(
    "fusekern::decode_mm",
    "(Tensor x, Tensor[] leaves, str program, Tensor? bias, str layout=\"\") -> Tensor",
)


_REPLAYS = LeafCache()  # (program, layout as given, bias given, checked leaves' versions, activation) per leaf set -> replay


def replay_key(x, leaves, program: str, bias_given: bool, layout: str) -> tuple:
    """Where the op keeps a call's replay (``_REPLAYS``, beside its leaf set): the program, the layout as
    given, whether a bias is, the guarded leaves' write counts and the activation's layout."""
    return (program, layout, bias_given, layout_guard.versions(program, layout, leaves), *replay.x_key(x))


def _decode_mm_cuda(x, leaves, program, bias, layout=""):
    """``x @ W + bias`` with W decoded in the GEMM; leaves with other strides than traced take the CPU path.
    Calls after the first with the same leaves, bias and activation layout replay its launch (``replay``),
    and, for a guarded layout, with the same write counts of the leaves it checks (``layout_guard``: the
    replay then stands for its verdict)."""
    key = replay_key(x, leaves, program, bias is not None, layout)
    tensors = leaves if bias is None else [*leaves, bias]
    rep = _REPLAYS.get(key, tensors)
    if rep is not None:
        return rep(x, bias, key[-1])
    program, layout = layout_guard.resolve(program, layout, leaves)
    prog = DecodeProgram.from_text(program)
    leaves = prog.bind(leaves, x.device)
    if x.dtype in SUPPORTED_ACT_DTYPES and all(tuple(t.stride()) == l.stride for t, l in zip(leaves, prog.leaves)):
        return decode_mm_triton(x, leaves, program, bias, layout=layout, record=replay.recorder(_REPLAYS, key, tensors))
    return _decode_mm_cpu(x, leaves, program, bias)


torch.library.impl("fusekern::decode_mm", "CUDA")(_decode_mm_cuda)  # (kept callable: tests, direct_calls)
direct_calls.register(torch.ops.fusekern.decode_mm.default, _decode_mm_cuda)


def _decode_mm_cpu(x, leaves, program, bias, layout=""):
    """Decode the whole weight with torch (the kernel's semantics), then one matmul."""
    prog = DecodeProgram.from_text(program)
    _check_args(x, leaves, prog, bias)
    w = prog.evaluate(prog.bind(leaves, x.device))
    out = torch.matmul(x, w)
    if bias is not None:
        out = (out.float() + bias.float()).to(x.dtype)
    return out


# (registered, not decorated: the decorator returns None, and the CUDA kernel falls back to this)
torch.library.impl("fusekern::decode_mm", "CPU")(_decode_mm_cpu)


@torch.library.register_fake("fusekern::decode_mm")
def _decode_mm_fake(x, leaves, program, bias, layout=""):
    prog = DecodeProgram.from_text(program)
    _check_args(x, leaves, prog, bias)
    return x.new_empty((*x.shape[:-1], prog.N))


decode_mm = torch.ops.fusekern.decode_mm
