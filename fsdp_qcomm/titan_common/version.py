"""Which torchtitan is installed, and a clear error when an adapter does not fit it.

One environment holds one torchtitan: 0.2.x (TOML job files) takes ``fsdp_qcomm.titan``,
0.3.x (Python config registry) takes ``fsdp_qcomm.titan03``. Each adapter calls
:func:`require_torchtitan` when it is imported, so the wrong one fails at once with the fix in
the message instead of with an ``AttributeError`` deep inside torchtitan.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from typing import Optional

#: set to 1 to skip the check (a torchtitan build from source that reports another version)
SKIP_ENV = "FSDP_QCOMM_SKIP_TORCHTITAN_CHECK"

#: adapter module -> (lowest version, first version not supported, pip extra)
ADAPTERS: dict[str, tuple[tuple[int, ...], tuple[int, ...], str]] = {
    "fsdp_qcomm.titan": ((0, 2, 2), (0, 3), "titan"),
    "fsdp_qcomm.titan03": ((0, 3, 0), (0, 4), "titan03"),
}


class TorchtitanVersionError(RuntimeError):
    """The installed torchtitan does not match the adapter being imported.

    A ``RuntimeError``, not an ``ImportError``: torchtitan 0.3's ``--module`` loader tries
    several module paths and swallows ``ImportError`` between tries, which would hide this
    message behind its own.
    """


def installed_version() -> Optional[str]:
    """torchtitan's version string, or None when it is not installed."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import torchtitan
    except ImportError:
        return None
    return getattr(torchtitan, "__version__", "0.0.0")


def parse_version(text: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"0.3.0.dev20260101"`` -> (0, 3, 0)."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", text)
    if m is None:
        raise ValueError(f"cannot read a release number from the version {text!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def require_torchtitan(adapter: str) -> str:
    """Raise :class:`TorchtitanVersionError` unless torchtitan fits ``adapter``; returns the
    installed version."""
    lo, hi, extra = ADAPTERS[adapter]
    want = f">={_fmt(lo)},<{_fmt(hi)}"
    version = installed_version()
    if version is None:
        raise TorchtitanVersionError(
            f"{adapter} needs torchtitan {want}, which is not installed; "
            f"pip install 'fsdp-qcomm[{extra}]'"
        )
    if os.environ.get(SKIP_ENV) == "1":
        return version
    if not lo <= parse_version(version) < hi:
        fits = [a for a, (alo, ahi, _) in ADAPTERS.items()
                if alo <= parse_version(version) < ahi]
        hint = (f"use {fits[0]} instead" if fits else
                "no fsdp_qcomm adapter supports it")
        raise TorchtitanVersionError(
            f"{adapter} is the integration for torchtitan {want}, but torchtitan {version} is "
            f"installed: {hint}, or pip install 'fsdp-qcomm[{extra}]' for this one "
            f"(set {SKIP_ENV}=1 to try anyway)"
        )
    return version


__all__ = ["ADAPTERS", "SKIP_ENV", "TorchtitanVersionError", "installed_version",
           "parse_version", "require_torchtitan"]
