"""Time each sampler launch alone (B = 1 and 256, V = 128256, bf16), plus a plain streaming loop with the
same grid and loop shape, to see which pass is slow. Diagnostic; not part of the results."""
import torch
import triton
import triton.language as tl
import triton.testing

from fusekern.kernels import sampler as S


@triton.jit
def _stream_kernel(x_ptr, out_ptr, V, span, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    start = chunk * span
    for off in range(start, tl.minimum(start + span, V), BLOCK):
        offs = off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * stride_row + offs, mask=offs < V, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * tl.num_programs(1) + chunk, tl.sum(acc, axis=0))


def main():
    V, block = 128256, 2048
    for B in (1, 32, 256):
        logits = torch.randn(B, V, device="cuda", dtype=torch.bfloat16) * 3
        seed = torch.tensor([1], device="cuda")
        C, span = S.row_split(B, V, 132, block)
        cap = S.candidate_capacity(V, 50)
        ints = torch.zeros((3, B), dtype=torch.int32, device="cuda")
        cand = torch.empty((B, cap), dtype=torch.int32, device="cuda")
        out = torch.empty(B, dtype=torch.int64, device="cuda")
        temp = (logits, 0.8, 0)
        topk = (logits, 50, 0)
        n = S.sample_size(V)
        runs = {
            "threshold": lambda: S._threshold_kernel[(B,)](logits, *temp, *topk, ints[0], ints[1], ints[2], V, V, V // n,
                                                            TEMP_PER_ROW=False, K_PER_ROW=False, SAMPLE=n, KEY_BITS=16, num_warps=8),
            "collect": lambda: S._collect_kernel[(B, C)](logits, *temp, ints[0], ints[1], ints[2], cand, V, span, V, cap,
                                                          TEMP_PER_ROW=False, BLOCK_SLOTS=S.block_slots(B), BLOCK=block, num_warps=8),
            "finish": lambda: S._finish_kernel[(B,)](logits, *temp, *topk, seed, cand, ints[1], ints[2], cand, out, V, V,
                                                      cap, TEMP_PER_ROW=False, K_PER_ROW=False, HAS_NOISE=False,
                                                      CAP_BLOCK=cap, KEY_BITS=16, BLOCK=block, num_warps=8),
            "stream": lambda: _stream_kernel[(B, C)](logits, cand, V, span, logits.stride(0), BLOCK=block, num_warps=8),
            "all": lambda: S.sample_top_k_triton(logits, 0.8, 50, seed),
        }
        runs["threshold"]()
        for name, fn in runs.items():
            if name == "collect":  # the count must be reset between timed launches: time it inside "all"
                fn()
                print(f"B={B:4d} C={C:3d} candidates per row {ints[1].float().mean().item():.0f} (capacity {cap})")
                continue
            fn()
            us = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
            print(f"B={B:4d} C={C:3d} {name:9s} {us:8.2f} us", flush=True)


if __name__ == "__main__":
    main()
