"""Block-scaled FP8 CuTe GEMM at 128x256: where its time goes, and a sum rescaled per K block (probe).

    python benchmarks/proto/block_scaled_rescale_probe.py [--csv OUT.csv] [--shapes 4096x7168x7168,...] [--rounds 2]
    python benchmarks/proto/block_scaled_rescale_probe.py --accuracy 1024,7168,16384,32768 [--csv OUT.csv]
    python benchmarks/proto/block_scaled_rescale_probe.py --compile-only OUT_DIR     (CPU: sm_90a builds)

Why: until git 6852fd7 the 128x256 block-scaled loop wrote each K block's product of a 128-column half into a
fresh fragment, waited for it (``wait_group(0)``) and folded it into the sum with one FMA per register: the
warpgroup's tensor-core queue ran empty twice per K block. It ran 1035-1037 TFLOP/s on an H100 (M = 4096, N =
K = 7168) against 1273-1298 for the rowwise kernel at the same tile (no fold).

Variants:
- ``base``: the shipped 128x128 block-scaled kernel; ``wide``: the shipped 128x256 one (since git 0c5c38c the
  quarter loop ``_mainloop_block_scaled_quarters``, before it the half loop above);
- ``rescale`` (``_u2``, ``_u1``: two or one K blocks per pass): the sum of a half kept in units of the current
  block's scale c(kb) = a_block[row, kb] * b_block[half, kb]: before block kb's WGMMAs accumulate into it,
  sum *= c(kb - 1) / c(kb) (one multiply per register, as many as the fold's FMAs), and after the last block
  sum *= c(last). No fragment, and while one half is rescaled the other half's WGMMAs run. It has no guard for
  zero, non-finite or widely spread scales (the kernel would need one);
- ``*_mcast``: with the 1 x 2 multicast cluster of block_scaled_wide_probe.py;
- ``rowwise_128x256`` and ``rowwise_128x256_n128`` (the same from 64x128 WGMMAs): the tile without any fold;
- ``*_sw8n`` / ``*_sw16n``: tiles visited in bands of 8 / 16 M tiles along N;
- ``wide_pass4``: the shipped quarter loop at four K blocks per pass (what it ships with for a bare 16-bit
  epilogue; against one per pass: benchmarks/proto/probe_blocks_per_pass.py).

Every output is checked against float64 with the output poisoned first; the variants that promote each K block
to fp32 (``PROMOTING``) are checked bit for bit against each other. Results on an H100, CUDA graph, median
TFLOP/s over two rounds at M = 4096 / 2048 (N = K = 7168), in benchmarks/results/h100/:
- ``block_scaled_rescale_probe_f7a86f8.csv``: half loop 1027-1037 / 928-932, rescale 1130-1133 / 1005-1006
  (1120-1128 with fewer blocks per pass; multicast no better), rowwise 1293-1298 / 1135.
- ``fp8_accumulation_accuracy_362e842.csv`` (``--accuracy``): the rescaled sum stays in the tensor cores'
  accumulator, whose additions keep fewer bits than fp32; its error grows with K to 4.3x the output's own
  rounding at K = 32768, where the fold stays at that rounding. So it is not in the kernel.
- ``block_scaled_n128_probe_43c0742.csv``: rowwise from 64x128 WGMMAs 1249-1258 against 1267-1274: the atom
  width costs 1-2%; the fp32 work beside the running WGMMAs costs about 11% by itself (rescale 1113-1119).
- ``block_scaled_quarters_probe_6852fd7.csv``: the quarter loop (64x64 WGMMAs, two 32-register fragments in
  turn, one quarter folded while the next runs) 1073-1078 / 936-948 against the half loop's 1035-1037 /
  927-932 and 128x128's 942-944 / 952-955, the same bits as both; it went into the kernel.

ptxas serialized every WGMMA of the kernel (info C7514) for a rescaled loop whose WGMMAs accumulate into the same
registers across iterations of a dynamic K loop while multiplies touch them between ``wait_group(1)``s, and
compiled it clean once every iteration ended with no WGMMA in flight; so each pass of these loops is straight-line
code that starts and ends with none in flight, and each ``wait_group(1)`` follows the commit it leaves in flight.
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/proto")
from fusekern.kernels import cute_scaled_mm as csm  # noqa: E402
from block_scaled_wide_probe import (Base, BaseMcast, Multicast, _use, compile_only, time_shapes,  # noqa: E402
                                     write_csv)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402


class Rescale(Base):
    """The 128x256 block-scaled loop with the accumulator rescaled per K block (module docstring).

    ptxas serialized every WGMMA (C7514) while this loop's passes were iterations of the dynamic K loop with a
    group in flight across its head (module docstring). So each pass of the K loop handles ``unroll`` blocks in
    straight-line code and ends with ``wait_group(0)``; inside it, block kb issues half 0, waits for half 1 of
    kb - 1 (``wait_group(1)``: the one group it leaves in flight was committed just before, in the same
    pass), rescales half 1 into block kb's units, issues half 1, waits for half 0 of kb and rescales half 0
    into block kb + 1's units. The warpgroup's tensor-core queue drains once per pass instead of twice per
    block. Blocks left over after the last full pass go one per pass.
    """

    unroll = 4

    def _atom_n(self) -> int:
        return csm.SCALE_BLOCK  # one WGMMA per 128-column half

    @cute.jit
    def _mainloop_block_scaled_quarters(self, ab_pipeline, tiled_mma, tCrA, tCrB, acc, frag, tCcAcc, k_tiles,
                                        read_state, release_state, mSA, mSB, tile):
        read_state.reset_count()
        release_state.reset_count()
        slot_of, slot_rep = csm._row_slots(tiled_mma, (self.tile_mnk[0], csm.SCALE_BLOCK))
        sa_last = mSA.shape[0] - 1
        row0 = tile[0] * self.tile_mnk[0]
        sa_rows = [cutlass.min(row0 + tCcAcc[rep][0], sa_last) for rep in slot_rep]
        sb_last = mSB.shape[0] - 1
        sb_rows = [cutlass.min(tile[1] * 2 + h, sb_last) for h in range(2)]
        slots = len(slot_rep)
        # raw scales of blocks kb, kb + 1 and kb + 2: [block, (a_block per row slot..., b_block per half)]
        ring = cute.make_rmem_tensor((3, slots + 2), cutlass.Float32)
        # [half, slot]: the scale c = a_block * b_block of the block whose units the half's sum is in
        unit = cute.make_rmem_tensor((2, slots), cutlass.Float32)
        ratio = cute.make_rmem_tensor((slots,), cutlass.Float32)
        self._load_scales(ring, 0, mSA, mSB, sa_rows, sb_rows, 0)
        self._load_scales(ring, 1, mSA, mSB, sa_rows, sb_rows, cutlass.min(1, k_tiles - 1))
        for h in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(slots):
                unit[h, j] = ring[0, j] * ring[0, slots + h]
        acc.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        passes = k_tiles // self.unroll
        for p in range(passes):
            read_state, release_state = self._blocks(
                ab_pipeline, tiled_mma, tCrA, tCrB, acc, ring, unit, ratio, slot_of, slots, mSA, mSB,
                sa_rows, sb_rows, k_tiles, p * self.unroll, self.unroll, read_state, release_state)
        for kb in range(passes * self.unroll, k_tiles):
            read_state, release_state = self._blocks(
                ab_pipeline, tiled_mma, tCrA, tCrB, acc, ring, unit, ratio, slot_of, slots, mSA, mSB,
                sa_rows, sb_rows, k_tiles, kb, 1, read_state, release_state)
        for h in cutlass.range_constexpr(2):
            acc_v = acc[(None, 0, h)]
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                acc_v[i] = acc_v[i] * unit[h, slot_of[i]]
        return read_state, release_state

    @cute.jit
    def _blocks(self, ab_pipeline, tiled_mma, tCrA, tCrB, acc, ring, unit, ratio, slot_of, slots, mSA, mSB,
                sa_rows, sb_rows, k_tiles, first, count: cutlass.Constexpr, read_state, release_state):
        """Blocks first .. first + count - 1, straight-line, starting and ending with no WGMMA in flight.
        On entry half 0's sum is in block first's units and half 1's in those of the block before."""
        kmma = cute.size(tCrA, mode=[2])
        for i in cutlass.range_constexpr(count):
            kb = first + i
            self._load_scales(ring, 2, mSA, mSB, sa_rows, sb_rows, cutlass.min(kb + 2, k_tiles - 1))
            ab_pipeline.consumer_wait(read_state)
            self._issue_half(tiled_mma, tCrA, tCrB, acc, 0, read_state.index, kmma)
            cute.nvgpu.warpgroup.wait_group(1)  # half 1 of block kb - 1 done (none in flight when i == 0)
            if cutlass.const_expr(i > 0):
                ab_pipeline.consumer_release(release_state)  # both halves have read block kb - 1's stage
                release_state.advance()
            self._rescale(acc, 1, unit, ring, 0, slots, ratio, slot_of)  # half 1 into block kb's units
            self._issue_half(tiled_mma, tCrA, tCrB, acc, 1, read_state.index, kmma)
            cute.nvgpu.warpgroup.wait_group(1)  # half 0 of block kb done
            self._rescale(acc, 0, unit, ring, 1, slots, ratio, slot_of)  # half 0 into block kb + 1's units
            self._shift_scales(ring)
            read_state.advance()
        self._drain(ab_pipeline, release_state)
        return read_state, release_state

    @cute.jit
    def _rescale(self, acc, h, unit, scales, buf, slots, ratio, slot_of):
        """Half h's sum into the units of the block whose raw scales are scales[buf]: times unit / c, where
        c = a_block of the register's row * b_block of the half (``rcp.approx``: within an ulp)."""
        for j in cutlass.range_constexpr(slots):
            c = scales[buf, j] * scales[buf, slots + h]
            ratio[j] = unit[h, j] * cute.arch.rcp_approx(c)
            unit[h, j] = c
        acc_v = acc[(None, 0, h)]
        for i in cutlass.range_constexpr(cute.size(acc_v)):
            acc_v[i] = acc_v[i] * ratio[slot_of[i]]

    @cute.jit
    def _issue_half(self, tiled_mma, tCrA, tCrB, acc, h, stage, kmma):
        """Half h's WGMMAs of one K block, accumulating into its sum, and their commit."""
        acc_h = cute.append_ones(acc[(None, None, h)], 3)
        cute.nvgpu.warpgroup.fence()  # the sum was rescaled by ordinary instructions
        for kk in cutlass.range_constexpr(kmma):
            cute.gemm(tiled_mma, acc_h, tCrA[(None, None, kk, stage)],
                      cute.append_ones(tCrB[(None, h, kk, stage)], 2), acc_h)
        cute.nvgpu.warpgroup.commit_group()


class Rescale2(Rescale):
    unroll = 2


class Rescale1(Rescale):
    unroll = 1


class RowwiseN128(Base):
    """The rowwise kernel at 128x256 built from 64x128 WGMMAs (two per K step) instead of 64x256: the atom
    width the block-scaled loops used until git 6852fd7. A and B are read from shared memory once per WGMMA,
    so narrower atoms read A once more per K step."""

    def _atom_n(self) -> int:
        return csm.SCALE_BLOCK


class SwizzleN8(Base):
    """Tiles visited in bands of 8 M tiles, along N: the CTAs of one wave share 8 row blocks of A and about
    132 / 8 column blocks of B, instead of every row block of A and two or four column blocks of B."""
    swizzle_size = 8
    raster_along_m = False


class SwizzleN16(SwizzleN8):
    swizzle_size = 16


class WidePass4(Base):
    """The shipped 128x256 quarter loop at four K blocks per pass (as it was timed; it ships at one)."""
    blocks_per_pass = 4


class RescaleMcast(Multicast, Rescale):
    pass


# name -> (kernel class, tiles, block-scaled)
VARIANTS = {
    "base": (Base, (128, 128), True),
    "wide": (Base, (128, 256), True),
    "rescale": (Rescale, (128, 256), True),
    "rescale_u2": (Rescale2, (128, 256), True),
    "rescale_u1": (Rescale1, (128, 256), True),
    "wide_mcast": (BaseMcast, (128, 256), True),
    "rescale_mcast": (RescaleMcast, (128, 256), True),
    "rowwise_128x256": (Base, (128, 256), False),
    "rowwise_128x256_n128": (RowwiseN128, (128, 256), False),
    "rowwise_128x256_sw8n": (SwizzleN8, (128, 256), False),
    "rowwise_128x256_sw16n": (SwizzleN16, (128, 256), False),
    "wide_sw8n": (SwizzleN8, (128, 256), True),
    "wide_sw16n": (SwizzleN16, (128, 256), True),
    "wide_pass4": (WidePass4, (128, 256), True),
}


# block-scaled variants that fold each K block's fresh fragment in fp32: the same arithmetic, so the same bits
PROMOTING = ("base", "wide", "wide_mcast", "wide_sw8n", "wide_sw16n", "wide_pass4")
ROWWISE_256 = ("rowwise_128x256", "rowwise_128x256_sw8n", "rowwise_128x256_sw16n")  # the tile order changes no bits


def _family(name: str):
    return "promoting" if name in PROMOTING else "rowwise 64x256 atoms" if name in ROWWISE_256 else None


def accuracy(ks: list, csv_path) -> None:
    """How far each way of accumulating lands from float64, as K grows (M = N = 2048, bf16 output).

    ``bf16_of_exact`` is the float64 result rounded to bf16: the output's own rounding, the least any kernel
    can have. The block-scaled kernels (``wide``: a fresh fragment per K block folded in fp32; ``rescale``:
    the sum kept in the WGMMA accumulator) against the block-scaled product; the rowwise kernel and
    torch._scaled_mm (fast accumulation on and off) against the plain product with unit scales."""
    from bench_common import versions

    info = versions()
    rows = []
    M = N = 2048
    for K in ks:
        torch.manual_seed(K)
        a = (torch.randn(M, K, device="cuda") * 2).to(torch.float8_e4m3fn)
        b = (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn)
        kb, nb = -(-K // 128), -(-N // 128)
        sa = torch.exp2(torch.rand(M, kb, device="cuda") * 16 - 8)
        sb = torch.exp2(torch.rand(nb, kb, device="cuda") * 16 - 8)
        ref_block = csm._block_scaled_product(a.double(), b.double(), sa.double(), sb.double())
        ref_plain = a.double() @ b.double().t()
        ones_a, ones_b = torch.ones(M, 1, device="cuda"), torch.ones(1, N, device="cuda")

        def err(out, ref):
            d = out.double() - ref
            return (d.norm() / ref.norm()).item(), (d.abs().max() / ref.abs().max()).item()

        results = {"bf16_of_exact (block)": err(ref_block.to(torch.bfloat16), ref_block),
                   "bf16_of_exact (plain)": err(ref_plain.to(torch.bfloat16), ref_plain)}
        for name in ("wide", "rescale"):
            cls, tiles, _ = VARIANTS[name]
            _use(cls, tiles)
            results[name] = err(csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16, a_block=sa, b_block=sb), ref_block)
        _use(Base, (128, 256))
        results["rowwise_128x256"] = err(csm.cute_scaled_mm(a, b, out_dtype=torch.bfloat16), ref_plain)
        for fast in (False, True):
            out = torch._scaled_mm(a, b.t(), scale_a=ones_a, scale_b=ones_b, out_dtype=torch.bfloat16,
                                   use_fast_accum=fast)
            results[f"torch_scaled_mm fast_accum={fast}"] = err(out, ref_plain)
        for name, (rel, mx) in results.items():
            row = dict(variant=name, M=M, N=N, K=K, rel_err=f"{rel:.3e}", max_err_over_max=f"{mx:.3e}", **info)
            print(row, flush=True)
            rows.append(row)
    _use(Base, (128, 128))
    write_csv(csv_path, rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="4096x7168x7168,2048x7168x7168")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile-only", default=None, metavar="OUT_DIR")
    ap.add_argument("--accuracy", default=None, metavar="K,K,...",
                    help="instead of timing: relative errors against float64 at M = N = 2048 and these K")
    args = ap.parse_args()
    if args.compile_only:
        sys.exit(compile_only(args.compile_only, VARIANTS))
    if args.accuracy:
        accuracy([int(k) for k in args.accuracy.split(",")], args.csv)
        return

    write_csv(args.csv, time_shapes(args.shapes.split(","), args.variants.split(","), VARIANTS, args.rounds,
                                    _family, _spread_scales))


def _spread_scales(M, N, kb, nb):
    """Block scales spread over 2^-8 .. 2^8 (as activation scales of different blocks can be), b's of any sign."""
    sa = torch.exp2(torch.rand(M, kb, device="cuda") * 16 - 8)
    sb = torch.exp2(torch.rand(nb, kb, device="cuda") * 16 - 8) * (torch.randint(0, 2, (nb, kb), device="cuda") * 2 - 1)
    return sa, sb


if __name__ == "__main__":
    main()
