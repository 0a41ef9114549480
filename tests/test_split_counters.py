"""Split-K counters: one buffer per device and stream, so that split kernels on two streams may run at once."""
import pytest
import torch

from fusekern.kernels import int4_mma_sync as ims
from fusekern.kernels import packed_mm as pm
from fusekern.kernels import split_counters as sc
from test_int4_mma import setup


def test_cpu_counters_are_zero_and_kept():
    a = sc.split_counters(torch.device("cpu"), 5)
    assert a.numel() >= 5 and not a.any() and a.dtype == torch.int32
    assert sc.split_counters(torch.device("cpu"), 3) is a
    b = sc.split_counters(torch.device("cpu"), a.numel() + 1)  # outgrown: a new, larger buffer
    assert b.numel() > a.numel() and not b.any()
    assert sc.split_counters(torch.device("cpu"), 2) is b


@pytest.mark.gpu
def test_gpu_each_stream_has_its_own_counters():
    dev = torch.device("cuda", torch.cuda.current_device())
    main = sc.split_counters(dev, 8)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = sc.split_counters(dev, 8)
        assert sc.split_counters(torch.device("cuda"), 8) is other  # a device without its index: the same
    assert other.data_ptr() != main.data_ptr() and not other.any()
    assert sc.split_counters(dev, 8) is main


def on_two_streams_at_once(calls: list) -> list:
    """The calls' results, made alternately on two side streams that first sleep on the GPU for ~25 ms: the
    host queues every call meanwhile, so the two streams' kernels are ready together and share the SMs."""
    torch.cuda.synchronize()
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    for s in streams:
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)  # GPU cycles
    outs = []
    for i, call in enumerate(calls):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(call())
    torch.cuda.synchronize()
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [ims.Int4MmaSync(SPLIT_K=4), pm.PackedGemv(64, 128, 4, 4)], ids=["mma_sync", "gemv"])
def test_gpu_split_kernels_on_two_streams_at_once(cfg):
    """Small grids (32 column tiles x 4 splits) queued on two streams run on the SMs at the same time; every
    output must be the one the same call gives alone (the reduction is deterministic)."""
    K, N, calls = 4096, 2048, 48
    _, lay, leaves, x = setup(K, N, 1, seed=7, fmt="gptq")
    xs = [torch.randn_like(x) for _ in range(calls)]
    alone = [pm.packed_mm(xi, leaves, lay, K, N, cfg) for xi in xs]
    outs = on_two_streams_at_once([lambda xi=xi: pm.packed_mm(xi, leaves, lay, K, N, cfg) for xi in xs])
    bad = [i for i in range(calls) if not torch.equal(outs[i], alone[i])]
    assert not bad, f"{len(bad)} of {calls} outputs differ from the same call alone: {bad[:8]}"


@pytest.mark.gpu
def test_gpu_op_replays_per_stream_and_runs_on_two_at_once(monkeypatch):
    """A decode op's recorded launch holds its stream's counters: another stream takes the op's own path
    once (and records its own), and calls alternating between two streams give each call's output alone."""
    monkeypatch.setenv("FUSEKERN_STOCK_FALLBACK", "0")  # (the stock fallback records nothing)
    from fusekern.kernels import decode_mm as dm
    from test_replay import _program

    K, N, calls = 4096, 2048, 32
    x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
    text, leaves, layout = _program("int4_k_stack", K, N, x, 3)
    dm.decode_mm(x, leaves, text, None, layout)
    assert dm._REPLAYS.get(dm.replay_key(x, leaves, text, False, layout), leaves) is not None
    with torch.cuda.stream(torch.cuda.Stream()):
        assert dm._REPLAYS.get(dm.replay_key(x, leaves, text, False, layout), leaves) is None
    xs = [torch.randn_like(x) for _ in range(calls)]
    alone = [dm.decode_mm(xi, leaves, text, None, layout) for xi in xs]
    outs = on_two_streams_at_once([lambda xi=xi: dm.decode_mm(xi, leaves, text, None, layout) for xi in xs])
    bad = [i for i in range(calls) if not torch.equal(outs[i], alone[i])]
    assert not bad, f"{len(bad)} of {calls} outputs differ from the same call alone: {bad[:8]}"
