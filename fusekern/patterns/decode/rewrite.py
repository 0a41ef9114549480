"""The structural dequant -> matmul rewrite: any weight-decode cone feeding mm / addmm / bmm.

For each matmul whose weight operand is computed from packed codes (``analysis.find_cone``), the cone
is analysed into a decode program; if the program, dtypes and devices fit, the matmul and its cone
become one ``fusekern::decode_mm`` call (the weight is decoded inside the GEMM's load stage). Else the
graph stays as written and the match report says why — for candidates only: matmuls whose weight is
computed from integer / fp8 inputs.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

from fusekern.kernels import decode_mm as kernel
from fusekern.kernels import device_info, sorted_gather
from fusekern.patterns.decode.analysis import (
    CODE_DTYPES, Cone, Unsupported, analyse, analyse_sorted, ancestors, find_cone, weight_operand,
)
from fusekern.patterns.decode.formats import recognize
from fusekern.patterns.decode.layout import derive_layout
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


def _constants(graph: Graph, cone: Cone) -> dict:
    """Values of the leaves that are constants of the graph (lookup tables, shift tables)."""
    out = {}
    gm = graph.owning_module
    for i, leaf in enumerate(cone.leaves):
        if leaf.op == "get_attr" and gm is not None:
            v = getattr(gm, leaf.target, None)
            if isinstance(v, torch.Tensor) and v.numel() <= 256:
                out[i] = v.detach().cpu()
    return out


def _replace(graph: Graph, cone: Cone, prog: DecodeProgram) -> str:
    mm = cone.matmul
    if mm.target == aten.addmm.default:
        bias, act = mm.args[0], mm.args[1]
    else:
        bias, act = None, mm.args[0]
    constants = _constants(graph, cone)
    fmt = recognize(prog, constants)
    layout = derive_layout(prog, fmt, constants)
    sorted_variant = _sorted_gathers(cone, constants) if layout is None and prog.lookups() else None
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
    if sorted_variant is not None:
        sorted_prog, sorted_fmt, sorted_layout, checks = sorted_variant
        sorted_prog = sorted_prog.with_constants(embedded)
        if checks:
            layout_text = sorted_gather.guarded_layout(sorted_prog.to_text(), sorted_layout.to_text(), checks)
            note = (f"{sorted_fmt.describe()} where g_idx is arange(K) // G (checked on the first call with each "
                    f"set of weights: hand-tuned packed kernels), else {fmt.describe()} (generated kernel)")
        else:  # the index is a constant of the graph, and sorted
            prog, fmt, layout_text = sorted_prog, sorted_fmt, sorted_layout.to_text()
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


def _sorted_gathers(cone: Cone, constants: dict):
    """(program, format, layout, checks) of the decode read with every gather by a [K] index leaf as k // G,
    where that program has a packed layout (GPTQ's ``scales[g_idx]`` without act-order); checks: {leaf: G}
    for the index leaves the op must check (those that are constants of the graph are checked here). None
    where there is no such reading, or it has no layout, or a constant index is not sorted."""
    try:
        found = analyse_sorted(cone)
    except Unsupported:
        return None
    if found is None:
        return None
    prog, checks = found
    fmt = recognize(prog, constants)
    layout = derive_layout(prog, fmt, constants)
    if layout is None:
        return None
    try:
        kernel.decode_source(prog)
    except NotImplementedError:
        return None
    for i in [i for i in checks if i in constants]:
        if not sorted_gather.is_sorted(constants[i], checks.pop(i)):
            return None
    return prog, fmt, layout, checks


def rewrite_decode_matmuls(graph: Graph) -> int:
    from fusekern.compiler_pass.report import record_note, record_rejection

    fired = 0
    for mm in [n for n in graph.nodes if n.op == "call_function" and n.target in MATMULS]:
        try:
            cone, prog = plan(mm)
        except Unsupported as why:
            if _is_candidate(mm):
                record_rejection(NAME, mm.name, str(why))
            continue
        record_note(NAME, mm.name, _replace(graph, cone, prog))
        fired += 1
    return fired
