"""One entry point for the measurement campaigns: a campaign file lists jobs (workload, rows,
seeds); the runner trains the pending ones one at a time and stores each as it finishes.

    OMP_NUM_THREADS=1 python benchmarks/campaign.py benchmarks/campaigns/accuracy.toml \\
        [--plan] [--report-only] [--only WORKLOAD] [--max-runs N] [--stop-after MIN] \\
        [--commit-every MIN]

A campaign file (TOML) has three parts:

* ``[workloads.NAME]``: ``kind`` (``accuracy``: the rows of ``accuracy.py`` and
  ``frontier.py``, trained by ``accuracy.py``'s loop; ``diloco``: ``diloco.py``'s rows and
  loop), ``out`` (the results folder: its ``runs/`` store), and ``args``, the kind's own
  command-line arguments (model, data, steps, evaluation), which fix the store's setup;
* ``[rows.LABEL]``: rows the campaign adds to its kind's registry (``preset``, ``overrides``,
  ``hsdp`` for accuracy rows; ``preset``/``overrides`` for per-step HSDP rows of the DiLoCo
  kind, ``diloco`` for its DiLoCo rows: ``DiLoCoConfig`` fields, e.g. ``diloco = {
  sync_every = 32, bits = 4, outer_lr = 0.5, outer_momentum = 0.9 }``), each checked against
  its config before anything trains;
* ``[[jobs]]``: ``workload``, ``rows`` and ``seeds`` (a list, or ``"FIRST-LAST"``), and a
  ``note`` saying why. Jobs run in file order, seed by seed, every row of a seed before the
  next seed: a paired gap needs the baseline and the row of the same seed, so an interrupted
  campaign leaves complete pairs behind. A (row, seed) an earlier job names is listed and
  counted once, under the earlier job (a sweep's runs that a later verdict job reuses).

A job whose run is stored (same setup, same row definition: ``_seeds.RunStore``) is skipped,
so the runner resumes where it stopped, and a campaign can grow by editing its file. Each run
is a fresh group of gloo ranks (``fsdp_qcomm.testing.run_ranks``; ~0.3 s to start) and carries
its own provenance (commit, start, end, load average: ``_provenance.RunClock``); every
invocation is recorded in each workload folder's ``provenance.json``. After every run the
workload's tables are rebuilt from whatever is stored (``--report-only``: only that).
``--stop-after MIN`` starts no run after MIN minutes (a machine needed for something else
gets it back between runs); ``--commit-every MIN`` commits the campaign's results folders
(and nothing else) whenever MIN minutes have passed since the last commit, and at the end.

Nothing else heavy should run beside a campaign (a test suite, a second training): the load
average each run records says whether it did.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

try:
    import tomllib
except ImportError:  # Python 3.10: the titan extra's tomli
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import _provenance  # noqa: E402
from _seeds import RunStore, SetupMismatch  # noqa: E402

KINDS = ("accuracy", "diloco")


class CampaignError(ValueError):
    """A campaign file that cannot be run as written (the message names the fix)."""


@dataclass
class Workload:
    name: str
    kind: str
    out: Path
    args: list[str]
    rows: list[str] = field(default_factory=list)  # every row its jobs name


@dataclass(frozen=True)
class Job:
    workload: str
    row: str
    seed: int
    note: str = ""


def _seeds(value: Any, where: str) -> list[int]:
    if isinstance(value, str) and "-" in value.strip("-"):
        lo, hi = value.split("-", 1)
        try:
            first, last = int(lo), int(hi)
        except ValueError:
            raise CampaignError(f"{where}: seeds {value!r} is not FIRST-LAST") from None
        if last < first:
            raise CampaignError(f"{where}: seeds {value!r} ends before it starts")
        return list(range(first, last + 1))
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return list(value)
    if isinstance(value, int):
        return [value]
    raise CampaignError(f"{where}: seeds must be a list of integers or 'FIRST-LAST', "
                        f"got {value!r}")


def load(path: Path) -> tuple[dict[str, Workload], dict[str, dict], list[Job]]:
    """The campaign file's workloads, added rows and jobs (in run order), checked."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CampaignError(f"{path}: {e}") from None
    unknown = set(doc) - {"title", "workloads", "rows", "jobs"}
    if unknown:
        raise CampaignError(f"{path}: unknown top-level keys {sorted(unknown)} (title, "
                            "workloads, rows, jobs)")
    workloads = {}
    for name, w in doc.get("workloads", {}).items():
        bad = set(w) - {"kind", "out", "args"}
        if bad or w.get("kind") not in KINDS or "out" not in w:
            raise CampaignError(
                f"{path}: [workloads.{name}] needs kind (one of {KINDS}) and out, and may have "
                f"args" + (f"; unknown keys {sorted(bad)}" if bad else ""))
        args = w.get("args", [])
        if not (isinstance(args, list) and all(isinstance(x, str) for x in args)):
            raise CampaignError(f"{path}: [workloads.{name}] args must be a list of strings")
        forbidden = [x for x in args if x.split("=")[0] in ("--out", "--seed", "--seeds",
                                                             "--schemes", "--rows")]
        if forbidden:
            raise CampaignError(f"{path}: [workloads.{name}] args {forbidden}: the folder, the "
                                "seeds and the rows come from out and the jobs")
        out = Path(w["out"])
        workloads[name] = Workload(name, w["kind"], out if out.is_absolute() else REPO / out,
                                   list(args))
    rows = dict(doc.get("rows", {}))
    jobs: list[Job] = []
    seen: set[tuple[str, str, int]] = set()
    for i, j in enumerate(doc.get("jobs", [])):
        where = f"{path}: jobs[{i}]"
        bad = set(j) - {"workload", "rows", "seeds", "note"}
        if bad:
            raise CampaignError(f"{where}: unknown keys {sorted(bad)}")
        if j.get("workload") not in workloads:
            raise CampaignError(f"{where}: workload {j.get('workload')!r} is not one of "
                                f"{sorted(workloads)}")
        labels = j.get("rows")
        if not (isinstance(labels, list) and labels and all(isinstance(r, str) for r in labels)):
            raise CampaignError(f"{where}: rows must be a non-empty list of row labels")
        w = workloads[j["workload"]]
        for seed in _seeds(j.get("seeds"), where):
            for label in labels:
                if (w.name, label, seed) in seen:  # an earlier job's run: listed, trained once
                    continue
                seen.add((w.name, label, seed))
                jobs.append(Job(w.name, label, seed, j.get("note", "")))
                if label not in w.rows:
                    w.rows.append(label)
    return workloads, rows, jobs


# ---- the kinds: how a workload's arguments, rows, store, training and report are made ---------
def _accuracy_rows(extra: dict[str, dict]):
    import accuracy
    import frontier

    known = {**accuracy.SCHEMES, **frontier.ROWS}
    for label, spec in extra.items():
        bad = set(spec) - {"preset", "overrides", "hsdp"}
        if bad:
            raise CampaignError(f"[rows.{label!r}]: unknown keys {sorted(bad)} for an accuracy "
                                "row (preset, overrides, hsdp)")
        row = accuracy.Scheme(spec.get("preset"), dict(spec.get("overrides", {})),
                              bool(spec.get("hsdp", False)))
        if label in known and known[label] != row:
            raise CampaignError(f"[rows.{label!r}] redefines a built-in row; choose another "
                                "label")
        known[label] = row
    return known


def _diloco_rows(extra: dict[str, dict]):
    import diloco

    known = dict(diloco.ROWS)
    for label, spec in extra.items():
        bad = set(spec) - {"preset", "overrides", "diloco"}
        if bad:
            raise CampaignError(f"[rows.{label!r}]: unknown keys {sorted(bad)} for a DiLoCo "
                                "row (preset, overrides, diloco)")
        row = diloco.Row(spec.get("preset"), dict(spec.get("overrides", {})),
                         spec.get("diloco"))
        if label in known and known[label] != row:
            raise CampaignError(f"[rows.{label!r}] redefines a built-in row; choose another "
                                "label")
        known[label] = row
    return known


@contextmanager
def _registered(registry: dict, rows: dict):
    """``rows`` added to a script's row registry while its argument parser checks the row
    names, then the registry as it was: the rows travel to the ranks in ``a.row_defs``, and a
    process that builds several campaigns (the tests) sees no rows of an earlier one."""
    saved = dict(registry)
    registry.update(rows)
    try:
        yield
    finally:
        registry.clear()
        registry.update(saved)


class _Kind:
    """A workload's namespace of arguments, its store, a row's stored definition, the training
    function the ranks run and the report, for one kind."""

    def __init__(self, w: Workload, extra_rows: dict[str, dict]) -> None:
        self.w = w
        relevant = {k: v for k, v in extra_rows.items() if k in w.rows}
        if w.kind == "accuracy":
            import accuracy

            defs = _accuracy_rows(relevant)
            unknown = [r for r in w.rows if r not in defs]
            if unknown:
                raise CampaignError(f"workload {w.name}: unknown rows {unknown}; add them "
                                    "under [rows] or pick from accuracy.py / frontier.py")
            try:
                with _registered(accuracy.SCHEMES, {k: defs[k] for k in w.rows}):
                    a = accuracy._args([*w.args, "--schemes", ",".join(w.rows),
                                        "--out", str(w.out)])
            except SystemExit as e:
                raise CampaignError(f"workload {w.name}: its args do not parse") from e
            a.row_defs = {k: defs[k] for k in w.rows}
            self.a, self._row = a, lambda label: accuracy._row(label, a.row_defs)
            self.train = accuracy._train_all
            self.store = RunStore(w.out, accuracy._setup(a))
        else:
            import diloco

            defs = _diloco_rows(relevant)
            unknown = [r for r in w.rows if r not in defs]
            if unknown:
                raise CampaignError(f"workload {w.name}: unknown rows {unknown}; add them "
                                    "under [rows] or pick from diloco.py")
            try:
                with _registered(diloco.ROWS, {k: defs[k] for k in w.rows}):
                    a = diloco._args([*w.args, "--rows", ",".join(w.rows),
                                      "--out", str(w.out)])
            except SystemExit as e:
                raise CampaignError(f"workload {w.name}: its args do not parse") from e
            a.row_defs = {k: defs[k] for k in w.rows}
            self.a, self._row = a, lambda label: diloco._row(label, a.row_defs)
            self.train = diloco._train_all
            self.store = RunStore(w.out, diloco.setup_of(a))

    def row(self, label: str) -> dict[str, Any]:
        return self._row(label)

    def check_rows(self) -> None:
        """Every row resolves to a valid configuration (before anything trains)."""
        for label in self.w.rows:
            try:
                self.row(label)
            except (TypeError, ValueError) as e:
                raise CampaignError(f"workload {self.w.name}, row {label!r}: {e}") from None

    def stored(self, job: Job) -> bool:
        return self.store.load(job.row, job.seed, self.row(job.row)) is not None

    def report(self) -> Optional[str]:
        if self.w.kind == "accuracy":
            import frontier

            return frontier.write_report(self.a, self.store)
        import diloco

        return diloco.write_report(self.a, self.store)


# ---- running -----------------------------------------------------------------------------------
def _rel(p: Path) -> str:
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def _commit(paths: list[Path], message: str) -> str:
    """Commit the results folders (only them) if anything in them changed."""
    rel = [_rel(p) for p in paths]
    # results/ is ignored (its folders are added by hand): -f adds the new run files
    subprocess.run(["git", "-C", str(REPO), "add", "-f", "--", *rel], check=True)
    staged = subprocess.run(["git", "-C", str(REPO), "diff", "--cached", "--quiet", "--", *rel])
    if staged.returncode == 0:
        return "nothing new to commit"
    subprocess.run(["git", "-C", str(REPO), "commit", "-q", "-m", message, "--", *rel],
                   check=True)
    return "committed"


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("campaign", type=Path, help="the campaign file (TOML)")
    ap.add_argument("--plan", action="store_true",
                    help="list every job with whether it is stored, train nothing")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: rebuild every workload's tables from its store")
    ap.add_argument("--only", default=None, help="run only this workload's jobs")
    ap.add_argument("--max-runs", type=int, default=None, help="stop after training N runs")
    ap.add_argument("--stop-after", type=float, default=None, metavar="MIN",
                    help="start no run after MIN minutes")
    ap.add_argument("--commit-every", type=float, default=None, metavar="MIN",
                    help="commit the results folders every MIN minutes and at the end")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        workloads, extra_rows, jobs = load(a.campaign)
        if a.only is not None and a.only not in workloads:
            raise CampaignError(f"--only {a.only!r}: the campaign's workloads are "
                                f"{sorted(workloads)}")
        kinds = {name: _Kind(w, extra_rows) for name, w in workloads.items()
                 if a.only in (None, name) and w.rows}  # a workload no job names yet: idle
        for k in kinds.values():
            k.check_rows()
        jobs = [j for j in jobs if j.workload in kinds]
        pending = [j for j in jobs if not kinds[j.workload].stored(j)]
    except (CampaignError, SetupMismatch) as e:
        print(f"campaign: {e}", file=sys.stderr)
        return 2
    print(f"campaign {a.campaign}: {len(jobs)} job(s), {len(jobs) - len(pending)} stored, "
          f"{len(pending)} to train", flush=True)
    if a.plan:
        for j in jobs:
            mark = "todo  " if j in pending else "stored"
            print(f"  {mark} {j.workload:12s} {j.row:28s} seed {j.seed}"
                  + (f"  ({j.note})" if j.note else ""))
        return 0
    for name, k in kinds.items():
        k.w.out.mkdir(parents=True, exist_ok=True)
        _provenance.record(k.w.out, argv=None if argv is None else [__file__, *argv],
                           notes=f"campaign {a.campaign.name}, workload {name}")
    from fsdp_qcomm.testing import run_ranks

    t0 = last_commit = time.monotonic()
    trained = 0
    for j in [] if a.report_only else pending:
        if a.max_runs is not None and trained >= a.max_runs:
            print(f"campaign: --max-runs {a.max_runs} reached", flush=True)
            break
        if a.stop_after is not None and time.monotonic() - t0 > 60 * a.stop_after:
            print(f"campaign: --stop-after {a.stop_after:g} min reached", flush=True)
            break
        k = kinds[j.workload]
        if k.stored(j):  # stored meanwhile (a twin of this computation, another invocation)
            continue
        t = time.monotonic()
        print(f"campaign: {j.workload} {j.row} seed {j.seed} "
              f"({pending.index(j) + 1}/{len(pending)})", flush=True)
        run_ranks(k.train, k.a.world, k.a, k.store, [(j.row, j.seed)], timeout=6 * 3600)
        trained += 1
        k.report()
        print(f"campaign: stored in {time.monotonic() - t:.0f} s; {trained} trained in "
              f"{(time.monotonic() - t0) / 60:.1f} min", flush=True)
        if a.commit_every is not None and time.monotonic() - last_commit > 60 * a.commit_every:
            print("campaign:", _commit([k.w.out for k in kinds.values()],
                                       f"{a.campaign.stem} campaign: {trained} run(s) stored "
                                       "(benchmarks/campaign.py)"), flush=True)
            last_commit = time.monotonic()
    for name, k in kinds.items():
        md = k.report()
        if md is not None:
            print(f"\n## {name} ({_rel(k.w.out)})\n\n{md}")
    if a.commit_every is not None and trained:
        print("campaign:", _commit([k.w.out for k in kinds.values()],
                                   f"{a.campaign.stem} campaign: {trained} run(s) stored "
                                   "(benchmarks/campaign.py)"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
