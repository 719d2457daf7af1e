"""The ``qcomm`` config section, generated from ``QCommConfig``; shared by both torchtitan adapters.

torchtitan 0.2.2 merges it into its job config as the ``[qcomm]`` TOML section
(``fsdp_qcomm.titan.config``); torchtitan 0.3 has it as the ``qcomm`` field of the trainer's
``Config`` (``fsdp_qcomm.titan03.trainer``). Both parse CLI flags with tyro, so
``--qcomm.weight_bits 8`` works the same way in either, after the TOML file or the recipe
function has set its values.

The section is *generated* from the fields of ``fsdp_qcomm.config.QCommConfig``, so it cannot
drift from the library's configuration:

* ``preset`` (str, default ``"baseline"``) names ``QCommConfig.preset(name)``, a dataclass
  instance with a ``PRESETS`` mapping of known names;
* every ``QCommConfig`` field ``f`` becomes an optional override ``f`` (default: unset, meaning
  "whatever the preset says"), with the same type.

Values are checked when the section is built (TOML or recipe function) and again after CLI
overrides: each value must have its field's type (TOML values bypass tyro's parsing, so this is
checked here), and the resolved ``QCommConfig`` must construct, which runs the library's own
range checks. Resolution is ``QCommConfig.preset(preset).replace(**overrides)``.
Errors name the section and field, e.g. ``[qcomm] weight_bits=99: ...``. Unknown keys are
rejected by torchtitan 0.2.2 (``Invalid field names in ... {'foo'}``) and by tyro
(``Unrecognized options: --qcomm.foo``).

Two fields are the section's own, not ``QCommConfig``'s: ``exclude_modules`` (comma-separated
``fnmatch`` patterns of FSDP module names kept on FSDP2's own collectives: ``enable``'s
``module_filter_fn``) and ``module_presets`` (``"pattern=preset,..."``: those modules use that
preset, with this section's per-call fields: ``enable``'s ``module_configs``), e.g.
``--qcomm.preset lowbit --qcomm.module_presets "tok_embeddings=sdp4bit,output=sdp4bit"``.

Limitation: TOML has no null, so an override cannot set a field to ``None`` explicitly (unset
already means "the preset's value", and no preset sets a None-able field today).
"""

# NOTE: no ``from __future__ import annotations`` here: torchtitan 0.2.2's ConfigManager checks
# ``dataclasses.is_dataclass(field.type)`` to recurse into sections, which fails on strings.

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal, Optional, Union

import tyro

from fsdp_qcomm.config import QCommConfig

SECTION = "qcomm"


def qcomm_config_class() -> type:
    """The dataclass the ``[qcomm]`` section mirrors: ``fsdp_qcomm.config.QCommConfig``."""
    return QCommConfig


def preset_names(source: Optional[type] = None) -> list:
    return list((source or qcomm_config_class()).PRESETS)


# --------------------------------------------------------------------------- type checks
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    return getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _matches(value, typing.get_args(tp)[0])
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # a type we do not know how to check: leave it to QCommConfig


# --------------------------------------------------------------------------- the section
def _section_post_init(self) -> None:
    hints = self._field_types
    for name, tp in hints.items():
        value = getattr(self, name)
        if value is None and name != "preset":
            continue
        if not _matches(value, tp):
            raise ValueError(
                f"[{SECTION}] {name}={value!r} has type {type(value).__name__}; "
                f"expected {_type_name(tp)}"
            )
    known = preset_names(self._source)
    if self.preset not in known:
        raise ValueError(
            f"[{SECTION}] preset={self.preset!r} is not a known preset; "
            f"known presets: {', '.join(known)}"
        )
    try:
        self.resolve()
    except (ValueError, TypeError) as e:
        set_fields = ", ".join(f"{k}={v!r}" for k, v in self.overrides().items())
        raise ValueError(
            f"[{SECTION}] preset={self.preset!r}"
            + (f" with {set_fields}" if set_fields else "")
            + f" is invalid: {e}"
        ) from None


#: the section's own fields (not QCommConfig's): which modules get which configuration
MODULE_FIELDS = ("exclude_modules", "module_presets")


def _section_overrides(self) -> dict:
    """The QCommConfig fields set in TOML/CLI (not ``preset``, not ``MODULE_FIELDS``)."""
    return {
        f.name: getattr(self, f.name)
        for f in dataclasses.fields(self)
        if f.name != "preset" and f.name not in MODULE_FIELDS and getattr(self, f.name) is not None
    }


def _patterns(text: Optional[str]) -> list:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _section_module_choice(self) -> dict:
    """``enable``'s ``module_filter_fn`` and ``module_configs`` from ``exclude_modules`` and
    ``module_presets`` (both None when unset)."""
    import fnmatch

    from fsdp_qcomm.fsdp.module_choice import CALL_FIELDS

    out: dict = {"module_filter_fn": None, "module_configs": None}
    excluded = _patterns(self.exclude_modules)
    if excluded:
        def keep(module, fqn, _pats=tuple(excluded)):
            return not any(fnmatch.fnmatchcase(fqn, p) for p in _pats)

        out["module_filter_fn"] = keep
    pairs = _patterns(self.module_presets)
    if pairs:
        base = self.resolve()
        configs = {}
        for pair in pairs:
            pattern, sep, name = pair.partition("=")
            if not sep or not pattern.strip() or name.strip() not in preset_names(self._source):
                raise ValueError(
                    f"[{SECTION}] module_presets entry {pair!r}: expected pattern=preset with a "
                    f"known preset ({', '.join(preset_names(self._source))})")
            configs[pattern.strip()] = self._source.preset(name.strip()).replace(
                **{f: getattr(base, f) for f in CALL_FIELDS})
        out["module_configs"] = configs
    return out


def _section_resolve(self):
    """The ``QCommConfig`` this section describes: the preset with the overrides applied.

    ``replace`` rather than ``preset(name, **overrides)`` so that a field called ``name``
    cannot collide with ``preset``'s parameter; both construct (and validate) anew, and refuse
    widths set next to a ``bit_budget`` (``QCommConfig.replace``).
    """
    base = self._source.preset(self.preset)
    overrides = self.overrides()
    if not overrides:
        return base
    replace = getattr(base, "replace", None)  # QCommConfig's checks the bit budget
    return replace(**overrides) if callable(replace) else dataclasses.replace(base, **overrides)


def make_section_class(source: Optional[type] = None, name: str = "QComm") -> type:
    """Build the ``[qcomm]`` dataclass from ``source``'s fields (see module docstring)."""
    source = source or qcomm_config_class()
    hints = typing.get_type_hints(source)
    spec: list = [
        (
            "preset",
            typing.Annotated[
                str,
                tyro.conf.arg(help="QCommConfig preset: " + ", ".join(preset_names(source))),
            ],
            field(default="baseline"),
        )
    ]
    field_types: dict = {"preset": str}
    for extra, text in (
        ("exclude_modules", "comma-separated fnmatch patterns of FSDP module names kept on "
                            "FSDP2's own collectives (enable's module_filter_fn)"),
        ("module_presets", "pattern=preset,... : those FSDP modules use that preset "
                           "(enable's module_configs)"),
    ):
        spec.append((extra, typing.Annotated[Optional[str], tyro.conf.arg(help=text)],
                     field(default=None)))
        field_types[extra] = str
    for f in dataclasses.fields(source):
        if f.name == "preset":
            raise TypeError(f"{source.__name__} has a field named 'preset', which [qcomm] reserves")
        if f.name in MODULE_FIELDS:
            raise TypeError(f"{source.__name__} has a field named {f.name!r}, which [qcomm] "
                            "reserves")
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else "<required>"
        spec.append(
            (
                f.name,
                typing.Annotated[
                    Optional[tp],
                    tyro.conf.arg(
                        help=f"override QCommConfig.{f.name} ({_type_name(tp)}; library "
                        f"default {default!r}); unset = the preset's value"
                    ),
                ],
                field(default=None),
            )
        )
        field_types[f.name] = tp
    cls = dataclasses.make_dataclass(
        name,
        spec,
        namespace={
            "__post_init__": _section_post_init,
            "overrides": _section_overrides,
            "resolve": _section_resolve,
            "module_choice": _section_module_choice,
            "_source": source,
            "_field_types": field_types,
            "__doc__": f"[{SECTION}] section mirroring {source.__module__}.{source.__name__}.",
        },
    )
    cls.__module__ = __name__  # make_dataclass(module=...) needs Python 3.12
    return cls


QComm = make_section_class()


def section_of(job_config: Any) -> Any:
    """The ``[qcomm]`` section of a parsed job config, or None if the module was not merged."""
    return getattr(job_config, SECTION, None)


def resolve(job_config: Any):
    """The ``QCommConfig`` for a parsed job config (the default preset if [qcomm] is absent)."""
    section = section_of(job_config)
    if section is None:
        section = QComm()
    return section.resolve()
