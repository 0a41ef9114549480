"""Greedy decoding with a token mask (issue 5, pattern 4): argmax of logits / T with -inf written onto
banned tokens -> ``fusekern::masked_argmax``. Tokens must equal eager's exactly (no randomness here).

CPU: every mask form (scatter, ``x[:, ids] = -inf``, masked_fill with a [B, V] or [V] mask) with every
temperature form, compiled through ``backend="fusekern"``; the Triton kernel in the interpreter against
the reference on ties, NaN, all -inf rows, negative and repeated ids, odd V and strided rows; near misses
that must stay as written.
"""
import pytest
import torch

from fusekern.kernels import masked_argmax as ma
from fusekern.testing import assert_compiled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAME = "greedy_mask"


def scatter_banned(logits, ids, T):
    return (logits / T).scatter(-1, ids, float("-inf")).argmax(dim=-1)


def scatter_banned_no_temperature(logits, ids):
    return logits.clone().scatter_(-1, ids, float("-inf")).argmax(-1, keepdim=True)


def index_banned(logits, vocab_ids, T):
    x = logits / T
    x[:, vocab_ids] = float("-inf")
    return torch.argmax(x, dim=-1)


def masked_fill(logits, mask, T):
    return (logits / T).masked_fill(mask, float("-inf")).argmax(-1)


def logits_of(B, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=g) * 3).to(dtype)
    x[0, 5] = x[0].max()                       # a tie with an earlier or later max
    if B > 2:
        x[2, :] = float("-inf")                  # nothing finite: token 0
    return x.to(DEVICE)


def temperatures(B, dtype):
    return [0.7, torch.tensor(0.55, dtype=dtype, device=DEVICE),
            (torch.rand(B, 1) + 0.5).to(dtype).to(DEVICE)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("form", ["scatter", "index", "mask_2d", "mask_1d", "scatter_no_t"])
def test_forms_fire_and_match_eager_exactly(form, dtype):
    B, V = 4, 1000
    logits = logits_of(B, V, dtype)
    ids = torch.randint(0, V, (B, 6), device=DEVICE)
    ids[1, 0] = ids[1, 1]  # a repeated id
    mask = torch.rand(B, V, device=DEVICE) < 0.3
    for T in temperatures(B, dtype) if form != "scatter_no_t" else [None]:
        fn, args = {
            "scatter": (scatter_banned, (logits, ids, T)),
            "index": (index_banned, (logits, ids[0], T)),
            "mask_2d": (masked_fill, (logits, mask, T)),
            "mask_1d": (masked_fill, (logits, mask[0], T)),
            "scatter_no_t": (scatter_banned_no_temperature, (logits, ids)),
        }[form]
        assert_compiled(fn, args, fired={NAME: 1}, gone=["aten.argmax.default"], tol=0.0)


def test_temperature_tensor_does_not_recompile():
    B, V = 3, 500
    logits = logits_of(B, V, torch.bfloat16)
    ids = torch.randint(0, V, (B, 4), device=DEVICE)
    counts = []
    torch._dynamo.reset()
    compiled = torch.compile(scatter_banned, backend="fusekern")
    for t in (0.5, 0.9, 1.3):
        T = torch.full((B, 1), t, dtype=torch.bfloat16, device=DEVICE)
        assert torch.equal(compiled(logits, ids, T), scatter_banned(logits, ids, T))
        counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert counts[0] == counts[-1]


def test_dynamic_batch():
    V = 700
    ids = lambda B: torch.randint(0, V, (B, 3), device=DEVICE)  # noqa: E731
    args = [(logits_of(B, V, torch.bfloat16, seed=B), ids(B), 0.8) for B in (2, 5, 9)]
    assert_compiled(scatter_banned, args[0], fired={NAME: 1}, tol=0.0, dynamic=True, extra_args=args[1:])


def near_miss_dim0(logits, ids, T):
    return (logits / T).scatter(-1, ids, float("-inf")).argmax(dim=0)


def near_miss_finite_fill(logits, ids, T):
    return (logits / T).scatter(-1, ids, -1e4).argmax(dim=-1)


def near_miss_mask_returned(logits, mask, T):
    y = (logits / T).masked_fill(mask, float("-inf"))
    return y.argmax(-1), y


def near_miss_mask_broadcasts(logits, mask, T):  # one row of logits under B masks (it once crashed the compile)
    return logits[:1].masked_fill(mask, float("-inf")).argmax(-1)


def masked_fill_by_int_constant(logits, mask):
    return (logits / torch.tensor(2)).masked_fill(mask, float("-inf")).argmax(-1)


def temperatures_over_one_row(logits, mask, T):  # one row of logits at B temperatures
    return (logits[:1] / T).masked_fill(mask, float("-inf")).argmax(-1)


@pytest.mark.parametrize("case", ["int_tensor", "int_constant", "promotes", "one_row_at_b_temperatures"])
def test_a_temperature_the_op_does_not_take_stays_ahead_of_it(case):
    """An integer tensor T once reached the op, which refused it at run time (the compiled call raised); a wider
    float T that promotes the logits, or B values over one row of logits, declined the whole chain. Now the
    division stays in the graph and the op takes its quotient as the logits, with eager's tokens."""
    B, V = 4, 300
    logits = logits_of(B, V, torch.bfloat16)
    mask = torch.rand(B, V, device=DEVICE) < 0.2
    fn, args = {
        "int_tensor": (masked_fill, (logits, mask, torch.tensor(2, device=DEVICE))),
        "int_constant": (masked_fill_by_int_constant, (logits, mask)),
        "promotes": (masked_fill, (logits, mask, torch.rand(B, 1, device=DEVICE) + 0.5)),  # fp32 [B, 1]
        "one_row_at_b_temperatures": (temperatures_over_one_row,
                                      (logits, mask, torch.linspace(0.5, 2, B, device=DEVICE)[:, None].bfloat16())),
    }[case]
    assert_compiled(fn, args, fired={NAME: 1}, gone=["aten.argmax.default"], present=["aten.div.Tensor"], tol=0.0)


def test_a_dynamic_python_int_temperature_stays_ahead_of_the_op():
    """A Python int T that changes between calls: Dynamo makes it a SymInt from the second value on, whose
    division once crashed the pass (it called ``numel`` on the SymInt)."""
    B, V = 4, 300
    logits = logits_of(B, V, torch.float32)
    mask = torch.rand(B, V, device=DEVICE) < 0.2
    assert_compiled(masked_fill, (logits, mask, 2), fired={NAME: 1}, tol=0.0, dynamic=True,
                    extra_args=[(logits, mask, 3), (logits, mask, 5)])


@pytest.mark.parametrize("case", ["dim0", "finite_fill", "returned", "ids_one_row", "mask_broadcasts"])
def test_near_misses_stay(case):
    B, V = 4, 300
    logits = logits_of(B, V, torch.bfloat16)
    ids = torch.randint(0, V, (B, 3), device=DEVICE)
    mask = torch.rand(B, V, device=DEVICE) < 0.2
    fn, args = {
        "dim0": (near_miss_dim0, (logits, ids, 0.7)),
        "finite_fill": (near_miss_finite_fill, (logits, ids, 0.7)),
        "returned": (near_miss_mask_returned, (logits, mask, 0.7)),
        "ids_one_row": (scatter_banned, (logits, ids[:1], 0.7)),  # scatter masks row 0 only
        "mask_broadcasts": (near_miss_mask_broadcasts, (logits, mask, 0.7)),
    }[case]
    if case == "returned":
        torch._dynamo.reset()
        got = torch.compile(fn, backend="fusekern")(*args)
        want = fn(*args)
        assert torch.equal(got[0], want[0])
        import fusekern
        assert NAME not in fusekern.match_report().fired()
        return
    assert_compiled(fn, args, fired={}, tol=0.0)


# ----------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_kernel_matches_reference(dtype):
    B, V = 6, 2500  # V not a multiple of the block
    x = logits_of(B, V, dtype, seed=3)
    x[3, 11] = float("nan")                     # NaN wins, as torch.argmax
    x[4, 7] = float("inf")
    x[5, :] = x[5, 0]                           # all tied: the first unbanned token
    ids = torch.randint(-V, V, (B, 5), device=DEVICE)  # negative ids count from the end
    ids[5, 0] = 0
    ids[:3, 1] = x[:3].float().argmax(-1)  # banned winners: the chunk is searched again without them
    ids[3, 2] = 11 - V                     # a banned NaN (negative id) does not win
    mask = torch.rand(B, V, device=DEVICE) < 0.25
    T = (torch.rand(B, 1) + 0.5).to(dtype).to(DEVICE)
    wide = torch.empty(B, 2 * V, dtype=dtype, device=DEVICE)[:, ::2]  # strided logits: copied first
    wide.copy_(x)
    for logits in (x, wide, x[:, :V - 3]):
        for T_, b, m in ((None, ids, None), (0.7, None, mask[:, :logits.shape[1]]), (T, ids, None),
                         (T, None, mask[0, :logits.shape[1]]), (0.9, ids[0], None), (None, ids, mask[:, :logits.shape[1]])):
            b_ = None if b is None else torch.where(b.abs() < logits.shape[1], b, 0)
            for block, split in ((512, 3), (4096, 1), (256, None)):  # rows split over programs, or not
                got = ma.masked_argmax_triton(logits, T_, b_, m, block=block, split=split)
                want = ma.masked_argmax_reference(logits, T_, b_, m)
                assert torch.equal(got.cpu(), want.cpu()), (T_ is None, b is None, m is None, block, split)


def test_kernel_rounds_the_quotient_to_eagers_dtype():
    """fp16 logits one ulp apart over an fp32 temperature per row: eager's quotient is fp32 (no tie), and the
    kernel once rounded it to fp16 (a tie, the lower index). A 0-d fp32 T does not promote: fp16 there."""
    logits = torch.tensor([[3.0, 3.001953125], [3.001953125, 3.0]], dtype=torch.float16, device=DEVICE)
    for T in (torch.tensor([[1.3], [1.3]], device=DEVICE), torch.tensor(1.3, device=DEVICE), 1.3):
        want = (logits / T).argmax(-1)
        assert ma.quotient_dtype(logits, T) == (logits / T).dtype
        assert torch.equal(ma.masked_argmax_triton(logits, T).cpu(), want.cpu())
        assert torch.equal(ma.masked_argmax_reference(logits, T).cpu(), want.cpu())
    with pytest.raises(TypeError, match="float64"):
        ma.masked_argmax_triton(logits, torch.ones(2, 1, dtype=torch.float64, device=DEVICE))


@pytest.mark.gpu
def test_gpu_kernel_casts_a_wider_temperature_tensor_as_cuda_eager_does():
    """On CUDA, eager casts a 0-d fp32 T to fp16 logits' dtype before dividing (1.3 -> 1.2998): 2.6015625 and
    2.603515625 over it round to two fp16 values, where over 1.3 itself they tie. The kernel divides the same way."""
    logits = torch.tensor([[2.6015625, 2.603515625]], dtype=torch.float16, device="cuda")
    T = torch.tensor(1.3, device="cuda")
    want = (logits / T).argmax(-1)
    assert want.item() == 1 and (logits.float() / 1.3).half().argmax(-1).item() == 0  # (the case separates them)
    assert torch.equal(ma.masked_argmax_triton(logits, T), want)


def test_a_temperature_column_of_a_wider_tensor():
    """T [B, 1] whose rows are not one element apart (a column of per-row sampling parameters): the kernel read
    it as contiguous (stride 1), so rows 1.. took other rows' temperatures."""
    logits = logits_of(4, 64, torch.float32, seed=9)
    params = torch.tensor([[1.0, 9.0], [-1.0, 9.0], [-1.0, 9.0], [-1.0, 9.0]], device=DEVICE)
    T = params[:, :1]  # strides (2, 1)
    want = (logits / T).argmax(-1)
    stride_one_read = params.reshape(-1)[:4].reshape(-1, 1)  # 1, 9, -1, 9
    assert not torch.equal(want, (logits / stride_one_read).argmax(-1))  # (the case separates the two reads)
    assert torch.equal(ma.masked_argmax_triton(logits, T).cpu(), want.cpu())


def test_one_row_of_banned_ids_bans_them_in_every_row():
    """banned [1, n] with B > 1 (which check_args accepts): the kernel banned the ids in every row, the
    reference (the op's CPU path) in row 0 only."""
    logits = torch.tensor([[0., 5., 1.]] * 3, device=DEVICE)
    banned = torch.tensor([[1]], device=DEVICE)
    for fn in (ma.masked_argmax_triton, ma.masked_argmax_reference):
        assert fn(logits, None, banned, None).cpu().tolist() == [2, 2, 2]
        assert fn(logits, None, banned[0], None).cpu().tolist() == [2, 2, 2]


def test_combine_over_more_chunks_than_one_read_holds():
    """More than 1024 chunks a row: the last program combines them 1024 at a time, in order (a tie
    across reads goes to the earlier chunk, the first NaN wins)."""
    B, V = 6, 2600
    x = logits_of(B, V, torch.float32, seed=5)  # row 2: all -inf, token 0
    x[5, :] = -1.0
    x[5, 1000], x[5, 2300] = -0.0, 0.0     # -0 and +0 tie: the first
    x[1, :] = 0.5                          # all tied: token 0, in the first read
    x[1, 2100] = float("nan")              # a NaN in the third read
    x[3, 2200] = x[3].max() + 1            # the winner in the third read
    x[4, 2200] = x[4].max() + 1
    x[4, 5] = x[4, 2200]                   # tied with one in the first read: the first wins
    got = ma.masked_argmax_triton(x, None, None, None, block=2, split=1300)
    want = [x[0].argmax().item(), 2100, 0, 2200, 5, 1000]
    assert got.cpu().tolist() == ma.masked_argmax_reference(x).cpu().tolist() == want


def test_kernel_registers_and_report():
    builds = ma.aot_builds()
    assert {b.kernel for b in builds} == {"masked_argmax"}
