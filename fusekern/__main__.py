"""Command line: ``python -m fusekern check`` and ``python -m fusekern demo``."""
from __future__ import annotations

import argparse
import sys


def _check(args) -> int:
    import torch

    from fusekern.patterns.registry import GraphRewrite, all_patterns
    from fusekern.testing import check_pattern

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    patterns = [p for p in all_patterns() if not args.pattern or p.name in args.pattern]
    if not patterns:
        print(f"no pattern matches {args.pattern}", file=sys.stderr)
        return 2
    print(f"{'pattern':<34} {'family':<15} {'cases':>5} {'declined':>8} {'worst err':>10} {'tol':>8}  result")
    failed = []
    for p in patterns:
        if isinstance(p, GraphRewrite):
            # Random outputs cannot be compared elementwise: its own tests prove it (exact with injected
            # noise, chi-square on frequencies). Listed so nobody mistakes it for checked here.
            print(f"{p.name:<34} {p.family:<15} {'-':>5} {'-':>8} {'-':>10} {'-':>8}  structural rewrite: "
                  f"see tests/test_{p.family}_*.py", flush=True)
            continue
        r = check_pattern(p, device=device, draws=args.draws, seed=args.seed)
        w = r.worst
        print(f"{p.name:<34} {p.family:<15} {len(r.cases):>5} {r.declined:>8} "
              f"{(w.err if w else float('nan')):>10.3g} {(w.tol if w else float('nan')):>8.3g}  "
              f"{'PASS' if r.passed else 'FAIL'}", flush=True)
        if not r.passed:
            failed.append(r)
    for r in failed:
        print(f"\n{r}")
    checked = [p for p in patterns if not isinstance(p, GraphRewrite)]
    print(f"\n{len(checked) - len(failed)} passed, {len(failed)} failed (device {device})")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusekern")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check every registered pattern with the equivalence harness")
    c.add_argument("--device", choices=("cpu", "cuda"), default=None)
    c.add_argument("--pattern", action="append", help="only this pattern (repeatable)")
    c.add_argument("--draws", type=int, default=24)
    c.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("demo", help="generate with a quantized Llama-style decoder: eager, stock inductor, fusekern")
    d.add_argument("--device", choices=("cpu", "cuda"), default=None)
    d.add_argument("--weights", choices=("w4a16", "w8a16", "fp8", "nvfp4"), default="w4a16")
    d.add_argument("--steps", type=int, default=None, help="decode steps (default: 12 on CPU, 64 on CUDA)")
    d.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    if args.cmd == "check":
        return _check(args)
    from fusekern.demo import main as demo_main

    return demo_main(args.device, weights=args.weights, steps=args.steps, batch=args.batch)


if __name__ == "__main__":
    sys.exit(main())
