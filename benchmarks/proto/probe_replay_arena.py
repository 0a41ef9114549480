"""Host time of a layout replay's call with its workspaces in one arena (shipped) against one allocation per
buffer (before), in one process, alternating (probe, GPU): the sampler's replay at B = 1, V = 128256.

    python benchmarks/proto/probe_replay_arena.py [--calls 2000] [--rounds 5] [--csv OUT.csv]
"""
from __future__ import annotations

import argparse
import sys
import types

import torch

sys.path.insert(0, "benchmarks")
from bench_common import RowWriter, per_call_us, versions  # noqa: E402
from fusekern.kernels import sampler as S  # noqa: E402
from fusekern.kernels.layout_replay import New  # noqa: E402


def one_allocation_each(self, tensors, stream=None):
    """``LayoutReplay.__call__`` as it was (git 1a995ee): a ``torch.empty`` per buffer, tensors to the launches."""
    device = tensors[0].device
    made = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.buffers]
    if self.prepare is not None:
        self.prepare(lambda i: made[i])
    for launch, slots, sources in self.steps:
        launch.run(slots, [made[s.i] if isinstance(s, New) else tensors[s] for s in sources], stream)
    return made[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    logits = 3 * torch.randn(1, 128256, device="cuda", dtype=torch.bfloat16)
    op_args = (logits, None, 0.8, None, 50, None, 0.9, None, 0.0, None)
    S._sample_cuda(*op_args)
    rep, = S._REPLAYS.values()
    key = next(iter(S._REPLAYS))
    tensors = (logits, None, None, None, None, None)
    old = types.MethodType(one_allocation_each, rep)
    torch.manual_seed(0)
    a = rep(tensors, key[-1])
    torch.manual_seed(0)
    b = old(tensors, key[-1])
    print("same tokens:", torch.equal(a, b), "buffers:", len(rep.buffers), "arena bytes:", rep.arena_bytes)
    out, info = RowWriter(args.csv), versions()
    for r in range(args.rounds):
        for name, f in (("arena", lambda: rep(tensors, key[-1])), ("one_each", lambda: old(tensors, key[-1])),
                        ("op_cuda_function", lambda: S._sample_cuda(*op_args))):
            us = per_call_us(f, (), args.calls, warmup=50)
            print(f"round {r} {name:17s} {us:7.2f} us per call", flush=True)
            out.write(dict(B=1, V=128256, way=name, round=r, us_per_call=round(us, 2), **info))
    out.close()


if __name__ == "__main__":
    main()
