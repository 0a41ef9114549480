"""Every kernel fusekern ships, in every default config, as something that can be compiled for sm_90a.

Each kernel module lists its builds in ``aot_builds()``; ``all_builds()`` collects them. The register
report (``python -m fusekern.kernels.report``) and the CI tests compile these on a machine without a GPU,
so a config that spills or stops compiling for Hopper is caught before anyone runs it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from fusekern.kernels.remat import REMAT_MODES, remat_flags

# Modules with an ``aot_builds()`` function. A new kernel module adds itself here.
KERNEL_MODULES = ("fusekern.kernels.w8a16_linear", "fusekern.kernels.sampler", "fusekern.kernels.decode_mm",
                  "fusekern.kernels.packed_mm", "fusekern.kernels.packed_gemv_group", "fusekern.kernels.int4_mma",
                  "fusekern.kernels.int4_mma_n", "fusekern.kernels.int4_mma_sync", "fusekern.kernels.fp4_mma",
                  "fusekern.kernels.fp4_mma_sync", "fusekern.kernels.fp8_mma", "fusekern.kernels.masked_argmax", "fusekern.kernels.scaled_mm",
                  "fusekern.kernels.fp8_kv_attention", "fusekern.kernels.decode_attention")


@dataclass(frozen=True)
class TritonBuild:
    """One Triton kernel specialization: the function, its signature and constexprs, launch options."""

    kernel: str  # the kernel's name in reports, e.g. "w8a16_gemm"
    config: str  # the config as shipped, e.g. "BLOCK_M=16 BLOCK_N=64 BLOCK_K=256 w4 s4"
    fn: Any  # the triton.jit function
    args: dict[str, Any]  # representative launch arguments (see aot.compile_sm90)
    constexprs: dict[str, Any] = field(default_factory=dict)  # without the remat flags
    num_warps: int = 4
    num_stages: int = 3
    remat: str | None = None  # the mode shipped; None for kernels without a main loop (nothing to remat)
    maxnreg: int | None = None  # a register cap per thread (launch option), None for ptxas's choice

    @property
    def modes(self) -> tuple[str | None, ...]:
        """The rematerialization modes worth comparing for this kernel."""
        return REMAT_MODES if self.remat is not None else (None,)

    def compile(self, mode: str | None = None):
        """Compile for sm_90a in ``mode`` (the shipped mode by default)."""
        from fusekern.kernels.aot import compile_sm90

        constexprs = dict(self.constexprs)
        if self.remat is not None:
            constexprs.update(remat_flags(mode or self.remat))
        return compile_sm90(self.fn, self.args, constexprs, self.num_warps, self.num_stages, self.maxnreg)

    def resources(self, mode: str | None = None):
        from fusekern.kernels.aot import resources

        return resources(self.compile(mode))


def all_builds() -> list[TritonBuild]:
    builds = []
    for name in KERNEL_MODULES:
        builds.extend(importlib.import_module(name).aot_builds())
    return builds
