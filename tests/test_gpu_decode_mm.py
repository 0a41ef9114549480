"""GPU checks for the structural dequant -> matmul rewrite: every zoo format compiled on CUDA, and the
generated kernel at model sizes on every dispatch path (M = 1, 16, 2048) against its reference."""
import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels.device_info import sm_count
from fusekern.kernels.decode_mm_stock import StockConfig
from fusekern.testing import assert_compiled, rel_err
from fusekern.testing.decode_cones import decode_program
from fusekern.testing.decode_zoo import BY_NAME, CASES

pytestmark = pytest.mark.gpu
EXACT = ["w8a16_linear_scale_bias", "w8a16_linear_scale", "w8a16_dequant_linear_bias", "w8a16_dequant_linear",
         "w8a16_dequant_linear_col_scale", "w8a16_dequant_fp32_linear"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("M", [1, 16, 300])
def test_zoo_compiled_on_cuda(case, M):
    torch.manual_seed(M)
    K, N = 1024, 768 if case.name != "fp8_block" else 1024
    ws = case.make(K, N, case.group, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    if not case.fires:
        assert_compiled(case.fn, (x, *ws), fired={}, options={"fusekern.disable": EXACT})
        return
    assert_compiled(case.fn, (x, *ws), fired={"decode_matmul": 1}, gone=["aten.mm.default"],
                    options={"fusekern.disable": EXACT})


@pytest.mark.parametrize("name", ["gptq", "awq", "int4_k_stack", "int8_group", "fp8_block", "mxfp4", "nvfp4", "hqq"])
def test_generated_kernel_at_model_size(name):
    case = BY_NAME[name]
    torch.manual_seed(0)
    K = N = 8192
    ws = case.make(K, N, case.group, "cuda")
    text, leaves, _ = decode_program(case.fn, torch.randn(2, K, device="cuda", dtype=torch.bfloat16), *ws)
    for M in (1, 16, 2048):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        cfg = dm.tuned_config(x, leaves, text, None, 1, M)  # measured on first use, then cached
        assert cfg in [*dm.candidates(M, N, K, sms=sm_count(x.device)), StockConfig()] and dm.tuned_config(x, leaves, text, None, 1, M) == cfg
        ws_ = None
        if isinstance(cfg, dm.Config):
            ws_ = torch.full((cfg.SPLIT_K, 1, M, N), float("nan"), device="cuda",
                             dtype=torch.float32 if cfg.SPLIT_K > 1 else torch.bfloat16)
        got = dm.decode_mm_triton(x, leaves, text, config=cfg, workspace=ws_)
        want = dm.decode_mm_reference(x, leaves, text)
        assert not got.isnan().any(), (name, M)
        assert rel_err(got, want) < 1e-2, (name, M, rel_err(got, want))
