"""Block-scaled FP8 CuTe GEMM at a 128x256 tile, and the register split, against the shipped 128x128 (probe).

    python benchmarks/proto/block_scaled_wide_probe.py [--csv OUT.csv] [--shapes 4096x7168x7168,...]
    python benchmarks/proto/block_scaled_wide_probe.py --compile-only OUT_DIR     (CPU: sm_90a builds, resources)

Why: the shipped block-scaled kernel runs 128x128 tiles at 987-1041 TFLOP/s (issue 6 asks 1300), and the
rowwise kernel ran 8% faster at 128x256 than at 128x128 in one run (block_scaled_probe.csv): a wider tile halves
the A bytes each CTA reads from L2 per FLOP. The block-scaled kernel cannot take that tile as it stands: the
scaled sum and two fresh fragments of a 64x256 slab per consumer would be 384 registers. Here the variants:

- ``base``: the shipped kernel (128x128, two 64x128 fragments alternating, producer / consumer registers 40 / 232);
- ``base_24_240``: the same with registers split 24 / 240 (CUTLASS's Hopper blockwise example found 24 / 240 about
  25% faster than 40 / 232 for its kernel on an H100);
- ``wide``: 128x256 tiles built from m64n128 WGMMAs. Per K block, each 128-column half's WGMMAs write one fresh
  64-register fragment, which is awaited (``wait_group(0)``) and folded into that half of the 128-register sum
  with the half's b_block scalar before the other half is issued: 128 + 64 registers. Within a warpgroup nothing
  overlaps the fold; the other consumer's WGMMAs keep the tensor cores busy meanwhile. The scales of the next
  K block are loaded while this one's first half runs;
- ``wide_24_240``: ``wide`` with the 24 / 240 split;
- ``rowwise_128x128`` / ``rowwise_128x256``: the rowwise kernel at both tiles, same operands (what the tile gives
  without any fold).

Each block-scaled variant is checked against a float32 reference of the block-scaled product, and the two
``wide`` variants bit for bit against each other. Times: CUDA graph (``do_bench_cudagraph``), median.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
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


class Wide(Base):
    """128x256 block-scaled tiles from m64n128 WGMMAs, one half-width fragment folded per half (module doc)."""

    def __init__(self, config):
        super().__init__(dataclasses.replace(config, tile_n=csm.SCALE_BLOCK))  # (the base refuses tile_n 256)
        self.config = config

    def _setup_tiles(self):
        super()._setup_tiles()
        # the same tile, from 128-wide WGMMAs: partition_C then has two N iterations, one per half
        k_major = cute.nvgpu.warpgroup.OperandMajorMode.K
        self.tiled_mma = csm.sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, k_major, k_major, self.acc_dtype,
            (self.num_consumers, 1, 1), tiler_mn=(64, csm.SCALE_BLOCK))

    @cute.jit
    def _consume(self, ab_pipeline, tiled_mma, sA, sB, sD, mA, tma_d, mD_tma, mD,
                 mRow, mCol, mBias, mRes, mSA, mSB, sched_params, tidx, warp_idx):
        # The shipped consumer with its block-scaled main loop replaced (same epilogue): copied structure,
        # the only change is the call into ``_mainloop_wide``.
        mma_tidx = tidx - self.threads_per_warpgroup
        thr_mma = tiled_mma.get_slice(mma_tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))  # (V, halves, K steps, stages)
        tile_mn = (self.tile_mnk[0], self.tile_mnk[1])
        acc_shape = thr_mma.partition_C(cute.make_identity_tensor(tile_mn)).shape  # ((2,2,16), 1, 2)
        acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        half_shape = thr_mma.partition_C(cute.make_identity_tensor((self.tile_mnk[0], csm.SCALE_BLOCK))).shape
        frag = cute.make_rmem_tensor(half_shape, self.acc_dtype)
        tCcAcc = thr_mma.partition_C(cute.make_identity_tensor(tile_mn))
        k_tiles = cute.ceil_div(mA.shape[1], self.tile_mnk[2])

        r2s = self._make_r2s_copy(tiled_mma)
        thr_r2s = r2s.get_slice(mma_tidx)
        tRS_sD = thr_r2s.partition_D(sD)
        tRS_acc = r2s.retile(acc)
        tRS_coord = thr_r2s.partition_S(cute.make_identity_tensor(self.epi_tile))
        slice_shape = cute.shape(thr_r2s.partition_S(sD))[:3]
        slice_f32 = cute.make_rmem_tensor(slice_shape, self.acc_dtype)
        slice_out = cute.make_rmem_tensor(slice_shape, self.out_dtype)
        store_pipeline = csm.pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage,
            producer_group=csm.pipeline.CooperativeGroup(csm.pipeline.Agent.Thread, self.num_mma_threads),
        )
        sched = csm.utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        read_state = csm.pipeline.make_pipeline_state(csm.pipeline.PipelineUserType.Consumer, self.ab_stage)
        release_state = csm.pipeline.make_pipeline_state(csm.pipeline.PipelineUserType.Consumer, self.ab_stage)
        while work.is_valid_tile:
            read_state, release_state = self._mainloop_wide(
                ab_pipeline, tiled_mma, tCrA, tCrB, acc, frag, tCcAcc, k_tiles, read_state, release_state,
                mSA, mSB, work.tile_idx)
            tile = sched.get_current_work().tile_idx
            self._epilogue(tile, acc, tRS_acc, tRS_coord, slice_f32, slice_out, r2s, tRS_sD, sD,
                           tma_d, mD_tma, mD, mRow, mCol, mBias, mRes, store_pipeline,
                           sched.num_tiles_executed, warp_idx)
            sched.advance_to_next_work()
            work = sched.get_current_work()
        store_pipeline.producer_tail()

    @cute.jit
    def _mainloop_wide(self, ab_pipeline, tiled_mma, tCrA, tCrB, acc, frag, tCcAcc, k_tiles, read_state,
                       release_state, mSA, mSB, tile):
        read_state.reset_count()
        release_state.reset_count()
        acc.fill(0.0)
        half = cute.size(frag)
        # rows of the registers of one half (the same for both halves: they differ in columns only)
        slot_of, slot_rep = csm._row_slots(tiled_mma, (self.tile_mnk[0], csm.SCALE_BLOCK))
        sa_last = mSA.shape[0] - 1
        row0 = tile[0] * self.tile_mnk[0]
        sa_rows = [cutlass.min(row0 + tCcAcc[rep][0], sa_last) for rep in slot_rep]
        sb_last = mSB.shape[0] - 1
        sb_rows = [cutlass.min(tile[1] * 2 + h, sb_last) for h in range(2)]
        nslots = len(slot_rep)
        # this block's scales (cur) and the next block's (nxt): a_block per row slot, then b_block per half
        cur = cute.make_rmem_tensor((nslots + 2,), cutlass.Float32)
        nxt = cute.make_rmem_tensor((nslots + 2,), cutlass.Float32)
        for j in cutlass.range_constexpr(nslots):
            nxt[j] = mSA[sa_rows[j], 0]
        for h in cutlass.range_constexpr(2):
            nxt[nslots + h] = mSB[sb_rows[h], 0]
        frag_v = frag[(None, 0, 0)]
        for kb in range(k_tiles):
            for j in cutlass.range_constexpr(nslots + 2):
                cur[j] = nxt[j]
            ab_pipeline.consumer_wait(read_state)
            for h in cutlass.range_constexpr(2):
                cute.nvgpu.warpgroup.fence()  # frag was read by the previous fold
                atom = cute.make_mma_atom(tiled_mma.op)
                atom.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                for kk in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    # A (V, 1 M step), this half of B as (V, 1 N step), the fragment (V, 1, 1)
                    cute.gemm(atom, frag, tCrA[(None, None, kk, read_state.index)],
                              cute.append_ones(tCrB[(None, h, kk, read_state.index)], 2), frag)
                    atom.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.commit_group()
                if cutlass.const_expr(h == 0):  # the next block's scales, while this half's WGMMAs run
                    kn = cutlass.min(kb + 1, k_tiles - 1)
                    for j in cutlass.range_constexpr(nslots):
                        nxt[j] = mSA[sa_rows[j], kn]
                    for g in cutlass.range_constexpr(2):
                        nxt[nslots + g] = mSB[sb_rows[g], kn]
                cute.nvgpu.warpgroup.wait_group(0)
                if cutlass.const_expr(h == 1):  # both halves have read the stage
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()
                scale = [cur[j] * cur[nslots + h] for j in range(nslots)]
                acc_h = acc[(None, 0, h)]
                for i in cutlass.range_constexpr(half):
                    acc_h[i] = acc_h[i] + frag_v[i] * scale[slot_of[i]]
            read_state.advance()
        return read_state, release_state


class Wide24(Wide):
    producer_registers = 24
    consumer_registers = 240


class Multicast:
    """A 1 x 2 cluster: two CTAs on neighbouring N tiles of the same rows share A. Each loads half of
    the A tile and multicasts it to both (TMA multicast), so A's L2 reads halve; B is loaded per CTA.
    Mixed in before a kernel class (overrides the launch, the kernel's set-up, the pipeline and the producer)."""

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

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_d: cute.CopyAtom, mD_tma: cute.Tensor, mD: cute.Tensor, mRow, mCol, mBias, mRes, mSA, mSB,
               tiled_mma: cute.TiledMma, sched_params: csm.utils.PersistentTileSchedulerParams,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
               epi_smem_staged: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        ab_pipeline = self._make_ab_pipeline(storage.ab_barriers.data_ptr(), a_smem_staged, b_smem_staged)
        csm.pipeline.pipeline_init_arrive(cluster_shape_mn=(1, self.cluster_n), is_relaxed=True)
        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sD = storage.sD.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
        csm.pipeline.pipeline_init_wait(cluster_shape_mn=(1, self.cluster_n))
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self._produce(ab_pipeline, tma_a, mA, tma_b, mB, sA, sB, sched_params)
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            self._consume(ab_pipeline, tiled_mma, sA, sB, sD, mA, tma_d, mD_tma, mD,
                          mRow, mCol, mBias, mRes, mSA, mSB, sched_params, tidx, warp_idx)

    def _make_ab_pipeline(self, barrier_ptr, a_smem_staged, b_smem_staged):
        tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_staged, (None, None, 0)))
        tx_bytes += cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
        # a stage is refilled once the consumers of both CTAs (which both receive this CTA's A half) release it
        return csm.pipeline.PipelineTmaAsync.create(
            barrier_storage=barrier_ptr,
            num_stages=self.ab_stage,
            producer_group=csm.pipeline.CooperativeGroup(csm.pipeline.Agent.Thread),
            consumer_group=csm.pipeline.CooperativeGroup(csm.pipeline.Agent.Thread,
                                                         self.cluster_n * self.num_consumers * 4),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, self.cluster_n, 1)),
            defer_sync=True,
        )

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


class Wide24Mcast(Multicast, Wide24):
    pass


class Row24Mcast(Multicast, Base24):
    pass


class WideMcast(Multicast, Wide):
    pass


# name -> (kernel class, tiles, block-scaled)
VARIANTS = {
    "base": (Base, (128, 128), True),
    "base_24_240": (Base24, (128, 128), True),
    "wide": (Wide, (128, 256), True),
    "wide_24_240": (Wide24, (128, 256), True),
    "base_mcast": (BaseMcast, (128, 128), True),
    "wide_mcast": (WideMcast, (128, 256), True),
    "wide_24_240_mcast": (Wide24Mcast, (128, 256), True),
    "rowwise_128x128": (Base, (128, 128), False),
    "rowwise_128x256": (Base, (128, 256), False),
    "rowwise_128x256_24_240": (Base24, (128, 256), False),
    "rowwise_128x256_24_240_mcast": (Row24Mcast, (128, 256), False),
}


def _use(kernel_class, tiles):
    """Route the next calls to ``kernel_class`` at ``tiles``, compiling afresh."""
    csm._ScaledMmKernel = kernel_class
    csm._COMPILED.clear()
    csm._PLANS.clear()
    csm._MARSHALS.clear()
    csm.heuristics = lambda m, n, num_sms=132, _t=tiles: _t
    csm.block_scaled_heuristics = lambda m, _t=tiles: _t


def compile_only(out_dir: str) -> int:
    """sm_90a builds of every variant on this machine (no GPU): registers and spills."""
    failed = 0
    for name, (cls, tiles, block) in VARIANTS.items():
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

    import triton.testing
    from bench_common import versions, warm_up_clocks

    warm_up_clocks()
    info = versions()
    rows = []
    for shape in args.shapes.split(","):
        M, N, K = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        a = (torch.randn(M, K, device="cuda") * 2).to(torch.float8_e4m3fn)
        b = (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn)
        kb, nb = -(-K // 128), -(-N // 128)
        sa = torch.rand(M, kb, device="cuda") + 0.5
        sb = torch.rand(nb, kb, device="cuda") + 0.5
        ref = csm._block_scaled_product(a.double(), b.double(), sa.double(), sb.double()).float()
        ref_row = (a.float() @ b.float().t())
        flops = 2 * M * N * K
        first = {}  # arithmetic family -> its first output: the variants of one family give the same bits
        for rnd in range(args.rounds):
            for name in args.variants.split(","):
                cls, tiles, block = VARIANTS[name]
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
                    print(dict(variant=name, shape=shape, error=f"{type(exc).__name__}: {str(exc)[:400]}"), flush=True)
                    continue
                want = ref if block else ref_row
                err = ((out.float() - want).norm() / want.norm()).item()
                if not err < 1e-2 or out.isnan().any():
                    note = "WRONG"
                family = ("wide" if issubclass(cls, Wide) else "base", tiles, block)
                if family not in first:
                    first[family] = out.clone()
                elif not torch.equal(out, first[family]):
                    note += " bits differ within family"
                us = triton.testing.do_bench_cudagraph(fn, rep=300, return_mode="median") * 1e3
                row = dict(variant=name, round=rnd, M=M, N=N, K=K, tile=f"{tiles[0]}x{tiles[1]}",
                           block_scaled=block, rel_err=f"{err:.2e}", us=round(us, 1),
                           tflops=round(flops / us / 1e6, 1), note=note.strip(), **info)
                print(row, flush=True)
                rows.append(row)
    _use(Base, (128, 128))
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
