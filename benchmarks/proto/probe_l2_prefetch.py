"""Does prefetching a GEMV's weight into L2 while small kernels run ahead of it pay, in a CUDA graph?

    python benchmarks/proto/probe_l2_prefetch.py [--shapes 4096x4096,...] [--pre 0,2,4] [--csv OUT]

At B = 1 a decoder layer's GEMVs are bound by DRAM, and between them run kernels that move almost nothing
(norms, rotary, the KV write, attention over a short cache, SiLU): DRAM idles for those microseconds. The
weights do not depend on them, so their reads could start early. A prefetch into L2 is only a hint (no
result, nothing waits for it): launched before the small kernels, it may keep streaming after its own tiny
kernel exits, and the GEMV then finds its first lines in L2.

Per shape (the demo's W4A16 projections, N x K, each call a cold copy of the weight): the ``decode_mm`` op
(the dispatcher's tuned kernel) after ``pre`` small kernels (``torch.add`` on the 1 x K row, about what a
norm or rotary costs), without a prefetch, with one launched before the small kernels (``early``) and with
one launched right before the GEMV (``late``); the prefetch kernel either issues TMA bulk prefetches
(``cp.async.bulk.prefetch.L2``, 16 KB per lane) or one ``prefetch.global.L2`` per 128-byte line. The outputs
with a prefetch must equal the plain one bit for bit. Median µs with ``do_bench_cudagraph``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import triton.testing  # noqa: E402
from bench_common import RowWriter, copies_for_cold, cycling, versions, warm_up_clocks  # noqa: E402
from bench_int4_mma import floor_us, zoo_weight  # noqa: E402

from fusekern.kernels import decode_mm as dm  # noqa: E402

BULK = 16384  # bytes per bulk prefetch (a multiple of 16)
LINE = 128


@triton.jit
def l2_prefetch_bulk_kernel(base, nbytes, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)  # nbytes: a multiple of 16
    live = (size > 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [base + tl.where(size > 0, offs, 0), tl.maximum(size, 16), live],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch_line_kernel(base, nbytes, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    live = (offs < nbytes).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [base + tl.where(offs < nbytes, offs, 0), live], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(tensors, how: str) -> None:
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        flat = t.view(torch.uint8).view(-1) if t.is_contiguous() else None
        if flat is None or nbytes % 16:
            continue
        chunk = BULK if how == "bulk" else LINE
        lanes = triton.cdiv(nbytes, chunk)
        kernel = l2_prefetch_bulk_kernel if how == "bulk" else l2_prefetch_line_kernel
        kernel[(triton.cdiv(lanes, 128),)](flat, nbytes, BLOCK=128, CHUNK=chunk, num_warps=4)


def small_kernels(x, n):
    for _ in range(n):
        x = torch.add(x, x, alpha=1e-3)
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,6144x4096,4096x14336,28672x4096")
    ap.add_argument("--pre", default="0,2,4")
    ap.add_argument("--fmt", default="int4_k_stack")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    warm_up_clocks()
    info = versions()
    out = RowWriter(args.csv)
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        text, leaves, lay = zoo_weight(args.fmt, N, K)
        layout = lay.to_text()
        sets = copies_for_cold(leaves)
        fl = floor_us(leaves, N, K, 1)
        x0 = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        for pre in (int(v) for v in args.pre.split(",")):
            def call(ws, how=None, where="early", gemv=True, pre=pre):
                if how and where == "early":
                    prefetch(ws, how)
                x = small_kernels(x0, pre)
                if how and where == "late":
                    prefetch(ws, how)
                return dm.decode_mm(x, ws, text, None, layout) if gemv else x

            plain = call(sets[0]).clone()
            variants = [("plain", {}), ("small kernels only", dict(gemv=False))]
            for how in ("bulk", "line"):
                variants += [(f"{how} early", dict(how=how)), (f"{how} late", dict(how=how, where="late")),
                             (f"{how} early, no GEMV", dict(how=how, gemv=False))]
            for name, kw in variants:
                try:
                    if kw.get("gemv", True):
                        got = call(sets[0], **kw)
                        if not torch.equal(got, plain):
                            print(f"{shape} pre={pre} {name}: output differs from the plain call", flush=True)
                            continue
                    us = triton.testing.do_bench_cudagraph(
                        cycling([lambda ws=ws: call(ws, **kw) for ws in sets]), rep=200, return_mode="median") * 1e3
                except Exception as e:  # noqa: BLE001 - reported, the others go on
                    print(f"{shape} pre={pre} {name}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                print(f"{shape:>11} pre={pre} {name:24s} {us:7.2f} us  (floor {fl:5.2f})", flush=True)
                out.write(dict(shape=shape, fmt=args.fmt, pre=pre, variant=name, us=round(us, 2),
                               floor_us=round(fl, 2), **info))
    out.close()


if __name__ == "__main__":
    main()
