"""The loss-vs-bits frontier: how few node-crossing bits keep the baseline's loss?

Trains the accuracy benchmark's model on its data (``benchmarks/accuracy.py``: char GPT, 1000
steps, 4 gloo ranks as 2 nodes x 2) under the papers' schemes and under sub-4-bit settings
(2/3-bit weight differences, uniform / Hadamard / learned levels; 2/3-bit inter-node gradients
with and without error feedback), and reports, per row:

* the final validation loss, its spread over seeds and the gap to the baseline paired by seed,
  with its 95% interval (``_seeds``);
* the bits per element on the node-crossing exchanges that send, from the handle's counters:
  weight gathers (``weight_allgather.sending_bits_per_element``: 0-byte re-gathers excluded;
  on 2 nodes x 2 every gather crosses nodes) and the inter-node gradient hop (``grad_inter``,
  or ``grad_replica`` for HSDP rows), and their mean, the goal's measure (sdp4bit by the wire
  formula: 4.016 and 4.25, so 4.13; measured on this model, whose shards end in partial groups:
  4.049 and 4.251, so 4.15); FSDP's own collectives count 32 (fp32 on CPU).

Rows and runs live in a ``RunStore`` like the accuracy benchmark's (one JSON per row and seed,
resumable, splittable with ``--rows`` / ``--seed``); ``--reuse DIR`` copies the stored runs of
rows with the same definition and setup from another store (the accuracy table's baseline,
sdp4bit, qsdp and zeropp runs) instead of training them again. Writes ``OUT/{table.md,
results.json, frontier.png}``.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/frontier.py --steps 1000 --eval-every 100 \\
        --seeds 1 --out results/frontier --reuse results/accuracy_1000_seeds --rows ROWS
    # then the points that decide the goal with more seeds:
    ... --rows "baseline,SDP4Bit,QSDP (8/8),ZeRO++,W2-learned G3" --seeds 3

Without ``--rows`` every row of ``ROWS`` is trained; the committed ``results/frontier`` holds 15
of them, and ``docs/lowbit.md`` lists the exact ``--rows`` of both commands.

The method behind the verdict column (``docs/accuracy_method.md``): score runs on the whole
held-out split, mean of the last evaluations, 5 or more seeds for the rows that decide a claim:

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/frontier.py \\
        --rows "baseline,SDP4Bit,W2-learned G3" --steps 300 --eval-every 25 --eval-full \\
        --full-last 3 --tail 3 --seeds 5 --out results/accuracy_300
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _provenance  # noqa: E402
import accuracy  # noqa: E402
from _plotting import pyplot  # noqa: E402
from _seeds import (  # noqa: E402
    RunStore,
    SetupMismatch,
    fmt_interval,
    fmt_spread,
    seed_list,
)

Scheme = accuracy.Scheme
_EF = {"grad_error_feedback": "inter"}

#: row label -> Scheme. The papers' rows are the accuracy table's (same labels, same runs).
ROWS: dict[str, Scheme] = {
    "baseline": accuracy.SCHEMES["baseline"],
    "SDP4Bit": accuracy.SCHEMES["SDP4Bit"],
    "QSDP (8/8)": accuracy.SCHEMES["QSDP (8/8)"],
    "ZeRO++": accuracy.SCHEMES["ZeRO++"],
    # 3-bit weight differences: 3 or 2 gradient bits across nodes; error feedback with the
    # stochastic rounding of the presets and with nearest rounding (the compressor EF theory
    # assumes: contractive, but biased without EF)
    "SDP4Bit +EF": Scheme("sdp4bit", dict(_EF)),
    "W3 G3": Scheme("sdp4bit", dict(weight_bits=3, grad_inter_bits=3)),
    "W3 G3 +EF": Scheme("sdp4bit", dict(weight_bits=3, grad_inter_bits=3, **_EF)),
    "W3 G2": Scheme("sdp4bit", dict(weight_bits=3, grad_inter_bits=2)),
    "W3 G2 nearest": Scheme("sdp4bit", dict(weight_bits=3, grad_inter_bits=2,
                                           grad_rounding="nearest")),
    "W3 G2 +EF": Scheme("sdp4bit", dict(weight_bits=3, grad_inter_bits=2, **_EF)),
    "W3 G2 +EF nearest": Scheme("sdp4bit", dict(weight_bits=3, grad_inter_bits=2,
                                               grad_rounding="nearest", **_EF)),
    # 2-bit weight differences (ternary; Hadamard-rotated; learned levels; 4 min-max levels)
    "W2 G3": Scheme("sdp4bit", dict(weight_bits=2, grad_inter_bits=3)),
    "W2-HS G3": Scheme("sdp4bit", dict(weight_bits=2, weight_hadamard=True, grad_inter_bits=3)),
    "W2-learned G3": Scheme("sdp4bit", dict(weight_bits=2, weight_levels="learned",
                                           grad_inter_bits=3)),
    "W2-minmax G3": Scheme("sdp4bit", dict(weight_bits=2, weight_symmetric=False,
                                          grad_inter_bits=3)),
    "W2 G2": Scheme("sdp4bit", dict(weight_bits=2, grad_inter_bits=2)),
    # nearest rounding for the weight differences: qWD carries what rounding drops into the next
    # difference (error feedback on weights), the setting where a biased but contractive
    # quantizer beats an unbiased noisy one
    "W2-nearest G3": Scheme("sdp4bit", dict(weight_bits=2, weight_rounding="nearest",
                                           grad_inter_bits=3)),
    "W3-nearest G2": Scheme("sdp4bit", dict(weight_bits=3, weight_rounding="nearest",
                                           grad_inter_bits=2)),
    "W2-nearest G2": Scheme("sdp4bit", dict(weight_bits=2, weight_rounding="nearest",
                                           grad_inter_bits=2)),
    "W2-learned G2": Scheme("sdp4bit", dict(weight_bits=2, weight_levels="learned",
                                           grad_inter_bits=2)),
    # what lowbit's cost comes from: its weights with sdp4bit's gradients, and the reverse
    "W2-learned G4": Scheme("sdp4bit", dict(weight_bits=2, weight_levels="learned")),
    "W4 G3": Scheme("sdp4bit", dict(grad_inter_bits=3)),
    "W3-learned G3": Scheme("sdp4bit", dict(weight_bits=3, weight_levels="learned",
                                           grad_inter_bits=3)),
    # finer groups at 2-bit weights / 3-bit gradients (more scales, still under 3.0 bits)
    "W2-learned/256 G3": Scheme("sdp4bit", dict(weight_bits=2, weight_levels="learned",
                                               weight_group_size=256, grad_inter_bits=3)),
    "W2-learned G3/64": Scheme("sdp4bit", dict(weight_bits=2, weight_levels="learned",
                                              grad_inter_bits=3, grad_group_size=64)),
}
DEFAULT_ROWS = ",".join(ROWS)
#: the row the ``lowbit`` preset ships (tests/test_lowbit.py checks they are the same config)
LOWBIT_ROW = "W2-learned G3"
FP32_BITS = 32.0


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=DEFAULT_ROWS,
                    help="comma-separated subset of: " + ", ".join(ROWS))
    ap.add_argument("--reuse", default=None,
                    help="another store (e.g. the accuracy table's --out) whose runs of rows "
                         "with the same definition and setup are copied instead of retrained")
    # everything else is the accuracy benchmark's (model, data, steps, seeds, ...)
    rows_arg, rest = ap.parse_known_args(argv)
    accuracy.SCHEMES.update({k: v for k, v in ROWS.items() if k not in accuracy.SCHEMES})
    a = accuracy._args(rest + ["--schemes", rows_arg.rows])
    a.rows, a.reuse = a.schemes, rows_arg.reuse
    a.row_defs = {k: accuracy.SCHEMES[k] for k in a.rows}  # the ranks import accuracy afresh
    if "--out" not in rest and not any(x.startswith("--out=") for x in rest):
        a.out = str(HERE.parent / "results" / "frontier")
    return a


def _copy_reused(a: argparse.Namespace, store: RunStore) -> int:
    """Copy runs of the requested rows and seeds from ``--reuse`` (checked like any stored
    run: same setup, same row definition); returns how many were copied."""
    if not a.reuse:
        return 0
    other = RunStore(Path(a.reuse), store.setup)
    copied = 0
    for label in a.rows:
        for seed in seed_list(a.seed, a.seeds):
            row = accuracy._row(label)
            if store.load(label, seed, row) is not None:
                continue
            try:
                rec = other.load(label, seed, row)
            except SetupMismatch as e:
                rec = _same_computation(a, other.path(label, seed), label, seed, row)
                if rec is None:
                    print(f"frontier: not reusing {label} seed {seed}: {e}", file=sys.stderr)
                    continue
                store.save(label, seed, row, rec)
                copied += 1
                continue
            if rec is not None:
                store.dir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(other.path(label, seed), store.path(label, seed))
                copied += 1
    return copied


def _same_computation(a: argparse.Namespace, path: Path, label: str, seed: int,
                      row: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A stored run made under another ``--fix`` that computed exactly what this run would:
    every other setting equal, the same row, and the same seed for each part of the run
    (``accuracy.seeds_of``; e.g. ``--fix init,data`` at seed 1234 is the plain run of seed
    1234). Its record, marked with where it came from; None if it is not one."""
    if not path.is_file():
        return None
    got = json.loads(path.read_text())
    mine = RunStore(Path(a.out), accuracy._setup(a)).setup
    strip = lambda d: {k: v for k, v in d.items() if k != "fix"}  # noqa: E731
    if strip(got["setup"]) != strip(mine) or got["row"] != json.loads(json.dumps(row)):
        return None
    rec = got["record"]
    if rec.get("seeds") != accuracy.seeds_of(a, seed):
        return None
    return dict(rec, copied_from=f"{path.parent.parent.name}/runs/{path.name}")


def _bits(record: dict[str, Any]) -> Optional[tuple[float, float]]:
    """(weight bits, inter-node gradient bits) per element on the exchanges that send, from one
    run's stats; FSDP's own (unhooked) collectives count fp32."""
    st = record.get("stats")
    if st is None:
        return FP32_BITS, FP32_BITS
    w = st.get("weight_allgather", {})
    wb = w.get("sending_bits_per_element", w.get("bits_per_element", FP32_BITS))
    g = st.get("grad_replica") or st.get("grad_inter")
    gb = FP32_BITS if g is None else g.get("sending_bits_per_element", g["bits_per_element"])
    return wb, gb


def _frontier(summary: dict[str, Any], stored: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for label, r in summary.items():
        bits = [_bits(rec) for rec in stored[label]["runs"].values()]
        wb = sum(b[0] for b in bits) / len(bits)
        gb = sum(b[1] for b in bits) / len(bits)
        out[label] = dict(r, weight_bits=wb, grad_inter_bits=gb, mean_bits=(wb + gb) / 2)
    return out


def _table(front: dict[str, Any]) -> str:
    from _seeds import Spread

    lines = ["| row | settings | seeds | val loss (mean ± sd) | vs baseline, paired | "
             "95% interval | verdict | weight bits | inter-node grad bits | mean bits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in sorted(front.items(), key=lambda kv: -kv[1]["mean_bits"]):
        fv = Spread(**{k: v for k, v in r["final_val_spread"].items() if k != "beyond_noise"})
        g = r["gap_pct_vs_baseline"]
        gap = None if g is None else Spread(**{k: v for k, v in g.items() if k != "beyond_noise"})
        lines.append(
            f"| {label} | {accuracy.scheme_of(r['row']).describe()} | {len(r['seeds'])} | "
            f"{fmt_spread(fv)} | {'-' if gap is None else fmt_spread(gap, 2, '%')} | "
            f"{'-' if gap is None else fmt_interval(gap)} | {r['verdict'] or '-'} | "
            f"{r['weight_bits']:.3f} | "
            f"{r['grad_inter_bits']:.3f} | {r['mean_bits']:.3f} |")
    return "\n".join(lines)


def _plot(front: dict[str, Any], path: Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed (the 'bench' extra): no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, r in front.items():
        g = r["gap_pct_vs_baseline"]
        if g is None:
            continue
        paper = label in ("SDP4Bit", "QSDP (8/8)", "ZeRO++")
        ax.errorbar(r["mean_bits"], g["mean"], yerr=g["sd"] if len(r["seeds"]) > 1 else None,
                    fmt="s" if paper else "o", capsize=3, color="tab:blue" if paper else
                    ("tab:red" if label == LOWBIT_ROW else "tab:gray"))
        ax.annotate(f"{label} ({len(r['seeds'])})", (r["mean_bits"], g["mean"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.axhline(0, color="k", lw=0.8)
    ax.axhline(0.5, color="tab:red", lw=0.8, ls="--", label="goal: +0.5%")
    ax.axvline(3.0, color="tab:green", lw=0.8, ls="--", label="goal: 3.0 bits")
    ax.set(xlabel="bits per element on node-crossing exchanges that send (mean of weights and "
                  "inter-node gradients)", ylabel="final val loss vs baseline, % (paired)",
           title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def write_report(a: argparse.Namespace, store: RunStore, trained: int = 0,
                 wall: float = 0.0) -> Optional[str]:
    """Rebuild ``table.md``, ``results.json`` and ``frontier.png`` in ``a.out`` from every run
    stored there (and ``bytes.md`` for an MoE store: ``accuracy.write_traffic``); returns the
    table's markdown (None: nothing stored)."""
    out_dir = Path(a.out)
    stored = store.all()
    if not stored:
        return None
    front = _frontier(accuracy._summary(stored, a.tail), stored)
    md = accuracy.report_md(
        "Loss vs node-crossing bits", a, stored, front, _table(front), trained, wall, store)
    md += ("\nBits: per element on the node-crossing exchanges that send (weight gathers; "
           "inter-node gradient hop), measured from the handles' counters (scales and level "
           "tables included); mean bits = their mean (sdp4bit: 4.13 by the wire formula; the "
           "table's bits are measured). Goal: mean bits <= 3.0 with the gap's upper bound "
           "within +0.5%.\n")
    (out_dir / "table.md").write_text(md)
    accuracy.write_traffic(a, store)  # MoE stores: bytes.md, per kind of traffic
    (out_dir / "results.json").write_text(json.dumps(
        {"setup": store.setup, "rows": front, "args": vars(a)}, indent=1, default=str))
    _plot(front, out_dir / "frontier.png",
          f"{'BPE' if a.bpe else 'char'} GPT, {a.steps} steps, "
          f"{a.world // a.ranks_per_node} nodes x {a.ranks_per_node} ranks")
    return md


def main(argv=None) -> int:
    a = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fsdp_qcomm.testing import run_ranks

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prov = _provenance.record(out_dir, argv=None if argv is None else [__file__, *argv])
    store = RunStore(out_dir, accuracy._setup(a))
    try:
        copied = _copy_reused(a, store)
        todo = [] if a.report_only else accuracy._pending(a, store)
        store.all()
    except SetupMismatch as e:
        print(f"frontier: {e}", file=sys.stderr)
        return 2
    print(f"frontier: {len(a.rows)} rows x {a.seeds} seed(s) x {a.steps} steps: {copied} run(s) "
          f"reused, {len(todo)} to train; estimate: "
          f"{accuracy.cpu_estimate(store, todo, a.steps)}", flush=True)
    t0 = time.perf_counter()
    if todo:
        run_ranks(accuracy._train_all, a.world, a, store, todo, timeout=24 * 3600)
    wall = time.perf_counter() - t0
    prov.note(trained_runs=len(todo), train_wall_s=round(wall, 1))
    md = write_report(a, store, len(todo), wall)
    if md is None:
        print(f"no runs stored in {store.dir}", file=sys.stderr)
        return 1
    print("\n" + md)
    print(f"written: {out_dir}/table.md, results.json, frontier.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
