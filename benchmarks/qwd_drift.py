"""Long-run qWD drift check: does the reference everyone computes with stay near the true weights?

Trains a tiny MLP with FSDP2 + ``fsdp_qcomm.enable`` (qWD 4-bit weights) on 2 gloo CPU ranks for
``--steps`` optimizer steps and logs, every step, the gap between the weights the forward
computes with (the unsharded parameters after the quantized gather) and the true weights:

* ``gap_abs``: max |used - true| over all parameters;
* ``gap_rel``: max over parameters of max|used - true| / max|true|;
* ``update_abs``: max |w_t - w_{t-1}| (the last optimizer update, true weights);
* ``gap_per_update``: gap_abs / update_abs. qWD sends Q(w_t - ref_{t-1}), whose error is at most
  absmax/qmax of that difference, so with error feedback the gap stays below about
  update / (qmax - 1) forever: a ratio that creeps up would be drift.

Writes ``<out>.csv`` (one row per step) and ``<out>.md`` (summary per window of 500 steps) and
exits non-zero on drift: the last window's mean or maximum gap (absolute or relative) more than
10% above the 500-999 window's. The tolerance is for noise: window statistics of a bounded,
stationary quantity move by a few percent (the relative gap also moves with max|w|), while a
drifting reference grows without bound.

    OMP_NUM_THREADS=1 python benchmarks/qwd_drift.py --steps 2000 --out results/qwd_drift

``--variant LABEL:FIELD=VALUE,...`` (repeatable) runs one training per variant, each the preset
with those ``QCommConfig`` overrides, and writes ``<out>/<label>.{csv,md}`` plus a combined
``<out>/table.md``; ``--variants lowbit`` runs the sub-4-bit set (2 and 3 bits; uniform,
Hadamard-rotated and learned levels) next to the 4-bit default:

    OMP_NUM_THREADS=1 python benchmarks/qwd_drift.py --steps 2000 --variants lowbit \
        --out results/qwd_drift
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _provenance  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(24, 96), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 96), nn.GELU(),
        nn.Linear(96, 1),
    )


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from torch.distributed.fsdp import fully_shard

    import fsdp_qcomm
    from fsdp_qcomm import QCommConfig

    model = _model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    handle = fsdp_qcomm.enable(model, QCommConfig.preset(args.preset, **args.overrides))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    used: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.LayerNorm)):
            def pre(m, a, name=name):
                for p, t in m.named_parameters(recurse=False):
                    used[f"{name}.{p}"] = t.detach().clone()
            mod.register_forward_pre_hook(pre)
    g = torch.Generator().manual_seed(1 + rank)
    teacher = torch.randn(24, generator=torch.Generator().manual_seed(99))
    rows = []
    prev = None
    t0 = time.perf_counter()
    for step in range(args.steps):
        true = {k: p.full_tensor() for k, p in model.named_parameters()}
        x = torch.randn(32, 24, generator=g)
        y = torch.sin(x @ teacher).unsqueeze(1) + 0.1 * torch.randn(32, 1, generator=g)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            gap_abs = max((used[k] - true[k]).abs().max().item() for k in true)
            gap_rel = max(
                ((used[k] - true[k]).abs().max() / true[k].abs().max()).item() for k in true
            )
            upd = 0.0 if prev is None else max(
                (true[k] - prev[k]).abs().max().item() for k in true
            )
            rows.append((step, loss.item(), gap_abs, gap_rel, upd,
                         gap_abs / upd if upd else 0.0))
        prev = true
    wall = time.perf_counter() - t0
    modes = handle.gather_modes()
    dist.destroy_process_group()
    if rank == 0:
        q.put((rows, wall, modes))


#: the sub-4-bit set: label -> QCommConfig overrides of the qwd preset
LOWBIT = {
    "w4": {},
    "w3": dict(weight_bits=3),
    "w3_hadamard": dict(weight_bits=3, weight_hadamard=True),
    "w3_learned": dict(weight_bits=3, weight_levels="learned"),
    "w2": dict(weight_bits=2),
    "w2_hadamard": dict(weight_bits=2, weight_hadamard=True),
    "w2_learned": dict(weight_bits=2, weight_levels="learned"),
}


def _parse_variant(text: str) -> tuple[str, dict]:
    """``LABEL:FIELD=VALUE,...`` -> (label, overrides); ints, floats, true/false parsed."""
    label, _, body = text.partition(":")
    out: dict = {}
    for item in filter(None, body.split(",")):
        k, _, v = item.partition("=")
        low = v.lower()
        if low in ("true", "false"):
            out[k] = low == "true"
        else:
            for cast in (int, float):
                try:
                    out[k] = cast(v)
                    break
                except ValueError:
                    continue
            else:
                out[k] = v
    return label, out


def _summary(rows: list, wall: float, modes: dict, args: argparse.Namespace) -> tuple[str, bool]:
    win = 500
    extra = ", ".join(f"{k}={v}" for k, v in sorted(args.overrides.items()))
    lines = [
        f"# qWD drift: {args.steps} steps, preset {args.preset!r}{' ' + extra if extra else ''}, "
        f"2 gloo ranks, AdamW lr {args.lr}",
        "",
        f"wall time {wall:.1f} s ({1000 * wall / len(rows):.1f} ms/step); gather modes {modes}",
        "",
        "| steps | max gap_abs | mean gap_abs | max gap_rel | mean gap_rel | max gap/update "
        "| mean update | mean loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    maxima, means = {}, {}
    for lo in range(0, len(rows), win):
        w = rows[lo:lo + win]
        body = [r for r in w if r[0] > 0]  # step 0 is exact (full precision), no update yet
        ga = [r[2] for r in body]
        gr = [r[3] for r in body]
        ratio = [r[5] for r in body]
        maxima[lo] = max(ga)
        means[lo] = (sum(ga) / len(ga), sum(gr) / len(gr), max(gr))
        lines.append(
            f"| {lo}-{lo + len(w) - 1} | {max(ga):.3e} | {sum(ga) / len(ga):.3e} | "
            f"{max(gr):.3e} | {sum(gr) / len(gr):.3e} | {max(ratio):.3f} | "
            f"{sum(r[4] for r in body) / len(body):.3e} | {sum(r[1] for r in w) / len(w):.4f} |"
        )
    last = max(maxima)
    ok = (
        500 in maxima and maxima[last] <= 1.1 * maxima[500]
        and all(a <= 1.1 * b for a, b in zip(means[last], means[500]))
    )
    lines += [
        "",
        f"verdict: {'no drift' if ok else 'DRIFT'}: steps {last}-{len(rows) - 1} vs 500-999: "
        f"mean gap_abs {means[last][0]:.3e} vs {means[500][0]:.3e}, mean gap_rel "
        f"{means[last][1]:.3e} vs {means[500][1]:.3e}, max gap_abs {maxima[last]:.3e} vs "
        f"{maxima[500]:.3e}, max gap_rel {means[last][2]:.3e} vs {means[500][2]:.3e} "
        "(allowed: +10%)",
    ]
    args.window_means = means
    return "\n".join(lines), ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--preset", default="qwd")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="results/qwd_drift")
    ap.add_argument("--variant", action="append", default=[],
                    metavar="LABEL:FIELD=VALUE,...", help="a run with QCommConfig overrides")
    ap.add_argument("--variants", choices=["lowbit"], help="a named set of variants")
    args = ap.parse_args()
    if args.steps < 1000:
        ap.error("--steps must be at least 1000 (the verdict compares windows of 500 steps)")
    variants = [_parse_variant(v) for v in args.variant]
    if args.variants == "lowbit":
        variants += list(LOWBIT.items())
    if not variants:
        args.overrides = {}
        # one run writes <out>.csv and <out>.md: its provenance is <out>.provenance.json
        _provenance.record(os.path.dirname(args.out) or ".",
                           prefix=os.path.basename(args.out) + ".")
        return 0 if _run(args, args.out)[1] else 1
    os.makedirs(args.out, exist_ok=True)
    _provenance.record(args.out)
    rows = ["| variant | overrides | mean gap_abs 500-999 | mean gap_abs last 500 | max gap_rel "
            "last 500 | verdict |", "|---|---|---|---|---|---|"]
    all_ok = True
    for label, overrides in variants:
        args.overrides = overrides
        _, ok = _run(args, os.path.join(args.out, label))
        last = max(args.window_means)
        m = args.window_means
        all_ok &= ok
        rows.append(f"| {label} | {overrides or '-'} | {m[500][0]:.3e} | {m[last][0]:.3e} | "
                    f"{m[last][2]:.3e} | {'no drift' if ok else 'DRIFT'} |")
    cmd = ["OMP_NUM_THREADS=1 python benchmarks/qwd_drift.py", f"--steps {args.steps}"]
    cmd += [f"--variant {v}" for v in args.variant]
    cmd += [f"--variants {args.variants}"] if args.variants else []
    cmd += [f"--out {args.out}"]
    text = (f"# qWD drift per variant: {args.steps} steps, preset {args.preset!r}, 2 gloo "
            f"ranks, AdamW lr {args.lr}\n\nCommand: `{' '.join(cmd)}`\n\n" + "\n".join(rows)
            + "\n")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all_ok else 1


def _run(args: argparse.Namespace, out: str) -> tuple[str, bool]:
    """One training run of ``args.preset`` with ``args.overrides``; writes ``out.{csv,md}``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rows, wall, modes = q.get(timeout=3600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "gap_abs", "gap_rel", "update_abs", "gap_per_update"])
        w.writerows(rows)
    text, ok = _summary(rows, wall, modes, args)
    with open(out + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    return text, ok


if __name__ == "__main__":
    sys.exit(main())
