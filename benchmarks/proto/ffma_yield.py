"""Let warps yield inside long FFMA runs of a cubin (probe tool for the block-scaled FP8 CuTe GEMM, sm_90a).

    python benchmarks/proto/ffma_yield.py KERNEL.cubin [--out PATCHED.cubin]   # report (and write) the edit

Why: on the H200 the block-scaled GEMM's fold (64 FFMAs per thread per 128-deep K block, beside running WGMMAs)
spends 30% of its stall cycles in dispatch stalls (docs/results-h200.md). DeepGEMM reports 10% and more from one
SASS edit on the same kind of loop: on part of the promotion FFMAs it clears the operand-reuse flag together with
the control bit that, set, keeps the warp from yielding, so the scheduler may switch to the warp that issues the
next WGMMAs. ptxas sets that bit exactly where it marks an operand for reuse (a yield would lose the reuse
cache), so the two go together; neither changes what an instruction computes.

Here, in every run of at least ``MIN_RUN`` consecutive FFMAs (the fold; address order), every second FFMA that
carries a reuse flag gets both cleared. The edit is found with cuobjdump (the instruction words and their
addresses in the kernel's ``.text`` section) and written at the section's file offset read from the ELF
section headers. ``install()`` applies it to every cubin the CuTe DSL loads in this process (an in-process
compile hands the cubin as bytes to ``cutlass.base_dsl.runtime.cuda.load_library_data``).

Not run on a GPU yet: a patched kernel must give the same bits as the unpatched one (same instructions), and be
timed against it (``block_scaled_probe.py``).
"""
from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import tempfile

MIN_RUN = 16  # FFMAs in a row that make a fold (ptxas splits the 64 of a fold into runs of 27-58)
REUSE = 0xF << 58  # the four operand-reuse flags of the high control word
NO_YIELD = 1 << 45  # set by ptxas next to a reuse flag; cleared: the warp may yield here
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]{16}) \*/")
_HIGH = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_FUNC = re.compile(r"Function : (\S+)")


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def instructions(cubin: bytes) -> dict[str, list[tuple[int, str, int, int]]]:
    """Per kernel: (address in its .text section, text, low word, high word) of every instruction."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    out: dict[str, list] = {}
    kernel, pending = None, None
    for line in sass.splitlines():
        if m := _FUNC.search(line):
            kernel = m.group(1)
            out[kernel] = []
        elif m := _LINE.search(line):
            pending = (int(m.group(1), 16), m.group(2).strip(), int(m.group(3), 16))
        elif pending is not None and (m := _HIGH.match(line)):
            out[kernel].append((*pending, int(m.group(1), 16)))
            pending = None
    return out


def _sections(cubin: bytes) -> dict[str, int]:
    """ELF64 section name -> file offset."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(h):
        start = names_at + h[0]
        return cubin[start:cubin.index(b"\0", start)].decode()

    return {name(h): h[4] for h in headers}


def edits(instrs) -> list[tuple[int, int, int]]:
    """(address, old high word, new high word) for the FFMAs to let yield."""
    out, run = [], []
    for ins in instrs + [(None, "", 0, 0)]:  # (a sentinel closes the last run)
        if ins[1].split(" ")[0].split(".")[0].lstrip("@!P0123456789 ") == "FFMA":
            run.append(ins)
            continue
        if len(run) >= MIN_RUN:
            for addr, _, _, high in run[1::2]:
                if high & REUSE and high & NO_YIELD:
                    out.append((addr, high, high & ~REUSE & ~NO_YIELD))
        run = []
    return out


def patch(cubin: bytes) -> tuple[bytes, int]:
    """The cubin with every kernel's long FFMA runs edited, and how many instructions changed."""
    data = bytearray(cubin)
    offsets = _sections(cubin)
    changed = 0
    for kernel, instrs in instructions(cubin).items():
        base = offsets.get(f".text.{kernel}")
        if base is None:
            continue
        for addr, old, new in edits(instrs):
            at = base + addr + 8
            assert struct.unpack_from("<Q", data, at)[0] == old, (kernel, hex(addr))
            struct.pack_into("<Q", data, at, new)
            changed += 1
    return bytes(data), changed


def install() -> None:
    """Edit every cubin the CuTe DSL loads from now on in this process (bytes only: an in-process compile)."""
    from cutlass.base_dsl.runtime import cuda as cuda_helpers

    load = cuda_helpers.load_library_data
    if getattr(load, "_ffma_yield", False):
        return

    def patched(cubin_data):
        if isinstance(cubin_data, bytes):
            cubin_data, n = patch(cubin_data)
            print(f"ffma_yield: {n} FFMAs may yield", flush=True)
        return load(cubin_data)

    patched._ffma_yield = True
    cuda_helpers.load_library_data = patched


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cubin")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cubin = open(args.cubin, "rb").read()
    new, n = patch(cubin)
    before, after = instructions(cubin), instructions(new)
    for kernel in before:
        texts = [(a, t.replace(".reuse", "")) for a, t, _, _ in before[kernel]]
        assert texts == [(a, t.replace(".reuse", "")) for a, t, _, _ in after[kernel]], "instructions changed"
    print(f"{n} FFMAs may yield; instructions otherwise identical")
    if args.out:
        open(args.out, "wb").write(new)


if __name__ == "__main__":
    main()
