"""Small-scale reproduction of SDP4Bit Table 1: final validation loss per quantization scheme.

Trains the same small character-level GPT (``_model.GPT``) with the same seed, initial weights
and batches under each scheme, on 4 gloo ranks arranged as 2 nodes x 2 (``ranks_per_node=2``, so
the two-level gradient schemes really take an intra-node and an inter-node hop), with plain
FSDP2 and ``fsdp_qcomm.enable``. "baseline" is FSDP2 with its own collectives (no hooks).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/accuracy.py [--data PATH] [--steps N] ...

Writes ``results/accuracy/{table.md, loss_curves.png, results.json}`` and prints the table.
Expected shape of the result (the paper's): SDP4Bit within ~0.5% of baseline, qW (direct
4-bit weights) clearly worse, TLq-HS no worse than TLq.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's fsdp_qcomm
sys.path.insert(0, str(HERE))

#: scheme label (as in the paper's table) -> QCommConfig preset (None: FSDP's own collectives)
SCHEMES = {
    "baseline": None,
    "qW": "qw4",
    "qWD": "qwd",
    "TLq": "tlq",
    "TLq-HS": "tlq_hs",
    "SDP4Bit": "sdp4bit",
    "QSDP (8/8)": "qsdp",
    "ZeRO++": "zeropp",
}


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
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    help="comma-separated subset of: " + ", ".join(SCHEMES))
    ap.add_argument("--out", default=str(HERE.parent / "results" / "accuracy"))
    a = ap.parse_args(argv)
    a.schemes = [s.strip() for s in a.schemes.split(",") if s.strip()]
    bad = [s for s in a.schemes if s not in SCHEMES]
    if bad:
        ap.error(f"unknown scheme(s) {bad}; choose from {list(SCHEMES)}")
    if a.world % a.ranks_per_node:
        ap.error(f"--world {a.world} is not a multiple of --ranks-per-node {a.ranks_per_node}")
    return a


def _lr(step: int, a: argparse.Namespace) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _val_loss(model, data, a, rank: int, shape) -> float:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    total = torch.zeros(1)
    with torch.no_grad():
        for i in range(a.eval_batches):
            x, y = data.batch("val", a.batch, shape.seq, a.seed, i, rank)
            logits = model(x)
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten())
    dist.all_reduce(total)
    return total.item() / (a.eval_batches * dist.get_world_size())


def _train_all(rank: int, world: int, a: argparse.Namespace) -> dict:
    """Runs on every rank: each scheme in turn, from identical weights and batches."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from _model import CharData, GPTShape, build_fsdp_gpt

    import fsdp_qcomm

    data = CharData(a.data)
    shape = GPTShape(data.vocab, a.dim, a.layers, a.heads, a.seq)
    out: dict = {"params": shape.params(), "vocab": data.vocab, "schemes": {}}
    for label in a.schemes:
        t0 = time.perf_counter()
        model = build_fsdp_gpt(shape, a.seed)
        handle = None
        if SCHEMES[label] is not None:
            cfg = fsdp_qcomm.QCommConfig.preset(
                SCHEMES[label], ranks_per_node=a.ranks_per_node, seed=a.seed
            )
            handle = fsdp_qcomm.enable(model, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95),
                                weight_decay=0.1)
        train_curve, val_curve = [], []
        for step in range(a.steps):
            for g in opt.param_groups:
                g["lr"] = _lr(step, a)
            x, y = data.batch("train", a.batch, a.seq, a.seed, step, rank)
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
                    print(f"  [{label}] step {step + 1}/{a.steps}: train "
                          f"{train_curve[-1]:.4f} val {val_curve[-1][1]:.4f} "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
        rec = {"train": train_curve, "val": val_curve, "final_val": val_curve[-1][1],
               "seconds": time.perf_counter() - t0}
        if handle is not None:
            rec["stats"] = {k: v for k, v in handle.stats().items() if k != "notes"}
            rec["gather_modes"] = handle.gather_modes()
            handle.disable()
        out["schemes"][label] = rec
        if rank == 0:
            print(f"{label}: final val loss {rec['final_val']:.5f} in {rec['seconds']:.0f} s",
                  flush=True)
        del model, opt
    return out


def _table(res: dict) -> str:
    base = res["schemes"].get("baseline", {}).get("final_val")
    lines = ["| scheme | preset | final val loss | vs baseline | wall s (shared CPU) |",
             "|---|---|---|---|---|"]
    for label, rec in res["schemes"].items():
        diff = "-" if base is None or label == "baseline" else \
            f"{100 * (rec['final_val'] - base) / base:+.2f}%"
        lines.append(f"| {label} | {SCHEMES[label] or '(FSDP default)'} | "
                     f"{rec['final_val']:.5f} | {diff} | {rec['seconds']:.0f} |")
    return "\n".join(lines)


def _plot(res: dict, path: Path, a: argparse.Namespace) -> bool:
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
    for label, rec in res["schemes"].items():
        tr = rec["train"]
        smooth = [sum(tr[max(0, i - w + 1):i + 1]) / len(tr[max(0, i - w + 1):i + 1])
                  for i in range(len(tr))]
        ax1.plot(range(1, len(tr) + 1), smooth, label=label, lw=1.2)
        steps, vals = zip(*rec["val"])
        ax2.plot(steps, vals, marker="o", ms=3, label=label, lw=1.2)
    ax1.set(title=f"train loss ({w}-step mean)", xlabel="step", ylabel="loss")
    ax2.set(title="validation loss", xlabel="step", ylabel="loss")
    lo = min(rec["final_val"] for rec in res["schemes"].values())
    hi = max(rec["final_val"] for rec in res["schemes"].values())
    ax2.set_ylim(lo - 0.1, hi + 0.4)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['params'] / 1e6:.2f}M-param char GPT, {a.world} ranks as "
                 f"{a.world // a.ranks_per_node} nodes x {a.ranks_per_node}, {a.steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    a = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from _model import CharData

    CharData(a.data)  # fail here, with the message, before spawning ranks
    from fsdp_qcomm.testing import run_ranks

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"accuracy: {len(a.schemes)} schemes x {a.steps} steps, {a.world} ranks "
          f"({a.ranks_per_node} per node), gloo, CPU", flush=True)
    t0 = time.perf_counter()
    res = run_ranks(_train_all, a.world, a, timeout=4 * 3600)[0]
    wall = time.perf_counter() - t0
    res["wall_seconds"] = wall
    res["args"] = {k: v for k, v in vars(a).items()}
    table = _table(res)
    shape = (f"model: {res['params'] / 1e6:.2f}M params (dim {a.dim}, {a.layers} layers, "
             f"{a.heads} heads, vocab {res['vocab']}), seq {a.seq}, batch {a.batch}/rank, "
             f"AdamW lr {a.lr} cosine, {a.steps} steps, seed {a.seed}; validation: "
             f"{a.eval_batches * a.world} held-out batches")
    md = (f"# SDP4Bit Table 1, small-scale reproduction\n\n{shape}\n\n{table}\n\n"
          f"Wall time: {wall / 60:.1f} min for {len(a.schemes)} schemes.\n")
    (out_dir / "table.md").write_text(md)
    (out_dir / "results.json").write_text(json.dumps(res, indent=1))
    plotted = _plot(res, out_dir / "loss_curves.png", a)
    print("\n" + md)
    print(f"written: {out_dir}/table.md, results.json" + (", loss_curves.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
