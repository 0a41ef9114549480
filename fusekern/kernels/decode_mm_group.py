"""``fusekern::decode_mm_group``: the decode -> matmuls that read the same activation rows, as one op.

``decode_mm_group(x, leaves, programs, layout)`` returns ``[decode_mm(x, leaves_i, programs[i], None,
layout) for each member]`` (leaves: every member's leaves, in member order). On CUDA, for a few rows, the
members' GEMVs can run as one launch (``packed_gemv_group``; for int4 along K and bf16 rows also
``int4_mma_sync_group`` up to 8 rows and ``int4_mma_group`` up to 64; for 8-bit codes along K
``fp8_mma_group`` up to 16): the first call of a shape times the grouped configs against the members' own launches (each as ``decode_mm`` would run it, its own tuned
kernel) and keeps the fastest whose outputs agree with the members' own; a shape where grouping loses,
or that cannot be grouped, runs the members one by one. Elsewhere (CPU, more rows) the members run one
by one: the op never computes anything ``decode_mm`` would not.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from fusekern.compiler_pass import direct_calls
from fusekern.kernels import decode_mm as dm
from fusekern.kernels import fp8_mma as f8
from fusekern.kernels import int4_mma as im
from fusekern.kernels import int4_mma_sync as ims
from fusekern.kernels import packed_gemv_group as pg
from fusekern.kernels import packed_mm as pm
from fusekern.kernels import replay
from fusekern.kernels.device_info import sm_count
from fusekern.kernels.intmath import next_power_of_2
from fusekern.kernels.leaf_cache import LeafCache
from fusekern.patterns.decode.layout import PackedLayout
from fusekern.patterns.decode.program import DecodeProgram

log = logging.getLogger(__name__)

SEPARATE = "separate"  # the tuner's choice: each member's own launch


def split_leaves(leaves, programs) -> list[list[torch.Tensor]]:
    """The flat leaf list cut into each member's leaves (a program knows how many it reads): every leaf of
    every member, or only their inputs (the programs hold their constants, see ``DecodeProgram.bind``)."""
    progs = [DecodeProgram.from_text(text) for text in programs]
    full = sum(len(p.leaves) for p in progs) == len(leaves)
    out, i = [], 0
    for p in progs:
        n = len(p.leaves) if full else len(p.inputs)
        out.append(list(leaves[i:i + n]))
        i += n
    if i != len(leaves):
        raise ValueError(f"decode_mm_group: the programs read {i} leaves, got {len(leaves)}")
    return out


def _separate(x, members, programs, layout) -> list[torch.Tensor]:
    return [dm.decode_mm(x, leaves, text, None, layout) for leaves, text in zip(members, programs)]


GROUP_M_MAX = max(dm.PACKED_GEMV_M_MAX, im.M_MAX)  # the most rows a grouped kernel takes (int4_mma's 64)


def _groupable(x, members, progs, layout) -> bool:
    """One launch can serve these members: a few rows of a supported dtype, one K, 2-D weights whose
    leaves have the strides the programs were traced with, a packed layout they share."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype in dm.SUPPORTED_ACT_DTYPES and x.shape[0] <= GROUP_M_MAX
            and layout and 2 <= len(members) <= pg.MAX_MEMBERS):
        return False
    if any(p.batch or p.K != progs[0].K or p.dtype != x.dtype for p in progs):
        return False
    return all(tuple(t.stride()) == leaf.stride for leaves, p in zip(members, progs)
               for t, leaf in zip(leaves, p.leaves))


_tuned: dict = {}  # (programs, layout, M bucket, device) -> a grouped kernel's config or SEPARATE


def group_candidates(M: int, N: int, K: int, sms: int, lay: PackedLayout, dtype=torch.bfloat16) -> list:
    """The GEMV, ``int4_mma_sync``, ``int4_mma`` and ``fp8_mma`` configs the dispatcher offers for the summed width
    (GEMVs reading K in vectors serve only members whose codes are 16-byte aligned: ``packed_gemv_group.gemv_group``;
    so do ``int4_mma``'s TMA configs: ``int4_mma.int4_mma_group``)."""
    return [c for c in dm._packed_candidates(M, N, K, sms, lay, dtype)
            if isinstance(c, (pm.PackedGemv, ims.Int4MmaSync, im.Int4Mma, f8.Fp8Mma))]


def group_launch(x, members, lay: PackedLayout, K: int, Ns: list[int], cfg, workspace=None, record=None):
    """The members' outputs from one launch of ``cfg``'s kernel, or None where they cannot share one."""
    if isinstance(cfg, ims.Int4MmaSync):
        return ims.int4_mma_sync_group(x, members, lay, K, Ns, cfg, workspace=workspace, record=record)
    if isinstance(cfg, im.Int4Mma):
        return im.int4_mma_group(x, members, lay, K, Ns, cfg, workspace=workspace, record=record)
    if isinstance(cfg, f8.Fp8Mma):
        return f8.fp8_mma_group(x, members, lay, K, Ns, cfg, workspace=workspace, record=record)
    return pg.gemv_group(x, members, lay, K, Ns, cfg, workspace=workspace, record=record)


def tuned_choice(x, members, programs, layout):
    """A grouped launch's config (GEMV, ``int4_mma_sync``, ``int4_mma`` or ``fp8_mma``), or SEPARATE: measured on
    the first call of a shape (see the module doc)."""
    progs = [DecodeProgram.from_text(t) for t in programs]
    if not _groupable(x, members, progs, layout):
        return SEPARATE
    bucket = next_power_of_2(x.shape[0])
    key = (tuple(programs), layout, bucket, x.device)
    if key in _tuned:
        return _tuned[key]
    if torch.cuda.is_current_stream_capturing():
        return SEPARATE  # nothing can be timed while a graph is captured
    lay = PackedLayout.from_text(layout)
    K, Ns = progs[0].K, [p.N for p in progs]
    if pg.group_args(x, members, lay, K, Ns) is None:
        if not pg.one_program(members, lay, K, Ns):  # (the same for every layer with these programs)
            _tuned[key] = SEPARATE
        return SEPARATE  # else not cached: another layer's leaves for the same programs may lie apart
    cands = group_candidates(bucket, sum(Ns), K, sm_count(x.device), lay, x.dtype)
    if not cands:  # (e.g. 9-64 rows of a format only int4_mma groups): nothing to time against
        _tuned[key] = SEPARATE
        return SEPARATE
    probe = torch.randn(x.shape, generator=torch.Generator(x.device).manual_seed(0), device=x.device,
                        dtype=x.dtype)
    refs = _separate(probe, members, programs, layout)  # each member's own tuned (and checked) kernel
    bounds = [dm.AGREEMENT.get(r.dtype, 1e-3) * (r.float().abs() + r.float().abs().mean()) for r in refs]
    best, best_ms = SEPARATE, dm._gpu_time(lambda: _separate(x, members, programs, layout), device=x.device)
    for cfg in cands:
        try:
            outs = group_launch(probe, members, lay, K, Ns, cfg)
            if outs is None:  # (K-vector reads of codes that are not all 16-byte aligned)
                continue
            if any(not ((o.float() - r.float()).abs() <= b).all() for o, r, b in zip(outs, refs, bounds)):
                log.warning("fusekern decode_mm_group: %s is off for %s: skipped", cfg, Ns)
                continue
            ms = dm._gpu_time(lambda: group_launch(x, members, lay, K, Ns, cfg), device=x.device)
        except Exception as e:  # a config that does not compile or fit on this device: skip it
            log.warning("fusekern decode_mm_group: skipping %s for %s: %s", cfg, Ns, e)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    _tuned[key] = best
    return best


# ----------------------------------------------------------------------------- custom op

torch.library.define("fusekern::decode_mm_group",
                     "(Tensor x, Tensor[] leaves, str[] programs, str layout) -> Tensor[]")


_REPLAYS = LeafCache()  # (programs, layout, activation) per leaf set -> the grouped launch's replay


def replay_key(x, programs, layout: str) -> tuple:
    """Where the op keeps its grouped launch's replay (``_REPLAYS``, beside the leaf set): the members'
    programs, the layout and the activation's layout (as ``decode_mm.replay_key`` does for one weight)."""
    return (tuple(programs), layout, *replay.x_key(x))


def _decode_mm_group_cuda(x, leaves, programs, layout):
    """Calls after the first with the same leaves and activation layout replay its grouped launch
    (``replay``; None from it: this call's outputs do not fit the recorded launch, see ``GemvGroupReplay``);
    members run one by one replay at ``decode_mm``'s level."""
    key = replay_key(x, programs, layout)
    rep = _REPLAYS.get(key, leaves)
    if rep is not None:
        outs = rep(x)
        if outs is not None:
            return outs
    members = [DecodeProgram.from_text(t).bind(m, x.device) for m, t in zip(split_leaves(leaves, programs), programs)]
    cfg = tuned_choice(x, members, programs, layout)
    if cfg != SEPARATE:
        progs = [DecodeProgram.from_text(t) for t in programs]
        for m, p, text in zip(members, progs, programs):  # decode_mm's checks (cached per leaf set)
            dm._check_args(x, m, p, None, text)
        lay, Ns = PackedLayout.from_text(layout), [p.N for p in progs]
        try:
            outs = _grouped(x, members, lay, progs[0].K, Ns, cfg, key, leaves)
        except ValueError as e:  # tuned on another layer: these leaves do not fit the kernel (e.g. codes not
            # 4-byte aligned for int4 words); the members' own kernels, each checked and chosen for its leaves
            log.info("fusekern decode_mm_group: %s does not take this layer's leaves (%s): members run alone", cfg, e)
            outs = None
        except Exception as e:  # noqa: BLE001 - a build the tuner never ran (the plain-load retry, another
            # alignment's specialization) that does not compile or fit: the members' own kernels still do
            log.warning("fusekern decode_mm_group: %s failed on this layer (%s: %s): members run alone", cfg,
                        type(e).__name__, e)
            outs = None
        if outs is not None:
            return outs
    return _separate(x, members, programs, layout)


def _grouped(x, members, lay: PackedLayout, K: int, Ns: list[int], cfg, key, leaves):
    """The tuned grouped launch for this call, recorded for replay, or None where these members cannot share it.
    A config tuned on another layer whose codes were all 16-byte aligned may meet a layer where they are not:
    then the same tiles with plain loads, still one launch."""
    record = replay.recorder(_REPLAYS, key, leaves)
    outs = group_launch(x, members, lay, K, Ns, cfg, record=record)
    plain = _plain_loads(cfg)
    if outs is None and plain is not None:
        outs = group_launch(x, members, lay, K, Ns, plain, record=record)
    return outs


def _plain_loads(cfg):
    """cfg without the loads that need every member's codes 16-byte aligned (the GEMV's K vectors,
    ``int4_mma``'s TMA), or None where it has none."""
    if isinstance(cfg, pm.PackedGemv) and cfg.vec_k:
        return dataclasses.replace(cfg, vec_k=False)
    if isinstance(cfg, im.Int4Mma) and cfg.tma:
        return dataclasses.replace(cfg, tma=False, num_stages=1)
    return None


torch.library.impl("fusekern::decode_mm_group", "CUDA")(_decode_mm_group_cuda)  # (kept callable: tests, direct_calls)
direct_calls.register(torch.ops.fusekern.decode_mm_group.default, _decode_mm_group_cuda)


@torch.library.impl("fusekern::decode_mm_group", "CPU")
def _decode_mm_group_cpu(x, leaves, programs, layout):
    return _separate(x, split_leaves(leaves, programs), programs, layout)


@torch.library.register_fake("fusekern::decode_mm_group")
def _decode_mm_group_fake(x, leaves, programs, layout):
    return _separate(x, split_leaves(leaves, programs), programs, layout)  # decode_mm's fake checks each


decode_mm_group = torch.ops.fusekern.decode_mm_group
