"""A warp-specialized int4 GEMV in CuTe DSL: one TMA producer warp, mma.sync consumer warps (probe, issue 4).

    python benchmarks/proto/int4_ws_gemv.py [--csv OUT.csv] [--shapes 8192x8192,...]   # GPU: check + time
    python benchmarks/proto/int4_ws_gemv.py --compile-only DIR                           # CPU: sm_90a builds

Why (docs/results-h200.md, "What holds it"): ``int4_mma_sync`` at M = 1 streams its word loads alone at the
read's speed (10.0 against 9.9 µs at 8192 x 8192) and computes alone in 9.2 µs, but takes 16 µs with both:
each warp loads, waits and computes with about one group (1 KB) in flight, 32 warps per SM, so the SM has
about as many bytes in flight as DRAM's latency needs only while no warp computes. More in flight per warp
cost registers (the 64-register cliff); a per-lane cp.async ring lost cold. Here the loads leave the
consumers altogether:
- warp 0 (producer) asks TMA for each group of 128 k of a ``BLOCK_N``-column tile (a [BLOCK_N, 64 B] box) into
  a ring of ``STAGES`` x ``GROUPS`` slots guarded by mbarriers (``PipelineTmaAsync``), and for the tile's scales
  and zeros (one [BLOCK_N, G] box each, double-buffered by a second ring) ahead of them: the bytes in flight
  per SM are the ring's, in shared memory, with no register held for them;
- consumer warps decode from shared memory the way ``int4_mma_sync`` decodes from registers (lane (g, c) reads
  its 16-byte quarter of a group for columns g and g + 8: 64-byte rows, so the 8 lanes of a quarter-warp read
  128 contiguous bytes, no bank conflict), and multiply on ``mma.sync.m16n8k16``;
- x is not paired per group and warp: each CTA writes once, at its start, a table of x in the order the MMA's
  B registers take it (PRMT done once, not per column tile), and sum x per group (no sum-x MMAs in the loop);
  the loop then spends 2 + 4 shared loads, 56 decode instructions and 8 MMAs per group and lane (157 in all
  for ``int4_mma_sync``'s);
- CTAs are persistent over column tiles and K is not split: no partial sums in global memory, no counters,
  and the table is built once per CTA.
M = 1 only (the decoder's B = 1), two codes per byte (the demo's W4A16: uint8 [N, K/2], low nibble = even k,
bf16 scales and uint8 zeros [N, K/128]), K static per build. A probe: not in the dispatcher.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cuda.bindings.driver as cuda
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_fake_stream, make_ptr
from cutlass.cutlass_dsl import T

GROUP = 128  # k per group (scale and zero)
GROUP_BYTES = GROUP // 2
EVICT_FIRST_POLICY = 0x12F0000000000000  # the L2 cache-policy word CUTLASS's TMA uses for evict-first


@dataclass(frozen=True)
class WsConfig:
    BLOCK_N: int = 64  # columns per tile (16 per consumer warp and k part)
    CONSUMERS: int = 4  # consumer warps
    GROUPS: int = 2  # groups of 128 k per pipeline stage
    STAGES: int = 8  # stages in the ring
    CHAINS: int = 2  # independent MMA accumulators per group (8 MMAs split into CHAINS chains)
    EVICT_FIRST: bool = False  # the weights' TMA loads ask L2 to evict them first (read once per token)

    @property
    def column_tiles(self) -> int:
        return self.BLOCK_N // 16

    @property
    def k_parts(self) -> int:  # consumer warps per 16-column tile: they take a stage's groups in turn
        return self.CONSUMERS // self.column_tiles

    def check(self, K: int) -> None:
        G = K // GROUP
        assert K % GROUP == 0 and G % self.GROUPS == 0, "K: whole stages of groups"
        assert self.k_parts * self.column_tiles == self.CONSUMERS and self.GROUPS % self.k_parts == 0
        assert G <= 256 and G % 16 == 0, "scales / zeros box: G <= 256, 16-byte rows of zeros"
        assert self.BLOCK_N % 16 == 0 and self.BLOCK_N <= 256, "BLOCK_N: 16-column tiles, a TMA box <= 256 rows"
        assert self.CHAINS in (1, 2, 4) and self.GROUPS in (2, 4), "GROUPS: one 32- or 64-bit load of scales"


# ----------------------------------------------------------------------------- PTX helpers


def _asm(n_out: int, operands, ptx: str, constraints: str, side_effects: bool = False, out_type=None):
    """Inline PTX with n_out 32-bit results (Int32 or Float32 per ``out_type``)."""
    out_type = out_type or T.i32()
    ops = [o.ir_value() if hasattr(o, "ir_value") else o for o in operands]
    if n_out == 1:
        return llvm.inline_asm(out_type, ops, ptx, constraints, has_side_effects=side_effects,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    res = llvm.inline_asm(llvm.StructType.get_literal([out_type] * n_out), ops, ptx, constraints,
                          has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [llvm.extractvalue(out_type, res, [i]) for i in range(n_out)]


def lds128(addr):
    """Four 32-bit words from shared memory (16-byte aligned address). Side effects: kept after the
    mbarrier wait that makes them valid."""
    return [cutlass.Int32(v) for v in _asm(4, [cutlass.Int32(addr)], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
                                           "=r,=r,=r,=r,r", side_effects=True)]


def sts128(addr, v):
    llvm.inline_asm(None, [cutlass.Int32(addr).ir_value()] + [cutlass.Int32(x).ir_value() for x in v],
                    "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def ldg128(addr):
    return [cutlass.Int32(v) for v in _asm(4, [cutlass.Int64(addr)], "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];",
                                           "=r,=r,=r,=r,l", side_effects=True)]


def lds_f32(addr):
    return cutlass.Float32(_asm(1, [cutlass.Int32(addr)], "ld.shared.f32 $0, [$1];", "=f,r", side_effects=True,
                                out_type=T.f32()))


def sts_f32(addr, v):
    llvm.inline_asm(None, [cutlass.Int32(addr).ir_value(), cutlass.Float32(v).ir_value()],
                    "st.shared.f32 [$0], $1;", "r,f", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


def lds_words(addr, count: int):
    """``count`` (1 or 2) 32-bit words from shared memory (aligned to their size)."""
    if count == 1:
        return [cutlass.Int32(_asm(1, [cutlass.Int32(addr)], "ld.shared.b32 $0, [$1];", "=r,r", side_effects=True))]
    return [cutlass.Int32(v) for v in _asm(2, [cutlass.Int32(addr)], "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r",
                                           side_effects=True)]


def bf16_at(words, j: int):
    """The j-th bf16 of packed words, widened to fp32."""
    w = words[j // 2]
    bits = (w << 16) if j % 2 == 0 else (w & cutlass.Int32(-65536))
    return cutlass.Float32(_asm(1, [bits], "mov.b32 $0, $1;", "=f,r", out_type=T.f32()))


def pair_x(r0, r1, r2, r3):
    """x_0..x_7 as bf16 pairs (x0,x1) (x2,x3) (x4,x5) (x6,x7) -> (x0,x4) (x1,x5) (x2,x6) (x3,x7)."""
    return [cutlass.Int32(v) for v in _asm(
        4, [r0, r1, r2, r3],
        "prmt.b32 $0, $4, $6, 0x5410; prmt.b32 $1, $4, $6, 0x7632; "
        "prmt.b32 $2, $5, $7, 0x5410; prmt.b32 $3, $5, $7, 0x7632;",
        "=r,=r,=r,=r,r,r,r,r")]


def bf16_pair_sum(r):
    """lo + hi of a bf16 pair, in fp32."""
    return cutlass.Float32(_asm(1, [r], "{ .reg .b32 lo, hi; shl.b32 lo, $1, 16; and.b32 hi, $1, 0xFFFF0000; "
                                        "add.f32 $0, lo, hi; }", "=f,r", out_type=T.f32()))


def nibble_pairs(w):
    """bf16 pairs (128 + q_s, 128 + q_{s+4}), s = 0..3, of a word's eight nibbles (nibble j = k j)."""
    return [cutlass.Int32(v) for v in _asm(
        4, [w],
        "{ .reg .b32 t1, t2, t3; shr.b32 t1, $4, 4; shr.b32 t2, $4, 8; shr.b32 t3, $4, 12; "
        "lop3.b32 $0, $4, 0x000F000F, 0x43004300, 0xEA; lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA; "
        "lop3.b32 $2, t2, 0x000F000F, 0x43004300, 0xEA; lop3.b32 $3, t3, 0x000F000F, 0x43004300, 0xEA; }",
        "=r,=r,=r,=r,r")]


def mma(a, b, c):
    """mma.sync.m16n8k16 bf16 -> fp32: a 4 regs, b 2 regs, c 4 fp32 (accumulated)."""
    out = _asm(4, list(a) + list(b) + list(c),
               "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
               "{$8, $9}, {$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", out_type=T.f32())
    return [cutlass.Float32(v) for v in out]


# ----------------------------------------------------------------------------- kernel


class Int4WsGemv:
    def __init__(self, cfg: WsConfig, K: int):
        cfg.check(K)
        self.cfg, self.K, self.G = cfg, K, K // GROUP
        self.threads = 32 * (cfg.CONSUMERS + 1)

    @cute.jit
    def __call__(self, pX: cute.Pointer, pW: cute.Pointer, pS: cute.Pointer, pZ: cute.Pointer,
                 pOut: cute.Pointer, n: cutlass.Int32, ctas: cutlass.Int32, stream: cuda.CUstream):
        cfg, K, G = self.cfg, self.K, self.G
        BN = cfg.BLOCK_N
        mW = cute.make_tensor(pW, cute.make_layout((n, K // 2), stride=(K // 2, 1)))
        mS = cute.make_tensor(pS, cute.make_layout((n, G), stride=(G, 1)))
        mZ = cute.make_tensor(pZ, cute.make_layout((n, G), stride=(G, 1)))
        mX = cute.make_tensor(pX, cute.make_layout((K,), stride=(1,)))
        mO = cute.make_tensor(pOut, cute.make_layout((n,), stride=(1,)))
        slots = cfg.STAGES * cfg.GROUPS
        w_staged = cute.make_layout((BN, GROUP_BYTES, slots), stride=(GROUP_BYTES, 1, BN * GROUP_BYTES))
        sz_staged = cute.make_layout((BN, G, 2), stride=(G, 1, BN * G))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_w, tma_mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mW, cute.slice_(w_staged, (None, None, 0)), (BN, GROUP_BYTES))
        tma_s, tma_mS = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mS, cute.slice_(sz_staged, (None, None, 0)), (BN, G))
        tma_z, tma_mZ = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mZ, cute.slice_(sz_staged, (None, None, 0)), (BN, G))

        @cute.struct
        class SharedStorage:
            w_bars: cute.struct.MemRange[cutlass.Int64, cfg.STAGES * 2]
            sz_bars: cute.struct.MemRange[cutlass.Int64, 4]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, BN * GROUP_BYTES * slots], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BN * G * 2], 128]
            sZ: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, BN * G * 2], 128]
            sX: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, K], 128]
            sSum: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, G], 16]
            sRed: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cfg.CONSUMERS * 64], 16]

        self.shared_storage = SharedStorage
        self.kernel(tma_w, tma_mW, tma_s, tma_mS, tma_z, tma_mZ, mX, mO, n, w_staged, sz_staged).launch(
            grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_s: cute.CopyAtom, mS: cute.Tensor,
               tma_z: cute.CopyAtom, mZ: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, n: cutlass.Int32,
               w_staged: cute.Layout, sz_staged: cute.Layout):
        cfg, G = self.cfg, self.G
        BN = cfg.BLOCK_N
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        tiles = (n + BN - 1) // BN
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_s)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_z)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        w_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.w_bars.data_ptr(), num_stages=cfg.STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, cfg.CONSUMERS),
            tx_count=BN * GROUP_BYTES * cfg.GROUPS, defer_sync=True)
        sz_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.sz_bars.data_ptr(), num_stages=2,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, cfg.CONSUMERS),
            tx_count=BN * G * 3, defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sW = storage.sW.get_tensor(w_staged)
        sS = storage.sS.get_tensor(sz_staged)
        sZ = storage.sZ.get_tensor(sz_staged)
        cute.arch.sync_threads()

        if warp == 0:
            self._produce(w_pipe, sz_pipe, tma_w, mW, tma_s, mS, tma_z, mZ, sW, sS, sZ, bid, nblk, tiles)
        else:
            w_base = storage.sW.data_ptr().toint()
            s_base = storage.sS.data_ptr().toint()
            z_base = storage.sZ.data_ptr().toint()
            x_base = storage.sX.data_ptr().toint()
            sum_base = storage.sSum.data_ptr().toint()
            red_base = storage.sRed.data_ptr().toint()
            self._x_table(mX, x_base, sum_base, tidx, warp - 1)
            cute.arch.barrier(barrier_id=1, number_of_threads=cfg.CONSUMERS * 32)
            self._consume(w_pipe, sz_pipe, mO, n, w_base, s_base, z_base, x_base, sum_base, red_base,
                          tidx, warp - 1, bid, nblk, tiles)

    @cute.jit
    def _produce(self, w_pipe, sz_pipe, tma_w, mW, tma_s, mS, tma_z, mZ, sW, sS, sZ, bid, nblk, tiles):
        cfg, G = self.cfg, self.G
        BN = cfg.BLOCK_N
        gW = cute.local_tile(mW, (BN, GROUP_BYTES), (None, None))  # (BN, 64, tiles, G)
        gS = cute.local_tile(mS, (BN, G), (None, None))  # (BN, G, tiles, 1)
        gZ = cute.local_tile(mZ, (BN, G), (None, None))
        one_cta = cute.make_layout(1)
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_w, 0, one_cta, cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
        tSsS, tSgS = cute.nvgpu.cpasync.tma_partition(
            tma_s, 0, one_cta, cute.group_modes(sS, 0, 2), cute.group_modes(gS, 0, 2))
        tZsZ, tZgZ = cute.nvgpu.cpasync.tma_partition(
            tma_z, 0, one_cta, cute.group_modes(sZ, 0, 2), cute.group_modes(gZ, 0, 2))
        w_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.STAGES)
        sz_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        tile = bid
        while tile < tiles:
            sz_pipe.producer_acquire(sz_state)
            bar = sz_pipe.producer_get_barrier(sz_state)
            cute.copy(tma_s, tSgS[(None, tile, 0)], tSsS[(None, sz_state.index)], tma_bar_ptr=bar)
            cute.copy(tma_z, tZgZ[(None, tile, 0)], tZsZ[(None, sz_state.index)], tma_bar_ptr=bar)
            sz_pipe.producer_commit(sz_state)
            sz_state.advance()
            for st in cutlass.range(G // cfg.GROUPS, unroll=1):
                w_pipe.producer_acquire(w_state)
                bar = w_pipe.producer_get_barrier(w_state)
                for j in cutlass.range_constexpr(cfg.GROUPS):
                    if cutlass.const_expr(cfg.EVICT_FIRST):
                        cute.copy(tma_w, tWgW[(None, tile, st * cfg.GROUPS + j)],
                                  tWsW[(None, w_state.index * cfg.GROUPS + j)], tma_bar_ptr=bar,
                                  cache_policy=cutlass.Int64(EVICT_FIRST_POLICY))
                    else:
                        cute.copy(tma_w, tWgW[(None, tile, st * cfg.GROUPS + j)],
                                  tWsW[(None, w_state.index * cfg.GROUPS + j)], tma_bar_ptr=bar)
                w_pipe.producer_commit(w_state)
                w_state.advance()
            tile += nblk
        w_pipe.producer_tail(w_state)
        sz_pipe.producer_tail(sz_state)

    @cute.jit
    def _x_table(self, mX, x_base, sum_base, tidx, cw):
        """x in the MMA's B order: unit (group, t, c) = 16 bytes, the pairs (x0,x4) (x1,x5) (x2,x6) (x3,x7) of
        k = group * 128 + 32 c + 8 t + 0..7; and sum x per group (16 lanes per group, shuffles)."""
        cfg, G = self.cfg, self.G
        lane = tidx % 32
        u = lane % 16
        c = u // 4
        t = u % 4
        x_addr = mX.iterator.toint()
        for it in cutlass.range((G + 2 * cfg.CONSUMERS - 1) // (2 * cfg.CONSUMERS), unroll=1):
            grp = (it * cfg.CONSUMERS + cw) * 2 + lane // 16
            s = cutlass.Float32(0.0)
            if grp < G:
                k0 = grp * GROUP + 32 * c + 8 * t
                r = ldg128(x_addr + cutlass.Int64(k0) * 2)
                p = pair_x(r[0], r[1], r[2], r[3])
                sts128(x_base + ((grp * 4 + t) * 4 + c) * 16, p)
                s = bf16_pair_sum(r[0]) + bf16_pair_sum(r[1]) + bf16_pair_sum(r[2]) + bf16_pair_sum(r[3])
            for off in cutlass.range_constexpr(4):
                s = s + cute.arch.shuffle_sync_bfly(s, offset=8 >> off)
            if u == 0 and grp < G:
                sts_f32(sum_base + grp * 4, s)

    @cute.jit
    def _consume(self, w_pipe, sz_pipe, mO, n, w_base, s_base, z_base, x_base, sum_base, red_base,
                 tidx, cw, bid, nblk, tiles):
        cfg, G = self.cfg, self.G
        BN = cfg.BLOCK_N
        KP = cfg.k_parts
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        ct = cw % cfg.column_tiles
        kp = cw // cfg.column_tiles
        row0 = ct * 16 + g
        w_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.STAGES)
        sz_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        tile = bid
        while tile < tiles:
            sz_pipe.consumer_wait(sz_state)
            sz_off = sz_state.index * (BN * G)
            acc0 = cutlass.Float32(0.0)
            acc1 = cutlass.Float32(0.0)
            for st in cutlass.range(G // cfg.GROUPS, unroll=1):
                w_pipe.consumer_wait(w_state)
                # the stage's scales and zeros of rows row0 and row0 + 8: one load each (GROUPS * 2 and GROUPS
                # bytes, aligned: G is a multiple of 16)
                sz_row0 = sz_off + row0 * G + st * cfg.GROUPS
                sz_row1 = sz_row0 + 8 * G
                sw0 = lds_words(s_base + sz_row0 * 2, cfg.GROUPS // 2)
                sw1 = lds_words(s_base + sz_row1 * 2, cfg.GROUPS // 2)
                zw0 = lds_words(z_base + (sz_row0 & -4), 1)
                zw1 = lds_words(z_base + (sz_row1 & -4), 1)
                zshift0 = sz_row0 & 3
                for slot_j in cutlass.range_constexpr(cfg.GROUPS):
                    if kp == slot_j % KP:  # k parts take a stage's groups in turn (warp-uniform branch)
                        grp = st * cfg.GROUPS + slot_j
                        slot = w_state.index * cfg.GROUPS + slot_j
                        w_row = w_base + slot * (BN * GROUP_BYTES) + row0 * GROUP_BYTES + c * 16
                        wa = lds128(w_row)
                        wb = lds128(w_row + 8 * GROUP_BYTES)
                        xt = [lds128(x_base + ((grp * 4 + t) * 4 + c) * 16) for t in range(4)]
                        d = [[cutlass.Float32(0.0)] * 4 for _ in range(cfg.CHAINS)]
                        for t in cutlass.range_constexpr(4):
                            pa = nibble_pairs(wa[t])
                            pb = nibble_pairs(wb[t])
                            i0 = (2 * t) % cfg.CHAINS
                            d[i0] = mma((pa[0], pb[0], pa[1], pb[1]), (xt[t][0], xt[t][1]), d[i0])
                            i1 = (2 * t + 1) % cfg.CHAINS
                            d[i1] = mma((pa[2], pb[2], pa[3], pb[3]), (xt[t][2], xt[t][3]), d[i1])
                        d0 = d[0][0]
                        d2 = d[0][2]
                        for i in cutlass.range_constexpr(1, cfg.CHAINS):
                            d0 = d0 + d[i][0]
                            d2 = d2 + d[i][2]
                        sumx = lds_f32(sum_base + grp * 4)
                        s0 = bf16_at(sw0, slot_j)
                        s1 = bf16_at(sw1, slot_j)
                        z0 = cutlass.Float32((zw0[0] >> (8 * (zshift0 + slot_j))) & 0xFF)
                        z1 = cutlass.Float32((zw1[0] >> (8 * (zshift0 + slot_j))) & 0xFF)
                        acc0 = acc0 + s0 * (d0 - (z0 + 128.0) * sumx)
                        acc1 = acc1 + s1 * (d2 - (z1 + 128.0) * sumx)
                cute.arch.sync_warp()  # every lane's reads done before lane 0 releases the stage
                w_pipe.consumer_release(w_state)
                w_state.advance()
            cute.arch.sync_warp()
            sz_pipe.consumer_release(sz_state)
            sz_state.advance()
            if cutlass.const_expr(KP > 1):
                # the k parts' sums meet in shared memory; part 0 adds them in order and stores
                if kp > 0:
                    sts_f32(red_base + (cw * 32 + lane) * 8, acc0)
                    sts_f32(red_base + (cw * 32 + lane) * 8 + 4, acc1)
                cute.arch.barrier(barrier_id=2, number_of_threads=cfg.CONSUMERS * 32)
                if kp == 0:
                    for p in cutlass.range_constexpr(1, KP):
                        other = p * cfg.column_tiles + ct
                        acc0 = acc0 + lds_f32(red_base + (other * 32 + lane) * 8)
                        acc1 = acc1 + lds_f32(red_base + (other * 32 + lane) * 8 + 4)
                cute.arch.barrier(barrier_id=2, number_of_threads=cfg.CONSUMERS * 32)
            if kp == 0 and c == 0:
                col = tile * BN + row0
                if col < n:
                    mO[col] = acc0.to(cutlass.BFloat16)
                if col + 8 < n:
                    mO[col + 8] = acc1.to(cutlass.BFloat16)
            tile += nblk


# ----------------------------------------------------------------------------- build and launch

_COMPILED: dict = {}


def _fake_args(ctas: int = 132):
    ptr = lambda dtype, align: make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=align)  # noqa: E731
    return (ptr(cutlass.BFloat16, 16), ptr(cutlass.Uint8, 16), ptr(cutlass.BFloat16, 16), ptr(cutlass.Uint8, 16),
            ptr(cutlass.BFloat16, 2), cutlass.Int32(4096), cutlass.Int32(ctas), make_fake_stream())


def build(cfg: WsConfig, K: int, options: str | None = None):
    key = (cfg, K, options)
    if key not in _COMPILED:
        kernel = Int4WsGemv(cfg, K)
        args = _fake_args()
        _COMPILED[key] = (cute.compile(kernel, *args, options=options) if options else cute.compile(kernel, *args),
                          kernel)
    return _COMPILED[key]


def ctas_for(kernel: Int4WsGemv, N: int, sms: int) -> int:
    """Persistent CTAs: all tiles if they fit in one wave of the CTAs that fit per SM, else that wave."""
    cfg, K = kernel.cfg, kernel.K
    tiles = -(-N // cfg.BLOCK_N)
    smem = (cfg.STAGES * cfg.GROUPS * cfg.BLOCK_N * GROUP_BYTES + cfg.BLOCK_N * kernel.G * 3 * 2 + K * 2
            + kernel.G * 4 + cfg.CONSUMERS * 256 + 2048)
    per_sm = max(1, min(227 * 1024 // smem, 2048 // kernel.threads))
    return min(tiles, sms * per_sm)


def int4_ws_gemv(x, wp, s, z, cfg: WsConfig, out=None, ctas: int | None = None):
    """out[1, N] = x[1, K] @ dequant(wp, s, z).T (bf16); wp uint8 [N, K/2], s bf16 [N, G], z uint8 [N, G]."""
    import torch

    from fusekern.kernels.device_info import sm_count

    N, K = wp.shape[0], wp.shape[1] * 2
    assert x.shape == (1, K) and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert s.dtype == torch.bfloat16 and z.dtype == torch.uint8 and s.shape == z.shape == (N, K // GROUP)
    assert wp.is_contiguous() and s.is_contiguous() and z.is_contiguous()
    assert all(t.data_ptr() % 16 == 0 for t in (x, wp, s, z)), "16-byte aligned bases (TMA, ld.v4)"
    assert all(t.device == x.device for t in (wp, s, z))
    assert x.device == torch.device("cuda", torch.cuda.current_device()), "launches on the current device"
    fn, kernel = build(cfg, K)
    if out is None:
        out = torch.empty(1, N, dtype=torch.bfloat16, device=x.device)
    assert out.shape == (1, N) and out.dtype == torch.bfloat16 and out.is_contiguous() and out.device == x.device
    if ctas is None:
        ctas = ctas_for(kernel, N, sm_count(x.device))
    p = lambda t, dt, al: make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=al)  # noqa: E731
    stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    fn(p(x, cutlass.BFloat16, 16), p(wp, cutlass.Uint8, 16), p(s, cutlass.BFloat16, 16), p(z, cutlass.Uint8, 16),
       p(out, cutlass.BFloat16, 2), cutlass.Int32(N), cutlass.Int32(ctas), stream)
    return out


def reference(x, wp, s, z):
    """float64: the demo's int4_k_stack decode."""
    import torch

    N = wp.shape[0]
    w = torch.stack([wp & 0xF, wp >> 4], dim=-1).view(N, -1).double()
    w = (w - z.double().repeat_interleave(GROUP, dim=1)) * s.double().repeat_interleave(GROUP, dim=1)
    return x.double() @ w.t()


CONFIGS = [WsConfig(64, 4, 2, 8), WsConfig(64, 4, 2, 16), WsConfig(64, 4, 4, 6), WsConfig(64, 8, 2, 8),
           WsConfig(32, 4, 2, 8), WsConfig(32, 4, 2, 16), WsConfig(32, 2, 2, 12), WsConfig(16, 2, 2, 12),
           WsConfig(128, 8, 2, 6), WsConfig(64, 4, 2, 8, CHAINS=1), WsConfig(64, 4, 2, 8, EVICT_FIRST=True),
           WsConfig(32, 4, 2, 8, EVICT_FIRST=True)]


def compile_only(out_dir: str) -> None:
    import os
    import subprocess

    for cfg in CONFIGS:
        for K in (4096, 8192, 14336):
            d = os.path.abspath(os.path.join(out_dir, f"{cfg.BLOCK_N}_{cfg.CONSUMERS}_{cfg.GROUPS}_{cfg.STAGES}_"
                                                     f"{cfg.CHAINS}_{int(cfg.EVICT_FIRST)}_{K}"))
            os.makedirs(d, exist_ok=True)
            build(cfg, K, options=f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir={d}")
            cubins = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".cubin")]
            from fusekern.kernels.cute_scaled_mm import _tool

            res = subprocess.run([_tool("cuobjdump") or "cuobjdump", "-res-usage", cubins[0]], capture_output=True,
                                 text=True).stdout \
                if cubins else "no cubin"
            line = [ln for ln in res.splitlines() if "REG" in ln]
            print(cfg, K, line[0].strip() if line else res[:200], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,28672x4096,4096x14336,4096x4096,6144x4096")
    ap.add_argument("--compile-only", default=None, metavar="DIR")
    ap.add_argument("--configs", default=None, help="indices into CONFIGS (comma-separated; default all)")
    args = ap.parse_args()
    if args.compile_only:
        compile_only(args.compile_only)
        return
    import torch

    sys.path.insert(0, "benchmarks")
    sys.path.insert(0, "benchmarks/proto")
    from int4_sync_probe import dispatcher_configs, probe_shapes

    configs = CONFIGS if args.configs is None else [CONFIGS[int(i)] for i in args.configs.split(",")]
    for shape, sms in probe_shapes(args.shapes, args.csv, width=60):
        shape.stream_read(sms)
        for cfg in dispatcher_configs(shape, sms):
            shape.run_config(cfg)
        G = shape.K // GROUP
        idx = {name: next(i for i, t in enumerate(shape.leaves) if t.dtype == dt and tuple(t.shape) == shp)
               for name, dt, shp in (("wp", torch.uint8, (shape.N, shape.K // 2)), ("s", torch.bfloat16, (shape.N, G)),
                                     ("z", torch.uint8, (shape.N, G)))}
        wp, s, z = (shape.leaves[idx[k]] for k in ("wp", "s", "z"))
        for cfg in configs:
            try:
                out = torch.full((1, shape.N), float("nan"), dtype=torch.bfloat16, device="cuda")
                got = int4_ws_gemv(shape.x, wp, s, z, cfg, out=out)
                torch.cuda.synchronize()
                err_s = shape.rel_err(got)  # (against the float64 reference the int4_mma_sync rows use)
                err_s += "" if float(err_s) < 1e-2 else " WRONG"

                def call(i, cfg=cfg):
                    w = shape.weights[i]
                    o = torch.empty(1, shape.N, dtype=torch.bfloat16, device="cuda")
                    return lambda: int4_ws_gemv(shape.x, w[idx["wp"]], w[idx["s"]], w[idx["z"]], cfg, out=o)
                shape.timed("Int4WsGemv", str(cfg), err_s, call)
            except Exception as e:  # noqa: BLE001 - a config that does not build or fit
                print(f"  {cfg}: n/a ({type(e).__name__}: {str(e)[:300]})", flush=True)


if __name__ == "__main__":
    main()
