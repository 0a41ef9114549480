"""Patterns and kernel configs on GPUs fusekern's kernels do not compile for.

A pattern declines (the original graph stays) on a GPU older than sm_80, and on one older than sm_89 where
the replacement converts FP8 values; the decode dispatcher never times, picks or runs a config whose kernel
needs a newer GPU (TMA and ``mul.rn.bf16x2``: sm_90, FP8 conversions: sm_89). Runs on any machine: the graphs
are traced from fake CUDA tensors and the device's compute capability is set in ``device_info``'s cache.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import device_info
from fusekern.kernels import fp4_mma as f4
from fusekern.kernels import fp4_mma_sync as f4s
from fusekern.kernels import fp8_mma as f8
from fusekern.kernels import int4_mma as im
from fusekern.kernels import int4_mma_n as imn
from fusekern.kernels import int4_mma_sync as ims
from fusekern.kernels import packed_mm as pm
from fusekern.patterns import dequant_matmul, decode_attention, sampling, sampling_greedy
from fusekern.patterns import scale_folding, scale_folding_attention
from fusekern.patterns.decode import rewrite as decode_rewrite
from fusekern.testing.decode_cones import fake_cuda_graph

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
CUDA = "cuda:0"
AMPERE, ADA, HOPPER, TURING = (8, 0), (8, 9), (9, 0), (7, 5)


@pytest.fixture
def gpu(monkeypatch):
    """Makes cuda:0 report a compute capability (compiled kernels, not the interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def set_capability(cap):
        monkeypatch.setitem(device_info._capabilities, 0, cap)
    return set_capability


def test_unsupported_reasons(gpu):
    cuda = torch.device(CUDA)
    assert device_info.unsupported(torch.device("cpu"), fp8=True) is None
    assert "meta" in device_info.unsupported(torch.device("meta"))
    gpu(TURING)
    assert "sm_75" in device_info.unsupported(cuda)
    gpu(AMPERE)
    assert device_info.unsupported(cuda) is None
    assert "sm_89" in device_info.unsupported(cuda, fp8=True)
    gpu(ADA)
    assert device_info.unsupported(cuda, fp8=True) is None


def test_interpreter_and_cpu_have_no_capability(monkeypatch):
    monkeypatch.setitem(device_info._capabilities, 0, TURING)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels run on the CPU: nothing to compile for a GPU
    assert device_info.capability(torch.device(CUDA)) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert device_info.capability(torch.device("cpu")) is None
    assert device_info.capability(torch.device(CUDA)) == TURING


# -- patterns: traced on fake CUDA tensors, rewritten under each capability -------------------------------------


def _fp8_weight_only(x, w8, s):
    return F.linear(x, w8.to(x.dtype) * s)


def _fp8_bitcast(x, w_bytes, s):  # FP8 codes stored as uint8, viewed as fp8 inside the decode
    return F.linear(x, w_bytes.view(torch.float8_e4m3fn).to(x.dtype) * s)


def _int8_group(x, w, s):
    N, K = w.shape
    return F.linear(x, (w.to(x.dtype).view(N, K // 128, 128) * s.view(N, K // 128, 1)).view(N, K))


def _w8a8(x8, w8, sx, sw):
    return (x8.to(BF16) * sx) @ (w8.to(BF16) * sw).t()


def _fp8_kv(q, k8, ks, v8, vs):
    k, v = k8.to(q.dtype) * ks, v8.to(q.dtype) * vs
    return torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, False, False, scale=0.125)[0]


def _sdpa(q, k, v):
    return torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, False, False, scale=0.125)[0]


def _sample(logits):
    return torch.multinomial(F.softmax(logits / 0.8, dim=-1), 1)


def _greedy(logits, banned):
    return torch.argmax((logits / 0.7).masked_fill(banned, -float("inf")), dim=-1)


def _cases():
    """name -> (function, fake CUDA arguments, rewrite, the oldest capability where it fires)."""
    e = torch.empty
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = e(2, 512, device=CUDA, dtype=BF16)
        q, cache = e(1, 8, 1, 64, device=CUDA, dtype=BF16), (1, 8, 256, 64)
        return {
            "fp8 weight-only": (_fp8_weight_only, (x, e(256, 512, device=CUDA, dtype=E4M3), e(256, 1, device=CUDA, dtype=BF16)),
                                decode_rewrite.rewrite_decode_matmuls, ADA),
            "fp8 bitcast from uint8": (_fp8_bitcast, (x, e(256, 512, device=CUDA, dtype=torch.uint8),
                                                      e(256, 1, device=CUDA, dtype=BF16)),
                                       decode_rewrite.rewrite_decode_matmuls, ADA),
            "int8 groups": (_int8_group, (x, e(256, 512, device=CUDA, dtype=torch.int8), e(256, 4, device=CUDA, dtype=BF16)),
                            decode_rewrite.rewrite_decode_matmuls, AMPERE),
            "fp8 w8a8": (_w8a8, (e(16, 128, device=CUDA, dtype=E4M3), e(64, 128, device=CUDA, dtype=E4M3),
                                 e(16, 1, device=CUDA), e(64, 1, device=CUDA)), scale_folding.rewrite_scaled_matmuls, ADA),
            "fp8 kv attention": (_fp8_kv, (q, e(*cache, device=CUDA, dtype=E4M3), e(1, 8, 256, 1, device=CUDA, dtype=BF16),
                                           e(*cache, device=CUDA, dtype=E4M3), e(1, 8, 1, 1, device=CUDA, dtype=BF16)),
                                 scale_folding_attention.rewrite_fp8_kv_attention, ADA),
            "decode attention": (_sdpa, (q, e(*cache, device=CUDA, dtype=BF16), e(*cache, device=CUDA, dtype=BF16)),
                                 decode_attention.rewrite_decode_attention, AMPERE),
            "sampler": (_sample, (e(2, 1000, device=CUDA),), sampling.rewrite_samplers, AMPERE),
            "greedy mask": (_greedy, (e(2, 1000, device=CUDA), e(2, 1000, device=CUDA, dtype=torch.bool)),
                            sampling_greedy.rewrite_greedy, AMPERE),
        }


@pytest.mark.parametrize("name", list(_cases()))
def test_patterns_decline_on_gpus_their_kernels_do_not_compile_for(gpu, name):
    fn, args, rewrite, oldest = _cases()[name]
    for cap in (TURING, AMPERE, ADA, HOPPER):
        gpu(cap)
        fired = rewrite(fake_cuda_graph(fn, args))
        assert fired == (1 if cap >= oldest else 0), f"{name} on sm_{cap[0]}{cap[1]}: fired {fired}"


def test_exact_w8a16_patterns_check_the_gpu(gpu):
    with FakeTensorMode():
        v = dict(x=torch.empty(4, 256, device=CUDA, dtype=BF16), w=torch.empty(64, 256, device=CUDA, dtype=torch.int8),
                 s=torch.empty(64, device=CUDA, dtype=BF16))
    gpu(TURING)
    assert "sm_75" in dequant_matmul.check_scale_after(v)
    gpu(AMPERE)
    assert dequant_matmul.check_scale_after(v) is None


# -- the decode dispatcher's configs -----------------------------------------------------------------------------


def test_min_capability_of_each_config():
    assert dm.min_capability(pm.PackedGemv(64, 128, 1, 4)) == AMPERE
    assert dm.min_capability(pm.PackedDot(16, 64, 128, 1, 4)) == AMPERE
    assert dm.min_capability(im.Int4Mma(128, 1, 4)) == AMPERE
    assert dm.min_capability(im.Int4Mma(128, 1, 4, tma=True)) == HOPPER
    assert dm.min_capability(imn.Int4MmaN(1, tma=True)) == HOPPER
    assert dm.min_capability(ims.Int4MmaSync()) == AMPERE
    assert dm.min_capability(f4.Fp4Mma(128, 1)) == HOPPER  # mul.rn.bf16x2 scales the table's values
    assert dm.min_capability(f4s.Fp4MmaSync(1)) == HOPPER
    assert dm.min_capability(f8.Fp8Mma(64, 128, 1)) == ADA  # cvt.rn.f16x2.e4m3x2
    assert dm.min_capability(dm.DequantConfig()) == AMPERE


def test_fp8_layouts_need_ada():
    """FP8 codes (fp8_channel) and E4M3 scales (NVFP4) need sm_89 in every kernel, the generic tiles included."""
    gemv = pm.PackedGemv(64, 128, 1, 4)
    for name, want in (("fp8_channel", ADA), ("nvfp4", ADA), ("mxfp4", AMPERE), ("gptq", AMPERE)):
        assert dm.min_capability(gemv, pm.REPORT_LAYOUTS[name][0]) == want, name
        assert dm.min_capability(dm.DequantConfig(), pm.REPORT_LAYOUTS[name][0]) == want, name


@pytest.mark.parametrize("name", ["gptq", "int4_k_stack", "mxfp4", "nvfp4", "fp8_channel"])
def test_dispatcher_offers_only_configs_that_compile(gpu, name):
    """What ``tuned_config`` times, and what it picks while a graph is captured, on each GPU."""
    cuda, lay = torch.device(CUDA), pm.REPORT_LAYOUTS[name][0]
    oldest = ADA if "fp8" in (lay.value, lay.scale_enc) else AMPERE  # (where the pattern fires)
    for cap in (AMPERE, ADA, HOPPER):
        gpu(cap)
        for M in (1, 8, 16, 64):
            cands = dm.device_candidates(M, 4096, 4096, 1, lay.to_text(), BF16, cuda)
            if cap < oldest:
                assert cands == [], (cap, M)
                continue
            assert cands and all(dm.min_capability(c, lay) <= cap for c in cands), (cap, M)
            everything = dm.candidates(M, 4096, 4096, 1, 132, lay.to_text(), BF16)
            if cap == HOPPER:
                assert cands == everything  # nothing dropped on the target
            pick = dm.untimed_config(M, 4096, 4096, 1, lay.to_text(), cuda)
            assert dm.min_capability(pick, lay) <= cap, (cap, M, pick)
    gpu(AMPERE)
    assert any(isinstance(c, f4.Fp4Mma) for c in dm.candidates(16, 4096, 4096, 1, 132,
                                                               pm.REPORT_LAYOUTS["mxfp4"][0].to_text(), BF16))
    assert not any(isinstance(c, f4.Fp4Mma) for c in dm.device_candidates(
        16, 4096, 4096, 1, pm.REPORT_LAYOUTS["mxfp4"][0].to_text(), BF16, torch.device(CUDA)))


def test_a_config_for_a_newer_gpu_is_refused_with_the_reason(gpu):
    gpu(AMPERE)
    with pytest.raises(ValueError, match="Fp4Mma needs sm_90 .* is sm_80"):
        dm.check_runs_on(f4.Fp4Mma(128, 1), torch.device(CUDA), pm.REPORT_LAYOUTS["mxfp4"][0])
    dm.check_runs_on(pm.PackedGemv(64, 128, 1, 4), torch.device(CUDA), pm.REPORT_LAYOUTS["mxfp4"][0])


def test_runs_on(gpu):
    cuda, cfgs = torch.device(CUDA), [pm.PackedGemv(64, 128, 1, 4), f8.Fp8Mma(64, 128, 1), f4.Fp4Mma(128, 1)]
    assert all(dm.runs_on(c, torch.device("cpu")) for c in cfgs)
    for cap, want in ((AMPERE, [True, False, False]), (ADA, [True, True, False]), (HOPPER, [True, True, True])):
        gpu(cap)
        assert [dm.runs_on(c, cuda) for c in cfgs] == want


@pytest.mark.parametrize("name", list(pm.REPORT_LAYOUTS))
def test_untimed_choice_runs_on_ampere(name):
    """While a CUDA graph is captured, nothing is timed and ``select_config`` answers: it must compile on
    every GPU the patterns fire on (FP8 formats: the pattern needs sm_89, where Fp8Mma compiles)."""
    lay = pm.REPORT_LAYOUTS[name][0]
    for M in (1, 2, 4, 8, 16, 32, 64, 2048):
        cfg = dm.select_config(M, 4096, 4096, 1, 132, lay.to_text())
        fp8 = "fp8" in (lay.value, lay.scale_enc)
        assert dm.min_capability(cfg, lay) <= (ADA if fp8 else AMPERE), (name, M, cfg)
