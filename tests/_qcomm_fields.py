"""Every ``QCommConfig`` field set to each other value it can take, on a preset where that value
is valid: what the torchtitan tests feed through each version's config parser and through the
hooks and the figures, so that no field or preset can crash a run unnoticed.

Values come from :data:`CHOICES` for fields whose type says too little (a plain ``str``, a
float), else from the field's type (every other ``Literal`` choice, the other ``bool``, the
first valid of default-1 / default+1 / default*2 for ints, 1 and 2 for an optional int); a new
field of a type this module cannot vary fails :func:`field_variants` by name.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from fsdp_qcomm.config import QCommConfig

#: other values of the fields whose type does not say which values are valid
CHOICES = {"scale_dtype": ("bfloat16", "float16"), "bit_budget": (3.0, 5.5),
           "grad_error_feedback_decay": (0.5,)}
#: (preset, overrides) tried for each value, the ones that quantize most first
BASES: tuple[tuple[str, dict], ...] = (
    ("sdp4bit", {}), ("qsdp", {}), ("zeropp", {}), ("qw4", {}), ("qwd", {}), ("tlq", {}),
    ("tlq_hs", {}), ("baseline", {}),
    # where the error-feedback options take effect (tried last: only fields no other base takes)
    ("sdp4bit", {"grad_error_feedback": "inter"}),
)
#: QSDP with learned levels on both sides: where the ``levels_*`` fields take effect
LEARNED = ("qsdp", {"weight_levels": "learned", "grad_levels": "learned"})


def _candidates(f: dataclasses.Field, tp: Any) -> list:
    if f.name in CHOICES:
        return list(CHOICES[f.name])
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return [a for a in args if a != f.default]
    if tp is bool:
        return [not f.default]
    if tp is int:
        return [v for v in (f.default - 1, f.default + 1, f.default * 2) if v != f.default]
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if inner == [int]:
            return [1, 2]
        if inner == [bool]:
            return [True, False]
    raise TypeError(
        f"tests/_qcomm_fields.py cannot vary QCommConfig.{f.name} ({tp}); add its values to "
        "CHOICES or teach _candidates its type"
    )


def _changes(preset: str, base: dict, name: str, value: Any) -> bool:
    """The value is valid on this base and differs from what the base already has."""
    try:
        return QCommConfig.preset(preset, **base, **{name: value}) != QCommConfig.preset(
            preset, **base)
    except ValueError:
        return False


def field_variants() -> list[tuple[str, str, dict]]:
    """``(id, preset, overrides)``: every preset as it is, QSDP with learned levels, then every
    field at each other value (ints: the first valid one) on the first of :data:`BASES` where
    that value is valid and changes the configuration (``levels_*`` fields: on
    :data:`LEARNED`, where they take effect)."""
    out = [(f"preset-{p}", p, {}) for p in QCommConfig.PRESETS]
    out.append(("learned@qsdp", LEARNED[0], dict(LEARNED[1])))
    hints = typing.get_type_hints(QCommConfig)
    for f in dataclasses.fields(QCommConfig):
        tp = hints[f.name]
        bases = (LEARNED,) if f.name.startswith("levels_") else BASES
        found = False
        for value in _candidates(f, tp):
            base = next((b for b in bases if _changes(*b, f.name, value)), None)
            if base is None:
                continue
            preset, extra = base
            out.append((f"{f.name}={value}@{preset}", preset, {**extra, f.name: value}))
            found = True
            if tp is int or typing.get_origin(tp) is typing.Union:
                break
        if not found:
            raise AssertionError(f"no valid non-default value found for QCommConfig.{f.name}")
    return out


def cli_value(value: Any) -> str:
    """The value as a tyro CLI flag reads it."""
    return str(value)


def toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value + '"'
    return repr(value)
