"""The ``[qcomm]`` TOML section (and ``--qcomm.<field>`` CLI flags) for torchtitan 0.2.2.

Use it with ``[job] custom_config_module = "fsdp_qcomm.titan.config"``. torchtitan merges this
module's :class:`JobConfig` into its own, so ``[qcomm]`` parses like any built-in section:
TOML values first, then CLI flags (``--qcomm.weight_bits 8``) win. The section itself, its
checks and its errors are shared with the torchtitan 0.3 adapter
(``fsdp_qcomm.titan_common.section``).
"""

# NOTE: no ``from __future__ import annotations`` here: torchtitan 0.2.2's ConfigManager checks
# ``dataclasses.is_dataclass(field.type)`` to recurse into sections, which fails on strings.

from dataclasses import dataclass, field

from fsdp_qcomm.titan_common.diloco import DiLoCoSection
from fsdp_qcomm.titan_common.section import (
    SECTION,
    QComm,
    make_section_class,
    preset_names,
    qcomm_config_class,
    resolve,
    section_of,
)


@dataclass
class JobConfig:
    """torchtitan ``custom_config_module`` entry point: adds the ``[qcomm]`` and ``[diloco]``
    sections (``fsdp_qcomm.titan_common.diloco``)."""

    qcomm: QComm = field(default_factory=QComm)
    diloco: DiLoCoSection = field(default_factory=DiLoCoSection)


__all__ = [
    "DiLoCoSection", "JobConfig", "QComm", "SECTION", "make_section_class", "preset_names",
    "qcomm_config_class", "resolve", "section_of",
]
