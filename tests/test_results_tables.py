"""The result-table generators (benchmarks/results_tables.py) on made-up rows: stock max-autotune's column
appears where a run measured it (``--autotune``, which ``python -m fusekern bench`` passes) and only there."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import results_tables as rt  # noqa: E402


def _e2e_row(impl, us, graph):
    return dict(scope="layers", batch="1", impl=impl, us=str(us), us_cudagraph=str(graph), floor_us="50.0",
                x_floor_cudagraph=f"{graph / 50:.2f}")


def test_e2e_table_gains_the_autotune_column_only_when_measured():
    rows = [_e2e_row("eager", 900.0, 800.0), _e2e_row("stock", 700.0, 650.0), _e2e_row("fusekern", 300.0, 150.0)]
    plain = rt.e2e_decode(rows)
    assert "max-autotune" not in plain[0] and plain[2].count("|") == 10
    tuned = rt.e2e_decode(rows + [_e2e_row("stock_autotune", 690.0, 640.5)])
    assert "stock max-autotune + CUDA graph" in tuned[0]
    cells = [c.strip() for c in tuned[2].strip("|").split("|")]
    header = [c.strip() for c in tuned[0].strip("|").split("|")]
    assert len(cells) == len(header) == 10
    assert cells[header.index("stock max-autotune + CUDA graph")] == "640.5"
    assert cells[header.index("fusekern + CUDA graph")] == "150.0"


def test_variant_tables_gain_the_autotune_column_only_when_measured():
    def row(variant, us):
        return dict(B="8", variant=variant, median_us=str(us), cudagraph_us=str(us / 2), floor_us="1.0",
                    tokens_equal="True")

    rows = [row("eager", 30.0), row("stock", 20.0), row("fusekern", 10.0)]
    assert "max-autotune" not in rt.greedy_mask(rows)[0]
    tuned = rt.greedy_mask(rows + [row("stock_autotune", 18.0)])
    header = [c.strip() for c in tuned[0].strip("|").split("|")]
    cells = [c.strip() for c in tuned[2].strip("|").split("|")]
    assert cells[header.index("stock max-autotune")] == "18.0"
    assert cells[header.index("stock max-autotune + CUDA graph")] == "9.0"


def test_decode_mm_shapes_gains_the_autotune_columns_only_when_measured():
    row = dict(format="gptq", N="8192", K="8192", M="16", floor_us="8.0", eager_call_us="1000.0", stock_call_us="120.0",
               stock_graph_us="110.0", fusekern_call_us="40.0", fusekern_graph_us="16.0")
    plain = rt.decode_mm_shapes([row])
    assert "max-autotune" not in plain[0] and plain[1].count("|") == 12
    tuned = rt.decode_mm_shapes([dict(row, stock_autotune_graph_us="100.0")])
    header = [c.strip() for c in tuned[0].strip("|").split("|")]
    cells = [c.strip() for c in tuned[2].strip("|").split("|")]
    assert len(cells) == len(header) == 13 and tuned[1].count("|") == 14
    assert cells[header.index("max-autotune + CUDA graph")] == "100.0"
    assert cells[header.index("× faster than max-autotune (graphs)")] == "6.2"
    assert cells[header.index("× floor")] == "2.00"


def test_decode_mm_autotune_compares_graph_with_graph_and_survives_a_failed_capture():
    row = dict(format="gptq", N="8192", K="8192", M="2048", eager_call_us="900.0", stock_graph_us="480.0",
               stock_autotune_graph_us="470.0", fusekern_call_us="461.2", fusekern_graph_us="445.5",
               cublas_bf16_call_us="385.2", cublas_bf16_graph_us="405.0")
    header, _, line = rt.decode_mm_autotune([row])
    names, values = ([c.strip() for c in t.strip("|").split("|")] for t in (header, line))
    cells = dict(zip(names, values))
    assert cells["× cuBLAS (fusekern, graph)"] == f"{445.5 / 405.0:.2f}"  # not over cuBLAS's plain call (385.2)
    failed = rt.decode_mm_autotune([dict(row, stock_graph_us="n/a (RuntimeError)")])[2]
    assert "| n/a |" in failed


def test_decode_mm_shapes_survives_a_failed_capture():
    row = dict(format="gptq", N="8192", K="8192", M="16", floor_us="8.0", eager_call_us="1000.0", stock_call_us="120.0",
               stock_graph_us="110.0", fusekern_call_us="40.0", fusekern_graph_us="n/a (RuntimeError)",
               stock_autotune_graph_us="n/a (RuntimeError)")
    line = rt.decode_mm_shapes([row])[2]
    assert line.count("n/a") == 2 and "nan" in line  # the cells say so; the ratios are not numbers
