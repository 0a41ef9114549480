"""Decode attention over a 16-bit KV cache (``fusekern.kernels.decode_attention``) and its rewrite.

The kernel is compared with the float64 reference by relative error (on CPU in the Triton interpreter,
conftest); the rewrite through ``assert_compiled`` (against eager) and by what is left in the graph.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from fusekern.kernels import decode_attention as A
from fusekern.testing import assert_compiled, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: 1e-2, FP16: 2e-3}
FUSED = "fusekern.decode_attention.default"


def make(B=2, Hq=8, Hkv=2, Lq=1, S=100, D=64, dtype=BF16, seed=0, max_seq=None):
    """Fresh random q, k, v; k and v are the first S tokens of a max_seq cache when given (strided)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g).to(DEVICE, dtype)
    cache = max_seq or S
    k = torch.randn(B, Hkv, cache, D, generator=g).to(DEVICE, dtype)[:, :, :S]
    v = torch.randn(B, Hkv, cache, D, generator=g).to(DEVICE, dtype)[:, :, :S]
    return q, k, v


def make_mask(kind, B, Hq, Lq, S, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "causal_rows":  # the demo's: [Lq, S], True up to each query's position
        pos = torch.arange(S - Lq - 5, S - 5)
        return (torch.arange(S)[None, :] <= pos[:, None]).to(DEVICE)
    if kind == "bool_full":  # per (batch, head, query) with whole rows masked out
        m = torch.rand(B, Hq, Lq, S, generator=g) < 0.6
        m[0, 1] = False
        m[-1, :, :, : S // 2] = False  # whole early chunks masked
        return m.to(DEVICE)
    if kind == "bias":
        b = torch.randn(B, 1, Lq, S, generator=g)
        b[..., 3:11] = -math.inf
        return b.to(DEVICE, dtype)
    if kind == "bias_fp32":
        return torch.randn(1, Hq, 1, S, generator=g).to(DEVICE)
    raise ValueError(kind)


def check(q, k, v, mask=None, **kw):
    out = A.decode_attention(q, k, v, mask, **kw)
    ref = A.reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu())
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not out.isnan().any()
    err = rel_err(out.cpu(), ref)
    assert err < TOL[q.dtype], err
    return out


# ----------------------------------------------------------------------------- heuristics


def test_split_heuristic():
    assert A.block_tokens(128, 16) == 32  # an 8 KiB K tile
    assert A.block_tokens(64, 16) == 64 and A.block_tokens(256, 16) == 16
    assert A.kv_splits(1 * 8, 256, 132) == 4  # the demo at B = 1: 32 programs of 64 tokens
    assert A.kv_splits(64 * 8, 256, 132) == 1  # B = 64: 512 programs without splitting
    assert A.kv_splits(8 * 8, 8192, 132) == 8  # one wave of 512 programs
    assert A.kv_splits(1, 1 << 20, 132) == A.MAX_SPLITS


# ----------------------------------------------------------------------------- kernel


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("B,Hq,Hkv,Lq,S,D,splits,mask", [
    (1, 8, 2, 1, 100, 64, None, "causal_rows"),  # GQA 4, the demo's mask, odd S
    (2, 8, 2, 1, 131, 128, 3, "none"),  # a short last split
    (2, 4, 4, 3, 77, 64, 2, "bias"),  # no GQA, several queries, -inf in the bias
    (2, 8, 2, 2, 130, 64, 3, "bool_full"),  # fully masked rows and chunks: zeros, never NaN
    (1, 4, 2, 1, 40, 256, 1, "bias_fp32"),  # D = 256, one split, an fp32 bias per head
    (1, 16, 1, 4, 50, 64, 2, "causal_rows"),  # 64 rows: the most a program holds
])
def test_kernel_matches_reference(dtype, B, Hq, Hkv, Lq, S, D, splits, mask):
    q, k, v = make(B, Hq, Hkv, Lq, S, D, dtype, max_seq=S + 13)  # k / v strided views of a longer cache
    check(q, k, v, make_mask(mask, B, Hq, Lq, S, dtype), num_splits=splits)


@pytest.mark.parametrize("value", [-65536.0, -1e4])
def test_bool_mask_with_a_finite_masked_value(value):
    """What inductor's CUDA lowering makes of a bool mask (where(mask, 0, finite min)): a fully masked row
    averages V over its scores, as that bias does, instead of giving 0."""
    q, k, v = make(B=2, Hq=8, Hkv=2, Lq=1, S=150, D=64)
    m = make_mask("bool_full", 2, 8, 1, 150, BF16)
    out = A.decode_attention(q, k, v, m, masked_value=value, num_splits=3)
    ref = A.reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), m.cpu(), masked_value=value)
    assert rel_err(out.cpu(), ref) < TOL[BF16]
    assert out[0, 1].abs().max() > 0  # the fully masked head


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_bias_of_finfo_min_masks_like_sdpa(dtype):
    """Hugging Face masks with finfo(dtype).min, not -inf: finite after the kernel's log2 scaling too, so a
    row masked everywhere averages V (as SDPA does) and a partly masked row ignores those tokens."""
    q, k, v = make(B=1, Hq=4, Hkv=2, S=64, D=64)
    bias = torch.zeros(1, 4, 1, 64, dtype=dtype)
    bias[:, 1] = torch.finfo(dtype).min  # head 1: every token
    bias[:, 2, :, 10:] = torch.finfo(dtype).min  # head 2: all but ten
    out = check(q, k, v, bias.to(DEVICE), num_splits=2)
    assert out[0, 1].abs().max() > 0


@pytest.mark.parametrize("splits", [1, 3])
def test_nan_in_the_bias_makes_its_row_nan_as_sdpa(splits):
    """A NaN in an additive bias makes that query row NaN in SDPA and in the reference; the kernel's clamp to
    finite floats once turned it into the largest negative float (the token silently masked), and the last
    division gave 0 for a NaN sum."""
    q, k, v = make(B=1, Hq=4, Hkv=2, S=96, D=64)
    bias = torch.randn(1, 4, 1, 96).to(DEVICE, BF16)
    bias[0, 1, 0, 40] = float("nan")  # head 1 only
    out = A.decode_attention(q, k, v, bias, num_splits=splits)
    ref = A.reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bias.cpu())
    assert out[0, 1].isnan().all() and ref[0, 1].isnan().all()
    assert not out[0, [0, 2, 3]].isnan().any()
    assert rel_err(out.cpu(), ref) < TOL[BF16]  # (NaN at the same places, the rest within tolerance)


def test_fully_masked_row_is_zero():
    q, k, v = make(S=70)
    m = make_mask("bool_full", 2, 8, 1, 70, BF16)
    out = check(q, k, v, m, num_splits=3)
    assert out[0, 1].abs().max() == 0


def test_non_contiguous_query():
    q, k, v = make(B=2, Hq=8, Hkv=2, Lq=2, S=64)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Hq, 2, D] laid out [B, 2, Hq, D]
    assert qt.stride() == (2 * 8 * 64, 64, 8 * 64, 1) and not qt.is_contiguous()
    check(qt, k, v, None, num_splits=2)
    qd = q.repeat_interleave(2, dim=-1)[..., ::2]  # head dim stride 2: copied
    check(qd, k, v, None, num_splits=1)


def _bad_inputs(case):
    q, k, v = make(B=2, Hq=8, Hkv=2, S=100, D=64)
    mask = None
    if case == "fp32 q":
        q = q.float()
    elif case == "fp16 cache":
        k, v = k.half(), v.half()
    elif case == "head dim 96":
        q, k, v = make(D=96)
    elif case == "6 heads over 4":
        q, k, v = q[:, :6], make(Hq=4, Hkv=4)[1], make(Hq=4, Hkv=4)[2]
    elif case == "68 rows":
        q, k, v = make(Hq=8, Hkv=2, Lq=17)
    elif case == "mask shape":
        mask = torch.zeros(3, 100, dtype=torch.bool, device=DEVICE)
    elif case == "int mask":
        mask = torch.ones(1, 100, dtype=torch.int32, device=DEVICE)
    return q, k, v, mask


@pytest.mark.parametrize("case, match", [
    ("fp32 q", "one dtype, bf16 or fp16"), ("fp16 cache", "one dtype"), ("head dim 96", "head dim"),
    ("6 heads over 4", "multiple of Hkv"), ("68 rows", "at most 64"), ("mask shape", "broadcast"),
    ("int mask", "bool"),
])
def test_bad_input_is_refused(case, match):
    q, k, v, mask = _bad_inputs(case)
    with pytest.raises(ValueError, match=match):
        A.decode_attention(q, k, v, mask)


# ----------------------------------------------------------------------------- rewrite


def demo_attention(q, k, v, causal, pos):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal[pos], enable_gqa=True)


def repeated_kv(q, k, v):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def with_bias(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)


def causal_prefill(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_demo_form_reads_the_graphs_mask(dtype):
    """The demo's masked GQA attention: the op reads the bias inductor made of the bool mask (-inf on the
    CPU, the dtype's finite minimum on CUDA) as it is, and no library attention op is left."""
    q, k, v = make(B=2, Hq=32, Hkv=8, S=64, D=128, dtype=dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # as the demo's projection leaves it
    causal = torch.ones(64, 64, dtype=torch.bool, device=DEVICE).tril()
    pos = torch.tensor([40], device=DEVICE)
    result = assert_compiled(demo_attention, (q, k, v, causal, pos), fired={"decode_attention": 1})
    assert FUSED in result.targets
    assert not any("attention" in t and t != FUSED for t in result.targets), result.targets


def test_repeat_interleave_gqa_without_mask():
    q, k, v = make(B=2, Hq=8, Hkv=2, S=90, D=64)
    result = assert_compiled(repeated_kv, (q, k, v), fired={"decode_attention": 1},
                             gone=("aten.repeat_interleave.self_int", "aten.expand.default"))
    assert FUSED in result.targets


def test_float_bias_is_read_as_it_is():
    q, k, v = make(B=2, Hq=8, Hkv=2, S=90, D=64)
    bias = make_mask("bias", 2, 8, 1, 90, BF16)
    result = assert_compiled(with_bias, (q, k, v, bias), fired={"decode_attention": 1})
    assert FUSED in result.targets


def test_dynamic_batch_and_length():
    """Batch and cache length symbolic (heads and head dim stay static, as a model's are)."""
    q, k, v = make(B=2, Hq=8, Hkv=2, S=90, D=64)
    q2, k2, v2 = make(B=3, Hq=8, Hkv=2, S=150, D=64, seed=5)
    for t in (q, k, v):
        torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.mark_dynamic(k, 2)
    torch._dynamo.mark_dynamic(v, 2)
    assert_compiled(repeated_kv, (q, k, v), fired={"decode_attention": 1}, extra_args=[(q2, k2, v2)])


def test_fp8_cache_goes_to_fp8_kv_attention_and_its_near_miss_here():
    """An fp8 cache with movable scales is fp8_kv_attention's (it runs first); a per-token V scale cannot
    move, so that rewrite declines and the dequantized bf16 K / V come here, computed as written."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 1, 64, generator=g).to(DEVICE, BF16)
    k8 = torch.randn(2, 2, 80, 64, generator=g).to(torch.float8_e4m3fn).to(DEVICE)
    v8 = torch.randn(2, 2, 80, 64, generator=g).to(torch.float8_e4m3fn).to(DEVICE)
    ks = (torch.rand(2, 2, 80, generator=g) + 0.5).to(DEVICE)
    vs = (torch.rand(2, 1, 1, generator=g) + 0.5).to(DEVICE)

    def head_v_scale(q, k8, ks, v8, vs):
        k = k8.to(q.dtype) * ks[..., None].to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v8.to(q.dtype) * vs.to(q.dtype), enable_gqa=True)

    def token_v_scale(q, k8, ks, v8, vs):
        k = k8.to(q.dtype) * ks[..., None].to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v8.to(q.dtype) * ks[..., None].to(q.dtype), enable_gqa=True)

    assert_compiled(head_v_scale, (q, k8, ks, v8, vs), fired={"fp8_kv_attention": 1})
    assert_compiled(token_v_scale, (q, k8, ks, v8, vs), fired={"decode_attention": 1})


@pytest.mark.parametrize("case", ["prefill_rows", "fp32", "causal"])
def test_near_misses_stay_as_written(case):
    if case == "prefill_rows":  # 4 heads per KV head x 32 queries = 128 rows: prefill
        q, k, v = make(B=1, Hq=8, Hkv=2, Lq=32, S=64, D=64)
        assert_compiled(repeated_kv, (q, k, v), fired={})
    elif case == "fp32":
        q, k, v = (t.float() for t in make(B=1, Hq=8, Hkv=2, S=64, D=64))
        assert_compiled(repeated_kv, (q, k, v), fired={})
    else:
        q, k, v = make(B=1, Hq=8, Hkv=2, Lq=4, S=4, D=64)
        assert_compiled(causal_prefill, (q, k, v), fired={})


# ----------------------------------------------------------------------------- GPU, full size


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,mask", [(1, 256, "causal_rows"), (64, 256, "causal_rows"), (8, 8192, "none"),
                                      (3, 1000, "bool_full")])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_gpu_demo_and_long_context(B, S, mask, splits):
    q, k, v = make(B=B, Hq=32, Hkv=8, S=S, D=128)
    check(q, k, v, make_mask(mask, B, 32, 1, S, BF16), num_splits=splits)


@pytest.mark.gpu
def test_gpu_sdpa_path_returns_the_contiguous_output_the_fake_declares(monkeypatch):
    """Where the op runs PyTorch's SDPA, its output follows q's layout: q transposed from [B, Lq, H, D] (as a
    projection leaves it) with Lq > 1 gave a non-contiguous output where the fake declares a contiguous one."""
    monkeypatch.setattr(A, "_REPLAYS", {})
    monkeypatch.setattr(A, "_choose", lambda *a: False)
    q, k, v = make(B=2, Hq=8, Hkv=2, Lq=3, S=64)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = A.decode_attention_op(qt, k, v, None, 64 ** -0.5, -math.inf)
    assert out.is_contiguous()
    assert rel_err(out.cpu(), A.reference_decode_attention(qt.cpu(), k.cpu(), v.cpu())) < TOL[BF16]


def test_a_growing_cache_is_timed_once_per_power_of_two_of_its_length(monkeypatch):
    """The op's kernel-or-SDPA choice for a KV cache that grows by a token a step (a symbolic S, which the rewrite
    takes): timed on the first length of each power-of-two bucket, not on every step."""
    from fusekern.kernels import decode_mm

    timed = []
    monkeypatch.setattr(decode_mm, "_gpu_time", lambda run, device=None: timed.append(1) or float(len(timed) % 2))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(A, "_choice", {})
    q = torch.randn(1, 2, 1, 64, dtype=BF16)
    for S in range(8, 20):
        k = v = torch.randn(1, 2, S, 64, dtype=BF16)
        A._choose(q, k, v, None, 64 ** -0.5, -math.inf)
    assert len(timed) == 2 * 3 and len(A._choice) == 3  # S = 8; 9-16; 17-19: ours and SDPA's each
    # only the KV length is bucketed: 3 KV heads over 3 tokens and 4 over 3 are timed apart (a dim that equals the
    # KV length stays exact)
    q = torch.randn(1, 12, 1, 64, dtype=BF16)
    for kv_heads in (3, 4):
        k = torch.randn(1, kv_heads, 3, 64, dtype=BF16)
        A._choose(q, k, k, None, 64 ** -0.5, -math.inf)
    assert len(A._choice) == 5


@pytest.mark.gpu
def test_gpu_op_keeps_the_faster_path_and_both_are_right(monkeypatch):
    """The CUDA op times this kernel against PyTorch's SDPA on a shape's first call and keeps the faster;
    either way the result is the attention's."""
    A._choice.clear()
    monkeypatch.setattr(A, "_REPLAYS", {})  # (a replay recorded earlier would skip the choice)
    for B, S in ((1, 256), (1, 8192)):
        q, k, v = make(B=B, Hq=32, Hkv=8, S=S, D=128)
        m = make_mask("causal_rows", B, 32, 1, S, BF16)
        for value in (-math.inf, -65536.0):
            out = A.decode_attention_op(q, k, v, m, 128 ** -0.5, value)
            ref = A.reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), m.cpu(), masked_value=value)
            assert rel_err(out.cpu(), ref) < TOL[BF16]
    assert len(A._choice) == 4 and all(isinstance(c, bool) for c in A._choice.values())
