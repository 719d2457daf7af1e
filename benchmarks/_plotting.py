"""matplotlib for the benchmarks' plots, when it is installed.

Plots are an optional extra (the ``bench`` extra, or ``pip install matplotlib``): the tables are
the results, so a script without matplotlib still writes them and only skips its PNG.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional


def pyplot() -> Optional[ModuleType]:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (the scripts only save files, and
    may run with no display), or None when matplotlib is not installed: the caller says so and
    skips its plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


__all__ = ["pyplot"]
