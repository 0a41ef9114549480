"""Every kernel fusekern ships, in every default config, as something that can be compiled for sm_90a.

Each kernel module lists its builds in ``aot_builds()`` (``TritonBuild`` or ``CuteBuild``); ``all_builds()``
collects them. The register
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
                  "fusekern.kernels.fp8_kv_attention", "fusekern.kernels.decode_attention",
                  "fusekern.kernels.cute_scaled_mm")


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


@dataclass(frozen=True)
class CuteBuild:
    """One CuTe DSL kernel specialization (``cute_scaled_mm.KernelConfig``): no rematerialization modes. Registers,
    stack and static shared memory are read from the cubin the DSL built (``setmaxnreg`` then moves registers
    from the producer warpgroup to the consumers at run time); spill bytes from Triton's ptxas assembling the
    same PTX; shared memory is the static part plus the pipeline's buffers."""

    kernel: str
    config: str
    cute_config: Any
    remat: str | None = None
    modes: tuple = (None,)

    def resources(self, mode: str | None = None):
        import tempfile

        from fusekern.kernels.aot import Resources
        from fusekern.kernels.cute_scaled_mm import aot_compile_sm90a

        with tempfile.TemporaryDirectory() as out:
            (build,) = aot_compile_sm90a(out, [self.cute_config])
        missing = [k for k in ("registers", "stack", "shared", "spill_stores", "spill_loads") if k not in build]
        if missing:  # cuobjdump or ptxas (Triton's) missing or unreadable
            raise RuntimeError(f"{self.kernel} {self.config}: could not read {missing} from its sm_90a build")
        return Resources(registers=build["registers"], stack=build["stack"], spill_stores=build["spill_stores"],
                         spill_loads=build["spill_loads"], shared=build["shared"] + build["dynamic_shared"],
                         threads=build["threads"])


def all_builds() -> list:
    builds = []
    for name in KERNEL_MODULES:
        builds.extend(importlib.import_module(name).aot_builds())
    return builds
