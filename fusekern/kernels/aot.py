"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU, and read their resources.

``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` builds PTX and a cubin with no driver; Triton's
bundled ``cuobjdump -res-usage`` then reports registers, stack, shared and local (spill) memory.
CI uses this to prove every kernel compiles for the target and to watch for spills.
Run with TRITON_INTERPRET unset: interpreted kernels cannot be compiled.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)


@dataclass(frozen=True)
class Resources:
    registers: int
    stack: int
    shared: int
    local: int  # spills land here


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3):
    """AOT-compile ``kernel`` (a triton.jit function) for sm_90; returns the CompiledKernel."""
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    src = ASTSource(kernel, sig, constexprs=constexprs)
    return triton.compile(src, target=SM90, options={"num_warps": num_warps, "num_stages": num_stages})


def cuobjdump_path() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(compiled) -> Resources:
    """Registers, stack, shared and local memory of a compiled kernel, read from its cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        path = f.name
    try:
        text = subprocess.run([cuobjdump_path(), "-res-usage", path], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if m is None:
        raise RuntimeError(f"cannot read resource usage from cuobjdump output:\n{text}")
    return Resources(*map(int, m.groups()))
