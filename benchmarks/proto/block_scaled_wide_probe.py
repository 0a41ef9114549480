"""Block-scaled FP8 CuTe GEMM at 128x256, the register split and a multicast cluster, against 128x128 (probe).

    python benchmarks/proto/block_scaled_wide_probe.py [--csv OUT.csv] [--shapes 4096x7168x7168,...] [--rounds 2]
    python benchmarks/proto/block_scaled_wide_probe.py --compile-only OUT_DIR     (CPU: sm_90a builds, resources)

Why: the block-scaled kernel ran 128x128 tiles at 987-1041 TFLOP/s on the H200 (issue 6 asks 1300), and the
rowwise kernel ran 8% faster at 128x256 than at 128x128 in one run (block_scaled_probe.csv): a wider tile halves
the A bytes each CTA reads from L2 per FLOP. The two-fragment loop of 128x128 cannot take that tile (the sum and
two fragments of a 64x256 slab would be 384 registers per thread). The variants:

- ``base``: the 128x128 block-scaled kernel (two 64x128 fragments alternating; producer / consumer registers
  40 / 232);
- ``wide``: the 128x256 block-scaled tile (one 64-register fragment per 128-column half in turn; the kernel's
  ``_mainloop_block_scaled_halves``, replaced at git 0c5c38c by ``_mainloop_block_scaled_quarters``: this
  variant now runs that loop);
- ``*_24_240``: registers split 24 / 240 (CUTLASS's Hopper blockwise example found it about 25% faster than
  40 / 232 for its own kernel);
- ``*_mcast``: a 1 x 2 cluster whose two CTAs share A by TMA multicast (``Multicast`` below, not in the kernel);
- ``rowwise_*``: the rowwise kernel at 128x128 and 128x256 on the same operands (the tile without any fold).

Every variant is checked against a float64 reference (the output poisoned with NaN first), and the variants of
one arithmetic (same tile, same scaling) bit for bit against each other. Times: CUDA graph
(``do_bench_cudagraph``), median, every variant twice in turn.

Result on an H100 (git ba27890, where ``wide`` was a subclass here before it went into the kernel unchanged;
``benchmarks/results/h100/block_scaled_wide_probe_ba27890.csv``), M = 4096, N = K = 7168, TFLOP/s over the two
rounds: base 946-955, wide 1032-1036 (+9%), wide_mcast 1042, base_mcast 977-980, base_24_240 805-817 and
wide_24_240 1008 (the split loses), rowwise 1143-1146 at 128x128 and 1290-1293 at 128x256 (1301-1305 with
multicast and 24 / 240). At 1100 x 1664 x 1408 (63 tiles of 128x256 for 132 SMs) wide lost: 12.7 against 8.6 us,
and at M = 2048 it lost too (git 8cb811e, block_scaled_wide_shipped_8cb811e.csv: 222 against 215 us), so the
heuristic compares waves (``block_scaled_heuristics``). Every output matched the reference (rel. err
1.66e-3, the same as base) and its family's bits.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
from fusekern.kernels import cute_scaled_mm as csm  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

Base = csm._ScaledMmKernel


class Base24(Base):
    producer_registers = 24
    consumer_registers = 240


class Multicast:
    """A 1 x 2 cluster: two CTAs on neighbouring N tiles of the same rows share A. Each loads half of
    the A tile and multicasts it to both (TMA multicast), so A's L2 reads halve; B is loaded per CTA.
    Mixed in before a kernel class: overrides the launch and the producer; the kernel's own body and
    pipeline read ``cluster_n``."""

    cluster_n = 2

    @cute.jit
    def _launch(self, mA, mB, mD, mRow, mCol, mBias, mRes, mSA, mSB, num_sms, stream):
        self._setup_tiles()
        tile_mk = (self.tile_mnk[0], self.tile_mnk[2])
        tile_nk = (self.tile_mnk[1], self.tile_mnk[2])
        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(), mA,
            cute.slice_(self.a_smem_staged, (None, None, 0)), tile_mk, num_multicast=self.cluster_n)
        tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(self.b_smem_staged, (None, None, 0)),
            tile_nk)
        tma_d, tma_mD = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mD,
            cute.slice_(self.epi_smem_staged, (None, None, 0)), self.epi_tile)
        tiles = cute.zipped_divide(mD, tiler=(self.tile_mnk[0], self.tile_mnk[1]))
        tiles_mn = tiles[(0, (None, None))].shape
        sched_params = csm.utils.PersistentTileSchedulerParams((*tiles_mn, 1), (1, self.cluster_n, 1))
        grid = csm.utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, num_sms // self.cluster_n)

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_staged)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(self.epi_smem_staged)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a, tma_mA, tma_b, tma_mB, tma_d, tma_mD, mD,
            mRow, mCol, mBias, mRes, mSA, mSB, self.tiled_mma, sched_params,
            self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], cluster=(1, self.cluster_n, 1),
                 min_blocks_per_mp=1, stream=stream)

    @cute.jit
    def _produce(self, ab_pipeline, tma_a, mA, tma_b, mB, sA, sB, sched_params):
        gA = cute.local_tile(mA, (self.tile_mnk[0], self.tile_mnk[2]), (None, None))
        gB = cute.local_tile(mB, (self.tile_mnk[1], self.tile_mnk[2]), (None, None))
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())  # the N position in the cluster
        cluster = cute.make_layout((1, self.cluster_n, 1))
        a_mask = cute.make_layout_image_mask(cluster, cluster.get_flat_coord(rank), mode=1)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, rank, cute.make_layout(self.cluster_n), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        k_tiles = cute.size(gA, mode=[3])
        sched = csm.utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        state = csm.pipeline.make_pipeline_state(csm.pipeline.PipelineUserType.Producer, self.ab_stage)
        while work.is_valid_tile:
            tile = work.tile_idx
            tAgA_tile = tAgA[(None, tile[0], None)]
            tBgB_tile = tBgB[(None, tile[1], None)]
            state.reset_count()
            for _k in range(k_tiles):
                ab_pipeline.producer_acquire(state)
                full = ab_pipeline.producer_get_barrier(state)
                cute.copy(tma_a, tAgA_tile[(None, state.count)], tAsA[(None, state.index)], tma_bar_ptr=full,
                          mcast_mask=a_mask)
                cute.copy(tma_b, tBgB_tile[(None, state.count)], tBsB[(None, state.index)], tma_bar_ptr=full)
                ab_pipeline.producer_commit(state)
                state.advance()
            sched.advance_to_next_work()
            work = sched.get_current_work()
        ab_pipeline.producer_tail(state)


class BaseMcast(Multicast, Base):
    pass


class Base24Mcast(Multicast, Base24):
    pass


# name -> (kernel class, tiles, block-scaled)
VARIANTS = {
    "base": (Base, (128, 128), True),
    "base_24_240": (Base24, (128, 128), True),
    "wide": (Base, (128, 256), True),
    "wide_24_240": (Base24, (128, 256), True),
    "base_mcast": (BaseMcast, (128, 128), True),
    "wide_mcast": (BaseMcast, (128, 256), True),
    "wide_24_240_mcast": (Base24Mcast, (128, 256), True),
    "rowwise_128x128": (Base, (128, 128), False),
    "rowwise_128x256": (Base, (128, 256), False),
    "rowwise_128x256_24_240": (Base24, (128, 256), False),
    "rowwise_128x256_24_240_mcast": (Base24Mcast, (128, 256), False),
}


def _use(kernel_class, tiles):
    """Route the next calls to ``kernel_class`` at ``tiles``, compiling afresh."""
    csm._ScaledMmKernel = kernel_class
    csm._COMPILED.clear()
    csm._PLANS.clear()
    csm._MARSHALS.clear()
    csm.heuristics = lambda m, n, num_sms=132, _t=tiles: _t
    csm.block_scaled_heuristics = lambda m, n=None, num_sms=132, _t=tiles: _t


def time_variants(names, variants, rounds, a, b, sa, sb, ref, ref_row, family_of, info) -> list:
    """CSV rows: each variant in turn, ``rounds`` times, run once on a NaN-poisoned output, checked against the
    float64 reference (``ref`` for block-scaled variants, ``ref_row`` for the others) and bit for bit against
    the first output of its family (``family_of(name)``; None: no family), then timed in a CUDA graph."""
    import triton.testing

    M, N, K = a.shape[0], b.shape[0], a.shape[1]
    rows, first = [], {}
    for rnd in range(rounds):
        for name in names:
            cls, tiles, block = variants[name]
            _use(cls, tiles)
            if block:
                fn = lambda: csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, a_block=sa, b_block=sb)  # noqa: E731
            else:
                fn = lambda: csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16)  # noqa: E731
            note = ""
            try:
                # poison: the output is allocated in the block this NaN tensor frees (the caching
                # allocator hands back the last freed block of the size), so an unwritten tile shows
                poison = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
                del poison
                out = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others run
                print(dict(variant=name, shape=f"{M}x{N}x{K}", error=f"{type(exc).__name__}: {str(exc)[:400]}"),
                      flush=True)
                continue
            want = ref if block else ref_row
            err = ((out.float() - want).norm() / want.norm()).item()
            if not err < 1e-2 or out.isnan().any():
                note = "WRONG"
            family = family_of(name)
            if family is not None:
                if family not in first:
                    first[family] = out.clone()
                elif not torch.equal(out, first[family]):
                    note += " bits differ within family"
            us = triton.testing.do_bench_cudagraph(fn, rep=300, return_mode="median") * 1e3
            row = dict(variant=name, round=rnd, M=M, N=N, K=K, tile=f"{tiles[0]}x{tiles[1]}",
                       block_scaled=block, rel_err=f"{err:.2e}", us=round(us, 1),
                       tflops=round(2 * M * N * K / us / 1e6, 1), note=note.strip(), **info)
            print(row, flush=True)
            rows.append(row)
    return rows


def write_csv(path, rows) -> None:
    if path and rows:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)


def compile_only(out_dir: str, variants=None) -> int:
    """sm_90a builds of every variant (of ``variants``, default this probe's) on this machine (no GPU):
    registers and spills."""
    failed = 0
    for name, (cls, tiles, block) in (variants or VARIANTS).items():
        _use(cls, tiles)
        config = csm.KernelConfig("f8e4m3", "bf16", *tiles, block_scaled=block)
        try:
            (entry,) = csm.aot_compile_sm90a(os.path.join(out_dir, name), [config])
            print(name, {k: entry.get(k) for k in ("registers", "stack", "spill_stores", "spill_loads",
                                                  "fast_args")}, flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the others go on
            failed += 1
            print(name, "FAILED:", type(exc).__name__, str(exc)[:2000], flush=True)
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="4096x7168x7168")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile-only", default=None, metavar="OUT_DIR")
    args = ap.parse_args()
    if args.compile_only:
        sys.exit(compile_only(args.compile_only))

    write_csv(args.csv, time_shapes(args.shapes.split(","), args.variants.split(","), VARIANTS, args.rounds,
                                    lambda name: (VARIANTS[name][1], VARIANTS[name][2]), _unit_scales))


def _unit_scales(M, N, kb, nb):
    """Block scales in [0.5, 1.5)."""
    return torch.rand(M, kb, device="cuda") + 0.5, torch.rand(nb, kb, device="cuda") + 0.5


def time_shapes(shapes, names, variants, rounds, family_of, block_scales) -> list:
    """``time_variants`` at each ``MxNxK`` of shapes, on seeded random e4m3 operands with block scales from
    ``block_scales(M, N, K blocks, N blocks)``; the shipped kernel class is put back afterwards."""
    from bench_common import versions, warm_up_clocks

    warm_up_clocks()
    info = versions()
    rows = []
    for shape in shapes:
        M, N, K = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        a = (torch.randn(M, K, device="cuda") * 2).to(torch.float8_e4m3fn)
        b = (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn)
        sa, sb = block_scales(M, N, -(-K // 128), -(-N // 128))
        ref = csm._block_scaled_product(a.double(), b.double(), sa.double(), sb.double()).float()
        ref_row = (a.float() @ b.float().t())
        rows += time_variants(names, variants, rounds, a, b, sa, sb, ref, ref_row, family_of, info)
    _use(Base, (128, 128))
    return rows


if __name__ == "__main__":
    main()
