"""Bad arguments to the sampling ops called directly get a clear error on every path (CPU op, Triton kernel),
never a token read from outside the tensors (a short mask once made the GPU kernel read past it)."""
import pytest
import torch

from fusekern.kernels import masked_argmax as MA
from fusekern.kernels import sampler as S

NO_K = 2**31 - 1
LOGITS = torch.randn(3, 50)


def _greedy_cpu(logits=LOGITS, t=None, banned=None, mask=None):
    return MA.masked_argmax(logits, t, 1.0, banned, mask)


def _greedy_triton(logits=LOGITS, t=None, banned=None, mask=None):
    return MA.masked_argmax_triton(logits, t, banned, mask)


def _sample(logits=LOGITS, t=None, seed=None, out_dtype=None):
    return S.sample(logits, t, 1.0, None, NO_K, None, 1.0, None, 0.0, seed, out_dtype)


@pytest.mark.parametrize("run", [_greedy_cpu, _greedy_triton], ids=["cpu_op", "triton"])
@pytest.mark.parametrize("kwargs, error", [
    (dict(mask=torch.zeros(3, 49, dtype=torch.bool)), "mask must be bool"),
    (dict(mask=torch.zeros(3, 50, dtype=torch.uint8)), "mask must be bool"),
    (dict(mask=torch.zeros(2, 50, dtype=torch.bool)), "mask must be bool"),
    (dict(t=torch.rand(3) + 0.5), "temperature must be a float tensor"),
    (dict(t=torch.rand(3, 2) + 0.5), "temperature must be a float tensor"),
    (dict(banned=torch.rand(3, 2)), "banned must be int32 / int64 ids"),
    (dict(banned=torch.zeros(2, 4, dtype=torch.int64)), "banned must be int32 / int64 ids"),
    (dict(logits=LOGITS[0]), r"logits must be \[B, V\]"),
    (dict(logits=LOGITS[:, :0]), "empty vocabulary"),
    (dict(logits=LOGITS.double()), "logits must be bf16/fp16/fp32"),
    (dict(mask=torch.zeros(50, dtype=torch.bool, device="meta")), "mask is on meta"),
])
def test_masked_argmax_refuses(run, kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        run(**kwargs)


def test_masked_argmax_takes_what_it_documents():
    x = torch.randn(3, 50)
    t = torch.rand(3, 1) + 0.5
    banned, mask = torch.tensor([1, 2]), torch.rand(50) < 0.2
    assert torch.equal(_greedy_cpu(x, t, banned, mask), MA.masked_argmax_reference(x, t, banned, mask))


@pytest.mark.parametrize("kwargs, error", [
    (dict(logits=LOGITS[0]), r"logits must be \[B, V\]"),
    (dict(seed=torch.tensor([], dtype=torch.int64)), "seed must be one int64 value"),
    (dict(seed=torch.tensor([1.0])), "seed must be one int64 value"),
    (dict(seed=torch.tensor([1, 2])), "seed must be one int64 value"),
    (dict(out_dtype=torch.int8), "out_dtype must be int64 or int32"),
    (dict(logits=LOGITS[:, :0]), "empty vocabulary"),
    (dict(logits=LOGITS.long()), "logits must be bf16/fp16/fp32"),
    (dict(t=torch.rand(2) + 0.5), "temperature must be a number or hold 1 or B=3 values"),
])
def test_sample_op_on_cpu_refuses_what_the_kernel_refuses(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        _sample(**kwargs)


def test_sample_op_on_cpu_takes_an_empty_batch():
    out = _sample(LOGITS[:0], out_dtype=torch.int32)
    assert out.shape == (0,) and out.dtype == torch.int32
