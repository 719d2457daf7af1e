"""Several seeds per benchmark row: bookkeeping of the runs and the statistics of the table.

A difference smaller than the seed-to-seed spread is not a finding, so the accuracy benchmarks
train every row under several seeds and report the mean and standard deviation of the final
validation loss, and the gap to the baseline paired by seed (same seed = same initial weights
and batches, so the pairing removes most of the shared noise) with its 95% confidence
interval (Student's t, n - 1 degrees of freedom).

A row's verdict answers the question the tables exist for, "does this scheme cost more than
+0.5% loss?", from that interval alone (``verdict``): "within +0.5%" when its upper bound is
at most ``CLAIM_PCT``, "worse" when its lower bound is above ``WORSE_ABOVE_PCT`` (0: the
scheme's loss is measurably higher than the baseline's) and the first does not hold, else
"undecided" (one seed, or an interval that straddles both thresholds: more seeds or a quieter
measurement would settle it). ``docs/accuracy_method.md`` says where the spread came from and
what the measurement does to shrink it.

``RunStore`` keeps one JSON file per (row, seed) under ``<out>/runs/``. A long sweep can stop
and resume (finished runs are skipped), or be split by row or seed across invocations sharing
``--out``; the report is built from every run in the store. Runs made under other settings
(steps, model size, ...) or with another definition of a row are refused, naming the
difference, instead of being averaged with the new ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


#: a gap is "within +0.5%" when the upper bound of its 95% interval is at most this (percent)
CLAIM_PCT = 0.5
#: a gap is "worse" when the lower bound of its 95% interval is above this (percent)
WORSE_ABOVE_PCT = 0.0
WORSE = "worse"
UNDECIDED = "undecided"


def within(claim_pct: float = CLAIM_PCT) -> str:
    """The verdict's word for a gap whose upper bound is at most ``claim_pct`` percent."""
    return f"within +{claim_pct}%"


WITHIN = within()


def seed_list(first: int, n: int) -> list[int]:
    """The seeds of a sweep: ``first, first + 1, ..., first + n - 1``."""
    if n < 1:
        raise ValueError(f"--seeds {n}: need at least one seed")
    return [first + i for i in range(n)]


@dataclass(frozen=True)
class Spread:
    """Mean, sample standard deviation and 95% CI half-width of ``n`` values."""

    n: int
    mean: float
    sd: float
    ci95: float

    @property
    def beyond_noise(self) -> Optional[bool]:
        """Whether the 95% interval excludes 0 (None with fewer than 2 values)."""
        return None if self.n < 2 else abs(self.mean) > self.ci95

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mean": self.mean, "sd": self.sd, "ci95": self.ci95,
                "beyond_noise": self.beyond_noise}


def spread(values: Sequence[float]) -> Spread:
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("no values to summarize")
    n = len(xs)
    mean = sum(xs) / n
    if n == 1:
        return Spread(1, mean, 0.0, math.inf)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    t = _T95[n - 2] if n - 1 <= len(_T95) else 1.960
    return Spread(n, mean, sd, t * sd / math.sqrt(n))


def paired_gap_pct(values: dict[int, float], base: dict[int, float]) -> Optional[Spread]:
    """``100 * (value - base) / base`` over the seeds both have (None if they share none)."""
    common = sorted(set(values) & set(base))
    if not common:
        return None
    return spread([100.0 * (values[s] - base[s]) / base[s] for s in common])


def fmt_spread(s: Optional[Spread], digits: int = 5, unit: str = "") -> str:
    """``mean ± sd`` (just the value for one seed, "-" for none)."""
    if s is None:
        return "-"
    sign = "+" if unit == "%" else ""
    if s.n == 1:
        return f"{s.mean:{sign}.{digits}f}{unit}"
    return f"{s.mean:{sign}.{digits}f}{unit} ± {s.sd:.{digits}f}{unit}"


def fmt_verdict(s: Optional[Spread], digits: int = 2) -> str:
    """The 95% interval of a gap and whether it excludes 0."""
    if s is None:
        return "-"
    if s.n < 2:
        return "1 seed: no spread"
    lo, hi = s.mean - s.ci95, s.mean + s.ci95
    word = "beyond seed noise" if s.beyond_noise else "within seed noise"
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}]%: {word}"


def interval(s: Spread) -> tuple[float, float]:
    """The 95% interval ``mean -+ ci95`` (infinite with one value)."""
    return s.mean - s.ci95, s.mean + s.ci95


def verdict(s: Optional[Spread], claim_pct: float = CLAIM_PCT) -> str:
    """``within(claim_pct)`` (upper bound <= ``claim_pct``, ``CLAIM_PCT`` = +0.5% unless a
    benchmark asks another tolerance: DiLoCo's is +1.0%), else ``WORSE`` (lower bound >
    ``WORSE_ABOVE_PCT``), else ``UNDECIDED`` (also for one seed or no gap). An interval inside
    (0, claim] is "within": the claim is about the tolerance; ``interval`` shows it is above
    0."""
    if s is None or s.n < 2 or not math.isfinite(s.ci95):
        return UNDECIDED
    lo, hi = interval(s)
    if hi <= claim_pct:
        return within(claim_pct)
    if lo > WORSE_ABOVE_PCT:
        return WORSE
    return UNDECIDED


def ordering(s: Optional[Spread], a: str, b: str) -> str:
    """For the paired gap of ``a`` against ``b``: "A lower" when its 95% interval lies below 0,
    "B lower" when above, else "undecided" (also with one seed)."""
    if s is None or s.n < 2 or not math.isfinite(s.ci95):
        return UNDECIDED
    lo, hi = interval(s)
    if hi < 0:
        return f"{a} lower"
    if lo > 0:
        return f"{b} lower"
    return UNDECIDED


def fmt_interval(s: Optional[Spread], digits: int = 2) -> str:
    """``[lo, hi]%`` of a gap ("-" for none, "1 seed" without a spread)."""
    if s is None:
        return "-"
    if s.n < 2:
        return "1 seed"
    lo, hi = interval(s)
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}]%"


def file_digest(path: str | Path) -> str:
    """Name and content hash of a data file: what a run's setup records, so that checkouts at
    different paths can share stored runs, and a changed file cannot."""
    p = Path(path)
    return f"{p.name} sha256:{hashlib.sha256(p.read_bytes()).hexdigest()[:16]}"


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", label).strip("_") or "row"


class SetupMismatch(ValueError):
    pass


class RunStore:
    """One JSON file per (row label, seed): ``{"setup", "row", "seed", "record"}``.

    ``setup`` is what every run of one table must share (model, data, steps, ...); ``row`` is
    the definition of the row (its preset, overrides, mesh), which must not change under the
    same label.
    """

    def __init__(self, root: Path, setup: dict[str, Any]) -> None:
        self.root = Path(root)
        self.dir = self.root / "runs"
        self.setup = json.loads(json.dumps(setup))  # as stored: tuples become lists

    def path(self, label: str, seed: int) -> Path:
        return self.dir / f"{_slug(label)}__seed{seed}.json"

    def _check(self, got: dict[str, Any], path: Path, row: Optional[dict] = None) -> None:
        diff = sorted(k for k in set(got["setup"]) | set(self.setup)
                      if got["setup"].get(k) != self.setup.get(k))
        if diff:
            what = ", ".join(f"{k}: stored {got['setup'].get(k)!r}, now {self.setup.get(k)!r}"
                             for k in diff)
            raise SetupMismatch(
                f"{path} was made under other settings ({what}); pass another --out (or "
                f"remove {self.dir} to start over)"
            )
        if row is not None and json.loads(json.dumps(row)) != got["row"]:
            raise SetupMismatch(
                f"{path}: row {got['label']!r} was defined as {got['row']}, now as {row}; "
                "rename the row or pass --fresh"
            )

    def load(self, label: str, seed: int, row: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The stored record of (label, seed), or None if it was not run yet."""
        p = self.path(label, seed)
        if not p.is_file():
            return None
        got = json.loads(p.read_text())
        self._check(got, p, row)
        return got["record"]

    def save(self, label: str, seed: int, row: dict[str, Any], record: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.path(label, seed)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps({"label": label, "seed": seed, "setup": self.setup,
                                   "row": row, "record": record}, indent=1))
        tmp.replace(p)  # a killed run leaves no half-written file behind

    def seeds(self, label: str) -> list[int]:
        """The seeds stored for ``label``."""
        pre = f"{_slug(label)}__seed"
        return sorted(int(p.stem[len(pre):]) for p in self.dir.glob(f"{pre}*.json")
                      if p.stem[len(pre):].lstrip("-").isdigit()) if self.dir.is_dir() else []

    def all(self) -> dict[str, dict[str, Any]]:
        """Every stored run: ``{label: {"row": ..., "runs": {seed: record}}}``."""
        out: dict[str, dict[str, Any]] = {}
        for p in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            got = json.loads(p.read_text())
            self._check(got, p)
            entry = out.setdefault(got["label"], {"row": got["row"], "runs": {}})
            if entry["row"] != got["row"]:
                raise SetupMismatch(f"{p}: row {got['label']!r} is stored under two definitions")
            entry["runs"][int(got["seed"])] = got["record"]
        return out


__all__ = ["CLAIM_PCT", "UNDECIDED", "WITHIN", "WORSE", "WORSE_ABOVE_PCT", "RunStore",
           "SetupMismatch", "Spread", "file_digest", "fmt_interval", "fmt_spread", "fmt_verdict",
           "interval", "ordering", "paired_gap_pct", "seed_list", "spread", "verdict", "within"]

