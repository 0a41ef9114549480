"""Prototype: GPTQ int4 x bf16 GEMM for M <= 16 on Hopper tensor cores, decoding two values per instruction.

The variant study behind fusekern/kernels/int4_mma.py (then gptq_mma.py) (which ships the ``sub`` variant); its H200 run is
benchmarks/results/h200/gptq_mma_variants.csv (the CSV this prints on stdout, with the run's versions added).

    PYTHONPATH=$PWD python3 benchmarks/proto/w4_dot.py              # H200: check + time (CSV on stdout)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/proto/w4_dot.py --cpu-check   # CPU, small shapes
    PYTHONPATH=$PWD python3 benchmarks/proto/w4_dot.py --sass       # CPU: compile for sm_90a, SASS loop stats

out[M, N] = x[M, K] @ W, W[k, n] = (q[k, n] - z[k // 128, n]) * s[k // 128, n] (GPTQ: qweight int32 [K/8, N]
with k = 8 kw + i in bits [4i, 4i + 4), qzeros int32 [K/128, N/8], scales bf16 [K/128, N]).

Swap-AB: ``acc[BLOCK_N, 16] += dot(Wt[BLOCK_N, 128], xT[128, 16])`` on wgmma, x padded to 16 rows by masking,
one K tile = one group of 128, so each tile's product is scaled once per column (``acc += d * s``).

Decode: ``lop3.b32 r, w >> s, 0x000F000F, 0x43004300, 0xEA`` puts nibbles s/4 and s/4 + 4 of a word in one
register as the bf16 pair (128 + q_i, 128 + q_{i+4}) (exact). With s = 0, 4, 8, 12 a word gives 4 such
registers (3 SHF + 4 LOP3 per 8 values). The MMA's k slots are permuted (free: x is loaded with the same
permutation) so that these registers ARE the wgmma A-operand registers: for the A fragment, thread
(g = lane / 4, t = lane % 4) of a warp holds, per k16 block, the k-slot pairs (2t, 2t + 1) and (2t + 8, 2t + 9)
of rows g and g + 8. Slot ``32 c + 16 p1 + 8 p0 + 2 t + h`` holds real k ``8 (4 c + t) + (2 p1 + p0) + 4 h``:
one word (4 c + t) of one column n gives the 4 register pairs p = 2 p1 + p0 that thread t needs for
k32 chunk c. Triton expresses this as join / reshape / permute of the 8 decoded [BLOCK_N, 16] tensors and
emits NO layout conversion for it (the reshape lands in #dot_op<opIdx=0, #mma v3, kWidth=2>; read the
TTGIR with --sass).

Variants (all share the above):
- ``sub``:  words loaded with inline ``ld.global.nc`` in the A-operand layout (each thread loads exactly the
  16 words it decodes, immediate offsets from one base: no shared memory for the weights at all), then
  (128 + q) - (128 + z) with a packed bf16 subtraction (HADD2, exact small integers).
- ``bias``: same loads; no subtraction: the MMA gets 128 + q and the tile product is corrected with
  (128 + z[n]) * sum_k x[m, k] (fp32) before the scale.
- ``tlload``: as ``sub`` but the words come from ``tl.load`` (Triton loads them coalesced, LDG.128, and
  converts them to the A layout through shared memory, 4 B per 8 values; with num_stages > 1 its pipeliner
  uses cp.async of 4-byte words instead).

Split K: SPLIT_K programs per column tile each write an fp32 partial [M, BLOCK_N] to a workspace and count
themselves in on an atomic counter; the last one sums the partials in split order (deterministic), writes
bf16 ``out`` and resets the counter (as packed_mm's GEMV does; counters from fusekern.kernels.split_counters).

Supported: 1 <= M <= 16, K % 128 == 0 (group size exactly 128), N % 8 == 0 (any N: the last column tile is
clamped / masked), contiguous qweight / qzeros / scales / x. N and K are compile-time constants (one
compile per layer shape; needed for the immediate load offsets). Not supported: other group sizes,
act-order (g_idx), fp16 x, M > 16.
"""
from __future__ import annotations

import argparse
import os
import sys

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusekern.kernels.int4_mma import _load_words_nc as _load_words, _w_tile  # noqa: E402

GROUP = 128
VARIANTS = ("sub", "bias", "tlload")
_VCODE = {"sub": 0, "bias": 1, "tlload": 2}


# ----------------------------------------------------------------------------- kernel helpers


# the word loads and the decode are the shipped kernel's (fusekern/kernels/int4_mma.py)


@triton.jit
def _x_tile(x_ptr, k0, offs_m, mmask, K: tl.constexpr):
    """x[:, k0:k0+128] loaded in natural order ([16, 128], rows >= M read 0) and its [128, 16] transpose in
    the slot order of ``_w_tile`` (real k = 32 c + 8 t + 4 h + 2 p1 + p0)."""
    xn = tl.load(x_ptr + offs_m[:, None] * K + k0 + tl.arange(0, 128)[None, :], mask=mmask[:, None], other=0.0)
    xr = tl.reshape(xn, (16, 4, 4, 2, 2, 2))  # m, c, t, h, p1, p0
    xr = tl.permute(xr, (1, 4, 5, 2, 3, 0))  # c, p1, p0, t, h, m
    return xn, tl.reshape(xr, (128, 16))


@triton.jit
def _to_bf16(v, ASM: tl.constexpr):
    """fp32 -> bf16, round to nearest even (the interpreter's own conversion truncates)."""
    if ASM:
        return v.to(tl.bfloat16)
    else:
        b = v.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)


# ----------------------------------------------------------------------------- kernel


@triton.jit(do_not_specialize=["M"])  # one compile for every M (1, 3 and 16 share the code)
def w4_dot_kernel(x_ptr, q_ptr, z_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M,
                  N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                  VARIANT: tl.constexpr, PF: tl.constexpr, ASM: tl.constexpr):
    """One column tile [BLOCK_N] x one K slice (whole groups) of out^T; VARIANT 0 sub, 1 bias, 2 tlload.
    PF: load the next tile's words before decoding this one (register double buffer)."""
    BKW: tl.constexpr = 16  # words per column per tile (128 k)
    ASMLD: tl.constexpr = ASM and VARIANT != 2
    EVEN_N: tl.constexpr = N % BLOCK_N == 0
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    if EVEN_N:
        ln = offs_n
    else:
        ln = tl.minimum(offs_n, N - 1)  # clamped columns: loads stay in bounds, results are not stored
    offs_m = tl.arange(0, 16)
    mmask = offs_m < M
    TILES: tl.constexpr = K // 128
    PER: tl.constexpr = (TILES + SPLIT_K - 1) // SPLIT_K
    t0 = pid_k * PER
    t1 = tl.minimum(t0 + PER, TILES)
    zsh = 4 * (ln % 8)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    wp = q_ptr + ln[:, None] + tl.arange(0, BKW)[None, :] * N  # words of tile 0
    if PF:
        wnext = _load_words(wp + tl.minimum(t0, TILES - 1) * (BKW * N), ASMLD)
    for t in range(t0, t1):
        if PF:
            words = wnext
            wnext = _load_words(wp + tl.minimum(t + 1, t1 - 1) * (BKW * N), ASMLD)
        else:
            words = _load_words(wp + t * (BKW * N), ASMLD)
        z = (tl.load(z_ptr + t * (N // 8) + ln // 8) >> zsh) & 15
        s = tl.load(s_ptr + t * N + ln).to(tl.float32)
        wt = _w_tile(words, BLOCK_N, ASM)  # 128 + q
        if VARIANT != 1:  # q - z, exact in bf16 (one packed HADD2 per 2 values)
            if ASM:
                wt = wt - (z | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)[:, None]
            else:  # the interpreter subtracts bf16 tensors as raw 16-bit integers: go through fp32 (exact)
                wt = (wt.to(tl.float32) - (z.to(tl.float32) + 128.0)[:, None]).to(tl.bfloat16)
        xn, xt = _x_tile(x_ptr, t * 128, offs_m, mmask, K)
        if ASM:
            d = tl.dot(wt, xt)  # fp32 [BLOCK_N, 16]
        else:  # the interpreter multiplies bf16 dot operands as raw 16-bit integers: fp32 (exact products)
            d = tl.dot(wt.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        if VARIANT == 1:
            xs = tl.sum(xn.to(tl.float32), axis=1)
            d = d - (z.to(tl.float32) + 128.0)[:, None] * xs[None, :]
        acc += d * s[:, None]
    # epilogue: out[m, n] = acc[n, m]
    omask = mmask[None, :] & nmask[:, None]
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], _to_bf16(acc, ASM), mask=omask)
    else:
        tl.store(ws_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=omask)
        tl.debug_barrier()  # every thread's partial is written before the count (release below)
        cnt = cnt_ptr + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tot = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
            for sk in range(SPLIT_K):  # split order: deterministic; L2 reads (.cg)
                tot += tl.load(ws_ptr + (sk * M + offs_m[None, :]) * N + offs_n[:, None], mask=omask, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], _to_bf16(tot, ASM), mask=omask)


# ----------------------------------------------------------------------------- launcher

_COUNTERS: dict = {}


def _counters(device, n: int) -> torch.Tensor:
    try:  # the project's shared zeroed counters (reset by every kernel that uses them)
        from fusekern.kernels.split_counters import split_counters
        return split_counters(device, n)
    except ImportError:
        buf = _COUNTERS.get(device)
        if buf is None or buf.numel() < n:
            buf = _COUNTERS[device] = torch.zeros(max(n, 16384), device=device, dtype=torch.int32)
        return buf


DEFAULT = dict(BLOCK_N=128, SPLIT_K=8, num_warps=4, num_stages=1, PF=False)


def w4_dot(x, qweight, qzeros, scales, variant: str = "sub", out=None, workspace=None, **config):
    """out[M, N] (bf16) = x[M, K] @ W(qweight, qzeros, scales) for 1 <= M <= 16, group size 128.
    config: BLOCK_N, SPLIT_K, num_warps, num_stages, PF (see DEFAULT). out / workspace ([SPLIT_K, M, N]
    fp32): preallocated buffers (benchmarks pass them so that a timed call allocates nothing)."""
    cfg = dict(DEFAULT, **config)
    M, K = x.shape
    N = qweight.shape[1]
    if not (1 <= M <= 16 and K % GROUP == 0 and N % 8 == 0 and qweight.shape[0] * 8 == K
            and scales.shape == (K // GROUP, N) and qzeros.shape == (K // GROUP, N // 8)):
        raise ValueError(f"w4_dot: unsupported shapes x {tuple(x.shape)} qweight {tuple(qweight.shape)} "
                         f"qzeros {tuple(qzeros.shape)} scales {tuple(scales.shape)}")
    x, qweight, qzeros, scales = (t.contiguous() for t in (x, qweight, qzeros, scales))
    bn, sk = cfg["BLOCK_N"], cfg["SPLIT_K"]
    tiles_n = triton.cdiv(N, bn)
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if sk > 1:
        ws = workspace if workspace is not None else torch.empty((sk, M, N), device=x.device, dtype=torch.float32)
        cnt = _counters(x.device, tiles_n)
    else:
        ws = cnt = out
    w4_dot_kernel[(tiles_n, sk)](
        x, qweight, qzeros, scales, out, ws, cnt, M, N=N, K=K, BLOCK_N=bn, SPLIT_K=sk,
        VARIANT=_VCODE[variant], PF=bool(cfg["PF"]), ASM=not _INTERPRET,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# ----------------------------------------------------------------------------- reference and data


def make_gptq(K: int, N: int, device, seed: int = 0):
    """Random GPTQ leaves: qweight int32 [K/8, N], qzeros int32 [K/128, N/8], scales bf16 [K/128, N]."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int64)
    z = torch.randint(0, 16, (K // GROUP, N), generator=g, dtype=torch.int64)
    s = (torch.rand(K // GROUP, N, generator=g) * 0.02 + 0.002).to(torch.bfloat16)
    qw = torch.zeros(K // 8, N, dtype=torch.int64)
    for i in range(8):
        qw |= q[i::8] << (4 * i)
    qz = torch.zeros(K // GROUP, N // 8, dtype=torch.int64)
    for i in range(8):
        qz |= z[:, i::8] << (4 * i)
    to_i32 = lambda t: (t - ((t >> 31) & 1) * (1 << 32)).to(torch.int32)  # noqa: E731  (uint32 bits as int32)
    return to_i32(qw).to(device), to_i32(qz).to(device), s.to(device)


def reference64(x, qweight, qzeros, scales):
    """float64 x @ W (GPTQ decode as fusekern.testing.decode_zoo.gptq, without its bf16 rounding)."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    sh = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    w = ((qweight[:, None, :] >> sh[None, :, None]) & 0xF).reshape(K, N).to(torch.float64)
    z = ((qzeros[:, :, None] >> sh[None, None, :]) & 0xF).reshape(-1, N).to(torch.float64)
    w = (w - z.repeat_interleave(GROUP, dim=0)) * scales.to(torch.float64).repeat_interleave(GROUP, dim=0)
    return x.to(torch.float64) @ w


def rel_err(got, ref) -> float:
    return ((got.to(torch.float64) - ref).norm() / ref.norm()).item()


# ----------------------------------------------------------------------------- checks and timing


def grid():
    """The timed configs: (variant, config dict), 16 in all (each timed at M = 1 and 16)."""
    out = []
    for sk in (4, 8, 16):
        for pf in (False, True):
            out.append(("sub", dict(BLOCK_N=128, SPLIT_K=sk, num_warps=4, num_stages=1, PF=pf)))
    for sk in (4, 8):  # 179 registers x 256 threads: one CTA per SM (kept to see what 8 warps do)
        out.append(("sub", dict(BLOCK_N=256, SPLIT_K=sk, num_warps=8, num_stages=1, PF=False)))
    for sk in (4, 8, 16):
        out.append(("bias", dict(BLOCK_N=128, SPLIT_K=sk, num_warps=4, num_stages=1, PF=False)))
    for sk in (8, 16):
        for ns in (1, 3):  # num_stages 3: Triton's cp.async pipeline of the words (4-byte copies)
            out.append(("tlload", dict(BLOCK_N=128, SPLIT_K=sk, num_warps=4, num_stages=ns, PF=False)))
    return out


def cfg_str(c: dict) -> str:
    return f"BN{c['BLOCK_N']}_SK{c['SPLIT_K']}_w{c['num_warps']}_s{c['num_stages']}" + ("_pf" if c["PF"] else "")


def check(shapes, ms, configs, device, tol=4e-3, verbose=True) -> bool:
    """Every (variant, config) against float64 at every shape and M; outputs poisoned with NaN first."""
    ok = True
    for (K, N) in shapes:
        qw, qz, s = make_gptq(K, N, device, seed=K + N)
        for M in ms:
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M), dtype=torch.float32).to(torch.bfloat16).to(device)
            ref = reference64(x, qw, qz, s)
            floor = rel_err(ref.to(torch.bfloat16), ref)  # the best a bf16 output can do
            if verbose:
                print(f"check K={K} N={N} M={M}: bf16 rounding floor {floor:.2e}", flush=True)
            for variant, cfg in configs:
                out = torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)
                ws = torch.full((cfg["SPLIT_K"], M, N), float("nan"), device=device, dtype=torch.float32)
                try:
                    w4_dot(x, qw, qz, s, variant, out=out, workspace=ws, **cfg)
                    err = rel_err(out, ref)
                    good = err < tol  # NaN fails
                except Exception as e:  # noqa: BLE001
                    err, good = f"{type(e).__name__}: {str(e)[:200]}", False
                ok &= good
                if verbose or not good:
                    print(f"check K={K} N={N} M={M} {variant} {cfg_str(cfg)}: rel_err={err} {'ok' if good else 'FAIL'}",
                          flush=True)
    return ok


def cpu_check() -> int:
    assert _INTERPRET, "run with TRITON_INTERPRET=1"
    configs = [("sub", dict(BLOCK_N=64, SPLIT_K=1, num_warps=4, num_stages=1, PF=False)),
               ("sub", dict(BLOCK_N=64, SPLIT_K=3, num_warps=4, num_stages=1, PF=True)),
               ("bias", dict(BLOCK_N=64, SPLIT_K=2, num_warps=4, num_stages=1, PF=False)),
               ("tlload", dict(BLOCK_N=128, SPLIT_K=2, num_warps=4, num_stages=1, PF=False))]
    ok = check([(512, 192), (384, 136)], (1, 3, 16), configs, "cpu")
    # the decode's bits: the fallback must equal what lop3 gives: 0x4300 | nibble per bf16 half
    print("CPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


def _packed_mm_baseline(x, qw, qz, s, K, N):
    """A callable running fusekern's packed_mm GEMV (best known GEMV config), or None."""
    try:
        from fusekern.kernels import packed_mm as pm
        lay = pm.REPORT_LAYOUTS["gptq"][0]
        cfg = pm.PackedGemv(BLOCK_N=64, BLOCK_K=128, SPLIT_K=8, num_warps=4)
        leaves = (qw, qz, s)  # code leaf 0, zero leaf 1, scale leaf 2
        ws = torch.empty((cfg.SPLIT_K, x.shape[0], N), device=x.device, dtype=torch.float32)
        fn = lambda: pm.packed_mm(x, leaves, lay, K, N, cfg, workspace=ws)  # noqa: E731
        return fn, cfg
    except Exception as e:  # noqa: BLE001
        print(f"# packed_mm baseline skipped: {type(e).__name__}: {e}", file=sys.stderr)
        return None, None


def gpu_main(args) -> int:
    device = "cuda"
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    configs = grid()
    if args.variants:
        configs = [c for c in configs if c[0] in args.variants.split(",")]
    # (a) correctness: 8192x8192 and an odd shape (N = 4104: last column tile partial), M = 1, 3, 16
    ok = check([(8192, 8192)], (1, 3, 16), configs, device, verbose=False)
    firsts = [next(c for c in configs if c[0] == v) for v in VARIANTS if any(c[0] == v for c in configs)]
    ok &= check([(4096, 4104)], (1, 3, 16), firsts, device, verbose=False)  # N = 4104: partial column tile
    print(f"# check {'PASSED' if ok else 'FAILED'} ({len(configs)} configs at 8192x8192, {len(firsts)} at "
          f"K=4096 N=4104; M = 1, 3, 16; NaN-poisoned outputs and workspaces)", flush=True)
    # (b) timing at N = K = 8192 (plus the other shapes with --shapes)
    shapes = [(8192, 8192)] + ([(4096, 4096), (4096, 14336), (14336, 4096)] if args.all_shapes else [])
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    triton.testing.do_bench(lambda: a @ a, warmup=200, rep=300)  # clocks up
    del a
    print("variant,config,K,N,M,us,rel_err")
    for K, N in shapes:
        qw, qz, s = make_gptq(K, N, device)
        for M in (1, 16):
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            ref = reference64(x, qw, qz, s)
            for variant, cfg in configs:
                out = torch.empty((M, N), device=device, dtype=torch.bfloat16)
                ws = torch.empty((cfg["SPLIT_K"], M, N), device=device, dtype=torch.float32)
                fn = lambda: w4_dot(x, qw, qz, s, variant, out=out, workspace=ws, **cfg)  # noqa: E731
                try:
                    fn()
                    err = rel_err(out, ref)
                    us = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
                    print(f"{variant},{cfg_str(cfg)},{K},{N},{M},{us:.2f},{err:.2e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"{variant},{cfg_str(cfg)},{K},{N},{M},n/a,{type(e).__name__}: {str(e)[:100]}", flush=True)
            fn, pcfg = _packed_mm_baseline(x, qw, qz, s, K, N)
            if fn is not None:
                try:
                    err = rel_err(fn(), ref)
                    us = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
                    print(f"packed_mm_gemv,BN64_BK128_SK8_w4,{K},{N},{M},{us:.2f},{err:.2e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"packed_mm_gemv,BN64_BK128_SK8_w4,{K},{N},{M},n/a,{type(e).__name__}: {str(e)[:100]}")
            try:  # stock PyTorch (decode to bf16, then matmul): accuracy and time for context
                from fusekern.testing.decode_zoo import gptq
                err = rel_err(gptq(x, qw, qz, s), ref)
                us = triton.testing.do_bench_cudagraph(lambda: gptq(x, qw, qz, s), rep=20, return_mode="median") * 1e3
                print(f"torch_gptq,decode+matmul,{K},{N},{M},{us:.2f},{err:.2e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"# torch gptq skipped: {type(e).__name__}: {e}", file=sys.stderr)
    return 0 if ok else 1


# ----------------------------------------------------------------------------- SASS statistics (CPU)


def sass_stats(variant: str, cfg: dict, N=8192, K=8192, M=1, dump: str | None = None) -> dict:
    """Compile for sm_90a (no GPU needed) and count the main loop's SASS instructions."""
    import re
    import subprocess
    import tempfile
    from collections import Counter

    from fusekern.kernels.aot import _tool, compile_sm90, resources
    args = dict(x_ptr="*bf16", q_ptr="*i32", z_ptr="*i32", s_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32",
                cnt_ptr="*i32", M=M)
    ce = dict(N=N, K=K, BLOCK_N=cfg["BLOCK_N"], SPLIT_K=cfg["SPLIT_K"], VARIANT=_VCODE[variant], PF=cfg["PF"],
              ASM=True)
    c = compile_sm90(w4_dot_kernel, args, ce, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    if dump:
        for ext, text in (("ttgir", c.asm["ttgir"]), ("ptx", c.asm["ptx"]), ("sass", sass)):
            with open(f"{dump}.{ext}", "w") as fh:
                fh.write(text)
    ins, labels = [], {}
    for line in sass.splitlines():
        lab = re.match(r"^\s*\.(L_x_\d+):", line)
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if lab:
            labels[lab.group(1)] = len(ins)
        elif m:
            ins.append(m.group(2))
    body = []
    for i, s in enumerate(ins):  # the longest backward branch's body is the main loop
        tgt = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", s)
        if tgt and tgt.group(1) in labels and labels[tgt.group(1)] <= i and i + 1 - labels[tgt.group(1)] > len(body):
            body = ins[labels[tgt.group(1)]:i + 1]
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", s).split()[0].split(".")[0] for s in body)
    ttgir = c.asm["ttgir"]
    res = resources(c)
    values = cfg["BLOCK_N"] * 128 / (32 * cfg["num_warps"])  # weight values per thread per loop iteration
    return dict(loop_instrs=len(body), per_value=len(body) / values, registers=res.registers, spills=res.spills,
                smem=res.shared, ops=dict(ops.most_common()),
                a_from_smem=bool(re.search(r"local_load[^\n]*-> tensor<\d+x\d+xbf16, #ttg\.dot_op<\{opIdx = 0", ttgir)),
                convert_layouts=ttgir.count("ttg.convert_layout"))


def sass_main(args) -> int:
    if _INTERPRET:
        print("--sass needs TRITON_INTERPRET unset")
        return 1
    seen = set()
    for variant, cfg in grid():
        key = (variant, cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"], cfg["PF"])
        if key in seen:
            continue
        seen.add(key)
        st = sass_stats(variant, cfg, dump=args.dump and f"{args.dump}/{variant}_{cfg_str(cfg)}")
        top = ", ".join(f"{k} {v}" for k, v in list(st["ops"].items())[:14])
        print(f"{variant} {cfg_str(cfg)}: loop {st['loop_instrs']} instrs = {st['per_value']:.2f}/value, "
              f"regs {st['registers']}, spills {st['spills']}, smem {st['smem']} B, A via smem {st['a_from_smem']}, "
              f"convert_layouts {st['convert_layouts']}\n    {top}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-check", action="store_true", help="interpreter correctness check (TRITON_INTERPRET=1)")
    ap.add_argument("--sass", action="store_true", help="compile for sm_90a on CPU and print main-loop SASS stats")
    ap.add_argument("--dump", default=None, help="with --sass: folder for ttgir / ptx / sass files")
    ap.add_argument("--variants", default=None, help="comma list (default: all)")
    ap.add_argument("--all-shapes", action="store_true", help="also time 4096x4096, 4096x14336, 14336x4096")
    args = ap.parse_args(argv)
    if args.cpu_check or (_INTERPRET and not torch.cuda.is_available()):
        return cpu_check()
    if args.sass:
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
        return sass_main(args)
    if not torch.cuda.is_available():
        print("no CUDA device: use --cpu-check (with TRITON_INTERPRET=1) or --sass")
        return 1
    return gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
