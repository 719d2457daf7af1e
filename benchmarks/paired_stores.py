"""One row of two accuracy stores, paired by seed: what a code change did to the loss.

``accuracy.py``, ``frontier.py`` and ``diloco.py`` store each (row, seed) run under ``--out``
(``_seeds.RunStore``) and compare rows against a baseline of the same store. A change to the
code (a new rounding stream, other arithmetic) is checked the other way: the same row and seeds
trained by two checkouts into two stores, ``BEFORE`` and ``AFTER``. This prints each seed's
score in both, and the paired gap of ``AFTER`` against ``BEFORE`` with its 95% interval and
which is lower (``_seeds.ordering``; "undecided" when the interval holds 0).

    python benchmarks/paired_stores.py BEFORE AFTER --row LABEL [--tail N] [--sampled]
        [--out DIR]

The score is ``accuracy.score``: the mean of the last ``--tail`` evaluations on the whole
held-out split (``--sampled``: the sampled batches). The two stores must share their setup
(model, data, steps) and the row's definition; else it says what differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _provenance  # noqa: E402
import _seeds  # noqa: E402
from accuracy import score  # noqa: E402


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path, help="the store (an --out folder) of the code before")
    p.add_argument("after", type=Path, help="the store of the code after")
    p.add_argument("--row", required=True, help="the row's label, as the stores name it")
    p.add_argument("--tail", type=int, default=3, help="evaluations averaged per run")
    p.add_argument("--sampled", action="store_true",
                   help="score on the sampled batches, not the whole held-out split")
    p.add_argument("--out", type=Path, default=None, help="also write DIR/paired.md and .json")
    return p.parse_args(argv)


def _runs(store: Path, row: str) -> tuple[dict, dict, dict]:
    """(setup, row definition, {seed: record}) of ``row`` in ``store``, read as
    ``_seeds.RunStore`` reads it (every run under one setup, a row under one definition)."""
    files = sorted((store / "runs").glob("*.json"))
    if not files:
        raise SystemExit(f"paired_stores: {store / 'runs'} holds no run")
    setup = json.loads(files[0].read_text())["setup"]
    try:
        rows = _seeds.RunStore(store, setup).all()
    except _seeds.SetupMismatch as e:
        raise SystemExit(f"paired_stores: {e}") from None
    if row not in rows:
        raise SystemExit(f"paired_stores: {store / 'runs'} holds no run of row {row!r}")
    return setup, rows[row]["row"], rows[row]["runs"]


def compare(before: Path, after: Path, row: str, tail: int = 3, full: bool = True) -> dict:
    """Each seed's score in both stores and the paired gap (%) of ``after`` against ``before``
    over the seeds both hold."""
    setup_b, row_b, runs_b = _runs(before, row)
    setup_a, row_a, runs_a = _runs(after, row)
    diff = sorted(k for k in set(setup_b) | set(setup_a) if setup_b.get(k) != setup_a.get(k))
    if diff:
        raise SystemExit("paired_stores: the stores' setups differ in " + ", ".join(
            f"{k} ({setup_b.get(k)!r} against {setup_a.get(k)!r})" for k in diff))
    if row_b != row_a:
        raise SystemExit(f"paired_stores: row {row!r} is defined as {row_b} in {before} and "
                         f"as {row_a} in {after}")
    sb = {s: score(r, tail, full) for s, r in runs_b.items()}
    sa = {s: score(r, tail, full) for s, r in runs_a.items()}
    gap = _seeds.paired_gap_pct(sa, sb)
    return {"row": row, "tail": tail, "full": full,
            "seeds": {s: {"before": sb.get(s), "after": sa.get(s)}
                      for s in sorted(set(sb) | set(sa))},
            "gap_pct": gap.as_dict() if gap else None,
            "summary": (f"{row}: after against before, {gap.n if gap else 0} paired seed(s): "
                        f"{_seeds.fmt_spread(gap, 3, '%')}, {_seeds.fmt_interval(gap, 3)}, "
                        f"{_seeds.ordering(gap, 'after', 'before')}")}


def report(res: dict, before: Path, after: Path) -> str:
    lines = [f"# {res['row']}: {after} against {before}", "",
             "| seed | before | after |", "|---|---|---|"]
    for s, v in res["seeds"].items():
        lines.append(f"| {s} | " + " | ".join("-" if v[k] is None else f"{v[k]:.5f}"
                                              for k in ("before", "after")) + " |")
    where = "the whole held-out split" if res["full"] else "the sampled batches"
    lines += ["", f"Score: mean of the last {res['tail']} evaluations on {where}.", "",
              res["summary"], ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _args(argv)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        _provenance.record(a.out)
    res = compare(a.before, a.after, a.row, a.tail, not a.sampled)
    text = report(res, a.before, a.after)
    print(text)
    if a.out:
        (a.out / "paired.md").write_text(text)
        (a.out / "paired.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
