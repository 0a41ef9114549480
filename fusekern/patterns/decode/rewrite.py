"""The structural dequant -> matmul rewrite: any weight-decode cone feeding mm / addmm / bmm.

For each matmul whose weight operand is computed from packed codes (``analysis.find_cone``), the cone
is analysed into a decode program; if the program, dtypes and devices fit, the matmul and its cone
become one ``fusekern::decode_mm`` call (the weight is decoded inside the GEMM's load stage). Else the
graph stays as written and the match report says why — for candidates only: matmuls whose weight is
computed from integer / fp8 inputs.
"""
from __future__ import annotations

import itertools

import torch
from torch.fx import Graph, Node

from fusekern.kernels import decode_mm as kernel
from fusekern.compiler_pass import example_inputs
from fusekern.kernels import device_info, layout_guard
from fusekern.patterns.decode.analysis import (
    CODE_DTYPES, Cone, Unsupported, analyse, analyse_sorted, ancestors, find_cone, graph_constant, weight_operand,
)
from fusekern.patterns.decode.formats import AWQ_ORDER, recognize
from fusekern.patterns.decode.layout import derive_layout, edge_window, random_leaves
from fusekern.patterns.decode.program import FP8_DTYPES, MAX_TABLE, DecodeProgram

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
NAME = "decode_matmul"


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _is_candidate(mm: Node) -> bool:
    """Worth a line in the report: the weight operand is computed from integer or fp8 graph inputs."""
    try:
        _, w = weight_operand(mm)
    except Unsupported:
        return False
    if not isinstance(w, Node) or w.op != "call_function":
        return False
    for n in ancestors(w):
        v = _val(n)
        if n.op in ("placeholder", "get_attr") and isinstance(v, torch.Tensor) and v.dtype in CODE_DTYPES \
                and v.numel() > 256:
            return True
    return False


def plan(mm: Node) -> tuple[Cone, DecodeProgram]:
    """The cone and its program if this matmul may be replaced; raises Unsupported otherwise."""
    cone = find_cone(mm)
    act = mm.args[0] if mm.target != aten.addmm.default else mm.args[1]
    xv = _val(act)
    if not isinstance(xv, torch.Tensor):
        raise Unsupported("the activation has no tensor metadata")
    if xv.dtype not in kernel.SUPPORTED_ACT_DTYPES:
        raise Unsupported(f"activation dtype {xv.dtype} (fp16 / bf16 / fp32 only)")
    if xv.device.type not in ("cpu", "cuda"):
        raise Unsupported(f"activation on {xv.device}")
    prog = analyse(cone)
    # FP8 values anywhere in the decode (leaves stored as fp8, or uint8 bitcast with .view(float8)) need sm_89
    fp8 = any(v.dtype in FP8_DTYPES for v in (*prog.leaves, *prog.instrs))
    reason = device_info.unsupported(xv.device, fp8=fp8)
    if reason is not None:
        raise Unsupported(reason)
    if prog.dtype != xv.dtype:
        raise Unsupported(f"the decoded weight is {prog.dtype}, the activation {xv.dtype}")
    bv = _val(mm.args[0]) if mm.target == aten.addmm.default else None
    if isinstance(bv, torch.Tensor) and bv.dtype != xv.dtype:
        # eager's addmm raises there; FakeTensor's does not check, so the graph reaches this pass
        raise Unsupported(f"the bias is {bv.dtype}, the activation {xv.dtype} (eager's addmm raises)")
    for leaf in cone.leaves:
        if _val(leaf).device != xv.device:
            raise Unsupported(f"{leaf.name} is on {_val(leaf).device}, the activation on {xv.device}")
    if mm.target == aten.bmm.default and not prog.batch:
        raise Unsupported("bmm with a 2-D weight")
    try:
        kernel.decode_source(prog)
    except NotImplementedError as e:
        raise Unsupported(f"no kernel for this decode: {e}") from None
    return cone, prog


def _constants(cone: Cone) -> dict:
    """Values of the leaves that are constants of the graph (lookup tables, shift tables)."""
    out = {}
    for i, leaf in enumerate(cone.leaves):
        v = graph_constant(leaf)
        if v is not None and v.numel() <= 256:
            out[i] = v.detach().cpu()
    return out


def _replace(graph: Graph, cone: Cone, prog: DecodeProgram) -> str:
    mm = cone.matmul
    if mm.target == aten.addmm.default:
        bias, act = mm.args[0], mm.args[1]
    else:
        bias, act = None, mm.args[0]
    constants = _constants(cone)
    # what recognition may take as known: the graph's constants and the small tables the analysis folded
    known = {**constants, **prog.embedded_values()}
    fmt = recognize(prog, known)
    layout = derive_layout(prog, fmt, known)
    guarded = _guarded_variant(cone, prog, known) if layout is None else None
    if layout is None and guarded is None and prog.row_gathers():
        # Measured on the H100 (8192 x 8192, M = 1, CUDA graphs; benchmarks/results/h100/decode_mm_g_idx.csv):
        # act-order GPTQ 173 µs against stock's 145, AutoAWQ's column reorder 327 against 170.
        raise Unsupported("weight rows or columns gathered by data (act-order g_idx, a column reorder) and no "
                          "packed layout: the generated kernel and the program's stock code are slower than stock "
                          "inductor on the graph as written")
    # Small tables the user's code builds every call (``torch.tensor(...)``: a constant the graph copies with
    # lift_fresh_copy) and constant lookup tables travel inside the program, and the op keeps one tensor of
    # each: passed as graph values they would arrive as a fresh copy every call (below), a launch and a miss in
    # the op's caches. Other small constants (parameters under inductor's freezing: per-tensor scales) stay
    # arguments, so every layer keeps one program text, one compile and one tuning. (Freezing folds the
    # user's lift_fresh_copy away: its lookup tables are still recognised as such.)
    lookups = {i for i in prog.lookups() if prog.leaves[i].numel <= MAX_TABLE}  # not gathered scales
    embedded = {i: t for i, t in constants.items() if t.is_contiguous() and tuple(t.stride()) == prog.leaves[i].stride
                and (i in lookups or any(u.target == aten.lift_fresh_copy.default and not u.meta.get("fusekern_lifted")
                                         for u in cone.leaves[i].users))}
    prog = prog.with_constants(embedded)
    layout_text = layout.to_text() if layout else ""
    note = f"{fmt.describe()}; {'hand-tuned packed kernels' if layout else 'generated kernel'}"
    if guarded is not None:
        g_prog, g_fmt, g_layout, checks = guarded
        g_prog = g_prog.with_constants(embedded)
        if checks:
            layout_text = layout_guard.guarded(g_prog.to_text(), g_layout.to_text(), checks)
            what = " and ".join(sorted({"g_idx is arange(K) // G" if kind == "groups" else "the shift tables hold "
                                        f"{list(param)}" for kind, param in checks.values()}))
            note = (f"{g_fmt.describe()} where {what} (checked on the first call with each set of weights: "
                    f"hand-tuned packed kernels), else {fmt.describe()} (generated kernel)")
        else:  # what was assumed are constants of the graph, and they hold
            prog, fmt, layout_text = g_prog, g_fmt, g_layout.to_text()
            note = f"{fmt.describe()}; hand-tuned packed kernels"
    mode = _val(act).fake_mode
    leaves = []
    with graph.inserting_before(mm):
        for i, leaf in enumerate(cone.leaves):
            if i in embedded:
                continue
            if leaf.op == "get_attr":
                # A graph constant: its meta value is real; inductor lowers the op with fake tensors
                # (and rejects the real one), so pass a lifted copy, as the user's graph did.
                lifted = graph.call_function(aten.lift_fresh_copy.default, (leaf,))
                lifted.meta["fusekern_lifted"] = True  # (not the user's: the leaf is not a per-call literal)
                lifted.meta["val"] = mode.from_tensor(_val(leaf)) if not _is_fake(_val(leaf)) else _val(leaf)
                leaf = lifted
            leaves.append(leaf)
        args = (act, leaves, prog.to_text(), bias, layout_text)
        out = graph.call_function(kernel.decode_mm.default, args)
    vals = [_val(act), [_val(l) for l in leaves], args[2], _val(bias) if bias is not None else None, args[4]]
    with mode:
        out.meta["val"] = kernel.decode_mm(*vals)
    out.meta["fusekern_format"] = fmt
    for key in ("stack_trace", "nn_module_stack"):
        if key in mm.meta:
            out.meta[key] = mm.meta[key]
    mm.replace_all_uses_with(out)
    return note


def _guarded_variant(cone: Cone, prog: DecodeProgram, constants: dict):
    """A packed layout that holds if some leaves have the values real checkpoints give them, which the graph
    does not show: GPTQ's g_idx read as ``k // G`` (``analyse_sorted``), small integer leaves (shift tables in
    buffers, GPTQModel's ``wf``) as the shift tables of sequential or AWQ packing. Returns (program, format,
    layout, checks) with checks {leaf: ("groups", G) | ("values", [ints])} for the op to make on its first
    call (those on constants of the graph are made here), or None."""
    base, checks = prog, {}
    if prog.lookups():
        try:
            found = analyse_sorted(cone)
        except Unsupported:
            found = None
        if found is not None:
            base, groups = found
            checks = {i: ("groups", g) for i, g in groups.items()}
    tables = _small_int_leaves(base, constants)
    by_size: dict[int, list[int]] = {}
    for i in tables:
        by_size.setdefault(base.leaves[i].numel, []).append(i)
    sizes = sorted(by_size)
    # every table of one size gets the same values (GPTQModel keeps two views of one shift table)
    for values in itertools.product(*[[None, *_shift_tables(P)] for P in sizes]):
        assumed = {i: v for P, v in zip(sizes, values) if v is not None for i in by_size[P]}
        if not assumed and not checks:
            continue  # (nothing assumed: the plain derivation already failed)
        if not all(_example_allows(cone, i, ("values", tuple(v))) for i, v in assumed.items()):
            continue  # the input this graph is compiled for holds another table (AWQ's order, not sequential)
        known = {**constants, **{i: torch.tensor(v, dtype=base.leaves[i].dtype).reshape(base.leaves[i].shape)
                                 for i, v in assumed.items()}}
        fmt = recognize(base, known)
        layout = derive_layout(base, fmt, known)
        if layout is not None:
            break
    else:
        return None
    try:
        kernel.decode_source(base)
    except NotImplementedError:
        return None
    checks = {**checks, **{i: ("values", tuple(v)) for i, v in assumed.items()}}
    if not _same_weight(prog, base, layout, checks, constants):
        return None
    for i in list(checks):  # constants of the graph (of any size: a copy reaches the op afresh every call)
        value = constants.get(i)
        if value is None:
            value = graph_constant(cone.leaves[i])
        if value is not None:
            kind, param = checks.pop(i)
            if not layout_guard.holds(value.detach().cpu(), kind, param):
                return None
    for i, (kind, param) in checks.items():
        # The example input this graph is compiled for (the first layer's g_idx): where it fails, an act-order
        # checkpoint, every layer would run the program instead, slower than stock (measured): decline.
        if not _example_allows(cone, i, (kind, param)):
            return None
    return base, fmt, layout, checks


def _example_allows(cone: Cone, i: int, check: tuple) -> bool:
    """Whether the example input this graph is compiled for, where there is one, passes ``check`` at leaf i."""
    example = example_inputs.value_of(cone.leaves[i])
    return example is None or layout_guard.holds(example.detach(), *check)


def _same_weight(prog: DecodeProgram, base: DecodeProgram, layout, checks: dict, constants: dict) -> bool:
    """Do ``prog`` (as written) and ``base`` (read under the checks) give the same weight, bit for bit, where
    the checked leaves hold what the checks ask? On two draws of random leaves over the first and last rows
    and columns: the analysis's substitution of ``k // G`` is not trusted alone."""
    for seed in (0, 1):
        fixed = dict(constants)
        for i, (kind, param) in checks.items():
            leaf = prog.leaves[i]
            fixed[i] = layout_guard.expected(kind, param, leaf.numel).to(leaf.dtype).reshape(leaf.shape)
        leaves = random_leaves(prog, layout, fixed, torch.Generator().manual_seed(seed))
        window = {"k": edge_window(prog.K, 512, 64), "n": edge_window(prog.N, 64, 32), "b": 0}
        try:
            a = prog.evaluate_at(leaves, prog.out, window)
            b = base.evaluate_at(leaves, base.out, window)
        except (IndexError, RuntimeError, ValueError):
            return False
        if a.shape != b.shape or not bool(((a == b) | (a.isnan() & b.isnan())).all()):
            return False
    return True


def _small_int_leaves(prog: DecodeProgram, constants: dict) -> list[int]:
    """Leaves that could be shift tables: integer, at most 64 entries, read, not constants of the graph."""
    return [i for i in sorted(prog.read_leaves()) if i not in constants and prog.leaves[i].numel <= 64
            and prog.leaves[i].dtype in (torch.int16, torch.int32, torch.int64, torch.uint8)]


def _shift_tables(P: int) -> list[tuple[int, ...]]:
    """Shift tables of P fields in a word: sequential fields of 32 / 16 / 8-bit words, and AWQ's order."""
    out = [tuple(j * (w // P) for j in range(P)) for w in (32, 16, 8) if w % P == 0 and w // P >= 2]
    return out + [tuple(4 * j for j in AWQ_ORDER)] if P == 8 else out


def rewrite_decode_matmuls(graph: Graph) -> int:
    from fusekern.compiler_pass.report import record_note, record_rejection

    fired = 0
    for mm in [n for n in graph.nodes if n.op == "call_function" and n.target in MATMULS]:
        try:
            cone, prog = plan(mm)
        except Unsupported as why:
            if _is_candidate(mm):
                record_rejection(NAME, mm, str(why))
            continue
        try:
            note = _replace(graph, cone, prog)  # (raises before it changes the graph)
        except Unsupported as why:
            record_rejection(NAME, mm, str(why))
            continue
        record_note(NAME, mm.name, note)
        fired += 1
    return fired
