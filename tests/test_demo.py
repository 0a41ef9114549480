"""The demo end to end on CPU at its tiny size: a Llama-style decoder with quantized weights generates
under eager, stock torch.compile and fusekern; fusekern must agree with eager and fuse every quantized
linear (q, k, v, o, gate, up, down: 7 per layer) and the sampler."""
import pytest

import fusekern
from fusekern import demo
from fusekern.patterns.registry import get_pattern

# weights option -> the patterns that should fuse its linears
EXPECTED = {"w4a16": ("decode_matmul",), "w8a16": ("w8a16_",)}


@pytest.mark.slow
@pytest.mark.parametrize("weights", sorted(EXPECTED))
def test_demo_matches_eager_and_fuses(weights, capsys):
    assert demo.main("cpu", weights=weights, steps=8) == 0, capsys.readouterr().out

    fired = fusekern.match_report().fired()  # main resets the report: this is its run alone
    dequant = {name: n for name, n in fired.items() if get_pattern(name).family == "dequant_matmul"}
    assert sum(dequant.values()) >= 7 * demo.TINY.layers, fired
    assert all(name.startswith(EXPECTED[weights]) for name in dequant), dequant
    assert fired["sample"] >= 1, fired
    out = capsys.readouterr().out
    assert "equivalent" in out
    assert "CUDA graphs" not in out  # the default on CPU: no graph variants (inductor makes none there)


@pytest.mark.slow
def test_demo_skips_a_cuda_graph_variant_that_fails(capsys, monkeypatch):
    """A CUDA-graph variant whose compile or capture raises is skipped with a line saying why; the demo's
    check still runs on the others."""
    warm_up = demo._warm_up

    def failing(name, *a, graphs=False, **k):
        if graphs and name.startswith("fusekern"):
            raise RuntimeError("capture failed")
        return warm_up(name, *a, graphs=graphs, **k)
    monkeypatch.setattr(demo, "_warm_up", failing)
    assert demo.main("cpu", weights="w4a16", steps=2, cuda_graphs=True) == 0
    out = capsys.readouterr().out
    assert "fusekern + CUDA graphs skipped (RuntimeError: capture failed)" in out, out
    assert "stock + CUDA graphs vs eager" in out and "fusekern + CUDA graphs vs eager" not in out


@pytest.mark.slow
def test_demo_cuda_graph_option_checks_and_times_both(capsys):
    """``--cuda-graphs``: stock and fusekern compiled with mode="reduce-overhead" replay fusekern's tokens and are
    compared with eager like the plain runs (on CPU inductor makes no graphs: the loop's step marks and copies
    out of the graphs' buffers run, the graphs do not). The match report printed is the plain compile's."""
    assert demo.main("cpu", weights="w4a16", steps=3, cuda_graphs=True) == 0
    out = capsys.readouterr().out
    for name in ("fusekern + CUDA graphs", "stock + CUDA graphs"):
        assert f"{name} vs eager" in out and f"{name}:" in out, out
    assert out.count("fusekern match report") == 1, out


@pytest.mark.parametrize("argv,message", [
    (["demo", "--steps", "0"], "must be at least 1"),
    (["demo", "--steps", "-3"], "must be at least 1"),
    (["demo", "--batch", "0"], "must be at least 1"),
    (["demo", "--steps", "two"], "not an integer"),
    (["check", "--draws", "0"], "must be at least 1"),
])
def test_cli_refuses_bad_numbers_before_compiling(argv, message, capsys):
    from fusekern.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,message", [
    (dict(steps=0), "at least 1"), (dict(batch=0), "at least 1"), (dict(device="tpu"), "device must be"),
])
def test_demo_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        demo.main(**{"device": "cpu", **kwargs})


def test_check_names_an_unknown_pattern_and_lists_the_registered(capsys):
    from fusekern.__main__ import main

    assert main(["check", "--pattern", "w8a16_linear_scale", "--pattern", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "no pattern named nosuch" in err and "w8a16_linear_scale" in err


@pytest.mark.parametrize("argv,expected", [
    (["demo"], None), (["demo", "--cuda-graphs"], True), (["demo", "--no-cuda-graphs"], False),
])
def test_cli_cuda_graphs_default_to_the_device(argv, expected, monkeypatch):
    """The CLI passes None unless asked: the demo then uses CUDA graphs on a GPU and not on CPU."""
    import fusekern.demo
    from fusekern.__main__ import main

    seen = {}
    monkeypatch.setattr(fusekern.demo, "main", lambda *a, **k: seen.update(k) or 0)
    assert main(argv) == 0
    assert seen["cuda_graphs"] is expected
