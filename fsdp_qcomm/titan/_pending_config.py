"""PLACEHOLDER for ``fsdp_qcomm.config.QCommConfig`` until branch main provides it.

Delete this file once ``fsdp_qcomm.config`` exists: ``config.qcomm_config_class()`` prefers the
real class and only falls back to this one when ``fsdp_qcomm.config`` cannot be imported. It has
just the fields the titan integration was briefed with and the preset *names*; it attaches no
meaning to presets (nothing here quantizes anything).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional


@dataclass(frozen=True)
class PendingQCommConfig:
    weight_bits: int = 4
    grad_hadamard: bool = False
    ranks_per_node: Optional[int] = None
    seed: int = 0

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "baseline": {},
        "sdp4bit": {},
        "qsdp": {},
        "zeropp": {},
        "qw4": {},
    }

    def __post_init__(self) -> None:
        if isinstance(self.weight_bits, bool) or not 2 <= self.weight_bits <= 8:
            raise ValueError(f"QCommConfig.weight_bits={self.weight_bits!r} must be in [2, 8]")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"QCommConfig.ranks_per_node={self.ranks_per_node} must be >= 1")
        if self.seed < 0:
            raise ValueError(f"QCommConfig.seed={self.seed} must be >= 0")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "PendingQCommConfig":
        if name not in cls.PRESETS:
            raise ValueError(
                f"unknown QCommConfig preset {name!r}; known presets: {', '.join(cls.PRESETS)}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown QCommConfig field(s) {unknown}")
        return cls(**{**cls.PRESETS[name], **overrides})
