"""The demo: a Llama-style decoder with quantized weights generates tokens eagerly, under stock
torch.compile and under torch.compile(backend="fusekern").

    python -m fusekern demo [--device cpu|cuda] [--no-cuda-graphs]

Random weights, nothing downloaded: a tiny model on CPU, Llama-3-8B-shaped layers (a few) on CUDA. The
q/k/v/o/gate/up/down weights are packed (W4A16, groups of 128, by default) and dequantized in plain
PyTorch inside ``forward``, as users write them; the LM head stays bf16. fusekern generates, sampling
with Hugging Face's top-k / top-p chain; eager and stock inductor replay its tokens, so each step's
logits and greedy token can be compared on the same history. Prints the match report, the comparison
and tokens per second; ``main`` returns 0 when fusekern and stock both match eager, 1 otherwise.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusekern.testing.decode_zoo import BY_NAME
from fusekern.testing.sampling_chains import hf_sample


@dataclass(frozen=True)
class Config:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    max_seq: int
    rope_base: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


TINY = Config(dim=256, layers=2, heads=4, kv_heads=2, d_ff=768, vocab=2048, max_seq=64)  # d_ff: a multiple of G
LLAMA3_8B_SHAPED = Config(dim=4096, layers=2, heads=32, kv_heads=8, d_ff=14336, vocab=128256, max_seq=256)

# weights= option -> (decode function in decode_zoo, which of its tensors is the scale to rescale)
WEIGHTS = {"w4a16": ("int4_k_stack", 1), "w8a16": ("int8_channel", 1), "fp8": ("fp8_channel", 1),
           "nvfp4": ("nvfp4", 2)}
TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.9
TOLERANCE = 1e-2  # relative error of the logits against eager, bf16 activations
PROMPT_LEN = 8


class QuantLinear(nn.Module):
    """``x @ W.T`` with W packed; ``forward`` decodes W in plain PyTorch and calls ``F.linear``."""

    def __init__(self, d_in: int, d_out: int, weights: str, device):
        super().__init__()
        case_name, scale_index = WEIGHTS[weights]
        case = BY_NAME[case_name]
        self.decode = case.fn
        packed = list(case.make(d_in, d_out, case.group, device))
        # Random codes give a gain of ~sqrt(d_in); unit gain, as trained layers roughly have, keeps the
        # activations O(1), so attention does not saturate and small rounding differences stay small.
        probe = torch.randn(64, d_in, device=device, dtype=torch.bfloat16)
        gain = case.fn(probe, *packed).float().std().item()
        scale = packed[scale_index]
        packed[scale_index] = (scale.float() / gain).to(scale.dtype)
        # Buffers, not arguments: dynamo sees their shapes as static, which the structural matcher needs.
        for i, t in enumerate(packed):
            self.register_buffer(f"packed{i}", t)
        self.n_packed = len(packed)

    def forward(self, x):
        return self.decode(x, *(getattr(self, f"packed{i}") for i in range(self.n_packed)))


def rotate(x, cos, sin):
    """RoPE, rotate-half form (Hugging Face's Llama); x [B, T, H, D], cos / sin [1, T, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-x2, x1), dim=-1).float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Config, weights: str, batch: int, device):
        super().__init__()
        hd = cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, hd
        self.wq = QuantLinear(cfg.dim, cfg.heads * hd, weights, device)
        self.wk = QuantLinear(cfg.dim, cfg.kv_heads * hd, weights, device)
        self.wv = QuantLinear(cfg.dim, cfg.kv_heads * hd, weights, device)
        self.wo = QuantLinear(cfg.heads * hd, cfg.dim, weights, device)
        # Static KV cache: fixed shapes, so one compiled graph serves every decode position.
        shape = (batch, cfg.kv_heads, cfg.max_seq, hd)
        self.k_cache = nn.Buffer(torch.zeros(shape, dtype=torch.bfloat16, device=device))
        self.v_cache = nn.Buffer(torch.zeros(shape, dtype=torch.bfloat16, device=device))

    def forward(self, x, pos, cos, sin, mask):
        B, T, _ = x.shape
        q = rotate(self.wq(x).view(B, T, self.heads, self.head_dim), cos, sin).transpose(1, 2)
        k = rotate(self.wk(x).view(B, T, self.kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        # Grouped-query heads: each kv head serves heads / kv_heads query heads, read in place
        # (enable_gqa) rather than widened with repeat_interleave, which writes a 4x cache every step
        # (on the H200, stock compiled: 9.8 against 15.3 µs at B = 1, 25 against 167 at B = 64:
        # benchmarks/proto/probe_gqa_attention.py). Positions past the current one hold stale values;
        # the mask gives them weight 0.
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: Config, weights: str, batch: int, device):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=1e-5, device=device, dtype=torch.bfloat16)
        self.attn = Attention(cfg, weights, batch, device)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=1e-5, device=device, dtype=torch.bfloat16)
        self.gate = QuantLinear(cfg.dim, cfg.d_ff, weights, device)
        self.up = QuantLinear(cfg.dim, cfg.d_ff, weights, device)
        self.down = QuantLinear(cfg.d_ff, cfg.dim, weights, device)

    def forward(self, x, pos, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), pos, cos, sin, mask)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    """Llama-style decoder. ``forward(tokens [B, T], pos [T])`` fills the KV cache at ``pos`` and returns
    the last position's logits, float32 [B, vocab]."""

    def __init__(self, cfg: Config, weights: str, batch: int, device):
        super().__init__()
        bf16 = torch.bfloat16
        self.embed = nn.Embedding(cfg.vocab, cfg.dim, device=device, dtype=bf16)
        self.blocks = nn.ModuleList(Block(cfg, weights, batch, device) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5, device=device, dtype=bf16)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False, device=device, dtype=bf16)  # kept bf16
        inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_seq, device=device).float(), inv_freq).repeat(1, 2)
        self.rope_cos, self.rope_sin = nn.Buffer(angles.cos()), nn.Buffer(angles.sin())
        self.causal = nn.Buffer(torch.ones(cfg.max_seq, cfg.max_seq, dtype=torch.bool, device=device).tril())

    def forward(self, tokens, pos):
        x = self.embed(tokens)
        cos, sin = self.rope_cos[pos][None, :, None], self.rope_sin[pos][None, :, None]
        mask = self.causal[pos]  # [T, max_seq]: query at pos sees the cache up to pos
        for block in self.blocks:
            x = block(x, pos, cos, sin, mask)
        return self.lm_head(self.norm(x[:, -1])).float()  # float32 logits, as HF's generate() samples them


def sample(logits):
    """Hugging Face's sampling step: temperature, top-k, top-p, softmax, multinomial."""
    return hf_sample(logits, TEMPERATURE, TOP_K, TOP_P)


@dataclass
class Run:
    fed: torch.Tensor     # [steps, B] the token each decode step took
    logits: torch.Tensor  # [steps, B, vocab] what each step returned
    seconds: float        # wall time of the decode steps (with sampling)

    @property
    def greedy(self) -> torch.Tensor:
        return self.logits.argmax(-1)


def greedy_differences(run: Run, eager: Run) -> tuple[list[int], list[int]]:
    """Steps where ``run``'s greedy token is not eager's, as (near ties, real differences). A near tie:
    eager's logit for ``run``'s token is within TOLERANCE x its largest |logit| of its best one (a bf16
    step or two), so rounding picks either. Random weights' bf16 logits come that close now and then."""
    best = eager.logits.amax(-1)
    for_theirs = eager.logits.gather(-1, run.greedy[..., None]).squeeze(-1)
    near = best - for_theirs <= TOLERANCE * eager.logits.abs().amax(-1)
    differ = run.greedy != eager.greedy
    steps_where = lambda mask: mask.any(-1).nonzero().flatten().tolist()  # noqa: E731
    return steps_where(differ & near), steps_where(differ & ~near)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def generate(model, step, sampler, prompt, steps: int, replay: torch.Tensor | None = None,
             graphs: bool = False) -> Run:
    """Prefill ``prompt`` eagerly, then ``steps`` one-token steps through ``step`` (the position is a
    tensor, so one graph serves them all). Feeds the sampled tokens, or ``replay``'s where given; the
    sampler runs either way, so every path times the same work. ``graphs``: ``step`` and ``sampler`` were
    compiled with ``mode="reduce-overhead"`` (CUDA graphs): each step begins a new graph step, and what it
    keeps is copied out of the graphs' output buffers, which the next replay overwrites."""
    device = prompt.device.type
    T = prompt.shape[1]
    keep = (lambda t: t.clone()) if graphs else (lambda t: t)
    with torch.no_grad():
        token = keep(sampler(model(prompt, torch.arange(T, device=prompt.device))))
        fed, logits = [], []
        _sync(device)
        start = time.perf_counter()
        for i in range(steps):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            if replay is not None:
                token = replay[i]
            fed.append(token)
            logits.append(keep(_decode(step, token, T + i)))
            token = keep(sampler(logits[-1]))
        _sync(device)
        seconds = time.perf_counter() - start
    return Run(torch.stack(fed), torch.stack(logits), seconds)


def _decode(step, token, pos: int):
    """One decode step: token [B] at position ``pos``, given as a tensor so no step recompiles."""
    return step(token[:, None], torch.tensor([pos], device=token.device))


def _warm_up(name: str, step, sampler, prompt, graphs: bool = False) -> None:
    """The first calls compile. They write the cache at the prompt's end, which the real run rewrites.
    The token is a fresh [B] tensor, laid out as the sampler's are (another stride would recompile).
    ``graphs``: three calls, as CUDA graph trees run a function once before they record it."""
    print(f"  compiling the decode step and the sampler: {name} ...", flush=True)
    start = time.perf_counter()
    with torch.no_grad():
        token = torch.zeros(prompt.shape[0], dtype=prompt.dtype, device=prompt.device)
        for _ in range(3 if graphs else 1):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            sampler(_decode(step, token, prompt.shape[1])).clone()
    _sync(prompt.device.type)
    print(f"  compiled {name} in {time.perf_counter() - start:.1f} s", flush=True)


def main(device: str | None = None, weights: str = "w4a16", steps: int | None = None, batch: int = 1,
         cuda_graphs: bool | None = None) -> int:
    """``cuda_graphs``: stock and fusekern also run compiled with ``mode="reduce-overhead"`` (CUDA graphs: a
    decode step at small batch is bound by the host's launches without them), checked and timed the same way.
    None (the default): on with CUDA, off on CPU (where inductor makes no graphs: the runs would only repeat the
    plain ones). On an H100 at B = 1 fusekern went from 715.8 to 1315.8 tokens/s with them, stock from 515.0 to
    567.5 (docs/results-h100.md, session 29)."""
    import fusekern
    from fusekern.testing import rel_err

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"device must be 'cpu' or 'cuda' (with a CUDA device present), got {device!r}")
    cuda_graphs = device == "cuda" if cuda_graphs is None else cuda_graphs
    cfg = LLAMA3_8B_SHAPED if device == "cuda" else TINY
    steps = (64 if device == "cuda" else 12) if steps is None else steps
    if steps < 1 or batch < 1:
        raise ValueError(f"steps and batch must be at least 1, got steps={steps}, batch={batch}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {sorted(WEIGHTS)}, got {weights!r}")
    if PROMPT_LEN + steps > cfg.max_seq:
        raise ValueError(f"prompt ({PROMPT_LEN}) + steps ({steps}) exceed the KV cache ({cfg.max_seq})")
    print(f"fusekern demo on {device}: Llama-style decoder, {cfg.layers} layers, d={cfg.dim}, d_ff={cfg.d_ff}, "
          f"heads {cfg.heads} (kv {cfg.kv_heads}), vocab {cfg.vocab}, {weights} weights "
          f"({WEIGHTS[weights][0]}), bf16 activations and LM head; batch {batch}, prompt {PROMPT_LEN}, "
          f"{steps} decode steps", flush=True)

    torch.manual_seed(0)
    model = Decoder(cfg, weights, batch, device).eval()
    prompt = torch.randint(0, cfg.vocab, (batch, PROMPT_LEN), device=device)
    fusekern.reset_match_report()
    fused_step, fused_sampler = torch.compile(model, backend="fusekern"), torch.compile(sample, backend="fusekern")
    stock_step, stock_sampler = torch.compile(model), torch.compile(sample)

    # fusekern generates; eager and stock replay its tokens, so each step is compared on the same history.
    # Inductor's caches off for fusekern's compile: a cached graph skips the passes, and the report
    # would only say so instead of showing what fused.
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _warm_up("fusekern", fused_step, fused_sampler, prompt)
    report = str(fusekern.match_report())  # (the CUDA-graph compile below matches the same again)
    torch.manual_seed(1)
    runs = {"fusekern": generate(model, fused_step, fused_sampler, prompt, steps)}
    print("  ran fusekern; replaying its tokens eagerly ...", flush=True)
    runs["eager"] = generate(model, model, sample, prompt, steps, replay=runs["fusekern"].fed)
    try:
        _warm_up("stock torch.compile", stock_step, stock_sampler, prompt)
    except Exception as e:  # stock inductor has failed on HF's top-p chain at some batch sizes (README)
        print(f"  stock torch.compile failed ({type(e).__name__}); retrying with the eager sampler", flush=True)
        stock_sampler = sample
        _warm_up("stock torch.compile", stock_step, stock_sampler, prompt)
    runs["stock"] = generate(model, stock_step, stock_sampler, prompt, steps, replay=runs["fusekern"].fed)
    if cuda_graphs:
        # A compile or capture that fails skips that variant with a line saying why (the plain runs above are the
        # demo's check); a variant that runs is compared with eager like the others, and counts.
        ro = "reduce-overhead"
        try:
            with torch._inductor.config.patch(fx_graph_cache=False), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                step = torch.compile(model, backend="fusekern", mode=ro)
                sampler = torch.compile(sample, backend="fusekern", mode=ro)
                _warm_up("fusekern + CUDA graphs", step, sampler, prompt, graphs=True)
            runs["fusekern + CUDA graphs"] = generate(model, step, sampler, prompt, steps,
                                                      replay=runs["fusekern"].fed, graphs=True)
        except Exception as e:  # noqa: BLE001 - see above
            print(f"  fusekern + CUDA graphs skipped ({type(e).__name__}: {str(e)[:200]})", flush=True)
        try:
            step, sampler = torch.compile(model, mode=ro), (torch.compile(sample, mode=ro)
                                                           if stock_sampler is not sample else sample)
            _warm_up("stock torch.compile + CUDA graphs", step, sampler, prompt, graphs=True)
            runs["stock + CUDA graphs"] = generate(model, step, sampler, prompt, steps, replay=runs["fusekern"].fed,
                                                   graphs=True)
        except Exception as e:  # noqa: BLE001 - see above
            print(f"  stock + CUDA graphs skipped ({type(e).__name__}: {str(e)[:200]})", flush=True)

    print(report)
    eager = runs["eager"]
    print(f"sampled tokens (fusekern, row 0; T={TEMPERATURE}, top-k {TOP_K}, top-p {TOP_P}): "
          f"{runs['fusekern'].fed[:, 0].tolist()}")
    print(f"greedy tokens (eager, row 0): {eager.greedy[:, 0].tolist()}")
    ok = True
    for name in (n for n in runs if n != "eager"):
        run = runs[name]
        err = rel_err(run.logits, eager.logits)
        worst = max(rel_err(run.logits[i], eager.logits[i]) for i in range(steps))
        ties, differ = greedy_differences(run, eager)
        verdict = f"DIFFER at steps {differ}" if differ else "identical"
        if ties:
            verdict += f"{'; near' if differ else ' but for near'} ties at steps {ties}"
        print(f"{name:>22} vs eager: logits rel_err {err:.2e} (worst step {worst:.2e}; tolerance {TOLERANCE:g}), "
              f"greedy tokens {verdict}")
        ok &= err < TOLERANCE and not differ
    print(f"fusekern vs stock: logits rel_err {rel_err(runs['fusekern'].logits, runs['stock'].logits):.2e}")
    if device == "cpu":
        print("(on CPU fusekern's ops run their PyTorch reference implementations: correct, not fast)")
    for name in ("eager", "stock", "fusekern", "stock + CUDA graphs", "fusekern + CUDA graphs"):
        if name in runs:
            run = runs[name]
            per_step = run.seconds / steps * 1e3
            print(f"{name:>22}: {steps * batch / run.seconds:8.1f} tokens/s ({per_step:.2f} ms per step)")
    print("equivalent" if ok else "NOT EQUIVALENT")
    return 0 if ok else 1
