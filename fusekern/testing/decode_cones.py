"""Run user decode code through the post-grad graph and check the decode program against it.

``post_grad_graph(fn, *args)`` compiles ``fn`` with stock inductor and captures the graph the
post-grad passes see (where fusekern's dequant-matmul rewrite runs). ``cone_values(gm, args)`` runs
that graph eagerly and returns every node's value, so a test can compare the decode program's output
with the weight operand the user's code actually computed.
"""
from __future__ import annotations

import copy

import torch


def post_grad_graph(fn, *args, dynamic=False) -> tuple[torch.fx.GraphModule, list]:
    """The post-grad graph of ``fn`` and the inputs its placeholders take, in order."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    captured, inputs = [], []

    def capture(graph):
        captured.append(copy.deepcopy(graph.owning_module))  # holds the graph's constants too

    def backend(gm, example_inputs):
        inputs[:] = list(example_inputs)  # dynamo's order: the order the function first reads them
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    with config.patch(post_grad_custom_pre_pass=capture, fx_graph_cache=False):
        torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    torch._dynamo.reset()
    if not captured:
        raise RuntimeError("inductor ran no post-grad pass")
    return captured[-1], inputs


def node_values(gm: torch.fx.GraphModule, inputs) -> dict:
    """Every node's value when the captured graph runs on ``inputs`` (from ``post_grad_graph``)."""
    env = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            env[n] = out
            return out

    Recorder(gm).run(*[a for a in inputs if isinstance(a, torch.Tensor)])
    return env


def decode_program(fn, x, *weights):
    """``(program text, leaf tensors, constant leaves by index)`` of the first matmul's weight cone in
    ``fn(x, *weights)``'s post-grad graph: what the rewrite would hand to ``fusekern::decode_mm``."""
    from fusekern.patterns.decode.analysis import analyse, find_cone

    gm, inputs = post_grad_graph(fn, x, *weights)
    env = node_values(gm, inputs)
    mm = next(n for n in gm.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default))
    cone = find_cone(mm)
    constants = {i: getattr(gm, leaf.target) for i, leaf in enumerate(cone.leaves) if leaf.op == "get_attr"}
    return analyse(cone).to_text(), [env[leaf] for leaf in cone.leaves], constants


def fake_cuda_graph(fn, args) -> torch.fx.Graph:
    """The graph inductor would hand the post-grad passes on a GPU machine, traced from fake CUDA tensors
    (``args``: made under a ``FakeTensorMode``), on any machine: tests of what a pass does on a GPU."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusekern.compiler_pass.canonicalize import canonicalize

    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    canonicalize(gm.graph)
    gm.graph.eliminate_dead_code()
    return gm.graph
