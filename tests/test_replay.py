"""Replayed launches (``fusekern.kernels.replay``): after a decode op's first call, the same leaves and
activation layout replay its recorded Triton launch without the op's Python path.

CPU: a recorded launch keeps every argument in the kernel's signature order with tensors as addresses
(no weight kept alive) and writes new values into named slots; the ops replay only for the very same
leaves (and bias) and activation shape, strides, dtype and alignment, and record nothing while a CUDA graph
is captured. GPU: every replay (GEMV, grouped GEMV, the int4 tensor-core kernels (WGMMA for K- and N-packed
codes, mma.sync for K-packed);
split K, bias, TMA, fp16)
and the paths that follow a launch with torch work (tensor-core tiles' split-K sums, decode + cuBLAS, the
generated GEMM) give the first call's kernel's output bit for bit on new rows, into fresh (poisoned)
memory.
"""
import dataclasses

import pytest
import torch

from fusekern.kernels import decode_mm as dm
from fusekern.kernels import decode_mm_group as dmg
from fusekern.kernels import fp4_mma_sync as f4s
from fusekern.kernels import int4_mma as im
from fusekern.kernels import int4_mma_n as imn
from fusekern.kernels import int4_mma_sync as ims
from fusekern.kernels import packed_gemv_group as pg
from fusekern.kernels import packed_mm as pm
from fusekern.kernels import replay
from fusekern.testing import rel_err

from test_packed_gemv_group import member

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- CPU: the recording


@dataclasses.dataclass
class _Param:
    name: str
    default: object = None


class _Compiled:
    """Stands for a compiled kernel: records what its launcher is called with."""
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed_metadata, meta, enter, exit_, *args):
        self.calls.append(((g0, g1, g2), stream, list(args)))


class _Jit:
    """Stands for a ``triton.jit`` function: ``params`` and ``[grid](...)``, which runs and returns the
    compiled kernel."""

    def __init__(self, names, defaults=None):
        self.params = [_Param(n, (defaults or {}).get(n)) for n in names]
        self.compiled = _Compiled()
        self.jit_calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled
        return launch


def test_launch_records_the_signature_order_with_tensors_as_addresses(monkeypatch):
    monkeypatch.setattr(replay, "_stream", lambda device: 7)
    from triton.tools.tensor_descriptor import TensorDescriptor

    jit = _Jit(["x_ptr", "w_ptr", "desc", "M", "BLOCK", "FLAG"], defaults={"FLAG": 0})
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [4, 8])
    rec = replay.Launch(jit, (3, 2), (x, w, desc, 4), dict(BLOCK=32, num_warps=4))
    assert len(jit.jit_calls) == 1 and rec.replayable
    assert rec.args[:2] == [x.data_ptr(), w.data_ptr()]  # addresses: the record keeps no tensor alive
    assert rec.args[2].base.data_ptr() == w.data_ptr() and not isinstance(rec.args[2].base, torch.Tensor)
    assert rec.args[2].block_shape == [4, 8] and desc.base is w  # (the caller's descriptor is untouched)
    assert rec.args[3:] == [4, 32, 0]  # M, the keyword constexpr, a default; launch options are not args
    y = torch.randn(4, 8)
    rec.run(rec.slots("x_ptr", "M"), (y, 5))
    grid, stream, args = jit.compiled.calls[-1]
    assert grid == (3, 2, 1) and stream == 7
    assert args[0] is y and args[3] == 5 and args[1] == w.data_ptr()
    assert rec.args[0] == x.data_ptr() and rec.args[3] == 4  # the record itself is unchanged
    with pytest.raises(KeyError):
        rec.slots("nope")


def test_replay_fills_fresh_buffers_then_runs_the_tail(monkeypatch):
    monkeypatch.setattr(replay, "_stream", lambda device: 0)
    jit = _Jit(["x_ptr", "bias_ptr", "out_ptr", "ws_ptr", "M"])
    x, out, ws = torch.randn(2, 8), torch.empty(2, 4), torch.empty(3, 2, 4)
    rec = replay.Launch(jit, (1,), (x, x, out, ws, 2), {})
    seen = []
    rep = replay.Replay(rec, {"x_ptr": replay.X, "bias_ptr": replay.X, "out_ptr": 0, "ws_ptr": 1},
                        [((2, 4), torch.float16), ((3, 2, 4), torch.float32)],
                        lambda x, bufs, bias: seen.append((x, bufs, bias)) or "tail")
    y, b = torch.randn(2, 8), torch.randn(4)
    assert rep(y, b) == "tail"
    (tx, bufs, tb), = seen
    assert tx is y and tb is b
    assert [tuple(t.shape) for t in bufs] == [(2, 4), (3, 2, 4)] and [t.dtype for t in bufs] == [torch.float16, torch.float32]
    _, _, args = jit.compiled.calls[-1]
    assert args[0] is y and args[1] is y and args[2] is bufs[0] and args[3] is bufs[1] and args[4] == 2
    plain = replay.Replay(rec, {"out_ptr": 0}, [((2, 4), torch.float32)])
    got = plain(y)
    assert jit.compiled.calls[-1][2][2] is got and jit.compiled.calls[-1][2][0] == x.data_ptr()  # (x as recorded)


def test_launch_through_the_interpreter_is_not_replayable():
    class Interpreted:  # like triton's InterpretedFunction: no params, and no compiled kernel returned
        def __getitem__(self, grid):
            return lambda *a, **k: None
    assert not replay.Launch(Interpreted(), (1,), (1,), {}).replayable
    jit = _Jit(["a"])
    assert replay.launch(jit, (1,), (1,), {}, record=False) is None and len(jit.jit_calls) == 1


class _At:
    """A stand-in output at a chosen address (what the grouped replay reads of its fresh outputs)."""

    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr

    def element_size(self):
        return 2


def test_grouped_replay_offsets_and_slots(monkeypatch):
    """Fresh outputs' element offsets from the first go to DO1 / DO2 (two members: DO2 repeats DO1), the
    split-K partials or the placeholders to ws / cnt; offsets past 32 bits under a launch recorded with
    32-bit ones give None (the op's own path then compiles the 64-bit variant)."""
    import inspect

    monkeypatch.setattr(replay, "_stream", lambda device: 0)
    names = list(inspect.signature(pg.packed_gemv_group_kernel.fn).parameters)
    args = [0] * len(names)
    for split, Ns in ((2, [64, 32, 32]), (1, [96, 40])):
        jit = _Jit(names)
        rec = replay.Launch(jit, (4, split, 1), tuple(args), {})
        rep = pg.GemvGroupReplay(rec, 1, Ns, torch.bfloat16, split)
        addresses = iter([1 << 20, (1 << 20) + 4096, (1 << 20) - 256, 7 << 40])
        allocated = []

        def empty(*shape, **kw):
            allocated.append(shape)
            return _At(next(addresses))
        monkeypatch.setattr(torch, "empty", empty)
        outs = rep(torch.zeros(1, 8))
        monkeypatch.undo()
        monkeypatch.setattr(replay, "_stream", lambda device: 0)
        _, _, got = jit.compiled.calls[-1]
        at = {n: got[i] for i, n in enumerate(names)}
        assert [o.ptr for o in outs] == [1 << 20, (1 << 20) + 4096, (1 << 20) - 256][:len(Ns)]
        assert at["out_ptr"] is outs[0] and at["DO1"] == 2048
        assert at["DO2"] == (-128 if len(Ns) == 3 else 2048)
        if split > 1:
            assert at["ws_ptr"].ptr == 7 << 40 and at["cnt_ptr"] == 0 and allocated[-1] == (split * sum(Ns),)
        else:
            assert at["ws_ptr"] is outs[0] and at["cnt_ptr"] is outs[0]
    # 32-bit offsets recorded, outputs 2**31 elements apart now: None, nothing launched
    rec = replay.Launch(_Jit(names), (4, 1, 1), tuple(args), {})
    rep = pg.GemvGroupReplay(rec, 1, [64, 32], torch.bfloat16, 1)
    addresses = iter([0, 2 * 2**31])
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _At(next(addresses)))
    n = len(rec.kernel.calls)
    assert rep(torch.zeros(1, 8)) is None and len(rec.kernel.calls) == n
    monkeypatch.undo()
    # recorded with a 64-bit offset: any offset fits
    wide = list(args)
    wide[names.index("DO1")] = 2**33
    rec = replay.Launch(_Jit(names), (4, 1, 1), tuple(wide), {})
    assert not pg.GemvGroupReplay(rec, 1, [64, 32], torch.bfloat16, 1).narrow


class _Rep:
    """A stand-in replay: counts calls and returns a marker."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, bias=None, stream=None):
        self.calls += 1
        self.stream = stream  # the op hands over the stream its key read (0 off CUDA)
        return ("replayed", x.shape)


def _leaves(n=3):
    return [torch.randn(8, 4) for _ in range(n)]


def test_decode_mm_replays_only_the_same_leaves_and_activation_layout(monkeypatch):
    monkeypatch.setattr(dm, "_REPLAYS", dm.LeafCache())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has none)
    reps, normal = [], []

    def fake_triton(x, leaves, program, bias, layout="", record=None):
        normal.append(x.shape)
        rep = _Rep()
        reps.append(rep)
        record(rep)
        return "normal"
    monkeypatch.setattr(dm, "decode_mm_triton", fake_triton)
    monkeypatch.setattr(dm.DecodeProgram, "from_text", staticmethod(lambda t: _FakeProg()))
    leaves, bias = _leaves(), torch.randn(4)
    x = torch.randn(2, 16)
    assert dm._decode_mm_cuda(x, leaves, "p", None, "lay") == "normal"
    assert dm._decode_mm_cuda(torch.randn(2, 16), leaves, "p", None, "lay") == ("replayed", (2, 16))
    assert reps[0].calls == 1 and len(normal) == 1 and reps[0].stream == replay.x_key(x)[-1]
    # anything the launch assumed that differs: the op's own path (and a new record)
    others = [(torch.randn(3, 16), leaves, "p", None, "lay"),  # shape
              (torch.randn(16, 2).t(), leaves, "p", None, "lay"),  # strides
              (torch.randn(2, 16, dtype=torch.float16), leaves, "p", None, "lay"),  # dtype
              (torch.randn(2 * 16 + 1)[1:].view(2, 16), leaves, "p", None, "lay"),  # 4 bytes past alignment
              (x, [t.clone() for t in leaves], "p", None, "lay"),  # other leaf tensors
              (x, leaves, "q", None, "lay"),  # another program
              (x, leaves, "p", None, "other"),  # another layout
              (x, leaves, "p", bias, "lay")]  # a bias
    for args in others:
        n = len(normal)
        assert dm._decode_mm_cuda(*args) == "normal" and len(normal) == n + 1
    assert dm._decode_mm_cuda(x, leaves, "p", bias, "lay") == ("replayed", (2, 16))
    assert dm._decode_mm_cuda(x, leaves, "p", torch.randn(4), "lay") == "normal"  # another bias tensor
    leaves[1].t_()  # the same tensor object, its strides changed in place
    assert dm._decode_mm_cuda(x, leaves, "p", None, "lay") == "normal"
    # nothing is recorded while a CUDA graph is captured
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    given = []
    monkeypatch.setattr(dm, "decode_mm_triton", lambda *a, record=None, **k: given.append(record) or "normal")
    assert dm._decode_mm_cuda(x, _leaves(), "p", None, "lay") == "normal"
    assert given == [None]


def test_leaves_with_other_strides_take_the_reference_path():
    """The CUDA kernel hands leaves whose strides differ from the program's to the reference
    implementation (it was once decorated away to None, and this call raised TypeError)."""
    from fusekern.patterns.decode.layout import derive_layout
    from fusekern.patterns.decode.formats import recognize
    from fusekern.patterns.decode.program import DecodeProgram
    from fusekern.testing.decode_cones import decode_program
    from fusekern.testing.decode_zoo import BY_NAME

    torch.manual_seed(0)
    case = BY_NAME["int4_k_stack"]
    x, ws = torch.randn(2, 256, dtype=torch.bfloat16), case.make(256, 64, 128, "cpu")
    text, leaves, consts = decode_program(case.fn, x, *ws)
    prog = DecodeProgram.from_text(text)
    layout = derive_layout(prog, recognize(prog, consts), consts).to_text()
    strided = [t.t().contiguous().t() if t.dim() == 2 else t for t in leaves]  # same values, other strides
    assert any(tuple(t.stride()) != leaf.stride for t, leaf in zip(strided, prog.leaves))
    got = dm._decode_mm_cuda(x, strided, text, None, layout)
    assert torch.equal(got, dm.decode_mm(x, leaves, text, None, layout))
    assert rel_err(got.float(), case.fn(x, *ws).float()) < 1e-2  # the user's eager graph


class _FakeProg:
    """What ``_decode_mm_cuda`` reads of a program before it calls the kernel path."""

    @property
    def leaves(self):
        return []

    def bind(self, leaves, device):
        return list(leaves)


def test_decode_mm_group_replays_only_the_same_leaves(monkeypatch):
    monkeypatch.setattr(dmg, "_REPLAYS", dmg.LeafCache())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(dmg, "tuned_choice", lambda *a: pm.PackedGemv(32, 128, 1, 4))
    monkeypatch.setattr(dmg, "split_leaves", lambda leaves, programs: [leaves[:2], leaves[2:]])
    monkeypatch.setattr(dm, "_check_args", lambda *a: None)
    monkeypatch.setattr(dmg.DecodeProgram, "from_text", staticmethod(lambda t: dataclasses.make_dataclass(
        "P", [("K", int), ("N", int)], namespace={"bind": lambda self, leaves, device: list(leaves)})(16, 8)))
    monkeypatch.setattr(dmg.PackedLayout, "from_text", staticmethod(lambda t: None))
    reps, grouped = [], []

    def fake_group(x, members, lay, K, Ns, cfg, workspace=None, record=None):
        grouped.append(x.shape)
        rep = _Rep()
        reps.append(rep)
        if record is not None:
            record(rep)
        return ["normal"]
    monkeypatch.setattr(dmg.pg, "gemv_group", fake_group)
    leaves, x = _leaves(4), torch.randn(1, 16)
    assert dmg._decode_mm_group_cuda(x, leaves, ["a", "b"], "lay") == ["normal"]
    assert dmg._decode_mm_group_cuda(torch.randn(1, 16), leaves, ["a", "b"], "lay") == ("replayed", (1, 16))
    assert len(grouped) == 1
    assert dmg._decode_mm_group_cuda(x, leaves[:3] + [leaves[3].clone()], ["a", "b"], "lay") == ["normal"]
    assert dmg._decode_mm_group_cuda(x, leaves, ["a", "c"], "lay") == ["normal"]
    assert dmg._decode_mm_group_cuda(torch.randn(2, 16), leaves, ["a", "b"], "lay") == ["normal"]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fresh = _leaves(4)
    dmg._decode_mm_group_cuda(x, fresh, ["a", "b"], "lay")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    n = len(grouped)
    dmg._decode_mm_group_cuda(x, fresh, ["a", "b"], "lay")
    assert len(grouped) == n + 1  # recorded under capture: nothing to replay


# ----------------------------------------------------------------------------- CPU: every path through the interpreter


class _InterpretedLaunch:
    """``replay.Launch`` for the interpreter (tests only): keeps the arguments as given (the interpreter
    needs tensors, not addresses) in the kernel's signature order, and replays through the interpreter.
    The launch sites' slot names are checked against the real kernel's signature."""

    def __init__(self, jit_fn, grid, args, kwargs):
        import inspect

        jit_fn[grid](*args, **kwargs)
        params = inspect.signature(jit_fn.fn).parameters
        self.args = list(args) + [kwargs[n] if n in kwargs else p.default for n, p in list(params.items())[len(args):]]
        self.index = {n: i for i, n in enumerate(params)}
        self.jit, self.grid, self.replayable = jit_fn, grid, True

    def slots(self, *names):
        return tuple(self.index[n] for n in names)

    def run(self, slots, values, stream=None):  # (the interpreter runs in order: no stream)
        args = self.args.copy()
        for i, v in zip(slots, values):
            # A compiled launcher reads a tensor's address only; the kernel's signature fixes the element
            # type (an fp8 cache replayed into its int32 words' slot): the interpreter needs that view.
            was = args[i]
            if isinstance(was, torch.Tensor) and isinstance(v, torch.Tensor) and v.dtype != was.dtype:
                v = v.view(was.dtype)
            args[i] = v
        self.jit[self.grid](*args)


@pytest.fixture
def interpreted(monkeypatch):
    if DEVICE == "cuda":
        pytest.skip("the GPU tests below replay compiled kernels")
    monkeypatch.setattr(replay, "launch", lambda jit_fn, grid, args, kwargs, record:
                        _InterpretedLaunch(jit_fn, grid, args, kwargs) if record else jit_fn[grid](*args, **kwargs))


CPU_CASES = [("gemv", "int4_k_stack", 256, 72, 1, pm.PackedGemv(32, 128, 2, 4), True, torch.bfloat16),
             ("gemv", "fp8_channel", 256, 64, 2, pm.PackedGemv(32, 128, 1, 4), False, torch.float16),
             ("int4_mma", "gptq", 256, 136, 3, im.Int4Mma(64, 2, 4), True, torch.bfloat16),
             ("int4_mma", "int4_k_stack", 256, 128, 1, im.Int4Mma(64, 1, 4, tma=True, num_stages=2), False,
              torch.bfloat16),
             ("int4_mma", "int4_k_stack", 256, 72, 40, im.Int4Mma(64, 2, 4), True, torch.bfloat16),  # 64 rows
             ("dot", "int4_k_stack", 256, 72, 5, pm.PackedDot(16, 32, 64, 2, 4), True, torch.float16),
             ("dequant", "int4_k_stack", 256, 72, 5, pm.PackedDequant(), True, torch.bfloat16),
             ("generated", "hqq", 256, 72, 5, dm.Config(16, 32, 64, 2, 1, 4, 2), True, torch.float16),
             ("generated_gemv", "fp8_block", 256, 384, 1, dm.Config(1, 64, 64, 1, 1, 4, 2), False, torch.bfloat16),
             ("decode_once", "nvfp4", 256, 72, 5, dm.DequantConfig(), True, torch.bfloat16),
             ("fp4_mma_sync", "nvfp4", 256, 72, 12, f4s.Fp4MmaSync(2), True, torch.bfloat16),  # two row tiles
             ("fp4_mma_sync", "mxfp4", 256, 64, 1, f4s.Fp4MmaSync(1), False, torch.bfloat16)]


@pytest.mark.parametrize("path,fmt,K,N,M,cfg,with_bias,dtype", CPU_CASES, ids=[f"{c[0]}-{c[1]}" for c in CPU_CASES])
def test_every_replay_matches_its_path(interpreted, path, fmt, K, N, M, cfg, with_bias, dtype):
    """Each launch site's replay (slots named as in the real kernel, fresh buffers, the torch tail) gives
    what the path itself computes for new rows."""
    x = torch.randn(M, K, dtype=dtype)
    text, leaves, layout = _program(fmt, K, N, x)
    bias = torch.randn(N, dtype=dtype) if with_bias else None
    rep = _record(dm.decode_mm_triton, x, leaves, text, bias, cfg, layout=layout)
    x2 = torch.randn(M, K, dtype=dtype)
    got = rep(x2, bias)
    want = dm.decode_mm_triton(x2, leaves, text, bias, cfg, layout=layout)
    assert got.shape == (M, N) and got.dtype == dtype and torch.equal(got, want)
    assert rel_err(got.float(), dm.decode_mm_reference(x2, leaves, text, bias).float()) < 1e-2


@pytest.mark.parametrize("Ns,split", [((64, 32, 40), 2), ((96, 40), 1)], ids=["three_split", "two"])
def test_grouped_replay_matches_its_path(interpreted, Ns, split):
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    made = [member("int4_k_stack", 256, n, x, seed) for seed, n in enumerate(Ns)]
    members, lay, cfg = [m[0] for m in made], made[0][1], pm.PackedGemv(32, 128, split, 4)
    rep = _record(pg.gemv_group, x, members, lay, 256, list(Ns), cfg)
    x2 = torch.randn(1, 256, dtype=torch.bfloat16)
    got, want = rep(x2), pg.gemv_group(x2, members, lay, 256, list(Ns), cfg)
    assert all(g.shape == (1, n) and torch.equal(g, w) for g, w, n in zip(got, want, Ns))


def test_ops_record_then_replay(interpreted, monkeypatch):
    """Through the ops' implementations: the first call records, the second replays (the path itself is
    not entered) and gives the path's result."""
    monkeypatch.setattr(dm, "_REPLAYS", dm.LeafCache())
    monkeypatch.setattr(dmg, "_REPLAYS", dmg.LeafCache())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    text, leaves, layout = _program("int4_k_stack", 256, 72, x)
    bias = torch.randn(72, dtype=torch.bfloat16)
    first = dm._decode_mm_cuda(x, leaves, text, bias, layout)
    x2 = torch.randn(1, 256, dtype=torch.bfloat16)
    want = dm.decode_mm_triton(x2, leaves, text, bias, layout=layout)
    calls = []
    real = dm.decode_mm_triton
    monkeypatch.setattr(dm, "decode_mm_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = dm._decode_mm_cuda(x2, leaves, text, bias, layout)
    assert calls == [] and torch.equal(got, want) and not torch.equal(got, first)
    # the grouped op (its tuner measures on CUDA only: a config is given here)
    monkeypatch.setattr(dmg, "tuned_choice", lambda *a: pm.PackedGemv(32, 128, 2, 4))
    texts, members = zip(*[_program("int4_k_stack", 256, n, x, seed)[:2] for seed, n in enumerate((64, 40))])
    flat = [t for m in members for t in m]
    dmg._decode_mm_group_cuda(x, flat, list(texts), layout)
    monkeypatch.setattr(dmg.pg, "gemv_group", lambda *a, **k: pytest.fail("not replayed"))
    got = dmg._decode_mm_group_cuda(x2, flat, list(texts), layout)
    for g, m, t in zip(got, members, texts):
        assert torch.equal(g, real(x2, m, t, None, pm.PackedGemv(32, 128, 2, 4), layout=layout))



def test_op_replays_a_program_that_holds_its_table(interpreted, monkeypatch):
    """MXFP4's E2M1 table travels inside the program (as the rewrite passes it): the op takes the codes and
    scales only, holds one tensor of the table, and its second call replays. (When the graph passed the
    table, inductor made a fresh copy of it per call and every call missed the replay cache.)"""
    from fusekern.patterns.decode.program import DecodeProgram

    monkeypatch.setattr(dm, "_REPLAYS", dm.LeafCache())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    text, leaves, layout = _program("mxfp4", 256, 72, x)
    prog = DecodeProgram.from_text(text)
    tables = {i: t for i, t in enumerate(leaves) if t.numel() <= 16}
    assert len(tables) == 1 and len(leaves) == 3
    held = prog.with_constants(tables).to_text()
    hprog = DecodeProgram.from_text(held)
    inputs = [leaves[i] for i in hprog.inputs]
    assert len(inputs) == 2 and hprog.bind(inputs, x.device)[2] is hprog.bind(inputs, x.device)[2]
    assert torch.equal(hprog.bind(inputs, x.device)[2], leaves[2])
    first = dm._decode_mm_cuda(x, inputs, held, None, layout)
    assert torch.equal(first, dm.decode_mm_triton(x, leaves, text, None, layout=layout))
    x2 = torch.randn(1, 256, dtype=torch.bfloat16)
    want = dm.decode_mm_triton(x2, leaves, text, None, layout=layout)
    monkeypatch.setattr(dm, "decode_mm_triton", lambda *a, **k: pytest.fail("not replayed"))
    got = dm._decode_mm_cuda(x2, inputs, held, None, layout)
    assert torch.equal(got, want) and not torch.equal(got, first)


GROUPED_REPLAY_CASES = [  # (format, rows, config, the grouped launcher's module and name, the single launcher)
    ("int4_k_stack", 3, ims.Int4MmaSync(SPLIT_K=2), (ims, "int4_mma_sync_group"), ims.int4_mma_sync),
    ("int4_k_stack", 17, im.Int4Mma(64, 1, 4), (im, "int4_mma_group"), im.int4_mma),  # x padded to 32
    ("int4_k_stack", 17, im.Int4Mma(64, 2, 4), (im, "int4_mma_group"), im.int4_mma),
    ("fp8_channel", 16, dmg.f8.Fp8Mma(64, 128, 2), (dmg.f8, "fp8_mma_group"), dmg.f8.fp8_mma),
]


@pytest.mark.parametrize("fmt,M,cfg,grouped,single", GROUPED_REPLAY_CASES,
                         ids=["int4_mma_sync", "int4_mma", "int4_mma_split", "fp8_mma_split"])
def test_grouped_op_records_and_replays(interpreted, monkeypatch, fmt, M, cfg, grouped, single):
    """The grouped op with a grouped launch chosen: the first call records it, the second replays it (no
    launcher is entered) and gives each member's own launch's output."""
    monkeypatch.setattr(dmg, "_REPLAYS", dmg.LeafCache())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(dmg, "tuned_choice", lambda *a: cfg)
    x = torch.randn(M, 256, dtype=torch.bfloat16)
    layout = _program(fmt, 256, 64, x)[2]
    texts, members = zip(*[_program(fmt, 256, n, x, seed)[:2] for seed, n in enumerate((64, 40, 24))])
    flat = [t for m in members for t in m]
    first = dmg._decode_mm_group_cuda(x, flat, list(texts), layout)
    monkeypatch.setattr(*grouped, lambda *a, **k: pytest.fail("not replayed"))
    monkeypatch.setattr(dmg.pg, "gemv_group", lambda *a, **k: pytest.fail("not the GEMV"))
    x2 = torch.randn(M, 256, dtype=torch.bfloat16)
    got = dmg._decode_mm_group_cuda(x2, flat, list(texts), layout)
    lay = dmg.PackedLayout.from_text(layout)
    for g, f, m, n in zip(got, first, members, (64, 40, 24)):
        assert g.shape == (M, n) and torch.equal(g, single(x2, m, lay, 256, n, cfg))
        assert not torch.equal(g, f)


def test_grouped_op_runs_members_alone_where_the_tuned_kernel_refuses_the_leaves(interpreted, monkeypatch):
    """A grouped config tuned on another layer, here whose codes are 2 bytes off a 4-byte boundary (int4_mma
    reads them as int32 words and refuses them): the members run through their own ops, no error."""
    monkeypatch.setattr(dmg, "_REPLAYS", dmg.LeafCache())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(dmg, "tuned_choice", lambda *a: im.Int4Mma(64, 2, 4))
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    layout = _program("int4_k_stack", 256, 64, x)[2]
    texts, members = zip(*[_program("int4_k_stack", 256, n, x, seed)[:2] for seed, n in enumerate((64, 32))])
    codes = torch.empty(32 * 128 + 2, dtype=torch.uint8)[2:].view(32, 128)
    codes.copy_(members[1][0])
    members = [members[0], [codes, *members[1][1:]]]
    with pytest.raises(ValueError, match="4-byte aligned"):
        im.int4_mma(x, members[1], dmg.PackedLayout.from_text(layout), 256, 32, im.Int4Mma(64, 2, 4))
    got = dmg._decode_mm_group_cuda(x, [t for m in members for t in m], list(texts), layout)
    for g, m, t in zip(got, members, texts):
        assert torch.equal(g, dm.decode_mm(x, m, t, None, layout))


def test_grouped_op_drops_tma_for_members_not_all_16_byte_aligned(interpreted, monkeypatch):
    """A TMA ``int4_mma`` config tuned on a layer whose words were all 16-byte aligned, on a layer where one
    member's are not: the same tiles load the words directly, still one launch (not the members alone)."""
    monkeypatch.setattr(dmg, "_REPLAYS", dmg.LeafCache())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cfg = im.Int4Mma(64, 2, 4, tma=True, num_stages=3)
    monkeypatch.setattr(dmg, "tuned_choice", lambda *a: cfg)
    monkeypatch.setattr(dmg, "_separate", lambda *a, **k: pytest.fail("members run alone"))
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    layout = _program("int4_k_stack", 256, 64, x)[2]
    texts, members = zip(*[_program("int4_k_stack", 256, n, x, seed)[:2] for seed, n in enumerate((64, 32))])
    codes = torch.empty(32 * 128 + 4, dtype=torch.uint8)[4:].view(32, 128)  # 4 bytes off 16
    codes.copy_(members[1][0])
    members = [members[0], [codes, *members[1][1:]]]
    got = dmg._decode_mm_group_cuda(x, [t for m in members for t in m], list(texts), layout)
    lay = dmg.PackedLayout.from_text(layout)
    plain = im.Int4Mma(64, 2, 4)
    for g, m, n in zip(got, members, (64, 32)):
        assert torch.equal(g, im.int4_mma(x, m, lay, 256, n, plain))


# ----------------------------------------------------------------------------- GPU: replays compute the same


def _poisoned_replay(rep, x, shapes, bias=None):
    """``rep(x)`` after NaN-filled blocks of the output sizes were freed (the allocator hands them out again):
    a replay that leaves any output element unwritten shows NaN."""
    for s in shapes:
        torch.full(s, float("nan"), device=DEVICE, dtype=x.dtype)
        torch.full((64, *s), float("nan"), device=DEVICE, dtype=torch.float32)
    return rep(x) if bias is None else rep(x, bias)


def _record(fn, *args, **kwargs):
    recs = []
    fn(*args, **kwargs, record=recs.append)
    assert len(recs) == 1
    return recs[0]


GEMV_CASES = [("int4_k_stack", 4096, 1024, 1, pm.PackedGemv(64, 256, 4, 4), False, torch.bfloat16),
              ("int4_k_stack", 256, 136, 3, pm.PackedGemv(32, 128, 1, 4), True, torch.bfloat16),
              ("gptq", 4096, 4096, 1, pm.PackedGemv(128, 128, 2, 4, vec_k=True), False, torch.bfloat16),
              ("fp8_channel", 512, 200, 2, pm.PackedGemv(64, 128, 2, 4), True, torch.float16),
              ("mxfp4", 256, 64, 1, pm.PackedGemv(32, 128, 2, 4), False, torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,K,N,M,cfg,with_bias,dtype", GEMV_CASES,
                         ids=[f"{c[0]}-{c[2]}x{c[1]}-M{c[3]}-sk{c[4].SPLIT_K}{'-bias' if c[5] else ''}"
                              for c in GEMV_CASES])
def test_gpu_gemv_replay(fmt, K, N, M, cfg, with_bias, dtype):
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    leaves, lay = member(fmt, K, N, x, 0)
    bias = torch.randn(N, dtype=dtype, device=DEVICE) if with_bias else None
    rep = _record(pm.gemv, x, leaves, lay, K, N, cfg, bias)
    assert isinstance(rep, replay.Replay)
    for _ in range(2):
        x2 = torch.randn(M, K, dtype=dtype, device=DEVICE)
        got = _poisoned_replay(rep, x2, [(M, N)], bias)
        want = pm.gemv(x2, leaves, lay, K, N, cfg, bias)
        assert got.shape == (M, N) and got.dtype == dtype and not got.isnan().any()
        assert torch.equal(got, want)
        assert rel_err(got.float().cpu(), pm.packed_mm_reference(x2, leaves, lay, K, N, bias).float()) < 4e-3


INT4_CASES = [("int4_k_stack", 4096, 4096, 1, im.Int4Mma(128, 4, 4, tma=True, num_stages=3, scale_first=True), False),
              ("gptq", 4096, 14336, 16, im.Int4Mma(128, 8, 4, tma=True, num_stages=4), True),
              ("gptq", 384, 136, 3, im.Int4Mma(64, 1, 4), False),
              ("int4_k_stack", 4096, 1024, 1, im.Int4Mma(64, 8, 4, tma=True, num_stages=3, maxnreg=128), False)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,K,N,M,cfg,with_bias", INT4_CASES,
                         ids=[f"{c[0]}-{c[2]}x{c[1]}-M{c[3]}-sk{c[4].SPLIT_K}{'-tma' if c[4].tma else ''}"
                              f"{'-bias' if c[5] else ''}" for c in INT4_CASES])
def test_gpu_int4_mma_replay(fmt, K, N, M, cfg, with_bias):
    x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
    leaves, lay = member(fmt, K, N, x, 0)
    bias = torch.randn(N, dtype=torch.bfloat16, device=DEVICE) if with_bias else None
    rep = _record(im.int4_mma, x, leaves, lay, K, N, cfg, bias)
    assert isinstance(rep, replay.Replay)
    for _ in range(2):
        x2 = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
        got = _poisoned_replay(rep, x2, [(M, N)], bias)
        want = im.int4_mma(x2, leaves, lay, K, N, cfg, bias)
        assert not got.isnan().any() and torch.equal(got, want)
    # rows that are not contiguous are copied by the kernel's path: nothing to record
    recs = []
    im.int4_mma(torch.randn(M, 2 * K, dtype=torch.bfloat16, device=DEVICE)[:, ::2], leaves, lay, K, N, cfg, bias,
                record=recs.append)
    assert recs == []


REGISTER_DECODED_CASES = [
    ("awq", 4096, 4096, 1, imn.Int4MmaN(SPLIT_K=8, scale_first=True), False),
    ("awq", 4096, 14336, 16, imn.Int4MmaN(SPLIT_K=4, tma=True, num_stages=4, scale_first=True), True),
    ("awq", 384, 264, 3, imn.Int4MmaN(SPLIT_K=1), True),
    ("int4_k_stack", 4096, 4096, 1, ims.Int4MmaSync(SPLIT_K=8), False),
    ("gptq", 4096, 14336, 8, ims.Int4MmaSync(SPLIT_K=4, GROUPS_PER_WARP=2), True),
    ("int4_k_stack", 384, 264, 3, ims.Int4MmaSync(SPLIT_K=1, PREFETCH=2), True),
    ("nvfp4", 4096, 4096, 16, f4s.Fp4MmaSync(SPLIT_K=4), True),
    ("mxfp4", 4096, 14336, 1, f4s.Fp4MmaSync(SPLIT_K=8), False)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,K,N,M,cfg,with_bias", REGISTER_DECODED_CASES,
                         ids=[f"{type(c[4]).__name__}-{c[0]}-{c[2]}x{c[1]}-M{c[3]}-sk{c[4].SPLIT_K}"
                              f"{'-tma' if getattr(c[4], 'tma', False) else ''}{'-bias' if c[5] else ''}"
                              for c in REGISTER_DECODED_CASES])
def test_gpu_int4_mma_n_and_sync_replay(fmt, K, N, M, cfg, with_bias):
    """AWQ (int4 packed along N, WGMMA) and int4 along K on mma.sync: the replay gives the kernel's own
    output on new rows."""
    x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
    leaves, lay = member(fmt, K, N, x, 0)
    assert pm.fits(lay, cfg)
    bias = torch.randn(N, dtype=torch.bfloat16, device=DEVICE) if with_bias else None
    rep = _record(pm.packed_mm, x, leaves, lay, K, N, cfg, bias)
    assert isinstance(rep, replay.Replay)
    for _ in range(2):
        x2 = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
        got = _poisoned_replay(rep, x2, [(M, N)], bias)
        want = pm.packed_mm(x2, leaves, lay, K, N, cfg, bias)
        assert not got.isnan().any() and torch.equal(got, want)
        assert rel_err(got.float().cpu(), pm.packed_mm_reference(x2, leaves, lay, K, N, bias).float().cpu()) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,Ns,M,cfg,dtype", [
    ("int4_k_stack", [4096, 1024, 1024], 1, pm.PackedGemv(64, 256, 4, 4), torch.bfloat16),
    ("int4_k_stack", [14336, 14336], 1, pm.PackedGemv(128, 128, 2, 4), torch.bfloat16),
    ("int8_channel", [96, 40], 2, pm.PackedGemv(32, 128, 1, 4), torch.float16),
    ("int4_k_stack", [4096, 1024, 1024], 1, ims.Int4MmaSync(SPLIT_K=8), torch.bfloat16),
    ("int4_k_stack", [14336, 14336], 3, ims.Int4MmaSync(SPLIT_K=4, GROUPS_PER_WARP=2), torch.bfloat16)],
    ids=["qkv_split", "gate_up_split", "two_no_split_fp16", "sync_qkv_split", "sync_gate_up_two_groups"])
def test_gpu_gemv_group_replay(fmt, Ns, M, cfg, dtype):
    K = 4096 if Ns[0] >= 1024 else 256
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    made = [member(fmt, K, n, x, seed) for seed, n in enumerate(Ns)]
    members, lay = [m[0] for m in made], made[0][1]
    rep = _record(dmg.group_launch, x, members, lay, K, Ns, cfg)  # (the GEMV's, or int4_mma_sync's)
    assert isinstance(rep, pg.GemvGroupReplay)
    for _ in range(2):
        x2 = torch.randn(M, K, dtype=dtype, device=DEVICE)
        got = _poisoned_replay(rep, x2, [(M, n) for n in Ns])
        want = dmg.group_launch(x2, members, lay, K, Ns, cfg)
        assert len(got) == len(Ns)
        for g, w, n in zip(got, want, Ns):
            assert g.shape == (M, n) and not g.isnan().any() and torch.equal(g, w)


def _program(fmt, K, N, x, seed=0):
    """(text, leaves on x's device, layout text) of the zoo's ``fmt`` at N x K."""
    from fusekern.patterns.decode.formats import recognize
    from fusekern.patterns.decode.layout import derive_layout
    from fusekern.patterns.decode.program import DecodeProgram
    from fusekern.testing.decode_cones import decode_program
    from fusekern.testing.decode_zoo import BY_NAME

    torch.manual_seed(seed)
    case = BY_NAME[fmt]
    ws = [w.to(x.dtype) if w.is_floating_point() and w.element_size() > 1 else w for w in case.make(K, N, 128, "cpu")]
    text, leaves, consts = decode_program(case.fn, x.cpu(), *ws)
    prog = DecodeProgram.from_text(text)
    lay = derive_layout(prog, recognize(prog, consts), consts)
    return text, [t.to(x.device) for t in leaves], lay.to_text() if lay is not None else ""


TAIL_CASES = [("int4_k_stack", 512, 200, 16, pm.PackedDot(16, 64, 64, 2, 4), True),
              ("gptq", 512, 256, 16, pm.PackedDot(16, 64, 64, 1, 4), True),
              ("int4_k_stack", 512, 200, 70, pm.PackedDequant(), True),
              ("hqq", 512, 200, 16, dm.Config(16, 64, 64, 2, 1, 4, 2), True),
              ("fp8_block", 256, 384, 3, dm.Config(1, 64, 64, 1, 1, 4, 2), False),
              ("nvfp4", 512, 200, 70, dm.DequantConfig(), True)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,K,N,M,cfg,with_bias", TAIL_CASES,
                         ids=[f"{c[0]}-{type(c[4]).__name__}-M{c[3]}{'-bias' if c[5] else ''}" for c in TAIL_CASES])
def test_gpu_replay_with_a_torch_tail(fmt, K, N, M, cfg, with_bias):
    """Paths whose launch is followed by torch work (a split-K sum, cuBLAS on the decoded weight, the bias):
    the replay runs the same tail on its fresh buffers."""
    x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
    text, leaves, layout = _program(fmt, K, N, x)
    bias = torch.randn(N, dtype=torch.bfloat16, device=DEVICE) if with_bias else None
    rep = _record(dm.decode_mm_triton, x, leaves, text, bias, cfg, layout=layout)
    assert isinstance(rep, replay.Replay)
    for _ in range(2):
        x2 = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
        got = _poisoned_replay(rep, x2, [(M, N), (N, K)], bias)
        want = dm.decode_mm_triton(x2, leaves, text, bias, cfg, layout=layout)
        assert got.shape == (M, N) and not got.isnan().any() and torch.equal(got, want)
        assert rel_err(got.float().cpu(), dm.decode_mm_reference(x2, leaves, text, bias).float().cpu()) < 1e-2


@pytest.mark.gpu
def test_gpu_ops_replay_after_the_first_call(monkeypatch):
    """Through the registered ops: the first call records (the op keeps the record), the second replays
    and returns the chosen kernel's result for the new rows; the grouped op likewise where its tuner chose
    one launch (else each member's own op replays). (Kernels only: the stock fallback records nothing.)"""
    monkeypatch.setenv("FUSEKERN_STOCK_FALLBACK", "0")
    K, Ns = 4096, [1024, 1024]
    x = torch.randn(1, K, dtype=torch.bfloat16, device=DEVICE)
    made = [_program("int4_k_stack", K, n, x, seed) for seed, n in enumerate(Ns)]
    texts, members, layout = [m[0] for m in made], [m[1] for m in made], made[0][2]
    dm.decode_mm(x, members[0], texts[0], None, layout)
    assert dm._REPLAYS.get(dm.replay_key(x, members[0], texts[0], False, layout), members[0]) is not None
    x2 = torch.randn(1, K, dtype=torch.bfloat16, device=DEVICE)
    got = dm.decode_mm(x2, members[0], texts[0], None, layout)
    cfg = dm.tuned_config(x2, members[0], texts[0], None, 1, 1, layout)
    assert torch.equal(got, dm.decode_mm_triton(x2, members[0], texts[0], None, cfg, layout=layout))
    flat = [t for m in members for t in m]
    dmg.decode_mm_group(x, flat, texts, layout)
    choice = dmg.tuned_choice(x, members, texts, layout)  # (cached by the call above)
    recorded = dmg._REPLAYS.get(dmg.replay_key(x, texts, layout), flat)
    outs2 = dmg.decode_mm_group(x2, flat, texts, layout)
    if choice == dmg.SEPARATE:
        assert recorded is None
        want = [dm.decode_mm(x2, m, t, None, layout) for m, t in zip(members, texts)]
    else:
        assert recorded is not None
        lay = dmg.PackedLayout.from_text(layout)
        want = dmg.group_launch(x2, members, lay, K, Ns, choice)  # (a grouped GEMV or int4_mma_sync)
    assert len(outs2) == 2 and all(torch.equal(o, w) for o, w in zip(outs2, want))


def test_grouped_tuner_keeps_members_alone_without_timing_where_no_kernel_groups_them(monkeypatch):
    """32 rows of FP8 weights: the op may group up to 64 rows (int4_mma's limit), but no grouped kernel takes
    these (fp8_mma stops at 16), so the tuner answers SEPARATE at once (no timing of the members on the first
    call) and keeps it."""
    monkeypatch.setattr(dmg, "_tuned", {})
    monkeypatch.setattr(dmg, "_groupable", lambda *a: True)  # (it asks for CUDA rows)
    monkeypatch.setattr(dmg.pg, "group_args", lambda *a: ("fits",))
    monkeypatch.setattr(dmg, "sm_count", lambda d: 132)
    monkeypatch.setattr(dmg.dm, "_gpu_time", lambda *a, **k: pytest.fail("timed"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    texts, members, layouts = zip(*[_program("fp8_channel", 256, n, x, seed) for seed, n in enumerate((64, 32))])
    assert dmg.tuned_choice(x, list(members), list(texts), layouts[0]) == dmg.SEPARATE
    assert list(dmg._tuned.values()) == [dmg.SEPARATE]
