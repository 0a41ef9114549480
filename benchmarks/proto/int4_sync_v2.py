"""int4_mma_sync with its iteration's three waits taken off the chain at once (probe, H200, M <= 8, words in
16-byte rows along K: two codes per byte).

    python benchmarks/proto/int4_sync_v2.py [--csv OUT.csv] [--shapes 8192x8192,...]

Why: the plain kernel's loop waits, in every iteration, on the next words (loaded one group ahead, which ptxas
sinks to the end of the iteration), on the group's scales and zeros (loaded where used) and on the 8-deep chain
of MMAs that sums x; leaving out any one of them saves little, all three 42%
(benchmarks/results/h200/int4_mma_sync_drop_probe.csv). Here, per config flag:
- ``STAGES`` S >= 2: the words come through a ring of S slots in shared memory private to each lane (cp.async,
  S - 1 groups in flight without holding registers; the wait is ``cp.async.wait_group S - 1``);
- ``SCALE_TABLE``: the program's scales and 128 + z + c, all its groups and columns, are loaded once before the
  loop (every load independent: one trip to memory) into a table in shared memory, read per group there;
- ``SUMX_TABLE``: sum x per group and row, which depends on x only, is computed once per program before the loop
  (the same MMAs, so the same bits) into a table in shared memory.
The ring is primed before the tables are filled, so their loads overlap the first words' flight. One static
shared array holds ring and tables (declared in the PTX, as the ring of git e20b9e2 did). Each variant is
checked against the float64 reference and bit for bit against the plain kernel (same arithmetic, same order),
then timed warm and cold as the other probes (``int4_sync_probe.ProbeShape``).

Result (``benchmarks/results/h200/int4_sync_v2_probe.csv``, git 78ebd5d): no variant beat the plain kernel cold
by more than 1% at its best split (8192 x 8192: 16.02 us plain, 15.87 with the scale table alone, 16.7-17.5 with
the ring and both tables; 28672 x 4096: 26.66 plain, 27.87 at best). The ring helped only where the split left few programs
(split 2 at 8192 x 8192: 30.9 -> 20.8). At git 78ebd5d the scale table skipped its last entries where the
slice's groups times 64 columns were not a multiple of 128 threads (4096 x 14336, split 16: the rows marked
"nan DIFFERS FROM PLAIN"); fixed since, not re-run.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/proto")
from int4_sync_probe import dispatcher_configs, probe_shapes  # noqa: E402
from fusekern.kernels import int4_mma_sync as ims  # noqa: E402
from fusekern.kernels.int4_mma import _GROUP, _constexprs, _words_i32, _zero_of, split_buffers  # noqa: E402
from fusekern.kernels.intmath import cdiv  # noqa: E402

SMEM_MAX = 48 * 1024  # a static shared array's limit


@dataclasses.dataclass(frozen=True)
class SyncV2:
    SPLIT_K: int = 8
    num_warps: int = 4
    STAGES: int = 0  # 0: words in registers one group ahead (the plain kernel's way)
    SCALE_TABLE: bool = False
    SUMX_TABLE: bool = False
    maxnreg: int | None = None

    @property
    def BLOCK_N(self) -> int:
        return 16 * self.num_warps

    def layout(self, K: int) -> dict:
        """Byte offsets in the shared array: ring, scale table, sum-x table, and the total."""
        threads = 32 * self.num_warps
        per = K // 128 // self.SPLIT_K
        ring = self.STAGES * 2 * threads * 16
        scales = per * self.BLOCK_N * 8 if self.SCALE_TABLE else 0
        sumx = per * 4 * 8 if self.SUMX_TABLE else 0
        return dict(SC_OFF=ring, SX_OFF=ring + scales, SMEM=max(16, ring + scales + sumx))


@triton.jit
def _ring_issue(dst, p0, p1, CHUNK: tl.constexpr):
    """cp.async (L2 only) of a lane's 16-byte word rows of columns g and g + 8 into its slot, one commit group;
    returns a token that orders the group's wait after it."""
    return tl.inline_asm_elementwise(
        "cp.async.cg.shared.global [$1], [$2], 16; cp.async.cg.shared.global [$3], [$4], 16; "
        "cp.async.commit_group; mov.u32 $0, 0;",
        "=r,r,l,r,l", [dst, p0, dst + CHUNK, p1], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ring_read(src, token, WAIT: tl.constexpr):
    """Wait until at most STAGES - 1 groups are in flight, then the lane's four words at shared address src."""
    return tl.inline_asm_elementwise(WAIT + "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,r",
                                     [src, token], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False,
                                     pack=1)


@triton.jit
def _st_pair(addr, a, b):
    """Two fp32 into shared memory at addr (8-byte aligned)."""
    return tl.inline_asm_elementwise("st.shared.v2.f32 [$1], {$2, $3}; mov.u32 $0, 0;", "=r,r,f,f", [addr, a, b],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ld_pair(addr):
    """Two fp32 from shared memory at addr (written before the prologue's barrier)."""
    return tl.inline_asm_elementwise("ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r", [addr],
                                     dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit(do_not_specialize=["M"])
def int4_sync_v2_kernel(x_ptr, q_ptr, z_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M,
                        N: tl.constexpr, K: tl.constexpr, SQK: tl.constexpr, SQN: tl.constexpr,
                        ZMODE: tl.constexpr, C: tl.constexpr, SZK: tl.constexpr, SZN: tl.constexpr,
                        SSK: tl.constexpr, SSN: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                        THREADS: tl.constexpr, STAGES: tl.constexpr, SCALE_TABLE: tl.constexpr,
                        SUMX_TABLE: tl.constexpr, SMEM_DECL: tl.constexpr, RING_WAIT: tl.constexpr,
                        SC_OFF: tl.constexpr, SX_OFF: tl.constexpr):
    ASM: tl.constexpr = True
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BLOCK_N: tl.constexpr = 16 * (THREADS // 32)
    tid = ims._thread_index(tl.zeros((THREADS,), tl.int32), ASM)
    warp = tid // 32
    g = (tid % 32) // 4
    c = tid % 4
    TILES: tl.constexpr = K // _GROUP
    PER: tl.constexpr = TILES // SPLIT_K
    t0 = pid_k * PER
    LAST = t0 + PER - 1
    n0 = pid_n * BLOCK_N + warp * 16 + g
    n1 = n0 + 8
    ln0 = tl.minimum(n0, N - 1)
    ln1 = tl.minimum(n1, N - 1)
    xq_ptr = x_ptr.to(tl.pointer_type(tl.int32)) + tl.minimum(g, M - 1).to(tl.int64) * (K // 2) + c * 16
    wp0 = q_ptr + ln0.to(tl.int64) * SQN + (c * 4) * SQK
    wp1 = q_ptr + ln1.to(tl.int64) * SQN + (c * 4) * SQK
    GW: tl.constexpr = 16 * SQK
    base = tl.inline_asm_elementwise(SMEM_DECL, "=r,r", [tid], dtype=tl.int32, is_pure=True, pack=1)
    CHUNK: tl.constexpr = THREADS * 16
    SLOT: tl.constexpr = 2 * CHUNK
    lane_slot = base + tid * 16
    if STAGES > 0:  # the first STAGES - 1 groups of words in flight before the tables are filled
        for s in tl.static_range(STAGES - 1):
            ts = tl.minimum(t0 + s, LAST)
            _ring_issue(lane_slot + s * SLOT, wp0 + ts * GW, wp1 + ts * GW, CHUNK)
    else:
        nw0, nw1, nw2, nw3 = ims._load4(wp0 + t0 * GW, True, SQK, ASM, True)
        nv0, nv1, nv2, nv3 = ims._load4(wp1 + t0 * GW, True, SQK, ASM, True)
    if SCALE_TABLE:  # entry (group i of the slice, column j of the tile): (s, 128 + z + c) as fp32
        for r in tl.static_range((PER * BLOCK_N + THREADS - 1) // THREADS):
            e = tl.minimum(tid + r * THREADS, PER * BLOCK_N - 1)  # (past the table: its last entry again)
            if SSK == 1:  # groups run along memory: neighbouring threads read neighbouring groups
                ei = e % PER
                ej = e // PER
            else:
                ei = e // BLOCK_N
                ej = e % BLOCK_N
            col = tl.minimum(pid_n * BLOCK_N + ej, N - 1)
            sv = tl.load(s_ptr + (t0 + ei) * SSK + col * SSN).to(tl.float32)
            zv = (_zero_of(z_ptr, t0 + ei, col, ZMODE, SZK, SZN) + (128 + C)).to(tl.float32)
            _st_pair(base + SC_OFF + (ei * BLOCK_N + ej) * 8, sv, zv)
    if SUMX_TABLE:  # entry (group i, lane quarter c): sum x of rows 2c, 2c + 1; warp w fills groups w, w + 4, ..
        for i in range(0, PER, THREADS // 32):
            ti = t0 + tl.minimum(i + warp, PER - 1)  # (a slice of fewer groups than warps: the last again)
            xa = ims._load4(xq_ptr + ti * 64, True, 1, ASM)
            xb = ims._load4(xq_ptr + ti * 64 + 4, True, 1, ASM)
            xc = ims._load4(xq_ptr + ti * 64 + 8, True, 1, ASM)
            xd = ims._load4(xq_ptr + ti * 64 + 12, True, 1, ASM)
            sx0, sx1 = ims._sum_x(ims._x_pairs(xa + xb + xc + xd, ASM), ASM)
            _st_pair(base + SX_OFF + ((ti - t0) * 4 + c) * 8, sx0, sx1)
    if SCALE_TABLE or SUMX_TABLE:
        tl.debug_barrier()
    zero = tl.zeros((THREADS,), tl.float32)
    acc0, acc1, acc2, acc3 = zero, zero, zero, zero
    for t in range(t0, t0 + PER):
        i = t - t0
        if STAGES > 0:
            tn = tl.minimum(t + (STAGES - 1), LAST)
            token = _ring_issue(lane_slot + ((i + (STAGES - 1)) % STAGES) * SLOT, wp0 + tn * GW, wp1 + tn * GW,
                                CHUNK)
            here = lane_slot + (i % STAGES) * SLOT
            w0, w1, w2, w3 = _ring_read(here, token, RING_WAIT)
            v0, v1, v2, v3 = _ring_read(here + CHUNK, token, "")
        else:
            w0, w1, w2, w3 = nw0, nw1, nw2, nw3
            v0, v1, v2, v3 = nv0, nv1, nv2, nv3
            tn = tl.minimum(t + 1, LAST)
            nw0, nw1, nw2, nw3 = ims._load4(wp0 + tn * GW, True, SQK, ASM, True)
            nv0, nv1, nv2, nv3 = ims._load4(wp1 + tn * GW, True, SQK, ASM, True)
        xa = ims._load4(xq_ptr + t * 64, True, 1, ASM)
        xb = ims._load4(xq_ptr + t * 64 + 4, True, 1, ASM)
        xc = ims._load4(xq_ptr + t * 64 + 8, True, 1, ASM)
        xd = ims._load4(xq_ptr + t * 64 + 12, True, 1, ASM)
        xs = ims._x_pairs(xa + xb + xc + xd, ASM)
        if SCALE_TABLE:
            sa, za = _ld_pair(base + SC_OFF + (i * BLOCK_N + warp * 16 + g) * 8)
            sb, zb = _ld_pair(base + SC_OFF + (i * BLOCK_N + warp * 16 + g + 8) * 8)
            sz = (sa, sb, za, zb)
        else:
            sz = ims._scale_zero(s_ptr, z_ptr, t, ln0, ln1, ZMODE, C, SZK, SZN, SSK, SSN)
        if SUMX_TABLE:
            sx0, sx1 = _ld_pair(base + SX_OFF + (i * 4 + c) * 8)
        else:
            sx0, sx1 = ims._sum_x(xs, ASM)
        acc0, acc1, acc2, acc3 = ims._folded(acc0, acc1, acc2, acc3,
                                             ims._group_product(w0, w1, w2, w3, v0, v1, v2, v3, xs, ASM),
                                             sx0, sx1, sz)
    if STAGES > 0:  # (the re-issued last groups: nothing may land after the program ends)
        tl.inline_asm_elementwise("cp.async.wait_all; mov.u32 $0, 0;", "=r,r", [tid], dtype=tl.int32,
                                  is_pure=False, pack=1)
    m0 = 2 * c
    m1 = m0 + 1
    if SPLIT_K > 1:
        ims._partials(ws_ptr, acc0, acc1, acc2, acc3, pid_k, m0, m1, n0, n1, M, N)
        tl.debug_barrier()
        cnt = cnt_ptr + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            acc0, acc1, acc2, acc3 = ims._summed(ws_ptr, m0, m1, n0, n1, M, N, SPLIT_K)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            ims._store(out_ptr, bias_ptr, acc0, acc1, acc2, acc3, m0, m1, n0, n1, M, N, HAS_BIAS, ASM)
    else:
        ims._store(out_ptr, bias_ptr, acc0, acc1, acc2, acc3, m0, m1, n0, n1, M, N, HAS_BIAS, ASM)


def constexprs(cfg: SyncV2, lay, K: int, N: int) -> dict:
    """Every compile-time argument of a launch (the layout's, the config's, the shared array's PTX)."""
    sm = cfg.layout(K)
    if sm["SMEM"] > SMEM_MAX:
        raise ValueError(f"{cfg}: {sm['SMEM']} bytes of shared memory")
    return dict(**_constexprs(lay, K, N), HAS_BIAS=False, SPLIT_K=cfg.SPLIT_K, THREADS=32 * cfg.num_warps,
                STAGES=cfg.STAGES, SCALE_TABLE=cfg.SCALE_TABLE, SUMX_TABLE=cfg.SUMX_TABLE,
                SMEM_DECL=f"{{ .shared .align 16 .b8 fk_smem[{sm['SMEM']}]; mov.u32 $0, fk_smem; }}",
                RING_WAIT=f"cp.async.wait_group {max(cfg.STAGES - 1, 0)}; ", SC_OFF=sm["SC_OFF"],
                SX_OFF=sm["SX_OFF"])


def sync_v2(x: torch.Tensor, leaves, lay, K: int, N: int, cfg: SyncV2) -> torch.Tensor:
    """``x [M, K] @ W`` (M <= 8, contiguous 16-byte aligned x and words, whole groups, SPLIT_K | K / 128)."""
    M = x.shape[0]
    q = _words_i32(leaves, lay)
    consts = constexprs(cfg, lay, K, N)
    if M > 8 or not x.is_contiguous() or x.data_ptr() % 16 or consts["SQK"] != 1 or q.data_ptr() % 16 \
            or K % 128 or (K // 128) % cfg.SPLIT_K:
        raise ValueError("sync_v2: M <= 8, aligned contiguous x, words along K, whole groups")
    tiles_n = cdiv(N, cfg.BLOCK_N)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    ws, cnt = split_buffers(out, cfg.SPLIT_K, tiles_n, None, "sync_v2")
    z = leaves[lay.zero_leaf] if lay.zero in ("packed", "int") else q
    extra = dict(maxnreg=cfg.maxnreg) if cfg.maxnreg else {}
    int4_sync_v2_kernel[(tiles_n, cfg.SPLIT_K)](x, q, z, leaves[lay.scale], out, out, ws, cnt, M, **consts,
                                                num_warps=cfg.num_warps, **extra)
    return out


def variants(split_k: int) -> list[SyncV2]:
    out = []
    for stages, scales, sumx in ((0, False, False), (3, False, False), (0, True, False), (0, False, True),
                                 (0, True, True), (3, True, False), (2, True, True), (3, True, True),
                                 (4, True, True)):
        out.append(SyncV2(SPLIT_K=split_k, STAGES=stages, SCALE_TABLE=scales, SUMX_TABLE=sumx))
    for stages in (3, 4):
        out.append(SyncV2(SPLIT_K=split_k, STAGES=stages, SCALE_TABLE=True, SUMX_TABLE=True, maxnreg=64))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--shapes", default="8192x8192,28672x4096,4096x14336,4096x4096")
    args = ap.parse_args()
    for shape, sms in probe_shapes(args.shapes, args.csv, width=110):
        shape.stream_read(sms)
        splits = [cfg.SPLIT_K for cfg in dispatcher_configs(shape, sms) if shape.run_config(cfg) is not None
                  and cfg.GROUPS_PER_WARP == 1]
        near = [s for s in (2, 4, 8, 16) if (shape.K // 128) % s == 0 and any(s in (d // 2, d, 2 * d) for d in splits)]
        for split_k in dict.fromkeys(splits + near):
            ref_plain = ims.int4_mma_sync(shape.x, shape.leaves, shape.lay, shape.K, shape.N,
                                          ims.Int4MmaSync(SPLIT_K=split_k))
            for M in (3, 8):  # more rows: bit for bit the plain kernel's too
                xm = torch.randn(M, shape.K, dtype=torch.bfloat16, device="cuda")
                cfg = SyncV2(SPLIT_K=split_k, STAGES=3, SCALE_TABLE=True, SUMX_TABLE=True)
                same = torch.equal(sync_v2(xm, shape.leaves, shape.lay, shape.K, shape.N, cfg),
                                   ims.int4_mma_sync(xm, shape.leaves, shape.lay, shape.K, shape.N,
                                                     ims.Int4MmaSync(SPLIT_K=split_k)))
                print(f"  M={M} {cfg}: {'same bits as plain' if same else 'DIFFERS FROM PLAIN'}", flush=True)
            for cfg in variants(split_k):
                try:
                    got = sync_v2(shape.x, shape.leaves, shape.lay, shape.K, shape.N, cfg)
                    torch.cuda.synchronize()
                except Exception as e:
                    print(f"  {cfg}: n/a ({type(e).__name__}: {str(e)[:300]})", flush=True)
                    continue
                err = shape.rel_err(got) + ("" if torch.equal(got, ref_plain) else " DIFFERS FROM PLAIN")
                shape.timed("SyncV2", str(cfg).replace("SyncV2", ""), err,
                            lambda i, cfg=cfg: (lambda: sync_v2(shape.x, shape.weights[i], shape.lay, shape.K,
                                                                shape.N, cfg)))


if __name__ == "__main__":
    main()
