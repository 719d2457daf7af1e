"""Small-scale reproduction of SDP4Bit Table 1: final validation loss per quantization scheme.

Trains the same small character-level GPT (``_model.GPT``) with the same seed, initial weights
and batches under each scheme, on 4 gloo ranks arranged as 2 nodes x 2 (``ranks_per_node=2``, so
the two-level gradient schemes really take an intra-node and an inter-node hop), with plain
FSDP2 and ``fsdp_qcomm.enable``. "baseline" is FSDP2 with its own collectives (no hooks).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/accuracy.py [--data PATH] [--steps N]
        [--seeds N] [--schemes A,B] [--out DIR] [--fresh] [--report-only] ...

``--seeds N`` trains every scheme under seeds ``--seed``, ``--seed + 1``, ... (the seed fixes
the initial weights, the batches and the quantizers' random bits) and reports the mean and
standard deviation of the final validation loss per scheme and the gap to the baseline paired
by seed, with its 95% interval: a gap whose interval contains 0 is seed noise, not a finding.
Every (scheme, seed) run is stored as soon as it finishes (``DIR/runs/``, ``_seeds.RunStore``):
an interrupted sweep resumes where it stopped, and a long sweep can be split by scheme or seed
over several invocations with the same ``--out`` (``--report-only`` rebuilds the table from
what is stored). Writes ``DIR/{table.md, loss_curves.png, results.json}`` and prints the table.
Expected shape of the result (the paper's): SDP4Bit within ~0.5% of baseline, qW (direct
4-bit weights) clearly worse, TLq-HS no worse than TLq.

Rows are ``SCHEMES`` entries: a label, a ``QCommConfig`` preset (None: FSDP's own collectives),
field overrides and the mesh (``hsdp=True``: shard inside a node, replicate across nodes,
``_model.hsdp_mesh``). Adding a row is one line, e.g.
``"SDP4Bit HSDP 2x2": Scheme("sdp4bit", hsdp=True)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's fsdp_qcomm
sys.path.insert(0, str(HERE))

import _provenance  # noqa: E402
from _seeds import (  # noqa: E402
    RunStore,
    SetupMismatch,
    file_digest,
    fmt_spread,
    fmt_verdict,
    paired_gap_pct,
    seed_list,
    spread,
)


@dataclass(frozen=True)
class Scheme:
    """One row: a ``QCommConfig`` preset (None: FSDP's own collectives, no hooks), extra
    ``QCommConfig`` fields, and the mesh (``hsdp``: shard inside a node, replicate across
    nodes; else plain FSDP over all ranks)."""

    preset: Optional[str]
    overrides: dict[str, Any] = field(default_factory=dict)
    hsdp: bool = False

    def describe(self) -> str:
        text = self.preset or "(FSDP default)"
        if self.overrides:
            text += " " + ", ".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))
        if self.hsdp:
            text += ", HSDP"
        return text


#: row label (as in the paper's table) -> Scheme
SCHEMES: dict[str, Scheme] = {
    "baseline": Scheme(None),
    "qW": Scheme("qw4"),
    "qWD": Scheme("qwd"),
    "TLq": Scheme("tlq"),
    "TLq-HS": Scheme("tlq_hs"),
    "SDP4Bit": Scheme("sdp4bit"),
    "QSDP (8/8)": Scheme("qsdp"),
    "ZeRO++": Scheme("zeropp"),
    # Multi-node HSDP: shard inside a node, replicate across nodes (4-bit replica all-reduce)
    "SDP4Bit HSDP 2x2": Scheme("sdp4bit", hsdp=True),
}
BASELINE = "baseline"

# arguments that change what a run computes: runs stored under other values are refused
_SETUP_ARGS = ("steps", "dim", "layers", "heads", "seq", "batch", "lr", "warmup", "eval_every",
               "eval_batches", "val_seed", "world", "ranks_per_node")


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="text or JSONL file (default: tinyshakespeare)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=8, help="validation batches per rank")
    ap.add_argument("--seed", type=int, default=1234, help="first seed")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per scheme: --seed, --seed+1, ...")
    ap.add_argument("--val-seed", type=int, default=1234,
                    help="picks the held-out batches, the same for every scheme and seed")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    help="comma-separated subset of: " + ", ".join(SCHEMES))
    ap.add_argument("--out", default=str(HERE.parent / "results" / "accuracy"))
    ap.add_argument("--fresh", action="store_true",
                    help="recompute the requested runs even if --out holds them")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: rebuild the table from the runs stored in --out")
    a = ap.parse_args(argv)
    a.schemes = [s.strip() for s in a.schemes.split(",") if s.strip()]
    bad = [s for s in a.schemes if s not in SCHEMES]
    if bad:
        ap.error(f"unknown scheme(s) {bad}; choose from {list(SCHEMES)}")
    if a.world % a.ranks_per_node:
        ap.error(f"--world {a.world} is not a multiple of --ranks-per-node {a.ranks_per_node}")
    if a.seeds < 1:
        ap.error(f"--seeds {a.seeds} must be >= 1")
    return a


def _setup(a: argparse.Namespace) -> dict[str, Any]:
    from _model import CharData

    data = CharData(a.data)  # fails here, with the message, before spawning ranks
    out = {k: getattr(a, k) for k in _SETUP_ARGS}
    out["data"] = file_digest(data.path)
    return out


def _lr(step: int, a: argparse.Namespace) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _val_loss(model, data, a, rank: int, shape) -> float:
    """Mean loss on ``eval_batches`` held-out batches per rank, the same batches for every
    scheme and seed (``--val-seed``): seeds vary the training, not the yardstick."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    total = torch.zeros(1)
    with torch.no_grad():
        for i in range(a.eval_batches):
            x, y = data.batch("val", a.batch, shape.seq, a.val_seed, i, rank)
            logits = model(x)
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten())
    dist.all_reduce(total)
    return total.item() / (a.eval_batches * dist.get_world_size())


def _train_one(rank: int, world: int, a: argparse.Namespace, data, shape, label: str,
               seed: int) -> dict:
    """One scheme under one seed, from the seed's initial weights and batches."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from _model import build_fsdp_gpt, hsdp_mesh

    import fsdp_qcomm

    row = getattr(a, "row_defs", SCHEMES)[label]  # rows added by other scripts travel in a
    t0 = time.perf_counter()
    model = build_fsdp_gpt(shape, seed, hsdp_mesh(a.ranks_per_node) if row.hsdp else None)
    handle = None
    if row.preset is not None:
        cfg = fsdp_qcomm.QCommConfig.preset(
            row.preset, ranks_per_node=a.ranks_per_node, seed=seed, **row.overrides
        )
        handle = fsdp_qcomm.enable(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    train_curve, val_curve = [], []
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, a)
        x, y = data.batch("train", a.batch, a.seq, seed, step, rank)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        train_curve.append(lt.item() / world)
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            val_curve.append((step + 1, _val_loss(model, data, a, rank, shape)))
            if rank == 0:
                print(f"  [{label} seed {seed}] step {step + 1}/{a.steps}: train "
                      f"{train_curve[-1]:.4f} val {val_curve[-1][1]:.4f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    rec = {"train": train_curve, "val": val_curve, "final_val": val_curve[-1][1],
           "seconds": time.perf_counter() - t0}
    if handle is not None:
        rec["stats"] = {k: v for k, v in handle.stats().items() if k != "notes"}
        rec["gather_modes"] = handle.gather_modes()
        handle.disable()
    return rec


def _train_all(rank: int, world: int, a: argparse.Namespace, store: RunStore,
               todo: list) -> None:
    """Runs on every rank: each pending (scheme, seed) in turn; rank 0 stores each result as
    soon as it is done, so an interrupted sweep loses at most the run in progress."""
    from _model import CharData, GPTShape

    data = CharData(a.data)
    shape = GPTShape(data.vocab, a.dim, a.layers, a.heads, a.seq)
    for label, seed in todo:
        rec = _train_one(rank, world, a, data, shape, label, seed)
        rec["params"], rec["vocab"] = shape.params(), data.vocab
        if rank == 0:
            store.save(label, seed, _row(label, getattr(a, "row_defs", None)), rec)
            print(f"{label} seed {seed}: final val loss {rec['final_val']:.5f} in "
                  f"{rec['seconds']:.0f} s", flush=True)


def scheme_of(row: dict[str, Any]) -> Scheme:
    """The Scheme of a stored row definition (``_row``)."""
    return Scheme(**{k: v for k, v in row.items() if k != "config"})


def _row(label: str, defs: Optional[dict[str, Scheme]] = None) -> dict[str, Any]:
    """A row's definition as stored with its runs: the Scheme and, for fsdp_qcomm rows, the
    resolved QCommConfig, so a changed preset cannot pass for the stored one."""
    s = (defs or SCHEMES)[label]
    row = asdict(s)
    if s.preset is not None:
        from fsdp_qcomm import QCommConfig

        # the fields that differ from the defaults: a field added later (with a default that
        # keeps the old behaviour) does not make stored runs look different
        default = QCommConfig().to_dict()
        row["config"] = {k: v for k, v in QCommConfig.preset(s.preset, **s.overrides)
                         .to_dict().items() if v != default.get(k)}
    return row


def _summary(stored: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per row: seeds, final losses, their spread, and the gap to the baseline paired by seed."""
    base = stored.get(BASELINE, {}).get("runs", {})
    base_final = {s: r["final_val"] for s, r in base.items()}
    order = [k for k in SCHEMES if k in stored] + sorted(k for k in stored if k not in SCHEMES)
    out = {}
    for label in order:
        runs = stored[label]["runs"]
        final = {s: r["final_val"] for s, r in sorted(runs.items())}
        gap = None if label == BASELINE else paired_gap_pct(final, base_final)
        out[label] = {
            "row": stored[label]["row"], "seeds": sorted(final), "final_val": final,
            "final_val_spread": spread(list(final.values())).as_dict(),
            "gap_pct_vs_baseline": None if gap is None else gap.as_dict(),
            "seconds_mean": sum(r["seconds"] for r in runs.values()) / len(runs),
        }
    return out


def _table(summary: dict[str, Any]) -> str:
    from _seeds import Spread

    lines = ["| scheme | preset | seeds | final val loss (mean ± sd) | vs baseline, paired "
             "(mean ± sd) | 95% interval of the gap | wall s (shared CPU) |",
             "|---|---|---|---|---|---|---|"]
    for label, r in summary.items():
        row = scheme_of(r["row"])
        fv = Spread(**{k: v for k, v in r["final_val_spread"].items() if k != "beyond_noise"})
        g = r["gap_pct_vs_baseline"]
        gap = None if g is None else Spread(**{k: v for k, v in g.items() if k != "beyond_noise"})
        lines.append(f"| {label} | {row.describe()} | {len(r['seeds'])} | {fmt_spread(fv)} | "
                     f"{'-' if label == BASELINE else fmt_spread(gap, 2, '%')} | "
                     f"{'-' if label == BASELINE else fmt_verdict(gap)} | "
                     f"{r['seconds_mean']:.0f} |")
    return "\n".join(lines)


def _mean_curve(curves: list[list]) -> tuple[list, list, list]:
    """Pointwise mean and sd of equally long curves of (step, value) pairs."""
    steps = [c[0] for c in curves[0]]
    cols = list(zip(*[[v for _, v in c] for c in curves]))
    stats = [spread(col) for col in cols]
    return steps, [s.mean for s in stats], [s.sd for s in stats]


def _plot(summary: dict, stored: dict, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib, or the 'bench' extra): "
              "no plot", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 20
    for label in summary:
        runs = list(stored[label]["runs"].values())
        trains = [list(enumerate(r["train"], 1)) for r in runs]
        steps, tr, _ = _mean_curve(trains)
        smooth = [sum(tr[max(0, i - w + 1):i + 1]) / len(tr[max(0, i - w + 1):i + 1])
                  for i in range(len(tr))]
        ax1.plot(steps, smooth, label=label, lw=1.2)
        steps, vals, sds = _mean_curve([r["val"] for r in runs])
        line, = ax2.plot(steps, vals, marker="o", ms=3, label=label, lw=1.2)
        if len(runs) > 1:
            ax2.fill_between(steps, [v - d for v, d in zip(vals, sds)],
                             [v + d for v, d in zip(vals, sds)], color=line.get_color(),
                             alpha=0.15)
    ax1.set(title=f"train loss ({w}-step mean, mean over seeds)", xlabel="step", ylabel="loss")
    ax2.set(title="validation loss (mean ± sd over seeds)", xlabel="step", ylabel="loss")
    finals = [r["final_val_spread"]["mean"] for r in summary.values()]
    ax2.set_ylim(min(finals) - 0.1, max(finals) + 0.4)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _pending(a: argparse.Namespace, store: RunStore) -> list[tuple[str, int]]:
    """(scheme, seed) runs to train: all requested with --fresh, else those not stored."""
    todo = []
    for seed in seed_list(a.seed, a.seeds):
        for label in a.schemes:
            if a.fresh or store.load(label, seed, _row(label)) is None:
                todo.append((label, seed))
    return todo


def main(argv=None) -> int:
    a = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fsdp_qcomm.testing import run_ranks

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    _provenance.record(out_dir, argv=None if argv is None else [__file__, *argv])
    store = RunStore(out_dir, _setup(a))
    try:
        todo = [] if a.report_only else _pending(a, store)
        store.all()  # refuse before training, not after, if --out holds other settings
    except SetupMismatch as e:
        print(f"accuracy: {e}", file=sys.stderr)
        return 2
    print(f"accuracy: {len(a.schemes)} schemes x {a.seeds} seed(s) x {a.steps} steps, "
          f"{a.world} ranks ({a.ranks_per_node} per node), gloo, CPU: {len(todo)} run(s) to "
          f"train, the rest stored in {store.dir}", flush=True)
    t0 = time.perf_counter()
    if todo:
        run_ranks(_train_all, a.world, a, store, todo, timeout=12 * 3600)
    wall = time.perf_counter() - t0
    stored = store.all()
    if not stored:
        print(f"no runs stored in {store.dir}: nothing to report", file=sys.stderr)
        return 1
    summary = _summary(stored)
    first = next(iter(next(iter(stored.values()))["runs"].values()))
    shape = (f"model: {first['params'] / 1e6:.2f}M params (dim {a.dim}, {a.layers} layers, "
             f"{a.heads} heads, vocab {first['vocab']}), seq {a.seq}, batch {a.batch}/rank, "
             f"AdamW lr {a.lr} cosine, {a.steps} steps, {a.world} ranks as "
             f"{a.world // a.ranks_per_node} nodes x {a.ranks_per_node}; validation: "
             f"{a.eval_batches * a.world} held-out batches (the same for every run)")
    md = (f"# SDP4Bit Table 1, small-scale reproduction\n\n{shape}\n\n{_table(summary)}\n\n"
          "Seeds fix the initial weights, the batches and the quantizers' random bits; the gap "
          "to the baseline is paired by seed, and its 95% interval (Student's t) says whether "
          "it is beyond the seed-to-seed spread.\n\n"
          f"This invocation: {len(todo)} run(s) trained in {wall / 60:.1f} min; the table "
          f"covers every run stored in {store.dir}.\n")
    (out_dir / "table.md").write_text(md)
    res = {"setup": store.setup, "schemes": summary, "runs": stored,
           "args": {k: v for k, v in vars(a).items()}}
    (out_dir / "results.json").write_text(json.dumps(res, indent=1))
    plotted = _plot(summary, stored, out_dir / "loss_curves.png",
                    f"{first['params'] / 1e6:.2f}M-param char GPT, {a.world} ranks, {a.steps} "
                    "steps")
    print("\n" + md)
    print(f"written: {out_dir}/table.md, results.json" + (", loss_curves.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
