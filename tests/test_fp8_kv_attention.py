"""FP8-KV decode attention against its float64 reference.

On CPU the kernel runs in the Triton interpreter (conftest), where its fp8 -> fp16 split is the plain
Triton fallback of ``_fp8_planes`` (the GPU's inline PTX cannot be interpreted): the GPU tests below
are the only check of that PTX. Tolerances are output-rounding level: ||out - ref|| / ||ref|| of a
correctly rounded result is ~1.1e-3 in bf16 and ~1.4e-4 in fp16.
"""
import os
import subprocess
import sys

import pytest
import torch

from fusekern.kernels import fp8_kv_attention as F
from fusekern.testing import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def make_inputs(B, Hq, Hkv, Lq, S, D, dtype, seed=0, v_scale_shape="head", device=DEVICE):
    """Fresh random inputs: q ~ N(0, 1), k / v ~ N(0, 1) cast to fp8, positive random scales."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g).to(device, dtype)
    k8 = torch.randn(B, Hkv, S, D, generator=g).to(torch.float8_e4m3fn).to(device)
    v8 = torch.randn(B, Hkv, S, D, generator=g).to(torch.float8_e4m3fn).to(device)
    k_scale = (torch.rand(B, Hkv, S, generator=g) * 1.5 + 0.25).to(device)
    shape = (Hkv,) if v_scale_shape == "head" else (B, Hkv)
    v_scale = (torch.rand(shape, generator=g) + 0.5).to(device)
    return q, k8, k_scale, v8, v_scale


def check(q, k8, k_scale, v8, v_scale, sm_scale=None, **kw):
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    out = F.fp8_kv_decode_attention(q, k8, k_scale, v8, v_scale, sm_scale, **kw)
    ref = F.reference_fp8_kv_attention(q, k8, k_scale, v8, v_scale, sm_scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not out.isnan().any()
    err = rel_err(out, ref)
    assert err < TOL[q.dtype], err
    return err


# ----------------------------------------------------------------------------- heuristics


def test_split_heuristic():
    assert F.kv_splits(8 * 8, 8192, 132) == 8  # benchmark shape: 512 programs of 1024 tokens, one wave
    assert F.split_chunk(8192, 8, F.block_tokens(128, 16)) == (1024, 8)
    assert F.kv_splits(200, 8192, 132) == 2  # 400 programs: never a partial second wave (528 slots)
    assert F.kv_splits(64 * 8, 8192, 132) == 1  # large batch
    assert F.kv_splits(8, 300, 132) == 1  # short sequence
    assert F.kv_splits(1, 1 << 20, 132) == F.MAX_SPLITS


@pytest.mark.parametrize("S,splits", [(300, 3), (1000, 7), (64, 1), (1, 4)])
def test_split_chunk_has_no_empty_split(S, splits):
    chunk, n = F.split_chunk(S, splits, 64)
    assert chunk % 64 == 0 and (n - 1) * chunk < S <= n * chunk


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,Hq,Hkv,Lq,S,D,splits", [
    (2, 8, 2, 1, 300, 128, 3),  # GQA 4, splits of 128, 128, 44: a short last split, S % BLOCK_S != 0
    (1, 4, 4, 3, 100, 64, None),  # GQA 1 (MHA), Lq 3, one split (heuristic)
    (2, 8, 2, 3, 257, 128, 4),  # GQA 4 x Lq 3 = 12 rows, last split of one token
    (1, 8, 1, 1, 96, 256, 2),  # GQA 8, D 256
])
def test_matches_reference(B, Hq, Hkv, Lq, S, D, splits, dtype):
    check(*make_inputs(B, Hq, Hkv, Lq, S, D, dtype, seed=S + D), num_splits=splits)


@pytest.mark.parametrize("v_scale_shape", ["head", "batch_head"])
def test_v_scale_per_head_or_per_batch_and_head(v_scale_shape):
    check(*make_inputs(2, 4, 2, 1, 80, 64, torch.bfloat16, seed=3, v_scale_shape=v_scale_shape), num_splits=2)


def test_v_scale_with_trailing_ones_and_bf16_k_scale():
    q, k8, ks, v8, vs = make_inputs(2, 4, 2, 1, 70, 64, torch.float16, seed=4)
    check(q, k8, ks.to(torch.bfloat16), v8, vs.reshape(2, 1, 1), num_splits=2)


@pytest.mark.parametrize("round_to", [torch.bfloat16, torch.float16])
def test_scales_rounded_in_the_kernel(round_to):
    """k_scale_round / v_scale_round give what rounding the fp32 scales first gives, and differ from not
    rounding them (scales with more bits than the 16-bit type holds)."""
    q, k8, ks, v8, vs = make_inputs(2, 8, 2, 1, 300, 128, torch.bfloat16, seed=8)
    ks, vs = ks * (1 + 2 ** -12), vs * (1 + 2 ** -12)  # off every 16-bit grid point
    got = F.fp8_kv_decode_attention(q, k8, ks, v8, vs, 0.125, k_scale_round=round_to, v_scale_round=round_to,
                                    num_splits=3)
    ref = F.reference_fp8_kv_attention(q, k8, ks.to(round_to), v8, vs.to(round_to), 0.125)
    assert rel_err(got, ref) < TOL[q.dtype]
    rounded_first = F.fp8_kv_decode_attention(q, k8, ks.to(round_to), v8, vs.to(round_to), 0.125, num_splits=3)
    assert torch.equal(got, rounded_first)
    assert not torch.equal(got, F.fp8_kv_decode_attention(q, k8, ks, v8, vs, 0.125, num_splits=3))
    with pytest.raises(ValueError, match="rounded to bf16 or fp16"):
        F.fp8_kv_decode_attention(q, k8, ks, v8, vs, 0.125, k_scale_round=torch.float32)


def test_strided_views():
    """q, k8, v8 and k_scale as views into larger buffers (heads and tokens interleaved, padding)."""
    B, Hq, Hkv, Lq, S, D = 2, 8, 2, 1, 150, 64
    g = torch.Generator().manual_seed(5)
    q_buf = torch.randn(B, Lq, Hq + 3, D + 32, generator=g).to(DEVICE, torch.bfloat16)
    q = q_buf[:, :, 1:Hq + 1, 16:16 + D].transpose(1, 2)  # [B, Hq, Lq, D], last dim contiguous
    kv_buf = torch.randn(B, S + 5, 2, Hkv, D + 16, generator=g).to(torch.float8_e4m3fn).to(DEVICE)
    k8 = kv_buf[:, 2:S + 2, 0, :, 8:8 + D].transpose(1, 2)  # [B, Hkv, S, D] in a [B, S, 2, Hkv, D'] cache
    v8 = kv_buf[:, 2:S + 2, 1, :, 8:8 + D].transpose(1, 2)
    ks = (torch.rand(B, S, Hkv, generator=g) + 0.5).to(DEVICE).transpose(1, 2)
    vs = (torch.rand(Hkv, generator=g) + 0.5).to(DEVICE)
    assert not (q.is_contiguous() or k8.is_contiguous() or ks.is_contiguous())
    check(q, k8, ks, v8, vs, num_splits=3)


def test_large_and_small_q_rows_stay_exact_in_fp16():
    """bf16 q rows far outside fp16's range (and tiny ones) are scaled into it, not overflowed."""
    q, k8, ks, v8, vs = make_inputs(1, 4, 1, 1, 64, 64, torch.bfloat16, seed=6)
    q = q * torch.tensor([3e5, 1.0, 1e-6, 2e-3]).view(1, 4, 1, 1).to(q)
    check(q, k8, ks, v8, vs, sm_scale=1e-5)


def test_deterministic():
    args = make_inputs(1, 4, 1, 1, 200, 64, torch.bfloat16, seed=7)
    a = F.fp8_kv_decode_attention(*args, 0.125, num_splits=3)
    b = F.fp8_kv_decode_attention(*args, 0.125, num_splits=3)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_value_error():
    q, k8, ks, v8, vs = make_inputs(1, 4, 2, 1, 16, 64, torch.bfloat16)
    cases = {
        "fp32 q": (q.float(), k8, ks, v8, vs),
        "bf16 k": (q, k8.to(torch.bfloat16), ks, v8, vs),
        "k/v shapes": (q, k8, ks, v8[:, :, :8], vs),
        "D = 32": (q[..., :32], k8[..., :32], ks, v8[..., :32], vs),
        "Hq % Hkv": (q[:, :3], k8, ks, v8, vs),
        "too many rows": (q.expand(1, 4, 40, 64), k8, ks, v8, vs),
        "k_scale shape": (q, k8, ks[..., :8], v8, vs),
        "v_scale shape": (q, k8, ks, v8, torch.ones(3, device=DEVICE)),
        "empty cache": (q, k8[:, :, :0], ks[:, :, :0], v8[:, :, :0], vs),
        "strided head dim": (q, torch.cat([k8, k8], -1)[..., ::2], ks, v8, vs),
        "int k_scale": (q, k8, ks.int(), v8, vs),
    }
    for name, args in cases.items():
        with pytest.raises(ValueError):
            F.fp8_kv_decode_attention(*args, 0.125)
            pytest.fail(name)


def test_misaligned_cache_view_raises():
    q, k8, ks, v8, vs = make_inputs(1, 4, 2, 1, 16, 64, torch.bfloat16)
    buf = torch.zeros(1, 2, 16, 66, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="4-byte"):
        F.fp8_kv_decode_attention(q, buf[..., 1:65], ks, v8, vs, 0.125)


# ----------------------------------------------------------------------------- sm_90 build

COMPILE_CHECK = r"""
from fusekern.kernels import fp8_kv_attention as F
for b in F.aot_builds():
    r = b.resources()
    assert not r.spills and r.shared <= 232448, (b.config, r)
    print(b.config, r.registers)
"""


def test_aot_builds_compile_for_sm90_without_spills():
    """Compiled in a subprocess: TRITON_INTERPRET (set here by conftest) must be unset to compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(proc.stdout.strip().splitlines()) == len(F.SHIPPED_SHAPES)


# ----------------------------------------------------------------------------- GPU


def _reference_in_chunks(q, k8, ks, v8, vs, sm_scale):
    """The float64 reference one batch row at a time (the whole benchmark shape is ~4 GB in float64)."""
    vs2 = F.per_head_v_scale(vs, q.shape[0], k8.shape[1], q.device)
    return torch.cat([F.reference_fp8_kv_attention(q[b:b + 1], k8[b:b + 1], ks[b:b + 1], v8[b:b + 1], vs2[b:b + 1],
                                                   sm_scale) for b in range(q.shape[0])])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,Hq,Hkv,Lq,S,D", [
    (8, 32, 8, 1, 8192, 128),  # the benchmark shape
    (8, 32, 8, 1, 8191, 128),  # S % BLOCK_S != 0
    (64, 32, 8, 1, 4096, 128),  # large batch: one split
    (4, 64, 8, 4, 8192, 128),  # GQA 8 x Lq 4
    (2, 64, 8, 8, 3000, 128),  # 64 rows
    (8, 32, 8, 1, 5000, 64),
    (8, 16, 8, 3, 2049, 256),
    (1, 8, 8, 1, 33000, 128),  # MHA, many splits
])
def test_gpu_matches_reference(B, Hq, Hkv, Lq, S, D, dtype):
    q, k8, ks, v8, vs = make_inputs(B, Hq, Hkv, Lq, S, D, dtype, seed=S, device="cuda")
    out = F.fp8_kv_decode_attention(q, k8, ks, v8, vs, D ** -0.5)
    out2 = F.fp8_kv_decode_attention(q, k8, ks, v8, vs, D ** -0.5)  # counters were reset by the first call
    ref = _reference_in_chunks(q, k8, ks, v8, vs, D ** -0.5)
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(out, out2)


@pytest.mark.gpu
def test_gpu_every_fp8_value_converts_exactly():
    """Batch row b attends to token b only (K there is 448 against 0 elsewhere: p = 1 exactly), whose V
    row holds every non-NaN fp8 pattern, rotated per row and column: the output must be those values
    exactly, so the PTX split gets every byte, in every position of a word, right."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()].cuda()  # 254 values
    S = B = codes.numel()
    D = 128
    at = (torch.arange(S, device="cuda")[:, None] + torch.arange(D, device="cuda")[None, :]) % S
    v8 = codes[at].expand(B, 1, S, D).contiguous()  # v[b, 0, s, d] = codes[(s + d) % S]
    k8 = torch.zeros(B, 1, S, D, dtype=torch.float8_e4m3fn, device="cuda")
    k8[torch.arange(B), 0, torch.arange(B), 0] = torch.tensor(448.0).to(torch.float8_e4m3fn).cuda()
    q = torch.zeros(B, 1, 1, D, dtype=torch.float16, device="cuda")
    q[..., 0] = 1.0
    ks = torch.ones(B, 1, S, device="cuda")
    out = F.fp8_kv_decode_attention(q, k8, ks, v8, torch.ones(1, device="cuda"), 1.0, num_splits=2)
    assert torch.equal(out[:, 0, 0].float(), v8[torch.arange(B), 0, torch.arange(B)].float())


def test_v_scale_on_another_device_is_refused_or_one_value_moved():
    with pytest.raises(ValueError, match="v_scale is on meta"):  # (was read as if on q's device: garbage out)
        F.per_head_v_scale(torch.rand(2, device="meta"), 1, 2, torch.device("cpu"))
    one = F.per_head_v_scale(torch.tensor(0.5), 3, 2, torch.device("meta"))  # one value: moved, as eager takes it
    assert one.device.type == "meta" and one.shape == (3, 2)
