"""Registers, spills, shared memory and threads of every kernel in every default config, for sm_90a.

    python -m fusekern.kernels.report [--csv PATH] [--kernel NAME] [--jobs N]

Needs no GPU: kernels are compiled for Hopper on the CPU and ``ptxas -v`` reports their resources.
Each loop kernel is compiled in every rematerialization mode (off / epilogue / full, see
``fusekern.kernels.remat``); ``*`` marks the mode the config ships with.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

COLUMNS = ("kernel", "config", "remat", "shipped", "registers", "stack", "spill_stores", "spill_loads",
           "shared", "threads", "target", "triton")


@dataclass(frozen=True)
class Row:
    kernel: str
    config: str
    remat: str  # "-" for kernels without a main loop
    shipped: bool
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    shared: int
    threads: int


def _measure(job: tuple[int, str | None]) -> Row:
    from fusekern.kernels.catalog import all_builds

    index, mode = job
    build = all_builds()[index]
    r = build.resources(mode)
    return Row(build.kernel, build.config, mode or "-", mode == build.remat, r.registers, r.stack,
               r.spill_stores, r.spill_loads, r.shared, r.threads)


def collect(kernel: str | None = None, jobs: int | None = None) -> list[Row]:
    """Compile every build (optionally of one kernel) in every mode; compiles run in parallel processes."""
    from fusekern.kernels.catalog import all_builds

    work = [(i, mode) for i, b in enumerate(all_builds()) if kernel in (None, b.kernel) for mode in b.modes]
    if not work:
        raise SystemExit(f"no kernel named {kernel!r}")
    jobs = jobs or min(len(work), os.cpu_count() or 1)
    if jobs == 1:
        return [_measure(job) for job in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_measure, work))


def format_table(rows: list[Row]) -> str:
    header = ("kernel", "config", "remat", "regs", "stack", "spill st/ld", "smem", "threads")
    lines = [header]
    for r in rows:
        mode = r.remat + ("*" if r.shipped and r.remat != "-" else "")
        lines.append((r.kernel, r.config, mode, str(r.registers), str(r.stack),
                      f"{r.spill_stores}/{r.spill_loads}", str(r.shared), str(r.threads)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def write_csv(rows: list[Row], path: str) -> None:
    import triton

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow(dict(asdict(r), target="sm_90a", triton=triton.__version__))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusekern.kernels.report", description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="also write the table as CSV to this path")
    parser.add_argument("--kernel", help="only this kernel (e.g. w8a16_gemm)")
    parser.add_argument("--jobs", type=int, help="parallel compiles (default: CPU count)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        # Kernels decorated for the interpreter cannot be compiled: start again without it.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, "-m", "fusekern.kernels.report", *(argv or sys.argv[1:])], env)
    rows = collect(args.kernel, args.jobs)
    print(format_table(rows))
    spilling = [r for r in rows if r.shipped and (r.stack or r.spill_stores)]
    print(f"\n{len(rows)} compiles for sm_90a; shipped configs that spill: {len(spilling)}")
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
