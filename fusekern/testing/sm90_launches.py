"""Compile for sm_90a, on a machine without a GPU, the very launches the packed kernels make.

    python -m fusekern.testing.sm90_launches FORMAT [FORMAT ...]    (TRITON_INTERPRET unset)

The interpreter runs kernels without compiling them, so a launch that cannot compile for Hopper (an
argument of a type the kernel cannot take on a path it never runs, such as an fp8 pointer behind a
dummy zero point) passes every CPU test; the register report compiles hand-written signatures, not what
the launchers pass. Here every launch of ``packed_mm`` for a zoo format (each config the kernel tests
use, odd and even shapes) is recorded instead of run, with the tensors' real dtypes, and compiled with
``aot.compile_sm90``. Prints one line per launch; exits 1 if any fails to compile.
"""
from __future__ import annotations

import os
import sys

import torch
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from fusekern.kernels import packed_mm as pm
from fusekern.kernels.aot import compile_sm90
from fusekern.patterns.decode.formats import recognize
from fusekern.patterns.decode.layout import derive_layout
from fusekern.patterns.decode.program import DecodeProgram
from fusekern.testing.decode_cones import decode_program
from fusekern.testing.decode_zoo import BY_NAME

_POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.uint8: "*u8",
            torch.int8: "*i8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64",
            torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}
KERNELS = ("packed_gemv_kernel", "packed_gemv_n_kernel", "packed_dot_kernel", "packed_decode_kernel")


class _Recorder:
    """Stands in for a jit kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            names = [n for n in self.fn.arg_names if n not in kwargs]
            runtime = {n: _POINTER[v.dtype] if isinstance(v, torch.Tensor) else
                       mangle_type(v) if isinstance(v, TensorDescriptor) else v for n, v in zip(names, args)}
            self.launches.append((self.fn, runtime, kwargs, options))
        return launch


def configs(lay, M: int) -> list:
    """The configs the kernel tests run (tests/test_packed_mm.py imports them from here)."""
    out = [pm.PackedGemv(32, 64, 1, 4), pm.PackedGemv(64, 128, 3, 4, vec_k=True), pm.PackedDequant(64, 64)]
    if lay.bits == 8:  # the dispatcher's 256-deep tile for 1-byte codes (a K tail, groups narrower than it)
        out.append(pm.PackedGemv(64, 256, 2, 8, vec_k=True))
    out += [c for c in [pm.dequant_config(lay)] if c not in out]  # the dispatcher's decode-once tile
    if M > 1:
        out += [pm.PackedDot(16, 64, 64, 2, 4), pm.PackedDot(32, 32, 128, 1, 4)]
    return [c for c in out if pm.fits(lay, c)]


def launches_of(fmt: str, K: int, N: int, M: int = 5) -> list:
    """Every launch ``packed_mm`` makes for ``fmt`` at [M, K] x [K, N] (groups of 64, or the format's
    own when smaller; 128 x 128 blocks for fp8_block), for each config."""
    case = BY_NAME[fmt]
    g = 128 if fmt == "fp8_block" else (case.group if case.group != 128 else 64)
    torch.manual_seed(0)
    ws = [w.to(torch.bfloat16) if w.dtype in (torch.bfloat16, torch.float16) else w for w in case.make(K, N, g, "cpu")]
    x = torch.randn(M, K, dtype=torch.bfloat16)
    text, leaves, consts = decode_program(case.fn, x, *ws)
    prog = DecodeProgram.from_text(text)
    lay = derive_layout(prog, recognize(prog, consts), consts)
    recorded: list = []
    saved = {name: getattr(pm, name) for name in KERNELS}
    try:
        for name in KERNELS:
            setattr(pm, name, _Recorder(saved[name], recorded))
        out = []
        for cfg in configs(lay, M):
            recorded.clear()
            pm.packed_mm(x, leaves, lay, prog.K, prog.N, cfg)
            out += [(cfg, *launch) for launch in recorded]
        return out
    finally:
        for name, fn in saved.items():
            setattr(pm, name, fn)


def main(formats: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("sm90_launches: unset TRITON_INTERPRET (the kernels must be decorated for compiling)")
        return 2
    failed = 0
    for fmt in formats:
        for K, N in ((256, 128), (384, 256) if fmt == "fp8_block" else (320, 72)):
            for cfg, fn, runtime, constexprs, options in launches_of(fmt, K, N):
                try:
                    compile_sm90(fn, runtime, constexprs, options.get("num_warps", 4), options.get("num_stages", 3))
                    print(f"{fmt} {K}x{N} {cfg}: ok", flush=True)
                except Exception as e:  # noqa: BLE001 - reported, the run goes on
                    failed += 1
                    lines = [ln for ln in str(e).splitlines() if ln.strip().strip("^")]
                    print(f"{fmt} {K}x{N} {cfg}: FAILED {type(e).__name__}: {lines[-1][:300] if lines else ''}",
                          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
