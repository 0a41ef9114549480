"""Options of the fusekern backend, read from ``torch.compile(..., options={...})``.

Keys starting with ``fusekern.`` are fusekern's; every other key is an inductor config patch and is
passed through unchanged (``"max_autotune": True``, ``"triton.cudagraphs": True``...).

    fusekern.enable   list of family or pattern names to run (default: all)
    fusekern.disable  list of family or pattern names not to run
    fusekern.debug    True: log the match report and dump each graph before/after the passes
    fusekern.dump_dir where debug dumps go (default: $FUSEKERN_DUMP_GRAPHS, else a temp dir)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

PREFIX = "fusekern."
KEYS = ("enable", "disable", "debug", "dump_dir")


@dataclass(frozen=True)
class FusekernOptions:
    enable: tuple[str, ...] | None = None
    disable: tuple[str, ...] = ()
    debug: bool = False
    dump_dir: str | None = None
    inductor: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> "FusekernOptions":
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise TypeError(f"fusekern: options must be a dict, got {type(options).__name__}")
        ours: dict[str, Any] = {}
        inductor: dict[str, Any] = {}
        known: set | None = None  # inductor's config names, read once where an option needs them
        for key, value in options.items():
            if not isinstance(key, str):
                raise TypeError(f"fusekern: option names are strings, got {key!r}")
            if key.startswith(PREFIX):
                short = key[len(PREFIX):]
                if short not in KEYS:
                    raise ValueError(f"fusekern: unknown option {key!r}; known: {[PREFIX + k for k in KEYS]}")
                ours[short] = value
            else:
                if known is None:
                    from torch._inductor import config
                    known = set(config.get_config_copy())
                name, value = _inductor_option(key, value, known)
                inductor[name] = value
        for key in ("enable", "disable"):
            if key in ours and ours[key] is not None:
                value = ours[key]
                if isinstance(value, str):
                    value = [value]
                if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in value):
                    raise TypeError(f"fusekern: option {PREFIX + key} must be a list of names, got {value!r}")
                ours[key] = tuple(value)
        if not isinstance(ours.get("debug", False), bool):
            raise TypeError(f"fusekern: option {PREFIX}debug must be True or False, got {ours['debug']!r}")
        if ours.get("dump_dir") is not None and not isinstance(ours["dump_dir"], (str, os.PathLike)):
            raise TypeError(f"fusekern: option {PREFIX}dump_dir must be a path, got {ours['dump_dir']!r}")
        env_dump = os.environ.get("FUSEKERN_DUMP_GRAPHS") or None
        return cls(
            enable=ours.get("enable"),
            disable=ours.get("disable") or (),
            debug=ours.get("debug", False),
            dump_dir=os.fspath(ours["dump_dir"]) if ours.get("dump_dir") else env_dump,
            inductor=inductor,
        )

    def dumps(self) -> bool:
        return self.debug or self.dump_dir is not None


def _inductor_option(key: str, value, known: set):
    """An inductor config patch checked as ``torch.compile``'s inductor wrapper checks its options (``-`` read as
    ``_``, the name known, the value of the option's type), so that a typo or a wrong type fails here, naming the
    option, not inside inductor's compile."""
    from typing import get_origin

    from torch._inductor import config

    name = key.replace("-", "_")
    if name not in known:
        short = name if name in KEYS else None
        hint = f" (fusekern's own options take the prefix: {PREFIX + short!r})" if short else ""
        raise ValueError(f"fusekern: unknown option {key!r}: neither fusekern's ({[PREFIX + k for k in KEYS]}) nor an "
                         f"inductor config{hint}")
    kind = config.get_type(name) if hasattr(config, "get_type") else None
    if isinstance(kind, type) and get_origin(kind) is None and not isinstance(value, kind):
        raise TypeError(f"fusekern: inductor option {key!r} takes a {kind.__name__}, got {type(value).__name__} "
                        f"{value!r}")
    return name, value
