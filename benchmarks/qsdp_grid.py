"""QSDP's W/G bit-width grid (QSDP paper, GPT-125M on C4) at small scale on CPU, gloo ranks.

Every cell trains the same small GPT (same init, same batches, same seed) with FSDP2 and
``fsdp_qcomm.enable(model, QCommConfig.from_qsdp_string(cell, levels=...))`` for uniform and
learned levels, then reports the final validation loss (with the exact, unquantized master
weights, i.e. the model that training produced), its perplexity, and the bytes each rank handed
to the process group per step (weights, gradients, level-table syncs). Output: a markdown table
``grid.md``, ``grid.json`` and ``grid.png`` in ``--out``.

    PYTHONPATH=$PWD python benchmarks/qsdp_grid.py            # ~20 min on 2 cores
    PYTHONPATH=$PWD python benchmarks/qsdp_grid.py --seeds 3  # mean, sd and gaps over seeds

Char-level tinyshakespeare (first 90% train, last 10% validation). ``--seeds N`` trains every
cell under seeds ``--seed``, ``--seed + 1``, ... (initial weights, batches, quantizer bits; the
validation batches stay the same) and reports the mean and standard deviation of the final
validation loss, and the gap to the unquantized W32G32 paired by seed with its 95% interval.
Each (cell, levels, seed) run is stored in ``--out``/runs as it finishes (``_seeds.RunStore``):
an interrupted grid resumes, and a grid can be split over invocations (``--cells``, ``--seed``)
that share ``--out``; ``--report-only`` rebuilds the table from the stored runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's fsdp_qcomm

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fsdp_qcomm.testing import run_ranks  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import _provenance  # noqa: E402
from _plotting import pyplot  # noqa: E402
from _seeds import (  # noqa: E402
    RunStore,
    SetupMismatch,
    Spread,
    file_digest,
    fmt_spread,
    fmt_verdict,
    ordering,
    paired_gap_pct,
    seed_list,
    spread,
)

CELLS = ["W32G32", "W8G8", "W6G4", "W5G4", "W4G4", "W4G32", "W3G32", "W2G32", "W8G3", "W8G2"]
PAPER = {  # QSDP paper, GPT-125M on C4, perplexity (uniform, learned)
    "W32G32": (35.81, None), "W8G8": (35.58, None), "W6G4": (35.81, 35.75),
    "W5G4": (36.34, 36.01), "W4G4": (37.61, 36.94), "W4G32": (37.11, 36.55),
    "W3G32": (45.53, 42.31), "W2G32": (57.92, 56.54), "W8G3": (39.91, 37.72),
    "W8G2": (44.79, 44.65),
}


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, ctx: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def _load(path: str):
    text = Path(path).read_text()
    chars = sorted(set(text))
    table = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([table[c] for c in text], dtype=torch.long)
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:], len(chars)


def _batch(data: torch.Tensor, g: torch.Generator, b: int, t: int) -> torch.Tensor:
    starts = torch.randint(0, len(data) - t - 1, (b,), generator=g)
    return torch.stack([data[s:s + t + 1] for s in starts.tolist()])


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _cell(rank: int, world: int, cell: str, levels: str, seed: int, a: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import fsdp_qcomm
    from fsdp_qcomm import QCommConfig

    train, val, vocab = _load(a["data"])
    torch.manual_seed(seed)
    model = GPT(vocab, a["d"], a["heads"], a["layers"], a["seq"])
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    cfg = QCommConfig.from_qsdp_string(cell, levels=levels, seed=seed,
                                       levels_refresh_every=a["refresh"])
    handle = fsdp_qcomm.enable(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], weight_decay=0.0)
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    t0 = time.time()
    for step in range(a["steps"]):
        lr = a["lr"] * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / a["steps"]))
        for pg in opt.param_groups:
            pg["lr"] = lr
        loss = _loss(model, _batch(train, g, a["batch"], a["seq"]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    train_s = time.time() - t0
    stats = handle.stats()
    # bytes of a plain fp32 reduce-scatter per step (FSDP's own when gradients stay fp32)
    shard = sum(p.to_local().numel() for p in model.parameters())
    handle.disable()  # evaluate the weights training produced, at full precision
    gv = torch.Generator().manual_seed(12345 + rank)
    with torch.no_grad():
        vl = torch.stack([_loss(model, _batch(val, gv, a["batch"], a["seq"]))
                          for _ in range(a["val_batches"])]).mean()
    dist.all_reduce(vl)
    vl = (vl / world).item()
    steps = a["steps"]
    w = stats.get("weight_allgather", {}).get("sent_bytes", 0) / steps
    gq = sum(stats.get(k, {}).get("sent_bytes", 0) for k in ("grad_intra", "grad_inter")) / steps
    gb = world * shard * 4 if cell.upper().endswith("G32") else gq
    sync = stats.get("levels_sync", {}).get("sent_bytes", 0) / steps
    return dict(cell=cell, levels=levels, seed=seed, val_loss=vl, ppl=math.exp(vl), weight_bytes=w,
                grad_bytes=gb, sync_bytes=sync, total_bytes=w + gb + sync, train_s=train_s,
                notes=stats["notes"])


_SETUP = ("data", "ranks", "steps", "batch", "seq", "d", "heads", "layers", "lr", "refresh",
          "val_batches")


def _runs(cells: list[str]) -> list[tuple[str, str]]:
    return [(c, lv) for c in cells
            for lv in (("uniform",) if c.upper() == "W32G32" else ("uniform", "learned"))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=str(ROOT.parent / "shared/data/tinyshakespeare/input.txt"))
    p.add_argument("--out", default=str(ROOT / "results/qsdp_grid"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--refresh", type=int, default=50, help="levels_refresh_every (steps)")
    p.add_argument("--val-batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=1, help="seeds per cell: --seed, --seed+1, ...")
    p.add_argument("--cells", default=",".join(CELLS))
    p.add_argument("--fresh", action="store_true", help="recompute stored runs")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: rebuild the table from the runs stored in --out")
    args = p.parse_args()
    a = {k: v for k, v in vars(args).items()}
    if not Path(a["data"]).is_file():
        sys.exit(f"--data {a['data']} not found; pass the path of tinyshakespeare's input.txt")
    if args.seeds < 1:
        sys.exit(f"--seeds {args.seeds} must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _provenance.record(out)
    setup = {k: a[k] for k in _SETUP}
    setup["data"] = file_digest(a["data"])
    store = RunStore(out, setup)
    try:
        store.all()  # refuse now, not after training, if --out holds other settings
    except SetupMismatch as e:
        sys.exit(f"qsdp_grid: {e}")
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    for seed in ([] if args.report_only else seed_list(args.seed, args.seeds)):
        for cell, levels in _runs(cells):
            row = {"cell": cell, "levels": levels}
            label = f"{cell} {levels}"
            if not args.fresh and store.load(label, seed, row) is not None:
                continue
            t0 = time.time()
            res = run_ranks(_cell, args.ranks, cell, levels, seed, a, timeout=1800)[0]
            res["wall_s"] = time.time() - t0
            store.save(label, seed, row, res)
            print(f"{cell:7s} {levels:8s} seed {seed} val_loss={res['val_loss']:.4f} "
                  f"ppl={res['ppl']:.3f} bytes/step={res['total_bytes']:.0f} "
                  f"({res['wall_s']:.0f}s)", flush=True)
    stored = store.all()
    if not stored:
        sys.exit(f"no runs stored in {store.dir}: nothing to report")
    _report(stored, a, out)


def _summarize(stored: dict) -> dict:
    """Per (cell, levels): the val losses by seed, their spread, the paired gap to W32G32."""
    base = stored.get("W32G32 uniform", {}).get("runs", {})
    base_vl = {s: r["val_loss"] for s, r in base.items()}
    out = {}
    for label, entry in stored.items():
        runs = entry["runs"]
        vl = {s: r["val_loss"] for s, r in sorted(runs.items())}
        first = runs[min(runs)]
        out[(entry["row"]["cell"], entry["row"]["levels"])] = {
            "seeds": sorted(vl), "val_loss": vl, "spread": spread(list(vl.values())),
            "gap": None if label == "W32G32 uniform" else paired_gap_pct(vl, base_vl),
            "ppl": spread([r["ppl"] for r in runs.values()]).mean,
            "total_bytes": first["total_bytes"], "notes": first["notes"],
        }
    return out


def _report(stored: dict, a: dict, out: Path) -> None:
    by = _summarize(stored)
    base = by.get(("W32G32", "uniform"))
    seeds = sorted({s for r in by.values() for s in r["seeds"]})
    lines = [
        f"QSDP grid, small scale: GPT d={a['d']} layers={a['layers']} heads={a['heads']} "
        f"seq={a['seq']}, char-level tinyshakespeare, {a['ranks']} gloo ranks x batch "
        f"{a['batch']}, {a['steps']} steps, AdamW lr {a['lr']}, buckets 1024, level refresh "
        f"every {a['refresh']} steps, seeds {seeds}. Validation loss with the trained "
        "(unquantized) weights, mean ± sd over seeds; gap = to W32G32 (and learned vs uniform "
        "levels), paired by seed, with its 95% interval (within it: seed noise); bytes = what "
        "one rank hands to the process group per step.",
        "",
        "| cell | val loss uniform | val loss learned | gap uniform | gap learned | "
        "learned vs uniform | ppl uniform | ppl learned | paper ppl uniform / learned | "
        "bytes/step uniform | bytes/step learned |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells = [c for c in CELLS if any(k[0] == c for k in by)]
    cells += sorted({k[0] for k in by} - set(cells))
    for c in cells:
        u, lrn = by.get((c, "uniform")), by.get((c, "learned"))
        pu, pl = PAPER.get(c, (None, None))

        def gap(g):
            return "-" if g is None else f"{fmt_spread(g, 2, '%')} ({fmt_verdict(g)})"

        def order(g):
            if g is None:
                return "-"
            word = ordering(g, "learned", "uniform")
            return f"{fmt_spread(g, 2, '%')} ({fmt_verdict(g)}; {word})"

        lvu = None if not (u and lrn) else paired_gap_pct(lrn["val_loss"], u["val_loss"])

        def val(r, key, fmt):
            return fmt.format(r[key]) if r else ""

        lines.append(
            f"| {c} | {fmt_spread(u['spread'], 4) if u else ''} | "
            f"{fmt_spread(lrn['spread'], 4) if lrn else ''} | {gap(u and u['gap'])} | "
            f"{gap(lrn and lrn['gap'])} | {order(lvu)} | "
            f"{val(u, 'ppl', '{:.3f}')} | {val(lrn, 'ppl', '{:.3f}')} | "
            f"{pu if pu else ''} / {pl if pl else '-'} | "
            f"{val(u, 'total_bytes', '{:,.0f}')} | {val(lrn, 'total_bytes', '{:,.0f}')} |"
        )
    if base:
        lines += ["", f"Unquantized baseline (W32G32): val loss "
                  f"{fmt_spread(base['spread'], 4)}, {base['total_bytes']:,.0f} bytes/step."]
    (out / "grid.md").write_text("\n".join(lines) + "\n")

    def as_json(r: dict) -> dict:
        return {**r, "spread": r["spread"].as_dict(),
                "gap": None if r["gap"] is None else r["gap"].as_dict()}

    (out / "grid.json").write_text(json.dumps(dict(
        args=a, summary={f"{c} {lv}": as_json(r) for (c, lv), r in by.items()}, runs=stored,
    ), indent=1))
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        print("matplotlib missing: pip install matplotlib for grid.png")
        return
    qc = [c for c in cells if c != "W32G32"]
    x = range(len(qc))
    fig, ax = plt.subplots(figsize=(9, 4))
    nan = Spread(0, float("nan"), 0.0, 0.0)
    for lv, off in (("uniform", -0.2), ("learned", 0.2)):
        sp = [by[(c, lv)]["spread"] if (c, lv) in by else nan for c in qc]
        ax.bar([i + off for i in x], [s.mean for s in sp], width=0.4, label=f"{lv} levels",
               yerr=[s.sd for s in sp], capsize=3)
    if base:
        ax.axhline(base["spread"].mean, color="k", ls="--", lw=1, label="unquantized")
    means = [r["spread"].mean for r in by.values()]
    lo, hi = min(means), max(means)
    ax.set_ylim(lo - 0.1 * (hi - lo) - 0.01, hi + 0.05 * (hi - lo) + 0.01)
    ax.set_xticks(list(x), qc)
    ax.set_ylabel("final validation loss (mean ± sd over seeds)")
    ax.set_title("QSDP grid (small GPT, tinyshakespeare): uniform vs learned levels")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "grid.png", dpi=120)


if __name__ == "__main__":
    main()
