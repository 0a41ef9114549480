"""The result tables of README.md and docs/results-h200.md, generated from the committed CSVs (so the numbers
cannot drift).

    python benchmarks/results_tables.py [--results benchmarks/results/h200] [--docs README.md ...] [--check]

Each table sits in one of the documents between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``; this
rewrites what is between the markers from ``<results>/NAME.csv``. ``--check`` exits 1 if a document is not
what the CSVs give (tests/test_readme.py runs the same check).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _num(v: str) -> str:
    """A median in µs as the tables print it: one decimal; failed runs say so."""
    try:
        x = float(v)
    except ValueError:  # "n/a (Error)": the variant could not be captured or run
        return "n/a"
    return "–" if math.isnan(x) else f"{x:.1f}"


def csv_float(v: str) -> float:
    """A CSV number, NaN where the run wrote why it has none ("n/a (...)") or nothing."""
    try:
        return float(v)
    except ValueError:
        return math.nan


def _with_autotune(cols: list, rows: list[dict], key: str, variant: str, label: str) -> list:
    """cols plus stock max-autotune's column where the CSV has that variant (``--autotune`` runs)."""
    return cols + [(variant, label)] if any(r.get(key) == variant for r in rows) else cols


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def w8a16_linear(rows: list[dict]) -> list[str]:
    cols = [("eager", "eager"), ("inductor_default", "stock compile"), ("fusekern", "fusekern compiled"),
            ("fusekern_kernel", "fusekern kernel alone"), ("bf16_cublas_unquantized", "bf16 cuBLAS")]
    cols = _with_autotune(cols, rows, "variant", "inductor_autotune", "stock max-autotune")
    by = {}
    for r in rows:
        by.setdefault((int(r["M"]), r["N"], r["K"]), {})[r["variant"]] = r
    out = ["| M | floor | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for (m, _, _), v in sorted(by.items()):
        floor = next(iter(v.values()))["floor_us"]
        out.append(f"| {m} | {_num(floor)} | " + " | ".join(_num(v[c]["median_us"]) if c in v else "–" for c, _ in cols) + " |")
    return out


def decode_mm(rows: list[dict]) -> list[str]:
    cols = [("eager_call_us", "eager"), ("stock_call_us", "stock compile"), ("stock_graph_us", "stock + CUDA graph"),
            ("fusekern_call_us", "fusekern"), ("fusekern_graph_us", "fusekern + CUDA graph")]
    out = ["| format (recognized as) | M | floor | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 3) + "|"]
    for r in rows:
        out.append(f"| {r['format']} ({r['recognized']}) | {r['M']} | {_num(r['floor_us'])} | "
                   + " | ".join(_num(r[c]) for c, _ in cols) + " |")
    return out


def sampler(rows: list[dict]) -> list[str]:
    cols = [("eager", "eager"), ("inductor_default", "stock compile"),
            ("inductor_cudagraphs", "stock reduce-overhead"), ("inductor_default_graph", "stock, one graph"),
            ("fusekern", "fusekern"), ("fusekern_cudagraphs", "fusekern reduce-overhead"),
            ("fusekern_graph", "fusekern, one graph"), ("fusekern_kernel", "kernel alone")]
    cols = _with_autotune(cols, rows, "variant", "inductor_autotune", "stock max-autotune")
    cols = _with_autotune(cols, rows, "variant", "inductor_autotune_graph", "stock max-autotune, one graph")
    by: dict = {}
    for r in rows:
        by.setdefault((r["style"], int(r["B"])), {})[r["variant"]] = r
    order = {"hf": 0, "gpt_fast": 1, "vllm": 2}
    out = ["| style | B | " + " | ".join(c[1] for c in cols) + " | floor |", "|---" * (len(cols) + 3) + "|"]
    for (style, b), v in sorted(by.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1])):
        cells = []
        for c, _ in cols:
            r = v.get(c)
            cells.append("–" if r is None else ("crash" if r["correct"] != "True" and r["error"] else _num(r["median_us"])))
        floor = next(iter(v.values()))["floor_us"]
        out.append(f"| {style} | {b} | " + " | ".join(cells) + f" | {float(floor):.2f} |")
    return out


def gemv_sweep(rows: list[dict]) -> list[str]:
    """The fastest config per format and M in the packed GEMV's sweep."""
    best: dict = {}
    for r in rows:
        try:
            us = float(r["us"])
        except ValueError:  # a config that did not compile or fit
            continue
        key = (r["format"], int(r["M"]))
        if key not in best or us < float(best[key]["us"]):
            best[key] = r
    out = ["| format | M | floor | fastest config | µs | × floor |", "|---" * 6 + "|"]
    for (fmt, m), r in best.items():
        out.append(f"| {fmt} | {m} | {_num(r['floor_us'])} | `{r['config']}` | {_num(r['us'])} | {float(r['x_floor']):.2f} |")
    return out


def decode_mm_shapes(rows: list[dict]) -> list[str]:
    """Issue 4's shapes: stock and fusekern under CUDA graphs against the floor (and stock max-autotune's
    columns where the CSV has them: ``--autotune`` runs)."""
    auto = any(r.get("stock_autotune_graph_us") for r in rows)
    extra = " max-autotune + CUDA graph | × faster than max-autotune (graphs) |" if auto else ""
    out = ["| format | N x K | M | floor | eager | stock compile | stock + CUDA graph | fusekern | "
           "fusekern + CUDA graph | × floor | × faster than stock (graphs) |" + extra,
           "|---" * (13 if auto else 11) + "|"]
    for r in rows:
        g, sg, fl = csv_float(r["fusekern_graph_us"]), csv_float(r["stock_graph_us"]), float(r["floor_us"])
        line = (f"| {r['format']} | {r['N']} x {r['K']} | {r['M']} | {_num(r['floor_us'])} | "
                f"{_num(r['eager_call_us'])} | {_num(r['stock_call_us'])} | {_num(r['stock_graph_us'])} | "
                f"{_num(r['fusekern_call_us'])} | {_num(r['fusekern_graph_us'])} | {g / fl:.2f} | {sg / g:.1f} |")
        if auto:
            ag = csv_float(r["stock_autotune_graph_us"])
            line += f" {_num(r['stock_autotune_graph_us'])} | {ag / g:.1f} |"
        out.append(line)
    return out


def decode_mm_autotune(rows: list[dict]) -> list[str]:
    """Large M against stock max-autotune ("–" where the run had no ``--autotune``) and the unquantized bf16
    cuBLAS mm (``bench_decode_mm.py``)."""
    out = ["| format | N x K | M | eager | stock compile + CUDA graph | max-autotune + CUDA graph | fusekern | "
           "fusekern + CUDA graph | bf16 cuBLAS mm | × cuBLAS (fusekern, graph) |", "|---" * 10 + "|"]
    for r in rows:
        # graph against graph where the run timed cuBLAS in one (older CSVs, or a failed capture: its plain call)
        graph = csv_float(r.get("cublas_bf16_graph_us", ""))
        cublas = r["cublas_bf16_call_us"] if math.isnan(graph) else r["cublas_bf16_graph_us"]
        g, cb = csv_float(r["fusekern_graph_us"]), csv_float(cublas)
        auto = _num(r["stock_autotune_graph_us"]) if r.get("stock_autotune_graph_us") else "–"
        out.append(f"| {r['format']} | {r['N']} x {r['K']} | {r['M']} | {_num(r['eager_call_us'])} | "
                   f"{_num(r['stock_graph_us'])} | {auto} | "
                   f"{_num(r['fusekern_call_us'])} | {_num(r['fusekern_graph_us'])} | "
                   f"{_num(cublas)} | {g / cb:.2f} |")
    return out


def greedy_mask(rows: list[dict]) -> list[str]:
    cols = [("eager", "eager"), ("stock", "stock compile"), ("fusekern", "fusekern")]
    cols = _with_autotune(cols, rows, "variant", "stock_autotune", "stock max-autotune")
    by: dict = {}
    for r in rows:
        by.setdefault(int(r["B"]), {})[r["variant"]] = r
    out = ["| B | floor | " + " | ".join(c[1] for c in cols) + " | " + " | ".join(c[1] + " + CUDA graph" for c in cols)
           + " | kernel alone (graph) | tokens equal |", "|---" * (2 * len(cols) + 4) + "|"]
    for b, v in sorted(by.items()):
        eq = all(r["tokens_equal"] == "True" for r in v.values())
        cell = lambda c, key: _num(v[c][key]) if c in v else "–"  # noqa: E731
        out.append(f"| {b} | {float(next(iter(v.values()))['floor_us']):.2f} | "
                   + " | ".join(cell(c, "median_us") for c, _ in cols) + " | "
                   + " | ".join(cell(c, "cudagraph_us") for c, _ in cols)
                   + f" | {cell('kernel', 'cudagraph_us')} | {'yes' if eq else 'NO'} |")
    return out


def e2e_decode(rows: list[dict]) -> list[str]:
    tuned = any(r["impl"] == "stock_autotune" for r in rows)
    out = ["| scope | B | floor | eager | stock compile | fusekern | stock + CUDA graph | "
           + ("stock max-autotune + CUDA graph | " if tuned else "") + "fusekern + CUDA graph "
           "| fusekern (graph) × floor |", "|---" * (10 if tuned else 9) + "|"]
    by: dict = {}
    for r in rows:
        by.setdefault((r["scope"], int(r["batch"])), {})[r["impl"]] = r
    for (scope, b), v in by.items():
        f = v["fusekern"]
        at = (_num(v["stock_autotune"]["us_cudagraph"]) if "stock_autotune" in v else "–") + " | " if tuned else ""
        out.append(f"| {scope} | {b} | {_num(f['floor_us'])} | {_num(v['eager']['us'])} | {_num(v['stock']['us'])} | "
                   f"{_num(f['us'])} | {_num(v['stock']['us_cudagraph'])} | {at}{_num(f['us_cudagraph'])} | "
                   f"{float(f['x_floor_cudagraph']):.2f} |")
    return out


def scaled_mm(rows: list[dict]) -> list[str]:
    """Issue 6's GEMMs: every variant's median and throughput per case and M."""
    cols = [("eager", "eager"), ("stock_default", "stock compile"), ("fusekern", "fusekern compiled"),
            ("fusekern_triton", "Triton kernel"), ("fusekern_cute", "CuTe kernel"),
            ("torch_scaled_mm", "torch._scaled_mm"), ("cublas_mm_alone", "cuBLAS mm alone")]
    # The vendor's other baselines where the run measured them (newer runs: the block-scaled case's cuBLAS)
    for variant, label in (("torch_scaled_mm_fast_accum", "torch._scaled_mm fast accum"),
                           ("torch_scaled_mm_blockwise", "torch._scaled_mm block-scaled")):
        if any(r["variant"] == variant for r in rows):
            cols.append((variant, label))
    cols = _with_autotune(cols, rows, "variant", "stock_max_autotune", "stock max-autotune")
    by = {}
    for r in rows:
        by.setdefault((r["case"], int(r["M"]), r["N"], r["K"]), {})[r["variant"]] = r
    out = ["| case | M×N×K | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for (case, m, n, k), v in by.items():
        def cell(r):
            graph = f" / {_num(r['us_cudagraph'])}" if r.get("us_cudagraph") else ""
            return f"{_num(r['us'])}{graph} ({float(r['tflops']):.0f})"

        cells = [cell(v[c]) if c in v else "–" for c, _ in cols]
        out.append(f"| {case} | {m}×{n}×{k} | " + " | ".join(cells) + " |")
    return out


def fp8_kv_attention(rows: list[dict]) -> list[str]:
    out = ["| B | S | floor | variant | µs | × floor | µs, CUDA graph | × floor |", "|---" * 8 + "|"]
    for r in rows:
        graph = (_num(r["us_cudagraph"]), r["x_floor_cudagraph"]) if r.get("us_cudagraph") else ("–", "–")
        out.append(f"| {r['B']} | {r['S']} | {_num(r['floor_us'])} | {r['variant']} | {_num(r['us'])} | {r['x_floor']} "
                   f"| {graph[0]} | {graph[1]} |")
    return out


def decode_attention(rows: list[dict]) -> list[str]:
    """Per (case, B, S, position): CUDA-graph µs of eager, stock, fusekern compiled and the kernel alone."""
    cols = [("eager", "eager"), ("stock_default", "stock compile"), ("fusekern", "fusekern compiled"),
            ("fusekern_kernel", "kernel")]
    cols = _with_autotune(cols, rows, "variant", "stock_autotune", "stock max-autotune")
    by: dict = {}
    for r in rows:
        by.setdefault((r["case"], r["B"], r["S"], r.get("position", ""), r["floor_us"]), {})[r["variant"]] = r
    out = ["| B | S | mask up to | floor | " + " | ".join(c[1] for c in cols) + " | stock / fusekern |",
           "|---" * (len(cols) + 5) + "|"]
    for (case, b, s, pos, floor), v in by.items():
        cells = [_num(v[c]["us_cudagraph"]) if c in v else "–" for c, _ in cols]
        ratio = (f"{float(v['stock_default']['us_cudagraph']) / float(v['fusekern']['us_cudagraph']):.2f}"
                 if "stock_default" in v and "fusekern" in v else "–")
        out.append(f"| {b} | {s} | {pos or 'no mask'} | {_num(floor)} | " + " | ".join(cells) + f" | {ratio} |")
    return out


def int4_mma(rows: list[dict]) -> list[str]:
    """int4 along K at decode sizes: the fastest config of each packed kernel and the dispatcher's choice
    (the register-decoded tensor-core kernel was named GptqMma in the first run)."""
    kinds = ("PackedGemv", "PackedDot", "Int4Mma", "PackedDequant")
    by: dict = {}
    for r in rows:
        key = (r.get("format", "gptq"), int(r["N"]), int(r["K"]), int(r["M"]))
        cell = by.setdefault(key, {"floor": float(r["floor_us"])})
        kind = "Int4Mma" if r["kernel"] == "GptqMma" else r["kernel"]
        try:
            us = float(r["us"])
        except ValueError:  # did not compile or fit
            continue
        cell[kind] = min(us, cell.get(kind, math.inf))
        if r["chosen"] == "True":
            cell["chosen"] = (kind, us)
    out = ["| format | N x K | M | floor | GEMV | swap-AB tile | int4_mma | decode + cuBLAS | chosen | × floor |",
           "|---" * 10 + "|"]
    for (fmt, n, k, m), c in by.items():
        kind, us = c.get("chosen", ("–", math.nan))
        out.append(f"| {fmt} | {n} x {k} | {m} | {c['floor']:.1f} | "
                   + " | ".join(_num(c.get(x, math.nan)) for x in kinds) + f" | {kind} | {us / c['floor']:.2f} |")
    return out


def int4_mma_tma_sweep(rows: list[dict]) -> list[str]:
    """int4_mma with its words through TMA against direct loads: the fastest config of each per shape."""
    by: dict = {}
    for r in rows:
        key = (r["format"], int(r["N"]), int(r["K"]), int(r["M"]))
        cell = by.setdefault(key, {"floor": float(r["floor_us"])})
        try:
            us = float(r["us"])
        except ValueError:  # did not compile or fit
            continue
        kind = "scale_first" if r.get("scale_first") == "True" else "tma" if r["tma"] == "True" else "direct"
        if us < cell.get(kind, (math.inf,))[0]:
            cell[kind] = (us, r["config"].split("SPLIT_K=")[1].split(",")[0], r["config"].split("num_stages=")[1][0])
    out = ["| format | N x K | M | floor | direct loads | TMA words | TMA split / stages | TMA, scale first "
           "| × floor (best) |", "|---" * 9 + "|"]
    for (fmt, n, k, m), c in by.items():
        d, t = c.get("direct", (math.nan,)), c.get("tma", (math.nan, "–", "–"))
        f = c.get("scale_first", (math.nan,))
        best = min((v[0] for key, v in c.items() if key != "floor"), default=math.nan)
        out.append(f"| {fmt} | {n} x {k} | {m} | {c['floor']:.1f} | {_num(d[0])} | {_num(t[0])} | {t[1]} / {t[2]} | "
                   f"{_num(f[0])} | {best / c['floor']:.2f} |")
    return out


def int4_mma_n_sweep(rows: list[dict]) -> list[str]:
    """int4 packed along N on tensor cores: the fastest config of each direct-load variant per shape, with
    its K split (rows that did not compile or fit are left out)."""
    names = ("direct", "words ahead", "scale first", "scale first, 128 registers")
    by: dict = {}
    for r in rows:
        cfg = r["config"]
        if "tma=True" in cfg:
            continue
        try:
            us = float(r["us"])
        except ValueError:
            continue
        kind = (3 if "maxnreg=128" in cfg else 2) if "scale_first=True" in cfg else \
            (1 if "prefetch=True" in cfg else 0)
        cell = by.setdefault((r["format"], int(r["N"]), int(r["K"]), int(r["M"])), {"floor": float(r["floor_us"])})
        if us < cell.get(kind, (math.inf,))[0]:
            cell[kind] = (us, cfg.split("SPLIT_K=")[1].split(",")[0])
    out = ["| format | N x K | M | floor | " + " | ".join(names) + " | × floor (best) |", "|---" * 9 + "|"]
    for (fmt, n, k, m), c in by.items():
        cells = [f"{_num(c[i][0])} ({c[i][1]})" if i in c else "–" for i in range(4)]
        best = min(c[i][0] for i in range(4) if i in c)
        out.append(f"| {fmt} | {n} x {k} | {m} | {c['floor']:.1f} | " + " | ".join(cells) + f" | {best / c['floor']:.2f} |")
    return out


def int4_mma_n_vs_before(rows: list[dict]) -> list[str]:
    """int4_mma_n against the kernels the dispatcher had for AWQ, in one run: the fastest config of each,
    what the dispatcher would have picked before (the fastest of the others) and the speed-up over it."""
    kinds = ("PackedGemv", "PackedDot", "PackedDequant", "Int4MmaN")
    by: dict = {}
    for r in rows:
        try:
            us = float(r["us"])
        except ValueError:
            continue
        cell = by.setdefault((r["format"], int(r["N"]), int(r["K"]), int(r["M"])), {"floor": float(r["floor_us"])})
        cell[r["kernel"]] = min(us, cell.get(r["kernel"], math.inf))
    out = ["| format | N x K | M | floor | GEMV | swap-AB tile | decode + cuBLAS | int4_mma_n | × floor | × faster than "
           "before |", "|---" * 10 + "|"]
    for (fmt, n, k, m), c in by.items():
        before = min(c.get(x, math.inf) for x in kinds[:3])
        new = c.get("Int4MmaN", math.nan)
        out.append(f"| {fmt} | {n} x {k} | {m} | {c['floor']:.1f} | "
                   + " | ".join(_num(c.get(x, math.nan)) for x in kinds)
                   + f" | {new / c['floor']:.2f} | {before / new:.1f} |")
    return out


TABLES = {"scaled_mm": scaled_mm, "fp8_kv_attention": fp8_kv_attention, "decode_attention": decode_attention, "w8a16_linear": w8a16_linear, "decode_mm": decode_mm, "sampler": sampler,
          "gemv_sweep": gemv_sweep, "gptq_mma": int4_mma, "greedy_mask": greedy_mask,
          "decode_mm_shapes": decode_mm_shapes, "decode_mm_shapes_fp4": decode_mm_shapes,
          "int4_mma_tma_sweep": int4_mma_tma_sweep,
          "decode_mm_lm_head": decode_mm_shapes, "decode_mm_lm_head_2048": decode_mm_autotune,
          "decode_mm_shapes_2048": decode_mm_autotune,
          "e2e_decode": e2e_decode, "int4_mma_m64": int4_mma,
          "int4_mma_n_sweep": int4_mma_n_sweep, "int4_mma_n_sweep_c8a9946": int4_mma_n_vs_before}


def render(name: str, results: str) -> list[str]:
    return TABLES[name](_rows(os.path.join(results, f"{name}.csv")))


DOCS = (os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "results-h200.md"))


def updated_readme(text: str, results: str) -> str:
    """``text`` with every marked table regenerated from its CSV."""
    def fill(m: re.Match) -> str:
        name = m.group(1)
        return f"<!-- results:{name} -->\n" + "\n".join(render(name, results)) + f"\n<!-- /results:{name} -->"

    return re.sub(r"<!-- results:(\w+) -->\n.*?<!-- /results:\1 -->", fill, text, flags=re.S)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=os.path.join(HERE, "results", "h200"))
    ap.add_argument("--docs", nargs="+", default=list(DOCS), help="the documents whose tables to refresh")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = []
    for path in args.docs:
        with open(path) as f:
            text = f.read()
        new = updated_readme(text, args.results)
        if new == text:
            continue
        if args.check:
            stale.append(os.path.relpath(path, ROOT))
        else:
            with open(path, "w") as f:
                f.write(new)
    if stale:
        print(f"result tables differ from the CSVs in {', '.join(stale)}: run benchmarks/results_tables.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
