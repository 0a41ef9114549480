"""The attention ops and the greedy sampler replay a call's launch on later calls with the same layouts
(``fusekern/kernels/layout_replay.py``). On CPU the launches run in Triton's interpreter (recorded as
the arguments themselves, ``test_replay._InterpretedLaunch``); on a GPU the compiled launcher is replayed
and compared with the op's own path bit for bit."""
from __future__ import annotations

import math

import pytest
import torch
from test_replay import _InterpretedLaunch

from fusekern.kernels import layout_replay as lr
from fusekern.kernels import decode_attention as A
from fusekern.kernels import fp8_kv_attention as F
from fusekern.kernels import masked_argmax as MA
from fusekern.kernels import replay
from fusekern.kernels import sampler as S

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16


@pytest.fixture
def ops(monkeypatch):
    """Fresh replay tables; on CPU, interpreted launches and no capture; the op always takes the kernel
    (its first-call timing against SDPA needs a GPU)."""
    monkeypatch.setattr(A, "_REPLAYS", {})
    monkeypatch.setattr(F, "_REPLAYS", {})
    monkeypatch.setattr(MA, "_REPLAYS", {})
    monkeypatch.setattr(A, "_choose", lambda *a: True)
    if DEVICE != "cuda":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(replay, "launch", lambda jit_fn, grid, args, kwargs, record:
                            _InterpretedLaunch(jit_fn, grid, args, kwargs) if record else jit_fn[grid](*args, **kwargs))


def _qkv(B, S, seed, Hq=8, Hkv=2, D=64, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE, dtype)
    return q, k, v


def _mask(kind, B, Hq, S, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "bool":
        m = torch.rand(B, 1, 1, S, generator=g) < 0.7
        m[..., 0] = True
        return m.to(DEVICE)
    b = torch.randn(1, Hq, 1, S, generator=g)
    b[..., 5:9] = -math.inf
    return b.to(DEVICE, BF16)


def _counting(monkeypatch, module, name):
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls, real


# (B, S, splits forced through the heuristic's SM count) : one split and several
SHAPES = [(2, 96, 1), (1, 1024, 4)]


@pytest.mark.parametrize("mask_kind", ["none", "bool", "bias"])
@pytest.mark.parametrize("B,S,splits", SHAPES, ids=["one_split", "split"])
def test_decode_attention_replays_the_same_layouts(ops, monkeypatch, mask_kind, B, S, splits):
    monkeypatch.setattr(A, "kv_splits", lambda *a: splits)
    launches, launch = _counting(monkeypatch, A, "_launch")
    q, k, v = _qkv(B, S, 0)
    mask = _mask(mask_kind, B, 8, S, 1)
    A._decode_attention_cuda(q, k, v, mask, 0.125, -math.inf)
    assert len(launches) == 1 and len(A._REPLAYS) == 1
    q2, k2, v2 = _qkv(B, S, 2)  # other tensors, same layouts: replayed
    mask2 = _mask(mask_kind, B, 8, S, 3)
    got = A._decode_attention_cuda(q2, k2, v2, mask2, 0.125, -math.inf)
    assert len(launches) == 1
    assert torch.equal(got, launch(q2, k2, v2, mask2, 0.125, -math.inf))


def test_decode_attention_misses_on_any_other_layout(ops, monkeypatch):
    launches, _ = _counting(monkeypatch, A, "_launch")
    q, k, v = _qkv(2, 96, 0)
    mask = _mask("bool", 2, 8, 96, 1)
    A._decode_attention_cuda(q, k, v, mask, 0.125, -math.inf)
    cache = torch.randn(2, 2, 128, 64).to(DEVICE, BF16)
    offset = torch.randn(2 * 8 * 64 + 4).to(DEVICE, BF16)[4:].view(2, 8, 1, 64)  # 8 bytes past alignment
    others = [(q, cache[:, :, :96], v, mask, 0.125, -math.inf),  # k's strides (a longer cache)
              (q.half(), k.half(), v.half(), mask, 0.125, -math.inf),  # dtype
              (offset, k, v, mask, 0.125, -math.inf),  # q's alignment
              (q, k, v, mask.expand(2, 8, 1, 96), 0.125, -math.inf),  # the mask's strides
              (q, k, v, None, 0.125, -math.inf),  # no mask
              (q, k, v, mask, 0.25, -math.inf),  # another scale
              (q, k, v, mask, 0.125, -65536.0)]  # another masked value
    for args in others:
        n = len(launches)
        A._decode_attention_cuda(*args)
        assert len(launches) == n + 1
        A._decode_attention_cuda(*args)  # (and now recorded for that layout)
        assert len(launches) == n + 1


def test_a_copied_input_is_not_recorded(ops, monkeypatch):
    """q with a strided head dim is copied before the launch: a replay would read the caller's q."""
    launches, launch = _counting(monkeypatch, A, "_launch")
    q, k, v = _qkv(2, 96, 0)
    q = torch.randn(2, 8, 1, 128).to(DEVICE, BF16)[..., ::2]  # head dim stride 2
    assert q.stride(-1) != 1
    for _ in range(2):
        A._decode_attention_cuda(q, k, v, None, 0.125, -math.inf)
    assert len(launches) == 2 and not A._REPLAYS


def test_nothing_is_recorded_during_a_capture(ops, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    q, k, v = _qkv(2, 96, 0)
    A._launch(q, k, v, None, 0.125, -math.inf, record=lr.recorder(A._REPLAYS, "key"))
    assert not A._REPLAYS


def _fp8_inputs(B, S, seed, v_scale_device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 8, 1, 64, generator=g).to(DEVICE, BF16)
    k8 = torch.randn(B, 2, S, 64, generator=g).to(torch.float8_e4m3fn).to(DEVICE)
    v8 = torch.randn(B, 2, S, 64, generator=g).to(torch.float8_e4m3fn).to(DEVICE)
    k_scale = (torch.rand(B, 2, S, generator=g) + 0.5).to(DEVICE)
    v_scale = (torch.rand(2, generator=g) + 0.5).to(v_scale_device)
    return q, k8, k_scale, v8, v_scale


@pytest.mark.parametrize("B,S,splits", SHAPES, ids=["one_split", "split"])
@pytest.mark.parametrize("rounding", [None, BF16])
def test_fp8_kv_attention_replays_the_same_layouts(ops, monkeypatch, B, S, splits, rounding):
    monkeypatch.setattr(F, "kv_splits", lambda *a: splits)
    runs, run = _counting(monkeypatch, F, "_run")
    F._fp8_kv_attention_cuda(*_fp8_inputs(B, S, 0), 0.125, rounding, rounding)
    assert len(runs) == 1 and len(F._REPLAYS) == 1
    second = _fp8_inputs(B, S, 1)
    got = F._fp8_kv_attention_cuda(*second, 0.125, rounding, rounding)
    assert len(runs) == 1
    assert torch.equal(got, run(*second, 0.125, rounding, rounding))
    F._fp8_kv_attention_cuda(*second, 0.125, None if rounding else BF16, rounding)  # another rounding: a miss
    assert len(runs) == 2


def _fp8_at(cache: torch.Tensor, offset: int) -> torch.Tensor:
    """The same fp8 values in a fresh buffer ``offset`` bytes past an aligned address (same shape, strides)."""
    buf = torch.empty(cache.numel() + 16, dtype=torch.uint8, device=cache.device)
    assert buf.data_ptr() % 16 == 0
    out = buf[offset:offset + cache.numel()].view(cache.dtype).view(cache.shape)
    out.copy_(cache)
    return out


def test_fp8_cache_at_another_misaligned_offset_is_not_replayed(ops, monkeypatch):
    """A cache 4 bytes past alignment runs the kernel (whole int32 words) and is recorded; one 2 bytes past it has
    the same shapes, strides and 16-byte misalignment, but its words are not whole: it must take the op's
    unfused path, never the recorded word loads (the key holds the address modulo 16, not only whether it is 0)."""
    runs, _ = _counting(monkeypatch, F, "_run")
    q, k8, k_scale, v8, v_scale = _fp8_inputs(2, 96, 0)
    four = (q, _fp8_at(k8, 4), k_scale, _fp8_at(v8, 4), v_scale)
    F._fp8_kv_attention_cuda(*four, 0.125)
    assert len(runs) == 1 and len(F._REPLAYS) == 1
    two = (q, _fp8_at(k8, 2), k_scale, _fp8_at(v8, 2), v_scale)
    got = F._fp8_kv_attention_cuda(*two, 0.125)
    assert len(runs) == 2  # not the replay: the op ran, could not view the cache as words, and fell back
    assert torch.equal(got, F.attention_math(*two, 0.125, None, None))


def test_fp8_scale_moved_to_the_gpu_is_not_recorded(ops, monkeypatch):
    if DEVICE != "cuda":
        pytest.skip("a CPU scale is moved only to a GPU")
    runs, _ = _counting(monkeypatch, F, "_run")
    q, k8, k_scale, v8, _ = _fp8_inputs(2, 96, 0)
    for _ in range(2):
        F._fp8_kv_attention_cuda(q, k8, k_scale, v8, torch.tensor(0.7), 0.125)
    assert len(runs) == 2 and not F._REPLAYS


def _greedy_inputs(B, V, seed, temperature, banned, mask):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g).to(DEVICE, BF16)
    t = (torch.rand(B, 1, generator=g) + 0.5).to(DEVICE) if temperature == "rows" else None
    ids = torch.randint(0, V, (B, 3), generator=g).to(DEVICE) if banned else None
    m = (torch.rand(V, generator=g) < 0.1).to(DEVICE) if mask else None
    return logits, t, ids, m


# (B, V, split): one program per row and several (their partials in the workspaces)
@pytest.mark.parametrize("B,V,split", [(3, 1000, 1), (2, 5000, 3)], ids=["one_program", "split"])
@pytest.mark.parametrize("temperature,banned,mask", [(None, False, False), ("rows", True, False),
                                                     ("scalar", False, True)], ids=["plain", "t_banned", "scalar_mask"])
def test_masked_argmax_replays_the_same_layouts(ops, monkeypatch, B, V, split, temperature, banned, mask):
    monkeypatch.setattr(MA, "split_for", lambda *a: split)
    runs, run = _counting(monkeypatch, MA, "masked_argmax_triton")
    scalar = 0.7 if temperature == "scalar" else 1.0
    logits, t, ids, m = _greedy_inputs(B, V, 0, temperature, banned, mask)
    MA._masked_argmax_cuda(logits, t, scalar, ids, m)
    assert len(runs) == 1 and len(MA._REPLAYS) == 1
    logits, t, ids, m = _greedy_inputs(B, V, 1, temperature, banned, mask)
    got = MA._masked_argmax_cuda(logits, t, scalar, ids, m)
    assert len(runs) == 1
    assert torch.equal(got, run(logits, MA._temperature(t, scalar), ids, m))
    MA._masked_argmax_cuda(logits, t, 0.5, ids, m)  # another scalar temperature: a miss
    assert len(runs) == 2


def test_masked_argmax_with_a_cpu_temperature_is_not_recorded(ops, monkeypatch):
    """A one-value CPU temperature is read into a kernel argument: a replay would keep the first value."""
    runs, _ = _counting(monkeypatch, MA, "masked_argmax_triton")
    logits = _greedy_inputs(2, 1000, 0, None, False, False)[0]
    for _ in range(2):
        MA._masked_argmax_cuda(logits, torch.tensor([0.7]), 1.0, None, None)
    if DEVICE == "cuda":
        assert len(runs) == 2 and not MA._REPLAYS
    else:  # (on CPU the temperature is on the logits' device: an input like any other)
        assert len(runs) == 1 and len(MA._REPLAYS) == 1


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("B,S", [(1, 256), (8, 8192)])
def test_gpu_replays_are_the_paths_bits(ops, B, S):
    """The demo's shape and a long split context: each replay's output is the JIT path's, bit for bit,
    into an output the replay allocates (a NaN-filled pool first, so a slot left unwritten shows)."""
    q, k, v = _qkv(B, S, 0, Hq=32, Hkv=8, D=128)
    pos = torch.arange(S, device=DEVICE)[None, :] <= S - 7
    A._decode_attention_cuda(q, k, v, pos, 128 ** -0.5, -math.inf)
    rep, = A._REPLAYS.values()
    for seed in (1, 2):
        q2, k2, v2 = _qkv(B, S, seed, Hq=32, Hkv=8, D=128)
        torch.full((4 * q2.numel(),), float("nan"), device=DEVICE)  # (freed: the pool now holds NaN)
        got = A._decode_attention_cuda(q2, k2, v2, pos, 128 ** -0.5, -math.inf)
        assert len(A._REPLAYS) == 1 and A._REPLAYS[next(iter(A._REPLAYS))] is rep
        assert torch.equal(got, A._launch(q2, k2, v2, pos, 128 ** -0.5, -math.inf))
    inputs = _fp8_inputs(B, S, 0)
    F._fp8_kv_attention_cuda(*inputs, 0.125)
    for seed in (1, 2):
        second = _fp8_inputs(B, S, seed)
        got = F._fp8_kv_attention_cuda(*second, 0.125)
        assert len(F._REPLAYS) == 1 and torch.equal(got, F._run(*second, 0.125, None, None))
    logits, t, ids, m = _greedy_inputs(B, 128256, 0, "rows", True, True)
    MA._masked_argmax_cuda(logits, t, 1.0, ids, m)
    for seed in (1, 2):
        logits, t, ids, m = _greedy_inputs(B, 128256, seed, "rows", True, True)
        got = MA._masked_argmax_cuda(logits, t, 1.0, ids, m)
        assert len(MA._REPLAYS) == 1 and torch.equal(got, MA.masked_argmax_triton(logits, t, ids, m))


def _sample_inputs(B, V, seed, rows: bool, given_seed: bool):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, V, generator=g)).to(DEVICE, BF16)
    t = (torch.rand(B, 1, generator=g) + 0.5).to(DEVICE) if rows else None
    k = torch.randint(5, 60, (B,), generator=g).to(DEVICE) if rows else None
    s = torch.randint(0, 2**40, (1,), generator=g).to(DEVICE) if given_seed else None
    return logits, t, k, s


# (temperature, top_k, top_p, min_p): scalars as the rewrite passes them where no tensor is given
SAMPLE_SCALARS = {"top_k_top_p": (0.8, 50, 0.9, 0.0), "temperature_only": (0.7, 2**31 - 1, 1.0, 0.0),
                  "min_p": (1.0, 2**31 - 1, 1.0, 0.05)}


@pytest.mark.parametrize("filters", list(SAMPLE_SCALARS))
@pytest.mark.parametrize("rows,given_seed", [(False, False), (True, True)], ids=["scalars_drawn_seed", "rows_seed"])
def test_sample_replays_the_same_layouts(ops, monkeypatch, filters, rows, given_seed):
    """The seed's draw (from torch's generator, as the op's path draws it) and both launches replay: the
    same tokens as the op's path for other logits, parameters and seeds of the same layouts."""
    monkeypatch.setattr(S, "_REPLAYS", {})
    runs, run = _counting(monkeypatch, S, "sample_triton")
    T, k, p, m = SAMPLE_SCALARS[filters]
    B, V = 3, 1500

    def op(logits, t, top_k, seed, **kw):
        return S._sample_cuda(logits, t, T, top_k, k, None, p, None, m, seed, **kw)

    op(*_sample_inputs(B, V, 0, rows, given_seed))
    assert len(runs) == 1 and len(S._REPLAYS) == 1
    for draw in (1, 2):
        inputs = _sample_inputs(B, V, draw, rows, given_seed)
        torch.manual_seed(draw)
        got = op(*inputs)
        assert len(runs) == 1
        torch.manual_seed(draw)
        logits, t, top_k, seed = inputs
        want = run(logits, **S._unpack(logits, t, T, top_k, k, None, p, None, m, False), seed=seed)
        assert torch.equal(got, want)
    op(*_sample_inputs(B, V, 3, rows, given_seed), out_dtype=torch.int32)  # another output dtype: a miss
    assert len(runs) == 2


def test_sample_with_a_cpu_parameter_is_not_recorded(ops, monkeypatch):
    """A one-value CPU top-p is read into a kernel argument: a replay would keep the first value."""
    if DEVICE != "cuda":
        pytest.skip("a CPU parameter is read into an argument only beside GPU logits")
    monkeypatch.setattr(S, "_REPLAYS", {})
    runs, _ = _counting(monkeypatch, S, "sample_triton")
    logits = _sample_inputs(2, 1500, 0, False, False)[0]
    for _ in range(2):
        S._sample_cuda(logits, None, 1.0, None, 50, torch.tensor([0.9]), 1.0, None, 0.0, None)
    assert len(runs) == 2 and not S._REPLAYS


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("B", [1, 8, 256])  # 256: step 2 is a programmatic dependent launch (Hopper)
def test_gpu_sample_replays_are_the_paths_tokens(ops, monkeypatch, B):
    """The demo's vocabulary: a replay (seed drawn from torch's generator, two launches, PDL at B = 256)
    draws the op's path's tokens under the same generator state, into outputs and workspaces the replay
    allocates (a pool filled with -1 bytes first, so a slot left unwritten shows)."""
    monkeypatch.setattr(S, "_REPLAYS", {})
    S._sample_cuda(_sample_inputs(B, 128256, 0, False, False)[0], None, 0.8, None, 50, None, 0.9, None, 0.0, None)
    rep, = S._REPLAYS.values()
    for draw in (1, 2):
        logits = _sample_inputs(B, 128256, draw, False, False)[0]
        torch.full((64 * B * 1024,), -1, dtype=torch.int64, device=DEVICE)  # (freed: the pool holds -1)
        torch.manual_seed(draw)
        got = S._sample_cuda(logits, None, 0.8, None, 50, None, 0.9, None, 0.0, None)
        assert len(S._REPLAYS) == 1 and next(iter(S._REPLAYS.values())) is rep
        torch.manual_seed(draw)
        assert torch.equal(got, S.sample_triton(logits, 0.8, 50, 0.9, seed=None))


class _AddressLaunch:
    """A compiled launch's stand-in: takes pointers as addresses and keeps what each run got."""

    takes_addresses = True

    def __init__(self, names):
        self.index, self.runs = {n: i for i, n in enumerate(names)}, []

    def slots(self, *names):
        return tuple(self.index[n] for n in names)

    def run(self, slots, values, stream=None):
        self.runs.append(dict(zip(slots, values)))


def test_workspaces_share_one_allocation_at_aligned_offsets():
    """The output is its own tensor (the caller keeps it); the workspaces, odd sizes included, come from one
    arena at 256-byte offsets (16-byte aligned addresses, as the JIT assumed) without overlapping, as addresses for a compiled launch, and the same bytes as
    tensor views for ``prepare`` and for launches that need tensors."""
    buffers = [((3,), torch.int64), ((5, 7), torch.int32), ((1,), torch.int8), ((4, 33), torch.float32),
               ((1,), torch.int64)]
    names = ["x_ptr", "out_ptr", "a_ptr", "b_ptr", "c_ptr", "seed_ptr"]
    sources = {"x_ptr": 0, "out_ptr": lr.OUT, "a_ptr": lr.New(1), "b_ptr": lr.New(2), "c_ptr": lr.New(3),
               "seed_ptr": lr.New(4)}
    seen = []
    launch = _AddressLaunch(names)
    rep = lr.LayoutReplay([(launch, sources)], buffers, prepare=lambda view: seen.append(view(4).fill_(7)))
    x = torch.randn(3)
    out = rep((x,))
    assert out.shape == (3,) and out.dtype == torch.int64
    got = launch.runs[-1]
    assert got[0] is x and got[1] is out
    addresses = [got[i] for i in (2, 3, 4, 5)]
    assert all(isinstance(a, int) and a % 16 == 0 and (a - addresses[0]) % 256 == 0 for a in addresses)
    sizes = [5 * 7 * 4, 1, 4 * 33 * 4, 8]
    spans = sorted(zip(addresses, sizes))
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # disjoint
    seed, = seen
    assert seed.data_ptr() == got[5] and seed.dtype == torch.int64 and seed.shape == (1,) and seed.item() == 7

    class _TensorLaunch(_AddressLaunch):
        takes_addresses = False

    tensor_launch = _TensorLaunch(names)
    lr.LayoutReplay([(tensor_launch, sources)], buffers)((x,))
    views = tensor_launch.runs[-1]
    for i, (shape, dtype) in zip((2, 3, 4, 5), buffers[1:]):
        assert views[i].shape == shape and views[i].dtype == dtype and views[i].data_ptr() % 16 == 0
