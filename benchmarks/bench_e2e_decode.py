"""End-to-end decode step of the demo's Llama-3-8B-shaped decoder (issue 8's target), on the GPU.

    python benchmarks/bench_e2e_decode.py [--csv benchmarks/results/h200/e2e_decode.csv]
                                          [--weights w4a16] [--batches 1,16,64] [--scopes layers,step]
                                          [--ablate decode_attention]

Two scopes, both one decode step (one new token per row at position 8):
- ``layers``: the decoder layers (attention with the KV cache, SwiGLU MLP; every linear layer quantized);
- ``step``: the whole step, adding the embedding and the bf16 LM head (128256 x 4096, 1 GB: it dominates).
Each is timed compiled with stock ``torch.compile`` (default) and with ``backend="fusekern"``, and eager:
``do_bench`` (median, launch overhead included) and ``do_bench_cudagraph`` (GPU time). The floor is the
bytes of the layers' buffers (weights, scales, norms and the whole 256-slot KV cache, though a step at position 8
reads 9 slots: at B = 64 the cache is 134 of 363 MB) over the GPU's floor bandwidth (bench_common: 4.3 TB/s on an
H200, a measured copy rate elsewhere). A run stops if a fusekern variant fused no quantized linear (it would time
stock's graph) or any variant differs from eager by more than the demo's tolerance.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import RowWriter, floor_bandwidth, versions, warm_up_clocks  # noqa: E402

import fusekern  # noqa: E402,F401  (registers the backend)
from fusekern.demo import LLAMA3_8B_SHAPED, PROMPT_LEN, TOLERANCE, Decoder  # noqa: E402
from fusekern.patterns.decode.program import DecodeProgram  # noqa: E402
from fusekern.patterns.registry import get_pattern  # noqa: E402

BW = floor_bandwidth()  # bytes/s (bench_common: per GPU)


def layers_fn(model):
    def layers(x, pos):
        cos, sin = model.rope_cos[pos][None, :, None], model.rope_sin[pos][None, :, None]
        mask = model.causal[pos]
        for block in model.blocks:
            x = block(x, pos, cos, sin, mask)
        return x
    return layers


def nbytes(module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers()) + \
        sum(p.numel() * p.element_size() for p in module.parameters())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--weights", default="w4a16")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--scopes", default="layers,step")
    ap.add_argument("--autotune", action="store_true", help="also stock torch.compile with mode=\"max-autotune-no-cudagraphs\"")
    ap.add_argument("--ablate", default="", help="also time fusekern with each of these patterns disabled "
                                                 "(comma-separated names; a variant each), e.g. decode_attention")
    args = ap.parse_args()
    info = versions()
    warm_up_clocks()
    out = RowWriter(args.csv)
    cfg = LLAMA3_8B_SHAPED
    for B in (int(b) for b in args.batches.split(",")):
        torch.manual_seed(0)
        model = Decoder(cfg, args.weights, B, "cuda").eval()
        layers = layers_fn(model)
        pos = torch.tensor([PROMPT_LEN], device="cuda")
        x = torch.randn(B, 1, cfg.dim, device="cuda", dtype=torch.bfloat16)
        tokens = torch.randint(0, cfg.vocab, (B, 1), device="cuda")
        layer_bytes = sum(nbytes(b) for b in model.blocks)  # weights, scales, norms, KV caches
        head_bytes = nbytes(model.lm_head) + nbytes(model.norm) + B * cfg.dim * 2
        scopes = {"layers": (layers, (x, pos), layer_bytes), "step": (model, (tokens, pos), layer_bytes + head_bytes)}
        for scope, (fn, fargs, nb) in scopes.items():
            if scope not in args.scopes.split(","):
                continue
            floor = nb / BW * 1e6
            # Each batch and scope compiles afresh: without the reset a later batch's compile would be symbolic in
            # B (dynamo's automatic dynamic after a recompile), and the variants x batches would pass dynamo's
            # recompile limit (8), past which the last variants silently run eager.
            torch._dynamo.reset()
            variants = {"eager": fn, "stock": torch.compile(fn), "fusekern": torch.compile(fn, backend="fusekern")}
            if args.autotune:
                variants["stock_autotune"] = torch.compile(fn, mode="max-autotune-no-cudagraphs")
            for name in filter(None, args.ablate.split(",")):
                variants[f"fusekern_without_{name}"] = torch.compile(
                    fn, backend="fusekern", options={"fusekern.disable": [name]})
            ref = None
            for name, f in variants.items():
                fusekern.reset_match_report()  # (its compile happens in the first call)
                with torch.no_grad():
                    got = f(*fargs)
                    f(*fargs)  # fusekern measures its candidates on the first calls, before any capture
                    ref = got if ref is None else ref
                    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                    us = triton.testing.do_bench(lambda: f(*fargs), return_mode="median") * 1e3
                    us_cg = triton.testing.do_bench_cudagraph(lambda: f(*fargs), return_mode="median") * 1e3
                if name == "fusekern":  # (an ablation may switch off what fuses the linears)
                    fired = fusekern.match_report().fired(cached=True)
                    if not any(get_pattern(p).family == "dequant_matmul" for p in fired):
                        raise RuntimeError(f"{name} fused no quantized linear at B={B} ({scope}): it would time "
                                           f"stock's graph. Fired: {dict(fired)}")
                if err > TOLERANCE and name.startswith("fusekern"):  # (stock's own error is reported, not fatal)
                    raise RuntimeError(f"{name} at B={B} ({scope}) differs from eager: rel_err {err:.1e} > {TOLERANCE}")
                row = dict(weights=args.weights, scope=scope, batch=B, impl=name, us=round(us, 1),
                           us_cudagraph=round(us_cg, 1), floor_us=round(floor, 1),
                           x_floor_cudagraph=round(us_cg / floor, 2), rel_err_vs_eager=f"{err:.1e}",
                           bytes=nb, **info)
                print(f"{scope:6s} B={B:3d} {name:33s} {us:8.1f} us  cudagraph {us_cg:8.1f} us  floor {floor:6.1f} "
                      f"({us_cg / floor:.2f}x)  rel_err {err:.1e}", flush=True)
                out.write(row)
    out.close()
    from fusekern.kernels import decode_mm_group as dmg

    for (programs, _, bucket, _), choice in dmg._tuned.items():  # one launch or the members' own
        Ns = " + ".join(str(DecodeProgram.from_text(t).N) for t in programs)
        print(f"decode_mm_group N = {Ns}, M <= {bucket}: {choice}")


if __name__ == "__main__":
    main()
