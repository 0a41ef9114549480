"""PNG plots of the committed benchmark CSVs (matplotlib: ``pip install -e ".[bench]"``).

    python benchmarks/plot_results.py [--results benchmarks/results/h200]

One figure per CSV that has a plot below, written next to it (``NAME.png``): median µs per variant,
log scale, one group of bars per shape, the floor as a black tick.
"""
from __future__ import annotations

import argparse
import csv
import math
import os

from results_tables import csv_float  # (NaN, no bar, where a run wrote "n/a (...)")


def _bars(ax, groups: list[str], series: dict[str, list[float]], floors: list[float] | None, title: str):
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v and not math.isnan(v) else 0 for v in values], width, label=name)
    if floors:
        ax.scatter(range(len(groups)), floors, marker="_", s=400, color="black", label="floor", zorder=3)
    ax.set_xticks(range(len(groups)), groups, rotation=45, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("µs (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def plot_decode_mm(rows, ax):
    groups = [f"{r['format']} M={r['M']}" for r in rows]
    cols = {"eager": "eager_call_us", "stock + CUDA graph": "stock_graph_us", "fusekern + CUDA graph": "fusekern_graph_us"}
    series = {k: [csv_float(r[c]) for r in rows] for k, c in cols.items()}
    _bars(ax, groups, series, [float(r["floor_us"]) for r in rows], "structural dequant -> matmul, N = K = 8192")


def plot_by_variant(rows, ax, key, variants, title):
    groups, by = [], {}
    for r in rows:
        g = key(r)
        if g not in by:
            groups.append(g)
            by[g] = {"floor": float(r["floor_us"])}
        by[g][r["variant"]] = csv_float(r["median_us"])
    series = {v: [by[g].get(v, float("nan")) for g in groups] for v in variants}
    _bars(ax, groups, series, [by[g]["floor"] for g in groups], title)


def plot_e2e_decode(rows, ax):
    groups, by = [], {}
    for r in rows:
        g = f"{r['scope']} B={r['batch']}"
        if g not in by:
            groups.append(g)
            by[g] = {"floor": float(r["floor_us"])}
        by[g][r["impl"]] = csv_float(r["us_cudagraph"])
    series = {f"{v} + CUDA graph": [by[g].get(v, float("nan")) for g in groups] for v in ("eager", "stock", "fusekern")}
    _bars(ax, groups, series, [by[g]["floor"] for g in groups], "decode step, Llama-3-8B-shaped layers, W4A16")


PLOTS = {
    "decode_mm": plot_decode_mm,
    "e2e_decode": plot_e2e_decode,
    "w8a16_linear": lambda rows, ax: plot_by_variant(
        rows, ax, lambda r: f"M={r['M']}", ["eager", "inductor_default", "fusekern", "bf16_cublas_unquantized"],
        "W8A16 linear, N = K = 8192"),
    "sampler": lambda rows, ax: plot_by_variant(
        rows, ax, lambda r: f"{r['style']} B={r['B']}", ["eager", "inductor_default_graph", "fusekern_graph",
                                                          "fusekern_kernel"],
        "sampling, V = 128256 (missing bar: stock crashed)"),
}


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200"))
    args = ap.parse_args()
    for name, plot in PLOTS.items():
        path = os.path.join(args.results, f"{name}.csv")
        if not os.path.exists(path):
            continue
        rows = _rows(path)
        fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(rows) / (1 if name == "decode_mm" else 4) + 4), 4))
        plot(rows, ax)
        fig.tight_layout()
        out = os.path.join(args.results, f"{name}.png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
