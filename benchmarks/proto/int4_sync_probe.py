"""What the int4_mma_sync probes share: one int4 weight (two codes per byte, the demo's W4A16) of a shape with
enough copies that cycling through them reads every call from DRAM, M = 1, and rows timed warm and cold.

``probe_int4_sync_l2.py``, ``probe_int4_sync_ring.py`` and ``probe_int4_sync_strided.py`` use it.
"""
from __future__ import annotations

import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/proto")
from bench_common import RowWriter, copies_for_cold, cycling, versions, warm_up_clocks  # noqa: E402
from bench_int4_mma import floor_us, zoo_weight  # noqa: E402
from probe_int4_m1 import stream_read_kernel  # noqa: E402
from fusekern.kernels import decode_mm as dm  # noqa: E402
from fusekern.kernels import int4_mma_sync as ims  # noqa: E402
from fusekern.kernels import packed_mm as pm  # noqa: E402


def median_us(fn) -> float:
    """``do_bench_cudagraph``'s median in µs, after one call outside the graph (compiles, tunes)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


class ProbeShape:
    """One N x K weight, its cold copies, x (M = 1), the float64 reference and the rows written for it."""

    def __init__(self, N: int, K: int, out, meta: dict, width: int = 100):
        self.N, self.K, self.out, self.meta, self.width = N, K, out, meta, width
        _, self.leaves, self.lay = zoo_weight("int4_k_stack", N, K)
        self.weights = copies_for_cold(self.leaves)
        self.floor = floor_us(self.leaves, N, K, 1)
        self.x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        self.ref = pm.packed_mm_reference(self.x, self.leaves, self.lay, K, N).float().to(self.x.device)
        nbytes = sum(t.numel() * t.element_size() for t in self.leaves)
        print(f"== int4_k_stack {N}x{K} M=1 floor {self.floor:.2f} us ({nbytes / 1e6:.1f} MB, "
              f"{len(self.weights)} copies cold)", flush=True)

    def timed(self, kind: str, config: str, err: str, call_on) -> None:
        """A row for ``call_on(i)`` (a call reading copy i): warm on copy 0 again and again, cold cycling."""
        warm = median_us(call_on(0))
        cold = median_us(cycling([call_on(i) for i in range(len(self.weights))]))
        self.out.write(dict(**self.meta, format="int4_k_stack", N=self.N, K=self.K, M=1, kernel=kind, config=config,
                            warm_us=round(warm, 2), cold_us=round(cold, 2), floor_us=round(self.floor, 2),
                            x_floor_cold=round(cold / self.floor, 2), rel_err=err))
        print(f"  {config:{self.width}s} warm {warm:7.2f}  cold {cold:7.2f} us  x{cold / self.floor:.2f}  {err}",
              flush=True)

    def rel_err(self, got: torch.Tensor) -> str:
        return f"{((got.float() - self.ref).norm() / self.ref.norm()).item():.2e}"

    def stream_read(self, sms: int, block: int = 512, unroll: int = 8, per_sm: int = 4) -> None:
        """The practical floor: a plain streaming read of the same code bytes."""
        grid = sms * per_sm
        sink = torch.empty(grid * block, dtype=torch.int32, device="cuda")
        words = [w[0].view(torch.int32) for w in self.weights]

        def read(i):
            return lambda: stream_read_kernel[(grid,)](words[i], sink, words[i].numel(), BLOCK=block, UNROLL=unroll,
                                                       num_warps=4)
        self.timed("stream_read", f"stream read (codes only) BLOCK={block} UNROLL={unroll} {per_sm}/SM", "", read)

    def run_config(self, cfg, plain: torch.Tensor | None = None, note: str = "") -> torch.Tensor | None:
        """An ``int4_mma_sync`` config checked against the float64 reference (and bit for bit against ``plain``,
        the plain kernel's output, where given), then timed; None (and a line saying why) if it fails."""
        try:
            got = pm.packed_mm(self.x, self.leaves, self.lay, self.K, self.N, cfg)
            err = self.rel_err(got) + note
            if plain is not None and not torch.equal(got, plain):
                err += " DIFFERS FROM PLAIN"

            def call(i):
                return lambda: pm.packed_mm(self.x, self.weights[i], self.lay, self.K, self.N, cfg)
            self.timed("Int4MmaSync", str(cfg).replace("Int4MmaSync", ""), err, call)
            return got
        except Exception as e:  # a config that does not compile or fit
            print(f"  {cfg}: n/a ({type(e).__name__}: {str(e)[:200]})", flush=True)
            return None

    def words(self) -> list[torch.Tensor]:
        """Each copy's code words as int32."""
        return [w[0].view(torch.int32) for w in self.weights]


def probe_shapes(spec: str, csv: str | None, width: int = 100):
    """(ProbeShape, SM count) per "NxK" of ``spec``, rows written to ``csv`` (clocks warmed first)."""
    warm_up_clocks()
    meta = versions()
    out = RowWriter(csv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        for text in spec.split(","):
            N, K = map(int, text.split("x"))
            yield ProbeShape(N, K, out, meta, width), sms
    finally:
        out.close()


def probe_against_twins(spec: str, csv: str | None, configs, twin) -> None:
    """Per shape of ``spec``: the streaming read, then every config of ``configs(shape, sms)``, each checked bit
    for bit against the output of ``twin(cfg)``, the config it varies (``configs`` lists a twin before the
    variants of it; a config that is its own twin is only checked against float64)."""
    for shape, sms in probe_shapes(spec, csv, width=110):
        shape.stream_read(sms)
        outputs = {}
        for cfg in configs(shape, sms):
            key = twin(cfg)
            got = shape.run_config(cfg, outputs.get(key) if key != cfg else None)
            if key == cfg:
                outputs[key] = got


def dispatcher_configs(shape: ProbeShape, sms: int) -> list:
    """The ``int4_mma_sync`` configs the dispatcher offers at this shape, M = 1."""
    return [c for c in dm._packed_candidates(1, shape.N, shape.K, sms, shape.lay) if isinstance(c, ims.Int4MmaSync)]
