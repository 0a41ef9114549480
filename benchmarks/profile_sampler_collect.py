"""Which part of the sampler's collect pass costs: variants of its loop at B=256, V=128256, bf16."""
import torch, triton, triton.language as tl, triton.testing
from fusekern.kernels import sampler as S


@triton.jit
def _variant(logits_ptr, temperature, thr_ptr, count_ptr, cand_ptr, V, span, stride_row, CAP,
             DIV_RN: tl.constexpr, KEY: tl.constexpr, ATOMIC: tl.constexpr, NANCHECK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t0 = tl.load(thr_ptr + row)
    bad = tl.zeros((BLOCK,), dtype=tl.int1)
    n = tl.zeros((BLOCK,), dtype=tl.int32)
    start = chunk * span
    for off in range(start, tl.minimum(start + span, V), BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < V
        raw = tl.load(logits_ptr + row * stride_row + offs, mask=mask, other=0.0)
        if DIV_RN:
            rounded = tl.div_rn(raw.to(tl.float32), temperature).to(raw.dtype)
        else:
            rounded = (raw.to(tl.float32) / temperature).to(raw.dtype)
        x = tl.where(rounded == 0.0, 0.0, rounded.to(tl.float32))
        if KEY:
            bits = x.to(raw.dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            key = tl.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000)
        else:
            key = x.to(tl.int32)
        if NANCHECK:
            bad |= mask & ((x != x) | (x == float("inf")))
        sel = mask & (key >= t0)
        if ATOMIC:
            slot = tl.atomic_add(count_ptr + row + offs * 0, 1, mask=sel, sem="relaxed")
            tl.store(cand_ptr + row.to(tl.int64) * CAP + slot, offs, mask=sel & (slot < CAP))
        else:
            n += sel.to(tl.int32)
    tl.store(count_ptr + row + tl.arange(0, 1), tl.sum(n, axis=0) + tl.max(bad.to(tl.int32), axis=0))


V, block = 128256, 2048
for B in (256,):
    logits = torch.randn(B, V, device="cuda", dtype=torch.bfloat16) * 3
    C, span = S.row_split(B, V, 132, block)
    cap = 4096
    ints = torch.zeros((3, B), dtype=torch.int32, device="cuda")
    S._threshold_kernel[(B,)](logits, logits, 0.8, 0, logits, 50, 0, ints[0], ints[1], ints[2], V, V, V // 4096,
                              TEMP_PER_ROW=False, K_PER_ROW=False, SAMPLE=4096, KEY_BITS=16, num_warps=8)
    cand = torch.empty((B, cap), dtype=torch.int32, device="cuda")
    for name, f in [("all on", dict(DIV_RN=True, KEY=True, ATOMIC=True, NANCHECK=True)),
                    ("no div_rn", dict(DIV_RN=False, KEY=True, ATOMIC=True, NANCHECK=True)),
                    ("no atomic", dict(DIV_RN=True, KEY=True, ATOMIC=False, NANCHECK=True)),
                    ("no nancheck", dict(DIV_RN=True, KEY=True, ATOMIC=True, NANCHECK=False)),
                    ("only load+div", dict(DIV_RN=True, KEY=False, ATOMIC=False, NANCHECK=False)),
                    ("no div_rn, no atomic", dict(DIV_RN=False, KEY=True, ATOMIC=False, NANCHECK=True))]:
        for warps in (4, 8):
            fn = lambda: _variant[(B, C)](logits, 0.8, ints[0], ints[1], cand, V, span, V, cap, BLOCK=block, num_warps=warps, **f)
            fn()
            us = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
            print(f"B={B} {name:22s} w{warps} {us:8.2f} us", flush=True)
