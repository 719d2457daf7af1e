"""Where the seed-to-seed spread of the paired gap comes from: a report over stored runs.

Reads ``accuracy.py`` / ``frontier.py`` stores (``--store NAME=DIR``, several allowed: e.g. one
where every part of a run follows its seed, one made with ``--fix init,data`` so that only the
quantizers' random bits vary) and reports, for every quantized row, the standard deviation over
seeds of its gap to the baseline (paired by seed) under several ways of scoring a run:

* ``sampled, final``: the final loss on the sampled validation batches (the old method);
* ``sampled, tail K``: the mean of the last K evaluations on them;
* ``full, final`` / ``full, tail K``: the same on the whole held-out split (``--eval-full``);
* ``full, m windows``: the final loss on a fixed random subset of m held-out windows, the same
  subset for every run (as a fixed validation set of that size would be), the sd averaged over
  ``--draws`` subsets: what the size of the evaluation set alone does;
* ``train, last N``: the mean training loss of the last N steps (training batches are paired
  by seed too), for comparison;
* ``eval SE, m windows``: not a spread over seeds but, within each seed, the standard error
  that evaluating on m windows adds to the paired gap (the sd of the per-window differences
  over sqrt(m), neighbouring windows taken as independent), averaged over seeds: the part of
  the spread an evaluation set of that size can explain.

Trains nothing. Writes ``OUT/table.md`` and ``OUT/variance.json``.

    python benchmarks/accuracy_variance.py --store all=results/accuracy_300 \\
        --store quant_only=results/accuracy_variance/quant_only --out results/accuracy_variance
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _provenance  # noqa: E402

BASELINE = "baseline"


def _runs(store: Path) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for p in sorted((store / "runs").glob("*.json")):
        g = json.loads(p.read_text())
        out.setdefault(g["label"], {})[int(g["seed"])] = g["record"]
    return out


def _sd(xs: list[float]) -> Optional[float]:
    return statistics.stdev(xs) if len(xs) > 1 else None


def _gaps(row: dict[int, dict], base: dict[int, dict], fn) -> list[float]:
    seeds = sorted(set(row) & set(base))
    out = []
    for s in seeds:
        b, q = fn(base[s]), fn(row[s])
        if b is None or q is None:
            return []
        out.append(100.0 * (q - b) / b)
    return out


def _tail(curve_key: str, k: int):
    def fn(rec):
        c = rec.get(curve_key)
        if not c or len(c) < k:
            return None
        return sum(v for _, v in c[-k:]) / k
    return fn


def _train_tail(n: int):
    return lambda rec: sum(rec["train"][-n:]) / n


def _subset_sd(row, base, m: int, draws: int) -> Optional[float]:
    """Mean over ``draws`` random fixed subsets of ``m`` windows of the gap's sd over seeds."""
    seeds = sorted(set(row) & set(base))
    if len(seeds) < 2 or any("val_full_windows" not in r[s] for r in (row, base)
                             for s in seeds):
        return None
    n = len(base[seeds[0]]["val_full_windows"])
    if m >= n:
        return None
    rng = random.Random(0)
    sds = []
    for _ in range(draws):
        idx = rng.sample(range(n), m)
        gaps = []
        for s in seeds:
            bw, qw = base[s]["val_full_windows"], row[s]["val_full_windows"]
            b = sum(bw[i] for i in idx) / m
            q = sum(qw[i] for i in idx) / m
            gaps.append(100.0 * (q - b) / b)
        sds.append(statistics.stdev(gaps))
    return sum(sds) / len(sds)


def _eval_se(row, base, m: Optional[int]) -> Optional[float]:
    seeds = sorted(set(row) & set(base))
    ses = []
    for s in seeds:
        bw, qw = base[s].get("val_full_windows"), row[s].get("val_full_windows")
        if not bw or not qw:
            return None
        mb = sum(bw) / len(bw)
        d = [100.0 * (q - b) / mb for q, b in zip(qw, bw)]
        ses.append(statistics.stdev(d) / (m or len(d)) ** 0.5)
    return sum(ses) / len(ses) if ses else None


def analyse(name: str, store: Path, tail: int, train_n: int, sizes: list[int],
            draws: int) -> list[dict[str, Any]]:
    runs = _runs(store)
    base = runs.get(BASELINE, {})
    out = []
    for label, row in runs.items():
        if label == BASELINE:
            continue
        seeds = sorted(set(row) & set(base))
        if len(seeds) < 2:
            continue
        entry: dict[str, Any] = {"experiment": name, "row": label, "seeds": seeds,
                                 "sd": {}, "mean": {}}
        metrics = {
            "sampled, final": _tail("val", 1),
            f"sampled, tail {tail}": _tail("val", tail),
            "full, final": _tail("val_full", 1),
            f"full, tail {tail}": _tail("val_full", tail),
            f"train, last {train_n}": _train_tail(train_n),
        }
        for key, fn in metrics.items():
            g = _gaps(row, base, fn)
            entry["sd"][key] = _sd(g) if g else None
            entry["mean"][key] = statistics.mean(g) if g else None
            entry.setdefault("gaps", {})[key] = g
        for m in sizes:
            entry["sd"][f"full, {m} windows"] = _subset_sd(row, base, m, draws)
        entry["sd"]["eval SE, all windows"] = _eval_se(row, base, None)
        entry["sd"]["eval SE, 256 windows"] = _eval_se(row, base, 256)
        first = base[seeds[0]]
        entry["windows"] = len(first.get("val_full_windows", []))
        # what pairing by seed buys: the correlation over seeds of the row's and the
        # baseline's scores (0: the same seed's runs share nothing that survives training)
        fn = _tail("val_full", tail) if "val_full" in first else _tail("val", 1)
        xs, ys = [fn(base[s]) for s in seeds], [fn(row[s]) for s in seeds]
        entry["score"] = "full, tail" if "val_full" in first else "sampled, final"
        entry["corr"] = (statistics.correlation(xs, ys)
                         if len(seeds) > 2 and statistics.pstdev(xs) and statistics.pstdev(ys)
                         else None)
        entry["sd_baseline_pct"] = 100 * statistics.stdev(xs) / statistics.mean(xs)
        entry["sd_row_pct"] = 100 * statistics.stdev(ys) / statistics.mean(ys)
        out.append(entry)
    return out


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--tail", type=int, default=3)
    ap.add_argument("--train-last", type=int, default=50)
    ap.add_argument("--sizes", default="64,256,512")
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--out", default=str(HERE.parent / "results" / "accuracy_variance"))
    a = ap.parse_args(argv)
    _provenance.record(a.out, argv=None if argv is None else [__file__, *argv])
    sizes = [int(x) for x in a.sizes.split(",") if x]
    entries = []
    for spec in a.store:
        name, _, d = spec.partition("=")
        entries += analyse(name, Path(d), a.tail, a.train_last, sizes, a.draws)
    if not entries:
        print("no quantized row with 2 or more seeds paired with a baseline", file=sys.stderr)
        return 1
    keys = list(entries[0]["sd"])
    lines = ["| experiment | row | seeds | " + " | ".join(keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    for e in entries:
        lines.append(f"| {e['experiment']} | {e['row']} | {len(e['seeds'])} | "
                     + " | ".join(_fmt(e["sd"][k]) for k in keys) + " |")
    lines += ["", "What pairing by seed buys (score: the tail mean on the whole split where the "
              "runs have it, else the final sampled loss): the sd over seeds of each row's and of "
              "the baseline's own scores, and their correlation over seeds.", "",
              "| experiment | row | seeds | gaps by seed | sd of baseline | sd of row | corr |",
              "|---|---|---|---|---|---|---|"]
    for e in entries:
        key = f"full, tail {a.tail}" if e["score"] == "full, tail" else "sampled, final"
        gaps = ", ".join(f"{g:+.2f}" for g in e["gaps"][key])
        corr = "-" if e["corr"] is None else f"{e['corr']:+.2f}"
        lines.append(f"| {e['experiment']} | {e['row']} | {len(e['seeds'])} | {gaps} | "
                     f"{e['sd_baseline_pct']:.2f}% | {e['sd_row_pct']:.2f}% | {corr} |")
    md = ("# Seed-to-seed sd of the paired gap, by how a run is scored\n\n"
          "Each cell: the standard deviation over seeds of 100 x (row - baseline) / baseline, "
          "the baseline run of the same seed. `m windows`: a fixed random subset of m held-out "
          f"windows (mean sd over {a.draws} subsets); the whole split has "
          f"{entries[0]['windows']} windows.\n\n" + "\n".join(lines) + "\n")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(md)
    (out / "variance.json").write_text(json.dumps(entries, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
