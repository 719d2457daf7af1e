"""Which FSDP modules ``enable`` installs on, and with which configuration.

``module_filter_fn(module, fqn) -> bool`` (torchao's ``convert_to_float8_training``
convention): False keeps that FSDP module on FSDP2's own collectives, exactly as without
``enable`` (nothing installed, nothing tracked, nothing in the checkpoint state).
``module_configs``: ``{pattern: QCommConfig}``, ``fnmatch`` patterns on the FSDP module's
fully qualified name (``""`` for the model itself, matched as ``"<root>"`` too); the first
pattern that matches gives that module its configuration, the rest take ``enable``'s. Embeddings
and the head are where low bit widths hurt most (``docs/lowbit.md``), so::

    enable(model, QCommConfig.preset("lowbit"),
           module_configs={"tok_embeddings": sdp4bit, "output": sdp4bit})

Fields that belong to the whole ``enable`` call (one RNG seed, one reduction thread, one change
agreement, one node layout, one consistency cadence) must be the same in every override.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Mapping, Optional

import torch.nn as nn

from ..config import QCommConfig

ModuleFilter = Callable[[nn.Module, str], bool]

#: one value per ``enable`` call: an override that changes one is refused
CALL_FIELDS = ("seed", "grad_overlap", "verify_weight_writes", "ranks_per_node",
               "consistency_check_every")


def check_overrides(config: QCommConfig,
                    module_configs: Optional[Mapping[str, QCommConfig]]) -> dict[str, QCommConfig]:
    """The overrides as a plain dict, after refusing a non-config value or a per-call field
    that differs from ``config``'s (naming the pattern, the field and the fix)."""
    if module_configs is None:
        return {}
    if not isinstance(module_configs, Mapping):
        raise TypeError("module_configs maps fnmatch patterns of FSDP module names to "
                        f"QCommConfig, got {type(module_configs).__name__}")
    out = {}
    for pattern, cfg in module_configs.items():
        if not isinstance(pattern, str) or not isinstance(cfg, QCommConfig):
            raise TypeError(f"module_configs[{pattern!r}] must map a str pattern to a "
                            f"QCommConfig, got {type(cfg).__name__}")
        for field in CALL_FIELDS:
            if getattr(cfg, field) != getattr(config, field):
                raise ValueError(
                    f"module_configs[{pattern!r}].{field}={getattr(cfg, field)!r} differs from "
                    f"the enable() config's {getattr(config, field)!r}; {field} holds for the "
                    "whole enable() call. Give every override the same value (e.g. "
                    f"override.replace({field}={getattr(config, field)!r}))"
                )
        out[pattern] = cfg
    return out


def choose(module: nn.Module, fqn: str, config: QCommConfig,
           module_filter_fn: Optional[ModuleFilter],
           overrides: Mapping[str, QCommConfig]) -> tuple[Optional[QCommConfig], str]:
    """(the configuration of this FSDP module, the pattern that chose it or ""); the
    configuration is None when the filter keeps the module out."""
    if module_filter_fn is not None:
        keep = module_filter_fn(module, fqn)
        if not isinstance(keep, bool):
            raise TypeError(f"module_filter_fn({fqn or '<root>'!r}) returned "
                            f"{type(keep).__name__}; it must return True (quantize) or False")
        if not keep:
            return None, ""
    for pattern, cfg in overrides.items():
        if fnmatch.fnmatchcase(fqn, pattern) or (fqn == "" and pattern == "<root>"):
            return cfg, pattern
    return config, ""


def unused_patterns(overrides: Mapping[str, Any], used: set[str],
                    names: list[str]) -> tuple[list[str], str]:
    """The ``module_configs`` patterns that chose none of ``names`` (a typo more often than
    not), and the error that names them; ``enable`` refuses them once no rank used them
    (``install_agreement``)."""
    unused = [p for p in overrides if p not in used]
    shown = ", ".join(repr(n or "<root>") for n in names[:8]) + (
        f" and {len(names) - 8} more" if len(names) > 8 else "")
    return unused, (f"module_configs pattern(s) {unused} match no FSDP module (or only "
                    f"modules module_filter_fn keeps out); the FSDP modules are {shown}")


__all__ = ["CALL_FIELDS", "ModuleFilter", "check_overrides", "choose", "unused_patterns"]
