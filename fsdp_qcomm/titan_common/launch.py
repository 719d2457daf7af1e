"""The CPU debug jobs of both adapters: the torchrun command, its environment, the printout.

``python -m fsdp_qcomm.titan.main`` (torchtitan 0.2.2, a TOML recipe) and
``python -m fsdp_qcomm.titan03.main`` (torchtitan 0.3, a recipe function) build the offline
data once, run stock ``torchtitan.train`` under ``torchrun --standalone`` on CPU processes,
then print :func:`print_summary` of the ``qcomm_summary.json`` rank 0 wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

from .comm_stats import COLLECTIVES, SUMMARY_FILE, collective_named
from .shapes import DEBUG_SCHEMES

#: the directory holding the fsdp_qcomm package: a checkout, or site-packages when installed
REPO_ROOT = Path(__file__).resolve().parents[2]


def checkout() -> Optional[Path]:
    """The repository checkout this fsdp_qcomm runs from, or None for an installed package, whose
    parent directory (site-packages) is no place for a job's outputs or working directory."""
    if (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "recipes").is_dir():
        return REPO_ROOT
    return None


def default_dump(name: str) -> Path:
    """A debug job's dump folder: ``outputs/<name>`` in the checkout, else in the working
    directory."""
    return ((checkout() or Path.cwd()) / "outputs" / name).resolve()


def torchrun_prefix(nproc: int, dump: Path, all_ranks: bool = False,
                    log_rank: int = 0) -> list[str]:
    """``torchrun --standalone --nproc_per_node N`` (printing rank ``log_rank``'s log only by
    default), with torchrun's own log folder in the job's ``dump`` folder: without
    ``--log-dir`` torchrun makes a ``torchelastic_*`` folder in the system's temporary
    directory on every launch (with each rank's full log when it tees) and never removes it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "--log-dir", str(Path(dump) / "torchrun_logs")]
    if not all_ranks:
        cmd += ["--local-ranks-filter", str(log_rank), "--role", "rank", "--tee", "3"]
    return cmd


def loss_rank(nproc: int, extra: list[str]) -> int:
    """The rank whose log shows the loss, from torchtitan flags among ``extra``: 0, or under
    pipeline parallelism (``--parallelism.pipeline_parallel_degree P``) the first rank of the
    last stage (``comm_stats.metrics_rank``), where torchtitan computes and logs it."""
    from .comm_stats import metrics_rank

    def flag(name: str, default: str) -> str:
        for i, a in enumerate(extra):
            if a == name and i + 1 < len(extra):
                return extra[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        return default

    prefix = "--parallelism.pipeline_parallel_"
    try:
        pp = int(flag(prefix + "degree", "1"))
    except ValueError:
        return 0
    return metrics_rank(pp, nproc, flag(prefix + "schedule", "1F1B")) if 0 < pp <= nproc else 0


def child_env() -> dict[str, str]:
    """One thread per rank, and this copy of fsdp_qcomm first on the ranks' path."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _mean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


_PLURAL = {"weight": "weights", "grad": "grads", "replica": "replicas", "levels": "levels",
           "weight_intra": "w-intra", "agreement": "agree"}


def print_summary(summary: dict, out: Optional[TextIO] = None) -> None:
    """Loss first -> last, held-out losses, and bytes sent against unquantized FSDP2."""
    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    loss = summary.get("loss") or []
    steps = summary.get("steps_logged") or []
    replicas = summary.get("replicas") or 1
    layout = f"{summary['world_size']} ranks" + (
        f" x {replicas} replicas (HSDP)" if replicas > 1 else "")
    p("=" * 72)
    p(f"fsdp_qcomm debug job: {summary['model']} {summary['flavor']}, preset "
      f"{summary['preset']!r}, {layout}, {summary['last_step']} steps, "
      f"{summary['wall_time_s']:.0f} s of training")
    if loss:
        p(f"loss: step {steps[0]} {loss[0]:.4f} -> step {steps[-1]} {loss[-1]:.4f}")
    for v in summary.get("validation") or []:
        p(f"held-out loss at step {v['step']}: {v['loss']:.4f}")
    for note in summary.get("notes") or []:
        p(f"note: {note}")
    ref = summary.get("reference_bytes_per_step") or {}
    if not summary.get("installed"):
        p("quantized communication: NOT INSTALLED: the run used stock FSDP2 collectives.")
        if ref:
            p("unquantized FSDP2 traffic per rank and step: " + ", ".join(
                f"{k} {_fmt_bytes(v)}" for k, v in ref.items() if v))
        p("=" * 72)
        return
    hist = [h for h in summary.get("history", []) if h["step"] > 1]  # step 1: first gather
    cross = _mean([h.get("qcomm/total_cross_node_bytes_per_step") for h in hist])
    ref32 = _mean([h.get("qcomm/ref_cross_node_fp32_bytes_per_step") for h in hist])
    ref16 = _mean([h.get("qcomm/ref_cross_node_bf16_fp32_bytes_per_step") for h in hist])
    last = hist[-1] if hist else {}
    unmeasured = [c.name for c in COLLECTIVES if last.get(f"qcomm/ref_{c.name}_crosses_nodes")
                  and f"qcomm/{c.name}_bytes_per_step" not in last]
    if cross and ref32 and not unmeasured:
        # what crosses the slow link is what the run is for: lead with it
        p(f"node-crossing bytes per rank and step: {_fmt_bytes(cross)}, against FSDP2's "
          f"{_fmt_bytes(ref32)} in fp32 ({ref32 / cross:.2f}x fewer) and "
          f"{_fmt_bytes(ref16)} with bf16 parameters and fp32 reduction "
          f"({ref16 / cross:.2f}x fewer)")
    p("bytes sent per rank and step (mean of the logged intervals after step 1) vs what")
    p("unquantized FSDP2 collectives would have been handed:")
    measured = {k[len("qcomm/"):-len("_baseline_bytes_per_step")] for h in hist for k in h
                if k.endswith("_baseline_bytes_per_step")}
    own = {c.name for c in COLLECTIVES
           if c.name not in measured and ref.get(_PLURAL.get(c.name, c.name))}
    no_baseline = {c.name for c in COLLECTIVES if not c.counts_baseline}
    known = [c.name for c in COLLECTIVES]
    for name in [n for n in known if n in measured | own] + sorted(measured - set(known)):
        label = _PLURAL.get(name, name)
        if name in own:
            p(f"  {label:8s} FSDP's own collective (not quantized, not measured)")
            continue
        c = collective_named(name)
        sent = _mean([h.get(f"qcomm/{name}_bytes_per_step") for h in hist])
        base = _mean([h.get(f"qcomm/{name}_baseline_bytes_per_step") for h in hist])
        bits = _mean([h.get(f"qcomm/{name}_bits_per_elem") for h in hist])
        hops = [
            f"{k.split('_', 1)[-1]} hop {b:.2f}" for k in c.kinds
            if len(c.kinds) > 1 and (b := _mean([h.get(f"qcomm/{k}_bits_per_elem") for h in hist]))
        ]
        if name in no_baseline:
            p(f"  {label:8s} {_fmt_bytes(sent or 0.0):>11s} inside nodes (no FSDP2 counterpart)")
            continue
        p(f"  {label:8s} {_fmt_bytes(sent or 0.0):>11s} vs {_fmt_bytes(base or 0.0):>11s}"
          + (f"  ratio {sent / base:.4f} ({base / sent:.2f}x less)" if base and sent else "")
          + (f"  {bits:.3f} bits/element" if bits is not None else "")
          + (f" ({', '.join(hops)} bits on the wire)" if hops else ""))
    tot = _mean([h.get("qcomm/total_ratio_vs_unquantized") for h in hist])
    if tot is not None:
        p(f"  total ratio vs unquantized: {tot:.4f}")
    if cross is not None:
        p(f"  sent to other nodes: {_fmt_bytes(cross)} per step"
          + (f" (FSDP2: {_fmt_bytes(ref32)} in fp32, {_fmt_bytes(ref16)} bf16/fp32)"
             if ref32 else ""))
    cum = summary.get("measured_cumulative") or {}
    n = summary.get("training_steps") or 0
    sent = sum(v for k, v in cum.items() if k.endswith("_sent") and k[:-5] in measured)
    base = sum(v for k, v in cum.items() if k.endswith("_baseline") and k[:-9] in measured
               and k[:-9] not in no_baseline)
    if n and base:
        p(f"whole run ({n} steps, first full-precision gathers and held-out passes included): "
          f"sent {_fmt_bytes(sent)} vs {_fmt_bytes(base)} (ratio {sent / base:.4f})")
    if summary.get("gather_modes"):
        p("weight gathers by mode: " + ", ".join(
            f"{k} {v}" for k, v in summary["gather_modes"].items()))
    p("=" * 72)


def debug_job_args(
    argv: Optional[list[str]], doc: str, add_arguments: Callable[[argparse.ArgumentParser], None]
) -> tuple[argparse.Namespace, list[str]]:
    """The debug jobs' command line: ``--scheme``, ``--nproc``, ``--steps``, ``--out``,
    ``--all-ranks``, what ``add_arguments`` adds, and everything after ``--`` (returned as is:
    flags for torchtitan)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--scheme", default="sdp4bit", choices=DEBUG_SCHEMES)
    add_arguments(ap)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="default: the recipe's (300)")
    ap.add_argument("--out", type=Path, default=None,
                    help="dump folder (default: outputs/<job> in the checkout, else in the "
                         "working directory)")
    ap.add_argument("--all-ranks", action="store_true", help="print every rank's log")
    return ap.parse_args(argv), extra


def run_debug_job(cmd: list[str], dump: Path, vocab_size: int) -> int:
    """Build the offline data, run ``cmd`` (a torchrun command), print the run's summary."""
    from . import data
    from .cpu import FORCE_DEVICE_ENV

    summary_path = dump / SUMMARY_FILE
    if summary_path.exists():
        summary_path.unlink()
    t0 = time.perf_counter()
    tok = data.ensure_tokenizer(vocab_size)
    print(f"offline data: corpus {data.corpus_dir()}, tokenizer {tok} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    print("+ " + " ".join(cmd), flush=True)
    t1 = time.perf_counter()
    env = child_env()
    # the CPU debug job stays on the CPU on a host with GPUs too (4 ranks on fewer GPUs fail in
    # set_device); FSDP_QCOMM_DEVICE set by the caller wins
    env.setdefault(FORCE_DEVICE_ENV, "cpu")
    if "--local-ranks-filter" in cmd:  # torchtitan warns unless LOG_RANK names the loss's rank
        env["LOG_RANK"] = cmd[cmd.index("--local-ranks-filter") + 1]
    rc = subprocess.call(cmd, env=env, cwd=str(checkout() or Path.cwd()))
    print(f"torchrun exited with {rc} after {time.perf_counter() - t1:.0f} s", flush=True)
    if rc != 0:
        return rc
    if not summary_path.exists():
        print(f"no summary at {summary_path}", file=sys.stderr)
        return 1
    print_summary(json.loads(summary_path.read_text()))
    return 0


__all__ = ["REPO_ROOT", "checkout", "child_env", "debug_job_args", "default_dump", "loss_rank",
           "print_summary", "run_debug_job", "torchrun_prefix"]
