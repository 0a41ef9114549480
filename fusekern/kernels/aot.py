"""Compile Triton kernels for Hopper (sm_90a) on a machine without a GPU, and read their resources.

``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` builds PTX and a cubin with no driver. Resources are
read from ``ptxas -v``'s report of Triton's own ptxas run (its flags differ between versions: Triton
3.9 adds ``--regAllocOptLevel=2``, and plain ``ptxas -v`` on its PTX reported spills that its cubin does
not have); it reports registers, the stack frame and spill stores/loads. ``cuobjdump -res-usage`` shows
the same registers and stack but no spill counts, and its LOCAL column stays 0 while a kernel spills (spills live in the stack
frame), so it is not enough to prove "no spills". Shared memory is Triton's dynamic allocation (metadata).
Run with TRITON_INTERPRET unset: interpreted kernels cannot be compiled.
"""
from __future__ import annotations

import contextlib
import inspect
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
    registers: int  # per thread
    stack: int  # stack frame bytes per thread (spills live here)
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared: int  # bytes per block, static + dynamic
    threads: int  # per block

    @property
    def local(self) -> int:
        """Local memory per thread: the stack frame (spills and local arrays)."""
        return self.stack

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.spill_stores > 0 or self.spill_loads > 0


def compile_sm90(kernel, args: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                 maxnreg: int | None = None):
    """AOT-compile ``kernel`` (a triton.jit function) for sm_90a, specialized as a launch would be.

    ``args`` gives each runtime argument: a pointer as its type string (``"*bf16"``; assumed 16-byte
    aligned, as torch allocations are), a tensor descriptor as its type string (``"tensordesc<i32[16,
    64]>"``), None for an unused one, a float scalar as a float, an integer as a representative value. Like Triton's launcher,
    an integer equal to 1 becomes a constant and one divisible by 16 gets a divisibility hint, so the
    code (vector widths, registers) is the code that runs for such arguments.
    """
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_sm90 needs TRITON_INTERPRET unset (kernels were decorated for the interpreter)")
    signature, constants, attrs = {}, dict(constexprs), {}
    for index, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if param.is_constexpr and name in args:  # a compile-time parameter given with the launch values
            signature[name] = "constexpr"
            constants[name] = args[name]
            continue
        if name not in args and param.is_constexpr and param.default is not inspect.Parameter.empty:
            signature[name] = "constexpr"  # a compile-time parameter left at its default, as a launch would
            constants[name] = param.default
            continue
        if name not in args:
            raise ValueError(f"compile_sm90: no value for argument {name!r} of {kernel.__name__}")
        value = args[name]
        if value is None:  # an argument the specialization does not use (Triton makes None a constant)
            signature[name] = "constexpr"
            constants[name] = None
        elif isinstance(value, str) and value.startswith("tensordesc"):
            signature[name] = value  # a TMA descriptor: "tensordesc<i32[16, 64]>"
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, str):
            signature[name] = value
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:  # a register cap per thread, as the launch's ``maxnreg=`` sets it
        options["maxnreg"] = maxnreg
    logs: list[str] = []
    with _ptxas_logs(logs):
        compiled = triton.compile(src, target=SM90, options=options)
    if logs:
        compiled.fusekern_ptxas_log = logs[-1]
    return compiled


@contextlib.contextmanager
def _ptxas_logs(sink: list[str]):
    """Compiles (no cache hit) and keeps the ``ptxas -v`` report of each ptxas run Triton makes: Triton
    sends ptxas's stderr to a log file, read here before Triton deletes it."""
    real_run = subprocess.run
    always = triton.knobs.compilation.always_compile

    def run(cmd, *args, **kwargs):
        result = real_run(cmd, *args, **kwargs)
        log = kwargs.get("stderr")
        if isinstance(cmd, (list, tuple)) and cmd and "ptxas" in os.path.basename(str(cmd[0])) and hasattr(log, "name"):
            with open(log.name) as f:
                sink.append(f.read())
        return result

    subprocess.run = run
    triton.knobs.compilation.always_compile = True
    try:
        yield
    finally:
        subprocess.run = real_run
        triton.knobs.compilation.always_compile = always


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _ptxas() -> str:
    """The ptxas Triton itself uses for sm_90 (Triton 3.9 ships two and needs the newer one for its PTX)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(SM90.arch).path
    except (ImportError, AttributeError, TypeError):
        return _tool("ptxas")


def ptxas_info(ptx: str, arch: str = "sm_90a") -> dict[str, int]:
    """Registers, stack frame, spill stores/loads and static shared memory that ``ptxas -v`` reports."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
        path = f.name
    try:
        proc = subprocess.run([_ptxas(), "-lineinfo", "-v", f"--gpu-name={arch}", path, "-o", os.devnull],
                              capture_output=True, text=True)
    finally:
        os.unlink(path)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{log}")
    return _parse_ptxas_log(log)


def _parse_ptxas_log(log: str) -> dict[str, int]:
    def num(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    if "Used" not in log:
        raise RuntimeError(f"cannot read resource usage from ptxas output:\n{log}")
    return dict(
        registers=num(r"Used (\d+) registers"),
        stack=num(r"(\d+) bytes stack frame"),
        spill_stores=num(r"(\d+) bytes spill stores"),
        spill_loads=num(r"(\d+) bytes spill loads"),
        shared=num(r"(\d+) bytes smem"),
    )


def resources(compiled) -> Resources:
    """Resources of a kernel compiled by ``compile_sm90``."""
    log = getattr(compiled, "fusekern_ptxas_log", None)  # Triton's own run, with its flags
    info = _parse_ptxas_log(log) if log else ptxas_info(compiled.asm["ptx"])
    shared = max(info.pop("shared"), int(compiled.metadata.shared))
    return Resources(**info, shared=shared, threads=32 * compiled.metadata.num_warps)
