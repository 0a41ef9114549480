"""Tensors kept across calls (decode tables, split-K counters) are made outside CUDA graph memory pools."""
import pytest
import torch

from fusekern.kernels.lasting import lasting


def test_cpu_tensors_are_made_in_place():
    t = lasting(lambda: torch.arange(4), torch.device("cpu"))
    assert torch.equal(t, torch.arange(4))


def test_errors_reach_the_caller():
    def broken():
        raise ValueError("no table")

    with pytest.raises(ValueError, match="no table"):
        lasting(broken, torch.device("cpu"))


@pytest.mark.gpu
def test_gpu_lasting_tensors_stay_out_of_a_graph_pool():
    """Made while this thread's allocations go to a CUDA graph pool (as inductor's CUDA-graph warm-up routes
    them), a lasting tensor lands in the default pool, written, while a plain allocation lands in the graph's."""
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
    if begin is None:
        pytest.skip("this torch routes allocations to a pool by stream, not by thread")
    dev = torch.cuda.current_device()
    pool = torch.cuda.graph_pool_handle()
    begin(dev, pool)
    try:
        inside = torch.empty(1 << 20, device="cuda")
        kept = lasting(lambda: torch.full((1 << 20,), 7.0, device="cuda"), torch.device("cuda", dev))
    finally:
        torch._C._cuda_endAllocateToPool(dev, pool)
    segments = torch.cuda.memory._snapshot()["segments"]

    def pool_of(t):
        seg = next(s for s in segments if s["address"] <= t.data_ptr() < s["address"] + s["total_size"])
        return tuple(seg["segment_pool_id"])

    assert pool_of(inside) == tuple(pool) and pool_of(kept) != tuple(pool)
    assert bool((kept == 7.0).all())
    del inside
    torch._C._cuda_releasePool(dev, pool)
