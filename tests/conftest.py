"""Test setup: on a machine without CUDA, Triton kernels run in the interpreter on CPU tensors.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test imports
fusekern's kernels. GPU tests carry the ``gpu`` marker and are skipped without CUDA.

``FUSEKERN_FAILURE_LOG=PATH`` appends each failing test's report to PATH as soon as it fails
(``fusekern.testing.failure_log``).
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from fusekern.testing.triton_interpreter import patch_bf16_support, patch_fast_sort, patch_nested_calls

    patch_bf16_support()
    patch_fast_sort()
    patch_nested_calls()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one pytest-xdist worker per core: torch's and inductor's CPU kernels would each start a thread per
        # core on top (OpenMP threads spinning against the other workers)
        torch.set_num_threads(1)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
pytest_plugins = ["fusekern.testing.failure_log"]


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # a fresh match report too: a test that reads it must not see the patterns earlier tests fired
    # (the GPU run's shards order tests differently from a plain run)
    import fusekern

    torch._dynamo.reset()
    fusekern.reset_match_report()
    yield


@pytest.fixture
def no_compile_caches():
    """For tests that read the match report's reasons: a graph loaded from inductor's FX-graph or AOT caches
    (compiled by an earlier run of the same code) skips the passes and records nothing."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
