"""Command line: ``python -m fusekern check``, ``python -m fusekern demo`` and ``python -m fusekern bench``."""
from __future__ import annotations

import argparse
import importlib
import sys


def _check(args) -> int:
    import torch

    from fusekern.patterns.registry import GraphRewrite, all_patterns
    from fusekern.testing import check_pattern

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.imports:
        sys.path.insert(0, ".")
    for module in args.imports or ():  # a user's module that registers patterns when imported
        try:
            importlib.import_module(module)
        except ImportError as e:
            print(f"--import {module}: {e}", file=sys.stderr)
            return 2
    patterns = [p for p in all_patterns() if not args.pattern or p.name in args.pattern]
    unknown = sorted(set(args.pattern or ()) - {p.name for p in patterns})
    if unknown:
        print(f"no pattern named {', '.join(unknown)}; registered: {', '.join(p.name for p in all_patterns())}",
              file=sys.stderr)
        return 2
    # worst err: the replacement's relative error against float64 in the case nearest its tolerance; search err:
    # the original graph's own error in that case (how much of the difference the rewrite did not add)
    print(f"{'pattern':<34} {'family':<15} {'cases':>5} {'declined':>8} {'worst err':>10} {'search err':>10} "
          f"{'tol':>8}  result")
    failed = []
    for p in patterns:
        if isinstance(p, GraphRewrite):
            # Random outputs cannot be compared elementwise: its own tests prove it (exact with injected
            # noise, chi-square on frequencies). Listed so nobody mistakes it for checked here.
            proof = {"sample": "tests/test_sampling_patterns.py", "decode_matmul": "tests/test_decode_matmul.py",
                     "greedy_mask": "tests/test_greedy_mask.py"}
            print(f"{p.name:<34} {p.family:<15} {'-':>5} {'-':>8} {'-':>10} {'-':>10} {'-':>8}  structural rewrite: "
                  f"see {proof.get(p.name, 'its own tests')}", flush=True)
            continue
        r = check_pattern(p, device=device, draws=args.draws, seed=args.seed)
        w = r.worst
        print(f"{p.name:<34} {p.family:<15} {len(r.cases):>5} {r.declined:>8} "
              f"{(w.err if w else float('nan')):>10.3g} {(w.search_err if w else float('nan')):>10.3g} "
              f"{(w.tol if w else float('nan')):>8.3g}  "
              f"{'PASS' if r.passed else 'FAIL'}", flush=True)
        if not r.passed:
            failed.append(r)
    for r in failed:
        print(f"\n{r}")
    checked = [p for p in patterns if not isinstance(p, GraphRewrite)]
    print(f"\n{len(checked) - len(failed)} passed, {len(failed)} failed (device {device})")
    return 1 if failed else 0


# family -> (benchmark script, the CSV it writes, extra arguments) in a source checkout's benchmarks/
ISSUE4_SHAPES = "8192x8192,4096x4096,14336x4096,4096x14336,128256x4096"  # N x K
BENCHMARKS = {  # every script also times stock torch.compile with mode="max-autotune-no-cudagraphs" (issue 8)
    "dequant_matmul": (("bench_decode_mm.py", "decode_mm.csv", ("--autotune",)),
                       ("bench_w8a16_linear.py", "w8a16_linear.csv", ("--autotune",)),
                       ("bench_decode_mm.py", "decode_mm_shapes.csv",
                        ("--shapes", ISSUE4_SHAPES, "--autotune", "--formats", "gptq,int4_k_stack,mxfp4,fp8_channel"))),
    "scale_folding": (("bench_scaled_mm.py", "scaled_mm.csv", ("--autotune",)),
                      ("bench_fp8_kv_attention.py", "fp8_kv_attention.csv", ("--autotune",)),
                      ("bench_decode_attention.py", "decode_attention.csv", ("--autotune",))),
    "sampling": (("bench_sampler.py", "sampler.csv", ("--autotune",)),
                 ("bench_greedy_mask.py", "greedy_mask.csv", ("--autotune",))),
    "end_to_end": (("bench_e2e_decode.py", "e2e_decode.csv", ("--autotune",)),),
}


def _bench(args) -> int:
    """Run the families' benchmarks on this GPU, then plot them (and refresh the result tables of README.md and
    docs/results-h200.md for the H200)."""
    import os
    import re
    import subprocess

    import torch

    if not torch.cuda.is_available():
        print("python -m fusekern bench needs a CUDA GPU; the committed H200 results are in benchmarks/results/h200",
              file=sys.stderr)
        return 2
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench = os.path.join(root, "benchmarks")
    if not os.path.isdir(bench):
        print("benchmarks/ not found: run from a source checkout (pip install -e .)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    gpu = "h200" if "H200" in name else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out = os.path.join(bench, "results", gpu)
    os.makedirs(out, exist_ok=True)
    families = args.family or list(BENCHMARKS)
    failed = 0
    for family in families:
        for script, csv_name, extra in BENCHMARKS[family]:
            print(f"== {family}: {script} -> {os.path.join(out, csv_name)}", flush=True)
            failed |= subprocess.run([sys.executable, os.path.join(bench, script), "--csv", os.path.join(out, csv_name),
                                      *extra]).returncode
    subprocess.run([sys.executable, os.path.join(bench, "plot_results.py"), "--results", out])
    if gpu == "h200":  # the documents' tables are the H200's
        subprocess.run([sys.executable, os.path.join(bench, "results_tables.py"), "--results", out])
    return 1 if failed else 0


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusekern")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check every registered pattern with the equivalence harness")
    c.add_argument("--device", choices=("cpu", "cuda"), default=None)
    c.add_argument("--pattern", action="append", help="only this pattern (repeatable)")
    c.add_argument("--draws", type=_positive_int, default=24)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                   help="import this module first, for the patterns it registers (repeatable; the current "
                        "directory is on the path)")
    d = sub.add_parser("demo", help="generate with a quantized Llama-style decoder: eager, stock inductor, fusekern")
    d.add_argument("--device", choices=("cpu", "cuda"), default=None)
    d.add_argument("--weights", choices=("w4a16", "w8a16", "fp8", "nvfp4"), default="w4a16")
    d.add_argument("--steps", type=_positive_int, default=None, help="decode steps (default: 12 on CPU, 64 on CUDA)")
    d.add_argument("--batch", type=_positive_int, default=1)
    d.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="also run stock and fusekern compiled with mode=\"reduce-overhead\" (CUDA graphs; "
                        "default: on with CUDA, off on CPU)")
    b = sub.add_parser("bench", help="run the benchmarks on this GPU: CSV, PNG plots, result tables (H200)")
    b.add_argument("--family", action="append", choices=sorted(BENCHMARKS), help="only this family (repeatable)")
    args = ap.parse_args(argv)
    if getattr(args, "device", None) == "cuda" and not __import__("torch").cuda.is_available():
        ap.error("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False)")
    if args.cmd == "check":
        return _check(args)
    if args.cmd == "bench":
        return _bench(args)
    from fusekern.demo import main as demo_main

    return demo_main(args.device, weights=args.weights, steps=args.steps, batch=args.batch,
                     cuda_graphs=args.cuda_graphs)


if __name__ == "__main__":
    sys.exit(main())
