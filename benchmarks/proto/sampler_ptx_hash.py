"""The sampler's sm_90a PTX per specialization, hashed with debug lines stripped (CPU, ~30 s).

    python benchmarks/proto/sampler_ptx_hash.py OUT.json

Run before and after a change that must leave the shipped specializations alone (a new constexpr branch)
and diff the two files: the shipped builds of ``sampler.aot_builds()`` plus min-p variants (HF's order) of
the B = 1 bf16 builds. Needs TRITON_INTERPRET unset.
"""
import hashlib
import json
import re
import sys

from fusekern.kernels import sampler as S
from fusekern.kernels.catalog import TritonBuild

builds = S.aot_builds()
for b in builds[:2]:
    for name, update in (("minp", dict(HAS_MIN_P=True)),
                         ("minp_rows", dict(HAS_MIN_P=True, M_PER_ROW=True, P_PER_ROW=True)),
                         ("nok", dict(HAS_TOP_K=False, ROW_SUM=True, HAS_MIN_P=True))):
        builds.append(TritonBuild(b.kernel, f"{b.config} {name}", b.fn, b.args, dict(b.constexprs, **update),
                                  b.num_warps))
out = {}
for b in builds:
    ptx = b.compile().asm["ptx"]
    ptx = "\n".join(line for line in ptx.splitlines() if not line.strip().startswith((".loc", ".file", "//")))
    ptx = re.sub(r"\.section\s+\.debug.*", "", ptx, flags=re.S)
    out[f"{b.kernel} {b.config}"] = hashlib.sha256(ptx.encode()).hexdigest()[:16]
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(f"{len(out)} builds hashed into {sys.argv[1]}")
