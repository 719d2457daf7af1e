"""The CPU debug job: ``python -m fsdp_qcomm.titan.main [--scheme sdp4bit] [--steps 300] ...``.

1. builds the offline corpus and tokenizer (cached; see ``data.py``) in this process, so the
   ranks do not all wait on the build lock;
2. runs ``torchrun --standalone --nproc_per_node 4 -m torchtitan.train`` on
   ``recipes/debug_<scheme>.toml`` (stock torchtitan entry point; our code comes in through
   ``custom_import``), one thread per rank, printing rank 0's log (loss every 10 steps);
3. reads ``<dump_folder>/qcomm_summary.json`` and prints a summary: loss first -> last,
   held-out loss, and bytes sent per step against unquantized FSDP2.

Arguments after ``--`` go to torchtitan, e.g. ``-- --qcomm.weight_bits 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fsdp_qcomm.titan.recipes import DEBUG_SCHEMES, RECIPES_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def torchrun_command(
    recipe: Path, nproc: int, steps: int | None, dump: Path, extra: list[str],
    all_ranks: bool = False,
) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}"]
    if not all_ranks:
        cmd += ["--local-ranks-filter", "0", "--role", "rank", "--tee", "3"]
    cmd += ["-m", "torchtitan.train", "--job.config_file", str(recipe),
            "--job.dump_folder", str(dump)]
    if steps is not None:
        cmd += ["--training.steps", str(steps)]
    return cmd + extra


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def print_summary(summary: dict, out=sys.stdout) -> None:
    """Loss first -> last, held-out losses, and bytes sent against unquantized FSDP2."""
    p = lambda *a: print(*a, file=out)  # noqa: E731
    loss = summary.get("loss") or []
    steps = summary.get("steps_logged") or []
    p("=" * 72)
    p(f"fsdp_qcomm debug job: {summary['model']} {summary['flavor']}, preset "
      f"{summary['preset']!r}, {summary['world_size']} ranks, {summary['last_step']} steps, "
      f"{summary['wall_time_s']:.0f} s of training")
    if loss:
        p(f"loss: step {steps[0]} {loss[0]:.4f} -> step {steps[-1]} {loss[-1]:.4f}")
    for v in summary.get("validation") or []:
        p(f"held-out loss at step {v['step']}: {v['loss']:.4f}")
    for note in summary.get("notes") or []:
        p(f"note: {note}")
    if not summary.get("installed"):
        ref = summary.get("reference_bytes_per_step") or {}
        p("quantized communication: NOT INSTALLED: the run used stock FSDP2 collectives.")
        if ref:
            p(f"unquantized FSDP2 traffic per rank and step: weights {_fmt_bytes(ref['weights'])}, "
              f"grads {_fmt_bytes(ref['grads'])}")
        p("=" * 72)
        return
    hist = [h for h in summary.get("history", []) if h["step"] > 1]  # step 1: first gather
    p("bytes sent per rank and step (mean of the logged intervals after step 1) vs what")
    p("unquantized FSDP2 collectives would have been handed:")
    for kind in ("weight", "grad"):
        sent = _mean([h.get(f"qcomm/{kind}_bytes_per_step") for h in hist])
        if sent is None:
            p(f"  {kind + 's':8s} FSDP's own collective (not quantized, not measured)")
            continue
        base = _mean([h.get(f"qcomm/{kind}_baseline_bytes_per_step") for h in hist])
        bits = _mean([h.get(f"qcomm/{kind}_bits_per_elem") for h in hist])
        hops = [
            f"{hop[5:]} hop {b:.2f}"
            for hop in ("grad_intra", "grad_inter")
            if kind == "grad" and (b := _mean([h.get(f"qcomm/{hop}_bits_per_elem") for h in hist]))
        ]
        p(f"  {kind + 's':8s} {_fmt_bytes(sent):>11s} vs {_fmt_bytes(base):>11s}"
          + (f"  ratio {sent / base:.4f} ({base / sent:.2f}x less)" if base and sent else "")
          + (f"  {bits:.3f} bits/element" if bits is not None else "")
          + (f" ({', '.join(hops)} bits on the wire)" if hops else ""))
    tot = _mean([h.get("qcomm/total_ratio_vs_unquantized") for h in hist])
    if tot is not None:
        p(f"  total ratio vs unquantized: {tot:.4f}")
    cum = summary.get("measured_cumulative") or {}
    n = summary.get("optimizer_steps") or 0
    sent = cum.get("weight_sent", 0.0) + cum.get("grad_sent", 0.0)
    base = cum.get("weight_baseline", 0.0) + cum.get("grad_baseline", 0.0)
    if n and base:
        p(f"whole run ({n} steps, first full-precision gathers and held-out passes included): "
          f"sent {_fmt_bytes(sent)} vs {_fmt_bytes(base)} (ratio {sent / base:.4f})")
    if summary.get("gather_modes"):
        p("weight gathers by mode: " + ", ".join(
            f"{k} {v}" for k, v in summary["gather_modes"].items()))
    p("=" * 72)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", default="sdp4bit", choices=DEBUG_SCHEMES)
    ap.add_argument("--recipe", type=Path, default=None,
                    help="a TOML recipe (default: recipes/debug_<scheme>.toml)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="default: the recipe's (300)")
    ap.add_argument("--out", type=Path, default=None,
                    help="dump folder (default: outputs/debug_<scheme> under the repo)")
    ap.add_argument("--all-ranks", action="store_true", help="print every rank's log")
    args = ap.parse_args(argv)

    recipe = args.recipe or RECIPES_DIR / f"debug_{args.scheme}.toml"
    dump = (args.out or REPO_ROOT / "outputs" / f"debug_{args.scheme}").resolve()
    summary_path = dump / "qcomm_summary.json"
    if summary_path.exists():
        summary_path.unlink()

    from fsdp_qcomm.titan import data

    t0 = time.perf_counter()
    tok = data.ensure_tokenizer(8192)
    print(f"offline data: corpus {data.corpus_dir()}, tokenizer {tok} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)

    cmd = torchrun_command(recipe, args.nproc, args.steps, dump, extra, args.all_ranks)
    print("+ " + " ".join(cmd), flush=True)
    t1 = time.perf_counter()
    rc = subprocess.call(cmd, env=child_env(), cwd=str(REPO_ROOT))
    wall = time.perf_counter() - t1
    print(f"torchrun exited with {rc} after {wall:.0f} s", flush=True)
    if rc != 0:
        return rc
    if not summary_path.exists():
        print(f"no summary at {summary_path}", file=sys.stderr)
        return 1
    print_summary(json.loads(summary_path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
