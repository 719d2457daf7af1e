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
import shutil
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


def print_summary(summary: dict, out=sys.stdout) -> None:
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
    ref = summary.get("reference_bytes_per_step") or {}
    hist = [h for h in summary.get("history", []) if h["step"] > 1]  # step 1: first gather
    if not summary.get("installed"):
        p("quantized communication: NOT INSTALLED (" + "; ".join(summary.get("notes") or [])
          + "): the run used stock FSDP2 collectives, so no measured figures exist.")
        if ref:
            p(f"unquantized FSDP2 traffic per rank and step: weights {_fmt_bytes(ref['weights'])}, "
              f"grads {_fmt_bytes(ref['grads'])}")
        p("=" * 72)
        return
    p("bytes sent per rank and step (mean over logged intervals after step 1) vs unquantized:")
    for kind in ("weight", "grad"):
        vals = [h[f"qcomm/{kind}_bytes_per_step"] for h in hist
                if f"qcomm/{kind}_bytes_per_step" in h]
        if not vals:
            continue
        mean = sum(vals) / len(vals)
        r = ref.get(kind + "s", 0.0)
        bits = [h.get(f"qcomm/{kind}_bits_per_elem") for h in hist]
        bits = [b for b in bits if b is not None]
        p(f"  {kind + 's':8s} {_fmt_bytes(mean):>12s}  vs {_fmt_bytes(r):>12s}"
          + (f"  ratio {mean / r:.3f} ({r / mean:.2f}x less)" if r and mean else "")
          + (f"  {sum(bits) / len(bits):.2f} bits/element" if bits else ""))
    tot = [h.get("qcomm/total_ratio_vs_unquantized") for h in hist]
    tot = [t for t in tot if t is not None]
    if tot:
        p(f"  total ratio vs unquantized: {sum(tot) / len(tot):.3f}")
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
