"""Checks for the warp-specialized int4 GEMV probe (benchmarks/proto/int4_ws_gemv.py, CuTe DSL).

CPU (CI): every probe config builds for sm_90a (K = 4096) without a GPU, with no local memory, at most 64 registers (so
registers never limit its CTAs per SM), 8 MMAs per group of 128 k and one TMA copy per group slot; bad
configs are refused. GPU (``gpu`` marker): the kernel against the float64 reference over odd N (tail tiles),
K = 2048 to 14336, every config, the output poisoned first.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from fusekern.kernels import cute_scaled_mm as csm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "proto"))
needs_cutlass = pytest.mark.skipif(csm._CUTLASS_ERROR is not None, reason=str(csm._CUTLASS_ERROR))


def _probe():
    import int4_ws_gemv

    return int4_ws_gemv


def _sass(cubin: str) -> str:
    tool = csm._tool("cuobjdump")
    if tool is None:
        pytest.skip("no cuobjdump in triton's package")
    return subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout


@needs_cutlass
@pytest.mark.parametrize("index", range(12))
def test_probe_builds_for_sm90a_without_spills(tmp_path, index):
    ws = _probe()
    assert len(ws.CONFIGS) == 12  # (the parametrization above counts them)
    cfg = ws.CONFIGS[index]
    ws.build(cfg, 4096, options=f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    cubin = next(str(tmp_path / f) for f in os.listdir(tmp_path) if f.endswith(".cubin"))
    ptx = next(str(tmp_path / f) for f in os.listdir(tmp_path) if f.endswith(".ptx"))
    res = csm.read_resources(cubin, ptx)
    print(cfg, res)
    assert res["stack"] == 0 and res["local"] == 0, res
    assert res["registers"] <= 64, res
    sass = _sass(cubin)
    # the consumer loop body is unrolled over a stage's groups, once per k part: 8 MMAs per group
    assert len(re.findall(r"HMMA\.16816\.F32\.BF16", sass)) == 8 * cfg.GROUPS, cfg
    # the producer: one 2-D TMA copy per group slot, one each for the tile's scales and zeros
    assert len(re.findall(r"UTMALDG\.2D", sass)) == cfg.GROUPS + 2, cfg


@needs_cutlass
def test_configs_refuse_what_the_kernel_cannot_take():
    ws = _probe()
    with pytest.raises(AssertionError, match="whole stages"):
        ws.WsConfig(64, 4, 4, 6).check(128 * 6)  # 6 groups: not whole stages of 4
    with pytest.raises(AssertionError, match="16-byte rows"):
        ws.WsConfig(64, 4, 2, 8).check(128 * 24)  # 24 groups: zero rows of 24 bytes, not TMA's 16-byte multiple
    with pytest.raises(AssertionError, match="BLOCK_N"):
        ws.WsConfig(512, 32, 2, 4).check(4096)
    with pytest.raises(AssertionError):
        ws.WsConfig(64, 6, 2, 8).check(4096)  # 6 consumer warps over 4 column tiles
    ws.WsConfig(32, 4, 4, 8).check(14336)  # 112 groups, two k parts: fine


@pytest.mark.gpu
@needs_cutlass
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper GPU (TMA, sm_90a)")
@pytest.mark.parametrize("N,K", [(4096, 4096), (1000, 8192), (8200, 2048), (520, 14336)])
def test_probe_matches_float64(N, K):
    ws = _probe()
    g = torch.Generator(device="cuda").manual_seed(N + K)
    G = K // ws.GROUP
    wp = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda", generator=g)
    s = (torch.rand(N, G, device="cuda", generator=g) * 0.02 + 0.005).to(torch.bfloat16)
    z = torch.randint(0, 16, (N, G), dtype=torch.uint8, device="cuda", generator=g)
    x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda", generator=g) + 0.5  # a mean: sum x matters
    ref = ws.reference(x, wp, s, z)
    for cfg in ws.CONFIGS:
        if K // ws.GROUP % cfg.GROUPS:
            continue
        out = torch.full((1, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        ws.int4_ws_gemv(x, wp, s, z, cfg, out=out)
        torch.cuda.synchronize()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (cfg, err)
        assert torch.isfinite(out).all(), cfg
