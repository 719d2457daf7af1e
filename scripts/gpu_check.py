"""The GPU path checked in one run on a single-GPU machine (``scripts/gpu_check.sh`` runs this).

Steps, ordered by what their figures are worth, each run in a child process of its own (a step
that hangs, crashes or poisons the CUDA context costs only itself) with a time limit taken
from ``--budget``; a step that no longer fits is recorded as skipped:

1. ``environment``: torch, triton, CUDA, the device, its peak memory bandwidth;
2. ``step_cost``: ``benchmarks/gpu_step_cost.py``: a Llama-shaped model (1B, and 4 layers of
   an 8B) as rank 0 of W = 8 and 64 ranks through torch's ``fake`` backend, bf16 parameters and
   fp32 reduction: step time without and with ``enable(sdp4bit)`` (the codec's share of the
   step; goal <= 10% at W = 8), and with ``verify_weight_writes=False`` (no change agreement:
   what its host read costs), peak memory, host syncs after the first step, bytes sent to
   other nodes and the step time they imply at 25, 100 and 400 Gbit/s;
3. ``step_profile``: the same step (1B and 8B-4L at W=8, 1B at W=64) with and without
   ``enable`` under ``torch.profiler`` and ``cProfile``: the kernels by time (ours marked), how
   much of the wall time the GPU is busy, fsdp_qcomm's Python by cumulative time;
4. ``exactness_sweep``: every kernel against the torch codec (``torch_codec`` on the CPU), bit
   for bit, over every width 2..8, group sizes from 8 to 4104, both scalings and roundings,
   the three scale dtypes and odd lengths (NaN/Inf/-0 groups included);
5. ``bandwidth``: ``benchmarks/gpu_kernels_bench.py`` at 64M elements: each kernel's device
   time against ``torch.clone`` and the device's peak (goal >= 70% of clone for
   quantize/dequantize), the host time of a call, and the share of a slow kernel's time that
   each diagnostic row leaves out (random numbers, segment switches, chunks);
6. ``fsdp_hooks``: every preset's hooks inside FSDP2 on CUDA: two ranks of the ``fake``
   backend, kernels on FSDP's streams, stats against the wire format, no host sync after the
   first step (``torch.cuda.set_sync_debug_mode("error")``), an asynchronous unshard waited on
   another stream, and sdp4bit with FSDP's ``CPUOffloadPolicy`` (the change agreement must
   exchange on the GPU though the shards are on the host);
7. ``fsdp_one_rank``: FSDP2 on one NCCL rank, ``enable()`` with each preset against a run
   without it: bit-identical weights (one rank calls no collective), bf16 mixed precision;
   sdp4bit also with CPU-offloaded shards, against FSDP2 offloading alone;
8. ``layouts``: sdp4bit where large-model users stack it, as rank 0 of 4 ``fake`` ranks: HSDP
   (2 x 2), FSDP x tensor parallelism (2 x 2), DiLoCo's outer all-reduce overlapped on its
   side stream (bit-identical to the same schedule in line) and blocks compiled by inductor;
   the quantized collectives reached the hooks, no host sync after the first step;
9. ``four_ranks``: four processes share the GPU as 2 nodes x 2, gloo moving real bytes between
   them: sdp4bit's quantized collectives give the bits and byte counts of the same calls on
   CPU tensors, FSDP2 with ``enable`` (sdp4bit, qsdp, sdp4bit under HSDP) computes with
   bit-identical weights on every rank, near FSDP2's own losses, and DiLoCo's overlapped outer
   all-reduce gives the bits of the same schedule run in line;
10. ``kernel_tests``: ``pytest tests/test_kernels.py`` on CUDA tensors, in up to 4 processes;
11. ``tiles``: the bandwidth of step 5 again with every kernel at 1024, 2048 and 4096 elements
   per program (their own: 4096 for the encoders, 2048 for the rest), for tuning: x clone per
   kernel and tile (diagnostic rows left out).

Results go to ``$OUT`` when it is set (the device tool brings that folder back), else
``--out`` (default ``results/gpu_check/``): ``gpu_check.json`` (every step, rewritten as each
ends, so a run cut short still returns everything finished), ``summary.md``, ``log.txt``
(each step's output) and the run's ``provenance.json`` / ``COMMANDS.md``. A session that
commits a run puts the folder under ``results/gpu_check/<device>_<date>/`` and appends its
invocation to ``results/gpu_check/provenance.json``. Exit status 1 if a step failed. Nothing
is installed: the machine's torch, triton, numpy, pytest and hypothesis are used, and the
package runs from this checkout.
``--dry-run`` (or ``GPU_CHECK_DRY_RUN=1``) runs every step on the CPU with small sizes: the
Triton interpreter for the kernels, gloo for NCCL (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.7  # of torch.clone's bandwidth, for quantize / dequantize kernels at 64M elements
# Peak DRAM bandwidth (GB/s) of parts NVML may not describe.
_KNOWN_PEAK = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB":
               2039, "A100 80GB PCIe": 1935, "A100": 1555, "B200": 8000, "L40S": 864}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   default=os.environ.get("GPU_CHECK_DRY_RUN") == "1",
                   help="CPU only, small sizes: the interpreter for kernels, gloo for NCCL")
    p.add_argument("--out", default="",
                   help="results folder (default: $OUT when set, else results/gpu_check)")
    p.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
    p.add_argument("--budget", type=float, default=480.0,
                   help="seconds for the whole run (default 480); steps that no longer fit "
                        "are skipped")
    p.add_argument("--step", default="", help=argparse.SUPPRESS)  # child: run this step
    p.add_argument("--result", default="", help=argparse.SUPPRESS)  # child: write it here
    p.add_argument("--limit", type=float, default=0.0, help=argparse.SUPPRESS)
    return p.parse_args()


class StepFailed(RuntimeError):
    """A step that ran to the end and found a problem: its figures are kept."""

    def __init__(self, message: str, result: dict) -> None:
        super().__init__(message)
        self.result = result


# ---- helpers ----------------------------------------------------------------------------------
def _digest(t) -> str:
    from fsdp_qcomm.testing import digest  # on any device

    return digest(t)


def _peak_gbps(torch) -> tuple[float | None, str]:
    """The device's peak DRAM bandwidth and where the figure came from."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
        bus = pynvml.nvmlDeviceGetMemoryBusWidth(h)
        if mhz and bus:
            return 2 * mhz * 1e6 * bus / 8 / 1e9, f"NVML: {mhz} MHz x {bus} bit x 2"
    except Exception as e:  # noqa: BLE001 - fall back to the table
        why = f"{type(e).__name__}"
    else:
        why = "NVML gave no clock"
    name = torch.cuda.get_device_name()
    for part, gbps in _KNOWN_PEAK.items():
        if part in name:
            return float(gbps), f"datasheet ({part}); {why}"
    return None, f"unknown part {name!r}; {why}"


# ---- steps ------------------------------------------------------------------------------------
def step_environment(ctx: dict) -> dict:
    import numpy
    import torch
    import triton

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "numpy": numpy.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "dry_run": ctx["dry_run"]}
    if ctx["dry_run"]:
        out["device"] = "cpu (dry run)"
        return out
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available: run with --dry-run for the CPU check")
    p = torch.cuda.get_device_properties(0)
    out.update(device=p.name, capability=f"sm_{p.major}{p.minor}",
               memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    out["peak_gbps"], out["peak_source"] = _peak_gbps(torch)
    ctx["peak_gbps"] = out["peak_gbps"]
    return out


def _processes(jobs: int) -> int:
    """Processes for ``jobs`` compile-bound jobs (Triton compiling on the host): up to 4, a
    quarter of the cores, at least 2 so that the dry run takes the same path."""
    return min(jobs, 4, max(2, (os.cpu_count() or 2) // 4))


def step_kernel_tests(ctx: dict) -> dict:
    """``tests/test_kernels.py`` on CUDA tensors, its tests dealt round-robin to a few pytest
    processes at once: most of their time is Triton compiling each kernel's specializations on
    the host (130 s in one process on the H100 run), which the machine's cores share."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if ctx["dry_run"]:  # a few tests under the interpreter (the whole file: CI does it)
        env["TRITON_INTERPRET"] = "1"
        select = ["-k", "two_level_pipeline or groups_larger_than_a_tile"]
    else:  # on CUDA tensors; the interpreter's own run is CI's
        select = ["-k", "not under_the_interpreter"]
    t0 = time.perf_counter()
    listed = subprocess.run([*cmd, "--collect-only", str(ROOT / "tests" / "test_kernels.py"),
                             *select], env=env, capture_output=True, text=True, cwd=ROOT,
                            timeout=max(10.0, ctx["limit"] / 4))
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    if listed.returncode or not ids:
        raise RuntimeError(f"pytest --collect-only found no test: {listed.stdout[-2000:]}\n"
                           f"{listed.stderr[-2000:]}")
    n = _processes(len(ids))
    procs = [subprocess.Popen([*cmd, *ids[k::n]], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for k in range(n)]
    deadline = t0 + max(10.0, ctx["limit"] - 5)
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=max(1.0, deadline - time.perf_counter()))[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for out in outs:
        last = out.strip().splitlines()[-1] if out.strip() else ""
        for word in counts:
            for part in last.split(","):
                bits = part.split()
                if len(bits) >= 2 and bits[1].startswith(word) and bits[0].isdigit():
                    counts[word] += int(bits[0])
    summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
               f"{counts['skipped']} skipped of {len(ids)} in {n} processes, "
               f"{time.perf_counter() - t0:.1f}s")
    if any(proc.returncode for proc in procs) or counts["passed"] + counts["skipped"] != len(ids):
        bad = "\n".join(out[-3000:] for proc, out in zip(procs, outs) if proc.returncode)
        raise RuntimeError(f"pytest failed: {summary}\n{bad}")
    return {"summary": summary, "processes": n, "tests": len(ids)}


def step_step_cost(ctx: dict) -> dict:
    """The codec's share of a training step, peak memory, host syncs, bytes and the step time
    they imply per link speed (``benchmarks/gpu_step_cost.py``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_step_cost

    out = Path(ctx["partial"])
    argv = ["--json", str(out), "--budget", str(max(30.0, ctx["limit"] - 40))]
    if ctx["dry_run"]:
        argv.append("--dry-run")
    rc = gpu_step_cost.main(argv)
    res = json.loads(out.read_text())
    problems = list(res["failed"])
    for row in res["rows"]:
        for run in ("fsdp2", "enabled", "unverified"):
            sync = row[run]["host_syncs"]
            if isinstance(sync, dict) and (not sync["ok"] or run == "unverified"
                                           and sync["agreement"]):
                problems.append(f"{row['shape']['name']} W={row['world']} {run}: host sync "
                                f"after the first step: {gpu_step_cost.describe_syncs(sync)}")
        goal = row["world"] == 8 and not ctx["dry_run"]
        row["goal"] = "codec <= 10% of the step at W=8" if goal else None
        if goal:
            row["goal_met"] = row["codec_share"] <= 0.10
    res["goal_missed"] = [f"{r['shape']['name']} W={r['world']}: {100 * r['codec_share']:.1f}%"
                          for r in res["rows"] if r.get("goal_met") is False]
    if rc or problems:
        raise StepFailed("; ".join(problems) or f"gpu_step_cost exited {rc}", res)
    return res


#: ``step_profile``'s layouts (shape, W, G): 1B at one rank per node, then (since 2026-12-07)
#: the two rows that missed the codec goal on the H100 or left most of their time unpriced:
#: the 8B-shaped layers at W=8 (10.8%) and 1B at 8 ranks per node (23.4 ms measured against
#: 13.3 priced, docs/gpu_path.md section 7)
PROFILED = (("1B", 8, 1), ("8B-4L", 8, 1), ("1B", 64, 8))


def step_step_profile(ctx: dict) -> dict:
    """Where the codec's share of the step goes: each of ``PROFILED`` with and without
    ``enable(sdp4bit)`` under ``torch.profiler`` (kernels, ours marked; launches; how much of
    the wall time the GPU is busy) and ``cProfile`` (fsdp_qcomm's Python by cumulative time).
    Keys: ``fsdp2`` and ``sdp4bit`` for the first layout, ``"<key> <shape> W=<W>"`` for the
    others. (Until 2026-12-06 it also ran qWD's launches per parameter: the H100 run settled
    that A/B, docs/gpu_path.md section 7.)"""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_step_cost as g

    dev = "cpu" if ctx["dry_run"] else "cuda"
    out = {}
    layouts = (("tiny", 8, 1), ("tiny", 64, 8)) if ctx["dry_run"] else PROFILED
    for k, (name, world, per_node) in enumerate(layouts):
        for label, preset in (("fsdp2", None), ("sdp4bit", "sdp4bit")):
            run = g.run_one(g.SHAPES[name], world, per_node, preset, steps=2,
                            warmup=3 if dev == "cuda" else 1, dev=dev, profile=True)
            key = label if k == 0 else f"{label} {name} W={world}"
            out[key] = {"ms": run["ms"], "profile": run["profile"]}
            g._free(dev)
    return out


def _sweep_pair(dev: str, c: int, bits: int, gs: int, lengths: tuple) -> tuple[int, list]:
    """The exactness sweep's comparisons for one (width, group size) pair, the ``c``-th: every
    kernel against ``torch_codec`` at each length. Returns (comparisons, failures)."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from _codec_cases import fitted_levels, level_rows, sample_rows

    import fsdp_qcomm.kernels as K
    from fsdp_qcomm import QuantSpec
    from fsdp_qcomm.codec import RngKey, torch_codec, wire

    key = RngKey(11, 5, 3, 1)
    sdts = ("float32", "bfloat16", "float16")
    checked, failures = 0, []

    def same(name, got, want) -> None:
        nonlocal checked
        checked += 1
        got = got.cpu()
        if got.dtype != want.dtype or got.shape != want.shape:
            failures.append(f"{name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}"
                            f"{tuple(want.shape)}")
            return
        if got.is_floating_point():
            nan_g, nan_w = torch.isnan(got), torch.isnan(want)
            ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
            ok = torch.equal(nan_g, nan_w) and torch.equal(got.view(ints)[~nan_g],
                                                           want.view(ints)[~nan_w])
        else:
            ok = torch.equal(got, want)
        if not ok:
            failures.append(name)

    sym, stoch = bool(c % 2), bool((c // 2) % 2)
    spec = QuantSpec(bits=bits, group_size=gs, symmetric=sym, scale_dtype=sdts[c % 3],
                     rounding="stochastic" if stoch else "nearest")
    spec8 = QuantSpec(bits=8, group_size=gs, symmetric=True, scale_dtype=sdts[c % 3])
    table = fitted_levels(spec, seed=bits)
    for n in lengths:
        tag = f"b{bits} g{gs} {'sym' if sym else 'asym'} {spec.rounding} " \
              f"{spec.scale_dtype} n{n}"
        x = sample_rows(3, n, seed=c * 100 + n)
        r = sample_rows(3, n, seed=c * 100 + n + 1, specials=False)
        had = gs % 32 == 0 and c % 3 == 0
        data = torch_codec.quantize(x, spec, key, r, had)
        same(f"quantize {tag}", K.quantize(x.to(dev), spec, key, r.to(dev), had), data)
        m = wire.hadamard_len(n) if had else n
        base = sample_rows(3, n, seed=7, specials=False).to(torch.bfloat16)
        got, want = base.to(dev), base.clone()
        K.dequantize(data.to(dev), n, spec, had, got, True)
        torch_codec.dequantize(data, n, spec, had, want, True)
        same(f"dequantize += bf16 {tag}", got, want)
        hop1 = [torch_codec.quantize(sample_rows(3, m, seed=j), spec8, key.fold(j))
                for j in range(3)]
        same(f"reduce_requantize {tag}",
             K.reduce_requantize([h.to(dev) for h in hop1], m, spec8, spec, key),
             torch_codec.reduce_requantize(hop1, m, spec8, spec, key))
        hop2 = [torch_codec.quantize(sample_rows(3, m, seed=j + 5), spec, key.fold(j))
                for j in range(3)]
        same(f"reduce_dequantize {tag}",
             K.reduce_dequantize([h.to(dev) for h in hop2], n, spec, had, None),
             torch_codec.reduce_dequantize(hop2, n, spec, had, None))
        xl = level_rows(3, n, seed=c + n, levels=table)
        lv = torch_codec.quantize_levels(xl, spec, table, key)
        same(f"quantize_levels {tag}",
             K.quantize_levels(xl.to(dev), spec, table.to(dev), key), lv)
        same(f"dequantize_levels {tag}",
             K.dequantize_levels_sum([lv.to(dev)], n, spec),
             torch_codec.dequantize_levels_sum([lv], n, spec))
    return checked, failures


def step_exactness_sweep(ctx: dict) -> dict:
    """Every kernel against ``torch_codec``, bit for bit. Each (width, group size) pair is a
    set of Triton compiles on the host, the cost of this step (87 s in one process on the H100
    run), so the pairs run in up to 4 processes at once."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    dev = "cpu" if ctx["dry_run"] else "cuda"
    # Every width once with the group sizes spread over them, and the papers' (4, 128),
    # (8, 128), (4, 2048); tests/test_kernels.py covers more pairings at short lengths. Odd
    # lengths, one spanning many tiles and groups.
    groups = (8, 24, 40, 128, 1024, 2048, 4104)
    pairs = [(b, groups[b % len(groups)]) for b in range(2, 9)] + [(4, 128), (8, 128),
                                                                    (4, 2048)]
    lengths = (7, 203, 20011)
    if ctx["dry_run"]:
        pairs, lengths = [(4, 8), (4, 40)], (203,)
    n = _processes(len(pairs))
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = list(pool.map(_sweep_pair, [dev] * len(pairs), range(len(pairs)),
                             *zip(*pairs), [lengths] * len(pairs)))
    checked = sum(k for k, _ in done)
    failures = [f for _, fs in done for f in fs]
    if failures:
        raise StepFailed(f"{len(failures)} of {checked} comparisons differ: {failures[:20]}",
                         {"comparisons": checked, "failures": failures})
    return {"comparisons": checked, "pairs": pairs, "lengths": list(lengths), "processes": n}


def _kernels_bench(ctx: dict, *extra: str, iters: int = 20, timeout: float) -> dict:
    """``gpu_kernels_bench.py`` at 64M elements (a small interpreted run when dry); raises
    if a kernel's bytes differ from the torch codec's."""
    out = Path(ctx["tmp"]) / f"bench{'_'.join(extra)}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_kernels_bench.py"), "--json", str(out),
           *extra]
    if ctx["dry_run"]:
        cmd += ["--interpret", "--numel", "8192", "--check-numel", "2048",
                "--only", "quantize 4b g128"]
    else:
        cmd += ["--numel", str(64 * 1024 * 1024), "--iters", str(iters)]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=max(10.0, timeout))
    print(proc.stdout[-6000:], flush=True)
    if not out.is_file():
        raise RuntimeError(f"the benchmark wrote no results:\n{proc.stderr[-3000:]}")
    res = json.loads(out.read_text())
    if proc.returncode or res["failures"]:
        raise StepFailed(f"kernel exactness failed in the benchmark: {res['failures']}", res)
    return res


def step_bandwidth(ctx: dict) -> dict:
    res = _kernels_bench(ctx, timeout=ctx["limit"] - 5)
    peak = ctx.get("peak_gbps")
    below = []
    for row in res["cases"]:
        if "gbps" in row and peak:
            row["x_peak"] = row["gbps"] / peak
        kind = row["case"].split(" ", 1)[0]
        if "x_copy" in row and "diagnostic" not in row and kind in (
                "quantize", "quantize_segments", "dequantize", "dequantize_segments",
                "quantize_levels", "dequantize_levels"):
            row["goal_met"] = row["x_copy"] >= GOAL
            if not row["goal_met"]:
                below.append(f"{row['case']}: {row['x_copy']:.2f}x")
    res["peak_gbps"] = peak
    res["clone_x_peak"] = res["clone_gbps"] / peak if peak else None
    res["goal"] = f">= {GOAL}x clone for quantize/dequantize kernels"
    res["goal_missed"] = below
    res["diagnostics"] = _diagnostics(res["cases"])
    return res


def _diagnostics(cases: list) -> list:
    """Each diagnostic row (``gpu_kernels_bench.DIAGNOSTICS``) against the row it takes one cost
    out of: both write as many values, so ``1 - its time / that row's`` is that cost's share."""
    ms = {row["case"]: row["ms"] for row in cases if "ms" in row}
    out = []
    for row in cases:
        d = row.get("diagnostic")
        if d and row["case"] in ms and d["against"] in ms:
            out.append({"case": row["case"], "ms": ms[row["case"]], "against": d["against"],
                        "against_ms": ms[d["against"]], "leaves_out": d["leaves_out"],
                        "share": 1 - ms[row["case"]] / ms[d["against"]]})
    return out


#: elements per program tried, each for every kernel (their own: ``kernels/_common.py``
#: ``GROUP_TILE`` for the encoders, ``TILE`` for the rest)
TILES = (1024, 2048, 4096)


def step_tiles(ctx: dict) -> dict:
    """The bandwidth table again at each tile, every kernel at it: 4096 elements per program
    take 6-27% fewer instructions per element than 2048 but more registers
    (``benchmarks/kernel_sass.py``); the H100 of 2026-12-06 ran the encoders faster at 4096,
    the rest no faster, and each run measures it again on its GPU."""
    out: dict = {}
    for k, tile in enumerate(TILES):
        left = ctx["limit"] - 5 - (time.perf_counter() - ctx["t0"])
        res = _kernels_bench(ctx, "--tile", str(tile), "--no-diagnostics", iters=10,
                             timeout=left / (len(TILES) - k))
        out[str(tile)] = {row["case"]: row["x_copy"] for row in res["cases"] if "x_copy" in row}
        Path(ctx["partial"]).write_text(json.dumps(out))  # kept if the next tile is cut short
    return {"x_clone": out}


def _presets() -> tuple:
    """Every named preset (``QCommConfig.PRESETS``), and QSDP's learned levels on both sides."""
    from fsdp_qcomm import QCommConfig

    return (*QCommConfig.PRESETS, "W4G4-learned")


def _model(torch, d: int, layers: int):
    import torch.nn as nn

    sys.path.insert(0, str(ROOT / "tests"))
    from _models import MLPBlock

    torch.manual_seed(0)
    return nn.Sequential(*[MLPBlock(d, 2 * d + 3) for _ in range(layers)], nn.LayerNorm(d),
                         nn.Linear(d, 97))


def _shard_kw(torch, mixed: bool, offload: bool = False, mesh=None) -> dict:
    """``fully_shard``'s options: bf16 parameters with fp32 reduction when ``mixed``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kw = {} if mesh is None else {"mesh": mesh}
    if offload:  # pinned host memory needs a GPU: the dry run offloads to pageable memory
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    return kw


def _shard(torch, model, mixed: bool, offload: bool = False, mesh=None):
    from torch.distributed.fsdp import fully_shard

    kw = _shard_kw(torch, mixed, offload, mesh)
    for block in list(model)[:-2]:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def _batches(torch, model, dev: str, steps: int, rank: int = 0) -> list:
    """The inputs of ``steps`` steps, made on the CPU and moved before any step runs (a copy
    from the host inside a step would be a host sync of our making)."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, model[0].norm.normalized_shape[0], generator=g)
        y = torch.randint(0, 97, (8,), generator=g)
        out.append((x.to(dev), y.to(dev)))
    return out


def _train(torch, model, batches: list, opt=None) -> tuple[list, object]:
    """Steps over ``batches``; the losses stay on the device (reading them syncs)."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, opt


def _init_group(torch, backend: str, world: int, **kw) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ or kw.get("new_port"):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        dist.init_process_group(backend, rank=0, world_size=world)


def _fake_fills_outputs(torch) -> None:
    """Makes this process's ``fake`` group write the outputs of ``all_to_all_single`` and
    ``reduce_scatter_tensor`` as torch 2.13 and later do (this rank's part of the input),
    where the running torch leaves them as they were: torch 2.11's, the GPU machine's, leaves
    both unwritten, so FSDP's reduced gradients and our received chunks would be whatever the
    allocator's memory held, and a run would not repeat. Installed for the rest of the child
    process (each step has its own)."""
    import torch.distributed as dist

    from fsdp_qcomm.collectives import _c10d

    world = dist.get_world_size()
    probe = torch.full((world,), -1.0)
    dist.all_to_all_single(probe, torch.zeros(world))
    rs = torch.full((1,), -1.0)
    _c10d.reduce_scatter_single(rs, torch.zeros(world))
    if probe[0] == 0 and rs[0] == 0:
        return  # this torch fills them (2.13 and later, which also name it reduce_scatter_single)
    a2a, rsc = dist.all_to_all_single, dist.reduce_scatter_tensor

    def fake(kw: dict) -> bool:  # FSDP and fsdp_qcomm pass the group by keyword
        return dist.get_backend(kw.get("group")) == "fake"

    def all_to_all_single(output, input, *a, **kw):
        work = a2a(output, input, *a, **kw)
        if fake(kw) and output.numel() == input.numel():
            output.view(-1).copy_(input.reshape(-1))
        return work

    def reduce_scatter_tensor(output, input, *a, **kw):
        work = rsc(output, input, *a, **kw)
        if fake(kw):
            output.view(-1).copy_(input.reshape(-1)[:output.numel()])
        return work

    dist.all_to_all_single, dist.reduce_scatter_tensor = all_to_all_single, reduce_scatter_tensor


def step_fsdp_one_rank(ctx: dict) -> dict:
    import torch
    import torch.distributed as dist

    import fsdp_qcomm

    dev = "cpu" if ctx["dry_run"] else "cuda"
    d, layers, steps = (24, 2, 3) if ctx["dry_run"] else (256, 4, 6)
    _init_group(torch, "gloo" if ctx["dry_run"] else "nccl", 1, new_port=True)
    try:
        ref = _model(torch, d, layers).to(dev)
        _shard(torch, ref, mixed=dev == "cuda")
        batches = _batches(torch, ref, dev, steps)
        ref_losses = [float(v) for v in _train(torch, ref, batches)[0]]
        want = {n: _digest(p.to_local()) for n, p in ref.named_parameters()}
        out = {"backend": dist.get_backend(), "steps": steps, "presets": {}}
        bad = []
        # every preset; then sdp4bit with CPU-offloaded shards against FSDP2 offloading alone
        cases = [(name, name, False) for name in _presets()] + [
            ("sdp4bit offload", "sdp4bit", True)]
        for name, preset, offload in cases:
            if offload:
                ref = _model(torch, d, layers).to(dev)
                _shard(torch, ref, mixed=dev == "cuda", offload=True)
                ref_losses = [float(v) for v in _train(torch, ref, batches)[0]]
                want = {n: _digest(p.to_local()) for n, p in ref.named_parameters()}
            model = _model(torch, d, layers).to(dev)
            _shard(torch, model, mixed=dev == "cuda", offload=offload)
            handle = fsdp_qcomm.enable(model, fsdp_qcomm.QCommConfig.preset(preset))
            losses = [float(v) for v in _train(torch, model, batches)[0]]
            got = {n: _digest(p.to_local()) for n, p in model.named_parameters()}
            calls = _kinds(handle)
            handle.disable()
            equal = got == want and losses == ref_losses
            out["presets"][name] = {"weights_equal_unhooked": equal, "calls": calls,
                                    "final_loss": losses[-1]}
            if not equal:
                bad.append(name)
        if bad:
            raise StepFailed(f"weights differ from the run without enable() for {bad}", out)
        return out
    finally:
        dist.destroy_process_group()


def step_fsdp_hooks(ctx: dict) -> dict:
    import torch
    import torch.distributed as dist

    import fsdp_qcomm
    from fsdp_qcomm.codec import wire

    dev = "cpu" if ctx["dry_run"] else "cuda"
    d, layers, steps = (24, 2, 3) if ctx["dry_run"] else (256, 4, 4)
    world = 2
    _init_group(torch, "fake", world)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_step_cost import describe_syncs, host_syncs

    out = {"backend": "fake", "world": world, "steps": steps, "presets": {}}
    problems = []
    # every preset, sdp4bit without the change agreement (no host read at all), and sdp4bit
    # with FSDP's CPU offload (shards on the host: the agreement must still exchange on the
    # GPU; FSDP's own offload copies may sync, so its syncs are recorded, not judged)
    cases = [(p, p, {}, False) for p in _presets()] + [
        ("sdp4bit unverified", "sdp4bit", {"verify_weight_writes": False}, False),
        ("sdp4bit offload", "sdp4bit", {}, True)]
    from fsdp_qcomm.fsdp import change_tracker

    exchanged: set = set()
    gather = change_tracker._c10d.all_gather_single

    def spy(out, mine, *a, **kw):  # the module is shared: the weight gathers call it too
        if sys._getframe(1).f_code is change_tracker.Agreement.agree.__code__:
            exchanged.add(mine.device.type)
        return gather(out, mine, *a, **kw)

    change_tracker._c10d.all_gather_single = spy
    try:
        for name, preset, overrides, offload in cases:
            model = _model(torch, d, layers).to(dev)
            _shard(torch, model, mixed=dev == "cuda", offload=offload)
            cfg = fsdp_qcomm.QCommConfig.preset(preset, ranks_per_node=1, **overrides)
            handle = fsdp_qcomm.enable(model, cfg)
            batches = _batches(torch, model, dev, steps)
            exchanged.clear()
            _, opt = _train(torch, model, batches[:1])  # the first step may sync (lazy init)
            syncs = "not checked (CPU)"
            if dev == "cuda":
                syncs = host_syncs(lambda: _train(torch, model, batches[1:], opt))
                if not offload and (not syncs["ok"] or (overrides and syncs["agreement"])):
                    problems.append(f"{name}: host sync after the first step: "
                                    f"{describe_syncs(syncs)}")
            else:
                _train(torch, model, batches[1:], opt)
            if exchanged - {dev}:
                problems.append(f"{name}: the change agreement exchanged {sorted(exchanged)} "
                                f"tensors, not {dev} ones")
            # An asynchronous unshard waited on another stream (explicit prefetch).
            block = model[0]
            if dev == "cuda":
                side = torch.cuda.Stream()
                h = block.unshard(async_op=True)
                with torch.cuda.stream(side):
                    h.wait()
                torch.cuda.current_stream().wait_stream(side)
                block.reshard()
                torch.cuda.synchronize()
            stats = handle.stats()
            modes = handle.gather_modes()
            handle.disable()
            kinds = {k: v for k, v in stats.items() if isinstance(v, dict) and "calls" in v}
            row = {"modes": modes, "host_syncs": syncs, "agreement_on": sorted(exchanged),
                   "kinds": {k: {"calls": v["calls"],
                                 "bits_per_element": round(v["bits_per_element"], 3)}
                             for k, v in kinds.items()}}
            out["presets"][name] = row
            w = kinds.get("weight_allgather")
            if w is None or w["calls"] == 0:
                problems.append(f"{name}: no weight gather reached the hook")
                continue
            if cfg.grad_scheme != "none" and not any(k.startswith("grad_") for k in kinds):
                problems.append(f"{name}: no gradient reduction reached the hook")
            if cfg.weight_scheme == "direct":
                # Per-parameter rows add scales and padding to the long-row figure; small
                # parameters (norms) more so, the dry run's tiny model most.
                spec = cfg.weight_spec()
                lo = 8 * wire.wire_bytes(1 << 20, spec) / (1 << 20)
                hi = lo + (3.0 if ctx["dry_run"] else 1.0)
                if not lo - 0.01 < w["bits_per_element"] < hi:
                    problems.append(f"{name}: weight bits/element {w['bits_per_element']:.3f}, "
                                    f"expected {lo:.3f} .. {hi:.3f} from the wire format")
        if problems:
            raise StepFailed("; ".join(problems), out)
        return out
    finally:
        change_tracker._c10d.all_gather_single = gather
        dist.destroy_process_group()


def _kinds(handle) -> dict:
    """Calls per collective kind of ``handle.stats()``."""
    return {k: v["calls"] for k, v in handle.stats().items()
            if isinstance(v, dict) and "calls" in v}


def step_layouts(ctx: dict) -> dict:
    """Where large-model users stack the hooks, on CUDA: HSDP (2 replicas x 2 shards), FSDP x
    tensor parallelism (2 x 2, torchtitan's plan with SequenceParallel), DiLoCo's outer
    all-reduce on its side stream and inductor-compiled blocks, each as rank 0 of 4 ``fake``
    ranks, whose collectives write this rank's own data (``_fake_fills_outputs``), so a run
    repeats bit for bit. Judged: each layout's quantized collectives reached the hooks, no host
    sync after the first step but the agreement's read (not DiLoCo's: recorded), DiLoCo
    overlapped on its side stream bit-identical to the same schedule run in line, the compiled
    blocks with the eager run's collectives. A layout that raises is recorded and the others
    still run."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdp_qcomm

    dev = "cpu" if ctx["dry_run"] else "cuda"
    mixed = dev == "cuda"
    d, layers, steps = (24, 2, 3) if ctx["dry_run"] else (256, 4, 4)
    _reproducible(torch)
    _init_group(torch, "fake", 4)
    _fake_fills_outputs(torch)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    from _tp_models import TinyLlama, batch, parallelize_tp
    from gpu_step_cost import describe_syncs, host_syncs

    sdp4bit = fsdp_qcomm.QCommConfig.preset("sdp4bit", ranks_per_node=2)  # ranks 0,1 | 2,3
    problems: list[str] = []

    def later_steps(step_fn, count: int):
        """Steps 1 .. count-1 (step 0 may sync: lazy init, the full-precision reference),
        under the sync detector on CUDA; what it found."""
        if dev != "cuda":
            for t in range(1, count):
                step_fn(t)
            return "not checked (CPU)"
        return host_syncs(lambda: [step_fn(t) for t in range(1, count)])

    def hooked(name: str, handle, step_fn, expect: set) -> dict:
        step_fn(0)
        syncs = later_steps(step_fn, steps)
        if isinstance(syncs, dict) and not syncs["ok"]:
            problems.append(f"{name}: host sync after the first step: {describe_syncs(syncs)}")
        kinds = _kinds(handle)
        notes = handle.stats()["notes"]
        handle.disable()
        missing = sorted(k for k in expect if not kinds.get(k))
        if missing:
            problems.append(f"{name}: no {missing} call reached the hooks ({kinds})")
        return {"kinds": kinds, "host_syncs": syncs, "notes": notes}

    def hsdp() -> dict:
        """Shards inside a node, the replica all-reduce across nodes (quantized)."""
        mesh = init_device_mesh(dev, (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _model(torch, d, layers).to(dev)
        _shard(torch, model, mixed, mesh=mesh)
        handle = fsdp_qcomm.enable(model, sdp4bit)
        batches = _batches(torch, model, dev, steps)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return hooked("hsdp 2x2", handle,
                      lambda t: _train(torch, model, batches[t:t + 1], opt), {"grad_replica"})

    def tensor_parallel() -> dict:
        """FSDP over "dp" (across nodes) x TP inside a node: TP's replicated parameters (norms,
        biases) averaged over their peers after the lossy reduction."""
        mesh = init_device_mesh(dev, (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = TinyLlama().to(dev)
        parallelize_tp(model, mesh["tp"], sequence_parallel=True)
        for m in (*model.layers, model):
            fully_shard(m, **_shard_kw(torch, mixed, mesh=mesh["dp"]))
        handle = fsdp_qcomm.enable(model, sdp4bit)
        data = [tuple(v.to(dev) for v in batch(t, 0)) for t in range(steps)]
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

        def step(t: int) -> None:
            x, y = data[t]
            F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()

        return hooked("fsdp x tp 2x2", handle, step,
                      {"weight_allgather", "grad_inter", "tp_peer_sync"})

    def diloco() -> dict:
        def steps(inner, count: int):
            inner(0)
            return later_steps(inner, count)  # recorded, not judged

        line, over = (_diloco_run(torch, dev, d, layers, o, steps=steps) for o in (False, True))
        return {**_diloco_verdict([(line, over)], problems), "host_syncs": over["steps"]}

    def compiled_blocks() -> dict:
        """Each block compiled by inductor after fully_shard, as torchtitan does (section 8):
        the hooks run eagerly around the blocks' graphs, so they see the collectives of an
        eager run; the losses are finite."""
        runs = {}
        for compiled in (False, True):
            torch._dynamo.reset()
            model = _model(torch, d, layers).to(dev)
            _shard(torch, model, mixed)
            if compiled:  # the dry run traces only: inductor on the CPU is a long test's
                for block in list(model)[:-2]:
                    block.compile(backend="aot_eager" if ctx["dry_run"] else "inductor")
            handle = fsdp_qcomm.enable(model, fsdp_qcomm.QCommConfig.preset("sdp4bit",
                                                                            ranks_per_node=1))
            batches = _batches(torch, model, dev, steps)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            losses = []
            runs[compiled] = hooked(
                "compiled blocks" if compiled else "eager blocks", handle,
                lambda t: losses.extend(_train(torch, model, batches[t:t + 1], opt)[0]),
                {"weight_allgather", "grad_inter"})
            runs[compiled]["losses"] = [float(v) for v in losses]
        row = runs[True]
        if row["kinds"] != runs[False]["kinds"]:
            problems.append(f"compiled blocks: collectives {row['kinds']}, eager "
                            f"{runs[False]['kinds']}")
        if not all(math.isfinite(v) for v in row["losses"]):
            problems.append(f"compiled blocks: losses {row['losses']}")
        row["eager_losses"] = runs[False]["losses"]
        return row

    out: dict = {"backend": "fake", "world": 4, "steps": steps, "layouts": {}}
    try:
        for name, fn in (("hsdp 2x2", hsdp), ("fsdp x tp 2x2", tensor_parallel),
                         ("diloco overlap", diloco), ("compiled blocks", compiled_blocks)):
            try:
                out["layouts"][name] = fn()
            except Exception as e:  # noqa: BLE001 - one layout's failure is its finding
                problems.append(f"{name}: {type(e).__name__}: {e}")
                out["layouts"][name] = {"error": traceback.format_exc()[-2000:]}
        if problems:
            raise StepFailed("; ".join(problems), out)
        return out
    finally:
        dist.destroy_process_group()


def _reproducible(torch) -> None:
    """DiLoCo's two runs (``_diloco_run``) are compared bit for bit: cuBLAS's deterministic
    workspace, set before its first use in this process (warn_only: an op without a
    deterministic kernel warns)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def _diloco_run(torch, dev: str, d: int, layers: int, overlap: bool, rank: int = 0,
                steps=None) -> dict:
    """DiLoCo over a (replicate 2, shard 2) mesh: 4-bit outer gradients over the replicas,
    merged one inner step late, 8 inner steps (4 outer all-reduces, 2 per fragment); with
    ``overlap`` the all-reduce and its codec run on a side stream from a background thread.
    ``steps(inner, count)`` runs the inner steps (default: in order); what it returns is kept
    under ``"steps"``."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_qcomm.diloco import DiLoCo, DiLoCoConfig

    mesh = init_device_mesh(dev, (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model(torch, d, layers).to(dev)
    _shard(torch, model, mixed=dev == "cuda", mesh=mesh["shard"])
    cfg = DiLoCoConfig(sync_every=4, fragments=2, delay=1, overlap=overlap, bits=4)
    diloco = DiLoCo(model, cfg, replicas=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = _batches(torch, model, dev, 8, rank)
    losses = []

    def inner(t: int) -> None:
        losses.append(_train(torch, model, batches[t:t + 1], opt)[0][0])
        diloco.step()

    ran = steps(inner, len(batches)) if steps else [inner(t) for t in range(len(batches))]
    diloco.finish()
    calls = diloco.stats().get("outer_allreduce", {}).get("calls", 0)
    diloco.close()
    return {"losses": [float(v) for v in losses], "outer_calls": calls, "steps": ran,
            "weights": {n: _digest(p.to_local()) for n, p in model.named_parameters()}}


def _diloco_verdict(pairs: list, problems: list) -> dict:
    """DiLoCo overlapped against the same schedule in line (``_diloco_run``'s pair, one per
    rank given): the same losses and weights bit for bit, outer all-reduces that ran;
    what differs is appended to ``problems``."""
    same = all(over["losses"] == line["losses"] and over["weights"] == line["weights"]
               for line, over in pairs)
    over = pairs[0][1]
    if not same:
        problems.append("diloco: the overlapped run differs from the same schedule in line")
    if not over["outer_calls"]:
        problems.append("diloco: no outer all-reduce ran")
    return {"outer_allreduce_calls": over["outer_calls"], "equal_to_in_line": same,
            "final_loss": over["losses"][-1]}


# ---- four ranks on the one GPU ----------------------------------------------------------------
_FOUR_M = 3000  # gradient values per rank and row: not a multiple of 128, 32 or 2048
_FOUR_SEGMENTS = (2000, 0, 517, 1024)  # the weight gather's parameters (an empty one among them)
# The quantized runs' final loss against FSDP2's, relative: the tiny model trains 6 steps on
# random labels from one initialization, so its losses differ by the quantization noise alone
# (2e-4 in the dry run); a gather or reduction that delivers wrong values moves it far more.
_FOUR_LOSS_GAP = 0.02


@contextlib.contextmanager
def _codec_path(kernels_on_cpu: bool):
    """The dry run's stand-in for CUDA: the codec sends CPU tensors to the Triton kernels (under
    the interpreter) instead of the C loops, so the comparison below holds the kernels' path
    against the CPU's even without a GPU. On a GPU the device decides and nothing is patched."""
    import fsdp_qcomm.codec as codec
    from fsdp_qcomm.codec import levels

    own = codec._impl
    if kernels_on_cpu:
        from fsdp_qcomm import kernels

        def impl(t, *others):
            return kernels if codec.raw_memory_ok("cpu", t, *others) else own(t, *others)

        codec._impl = levels._impl = impl
    try:
        yield
    finally:
        codec._impl = levels._impl = own


def _bits_equal(a, b) -> bool:
    """Bit-identical tensors (NaNs included), wherever they live."""
    return a.dtype == b.dtype and a.shape == b.shape and _digest(a) == _digest(b)


def _rank_device(torch, dry_run: bool) -> str:
    """A ``four_ranks`` rank's device: the one GPU (every rank on it), or the CPU."""
    if dry_run:
        return "cpu"
    torch.cuda.set_device(0)
    return "cuda"


def _four_ranks_collectives(torch, rank: int, world: int, dev: str, dry_run: bool) -> dict:
    """Each quantized collective twice with the same inputs and keys, its tensors on ``dev``
    (the Triton kernels) and on the CPU (the C loops): the outputs must be the same bits, the
    bytes sent the same counts."""
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from fsdp_qcomm import QCommConfig, RngKey
    from fsdp_qcomm.collectives.grad_reduce import reduce_scatter_quantized
    from fsdp_qcomm.collectives.replica_reduce import all_reduce_quantized
    from fsdp_qcomm.collectives.topology import node_topology
    from fsdp_qcomm.collectives.weight_gather import NodeShardedQwd
    from fsdp_qcomm.stats import CommStats

    cfg = QCommConfig.preset("sdp4bit", ranks_per_node=2, grad_pipeline_chunks=3)
    sides = (("device", dev), ("cpu", "cpu"))
    out: dict = {}

    def compare(name: str, run) -> None:
        """``run(side, device)`` -> (outputs, what was counted), for both sides; an error (a
        collective the backend refuses raises alike on every rank) is the row's result."""
        try:
            (a, sa), (b, sb) = (run(side, d) for side, d in sides)
        except Exception as e:  # noqa: BLE001 - judged by the step
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            return
        out[name] = {"bits_equal": all(_bits_equal(x, y) for x, y in zip(a, b)),
                     "bytes_equal": sa == sb}

    g = torch.Generator().manual_seed(100 + rank)
    # The gradient reduce-scatter: 8 bits inside a node, 4 across, Hadamard, 3 chunks in flight.
    for dtype, op in ((torch.float32, ReduceOp.AVG), (torch.bfloat16, ReduceOp.SUM)):
        x = torch.randn(world * _FOUR_M, generator=g).to(dtype)

        def grads(side: str, d: str, x=x, dtype=dtype, op=op):
            stats, res = CommStats(), torch.empty(_FOUR_M, dtype=dtype, device=d)
            with _codec_path(dry_run and side == "device"):
                reduce_scatter_quantized(res, x.to(d), None, cfg, RngKey(5, 1, rank, 0), op=op,
                                         stats=stats)
            return [res], stats.snapshot()

        compare(f"grad reduce-scatter {str(dtype)[6:]}", grads)
    # qWD's weight gather with the node-sharded reference (enable's at 2 nodes x 2), bf16 as
    # FSDP gathers with bf16 parameters: a full gather, then three of differences, the
    # device's asynchronous every other step, then a re-gather of unchanged weights.
    topo = node_topology(dist.group.WORLD, 2)
    n = sum(_FOUR_SEGMENTS)
    walk = [torch.randn(n, generator=g)]
    for _ in range(3):
        walk.append(walk[-1] + 0.05 * torch.randn(n, generator=g))

    def weights(side: str, d: str):
        gather = NodeShardedQwd(n, torch.bfloat16, torch.device(d), cfg.weight_spec(),
                                dist.group.WORLD, topo.layout, topo.intra, topo.inter,
                                segments=_FOUR_SEGMENTS)
        outs, seen = [], []
        with _codec_path(dry_run and side == "device"):
            for step, w in enumerate(walk):
                res = torch.empty(world * n, dtype=torch.bfloat16, device=d)
                work = gather(w.to(torch.bfloat16).to(d), RngKey(7, step, rank, 3), output=res,
                              full=step == 0, async_op=side == "device" and step % 2 == 1,
                              on_done=seen.append)
                if work is not None:
                    work.wait()
                outs.append(res)
            outs.append(torch.empty(world * n, dtype=torch.bfloat16, device=d))
            gather.reuse("qwd_reuse", output=outs[-1], on_done=seen.append)
        return outs, seen

    compare("qwd weight gather, node-sharded reference", weights)
    # HSDP's replica all-reduce across nodes (ranks 0, 2 and 1, 3), 4 bits with Hadamard.
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    t = torch.randn(5000, generator=g)

    def replicas(side: str, d: str):
        stats, res = CommStats(), t.clone().to(d)
        with _codec_path(dry_run and side == "device"):
            all_reduce_quantized(res, pairs[rank % 2], cfg.replica_spec(crosses_nodes=True),
                                 RngKey(9, 2, rank, 1), hadamard=True, op=ReduceOp.AVG,
                                 chunks=2, stats=stats)
        return [res], stats.snapshot()

    compare("replica all-reduce", replicas)
    return out


# (row, preset or None for FSDP2 alone, HSDP): FSDP2 alone last, as the reference of its mesh
_FOUR_TRAINING = (("sdp4bit", "sdp4bit", False), ("qsdp", "qsdp", False),
                  ("sdp4bit hsdp 2x2", "sdp4bit", True), ("fsdp2", None, False),
                  ("fsdp2 hsdp 2x2", None, True))


def _four_ranks_training(torch, rank: int, world: int, dev: str, dry_run: bool) -> dict:
    """FSDP2 with ``enable()``, over all ranks and as HSDP (shards inside a node, replicas
    across nodes): the weights every rank computes with are compared across ranks after each
    step (``ComputeWeights``), the mean loss over ranks kept per step; FSDP2 alone last, as
    the reference. Only the references may fail and still return (gloo's reduce-scatter may
    refuse CUDA tensors, a check every rank makes alike before sending anything): an error
    of ours raises, so that ``run_ranks`` stops every rank with its traceback rather than let
    the others wait in a collective the failed rank left."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_qcomm
    from fsdp_qcomm.testing import ComputeWeights

    d, layers, steps = (24, 2, 3) if dry_run else (256, 4, 6)
    out: dict = {}
    for name, preset, hsdp in _FOUR_TRAINING:
        row: dict = {}
        try:
            model = _model(torch, d, layers).to(dev)
            mesh = init_device_mesh(dev, (2, 2), mesh_dim_names=("replicate", "shard")) \
                if hsdp else None
            _shard(torch, model, mixed=dev == "cuda", mesh=mesh)
            handle = None
            if preset is not None:
                handle = fsdp_qcomm.enable(model, fsdp_qcomm.QCommConfig.preset(
                    preset, ranks_per_node=2))  # one host: the nodes are emulated
            seen = ComputeWeights(model)
            batches = _batches(torch, model, dev, steps, rank)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            losses, same = [], []
            with _codec_path(dry_run and handle is not None):
                for t in range(steps):
                    loss = _train(torch, model, batches[t:t + 1], opt)[0][0]
                    dist.all_reduce(loss)  # the mean over ranks (each trains on its own batch)
                    losses.append(float(loss) / world)
                    try:
                        seen.check_same(f"{name} step {t}")
                        same.append(True)
                    except AssertionError:
                        same.append(False)
            seen.remove()
            row.update(losses=losses, same_weights_every_step=all(same))
            if handle is not None:
                row["kinds"] = _kinds(handle)
                row["cross_node_bytes"] = handle.stats()["summary"]["cross_node_bytes"]
                handle.disable()
        except Exception as e:
            if preset is not None:
                raise
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"  # judged by the step
        out[name] = row
    return out


def _four_ranks_diloco(torch, rank: int, dev: str, dry_run: bool) -> tuple[dict, dict]:
    """DiLoCo over the 2 replicas (one per node), in line and with its outer all-reduce
    overlapped on a side stream from its background thread (``_diloco_verdict`` compares)."""
    d, layers = (24, 2) if dry_run else (256, 4)
    with _codec_path(dry_run):
        return tuple(_diloco_run(torch, dev, d, layers, o, rank) for o in (False, True))


def _four_ranks(rank: int, world: int, dry_run: bool) -> dict:
    """One rank of ``step_four_ranks``."""
    import torch

    _reproducible(torch)  # before this rank's first matmul: its DiLoCo runs are compared
    dev = _rank_device(torch, dry_run)
    return {"collectives": _four_ranks_collectives(torch, rank, world, dev, dry_run),
            "training": _four_ranks_training(torch, rank, world, dev, dry_run),
            "diloco": _four_ranks_diloco(torch, rank, dev, dry_run)}


def _coalesced_probe(rank: int, world: int, dry_run: bool) -> str:
    """torch alone: three ``all_gather_into_tensor`` calls coalesced by ``_coalescing_manager``
    on a gloo group, into the blocks of one buffer, on CUDA tensors (``docs/known_issues.md``:
    gloo's coalesced all-gather has no CUDA path, which fsdp_qcomm's ``_c10d.coalesces`` works
    around). What the blocks hold afterwards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    dev = _rank_device(torch, dry_run)
    blocks = torch.zeros(3, world, 2, device=dev)
    with _coalescing_manager(group=dist.group.WORLD):
        for q in range(3):
            dist.all_gather_into_tensor(blocks[q].view(-1),
                                        torch.full((2,), 10.0 * q + rank, device=dev))
    got = blocks.cpu().tolist()
    want = [[[10.0 * q + r] * 2 for r in range(world)] for q in range(3)]
    return "the gathered values" if got == want else f"other values: {got}"


def _compute_mode() -> str:
    """The GPU's compute mode (``nvidia-smi``), or why it is unknown: an exclusive mode lets one
    process at a time hold a CUDA context."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() \
        else f"unknown (nvidia-smi exit {proc.returncode})"


def step_four_ranks(ctx: dict) -> dict:
    """Four processes on the one GPU as 2 nodes x 2, with gloo moving real bytes between them:
    the other steps' ``fake`` ranks move none, and NCCL refuses two ranks on one GPU. Each
    quantized collective of sdp4bit (the two-hop gradient reduce-scatter with three chunks in
    flight, qWD's weight gather with the node-sharded reference, HSDP's replica all-reduce) must
    give the bits and byte counts of the same call on CPU tensors, on every rank; FSDP2 with
    ``enable`` (sdp4bit and qsdp over all ranks, sdp4bit as HSDP 2 x 2; bf16 parameters, fp32
    reduction) must compute with bit-identical weights on every rank at every step, with finite
    losses near FSDP2's own when gloo runs FSDP2's reduce-scatter on CUDA tensors; DiLoCo over
    the two replicas, its outer all-reduce overlapped from its thread on a side stream, must
    give the bits of the same schedule run in line. gloo stages
    CUDA tensors through host memory on streams of its own, so asynchronous collectives meet
    the kernels as NCCL's would: ordered only by the streams."""
    from fsdp_qcomm.testing import run_ranks

    mode = "cpu (dry run)" if ctx["dry_run"] else _compute_mode()
    if "exclusive" in mode.lower():
        raise RuntimeError(f"the GPU's compute mode is {mode}: one process at a time")
    env = {"TRITON_INTERPRET": "1"} if ctx["dry_run"] else {}
    # the ranks unpickle their function by reference, and a forked rank cannot import this
    # script as __main__: they get it from this file imported as a module
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    out: dict = {"compute_mode": mode, "backend": "gloo", "world": 4, "ranks_per_node": 2}
    try:  # torch's, recorded and not judged: a crash here is the finding
        probe = run_ranks(gpu_check._coalesced_probe, 2, ctx["dry_run"], env=env, spawn=True,
                          timeout=min(40.0, ctx["limit"] / 4))
        out["gloo_coalesced_all_gather"] = probe[0] if probe[0] == probe[1] else probe
    except AssertionError as e:
        out["gloo_coalesced_all_gather"] = f"failed: {str(e)[-600:]}"
    Path(ctx["partial"]).write_text(json.dumps(out))  # kept if the ranks are cut short
    left = ctx["limit"] - (time.perf_counter() - ctx["t0"])
    ranks = run_ranks(gpu_check._four_ranks, 4, ctx["dry_run"], env=env, spawn=True,
                      timeout=max(20.0, left - 10))
    out.update(collectives={}, training=ranks[0]["training"])
    problems = []
    for name in ranks[0]["collectives"]:
        per = [r["collectives"][name] for r in ranks]
        if any("error" in p for p in per):
            out["collectives"][name] = row = next(p for p in per if "error" in p)
            problems.append(f"{name}: {row['error']}")
            continue
        row = {k: all(p[k] for p in per) for k in per[0]}
        out["collectives"][name] = row
        if not all(row.values()):
            problems.append(f"{name}: the device's {[k for k, v in row.items() if not v]} "
                            "differ from the CPU's on some rank")
    for name, preset, hsdp in _FOUR_TRAINING:
        if preset is None:
            continue
        ref_name = "fsdp2 hsdp 2x2" if hsdp else "fsdp2"
        refs = [r["training"][ref_name] for r in ranks]
        ref = next((r for r in refs if "error" in r), refs[0])  # one that failed, if any did
        out["training"][ref_name] = ref
        rows = [r["training"][name] for r in ranks]
        row = out["training"][name]
        row["same_weights_every_step"] = all(r["same_weights_every_step"] for r in rows)
        if not row["same_weights_every_step"]:
            problems.append(f"{name}: ranks computed with different weights")
        if not all(math.isfinite(v) for v in row["losses"]):
            problems.append(f"{name}: losses {row['losses']}")
        crossing = "grad_replica" if hsdp else "weight_allgather"  # HSDP gathers in a node
        if not row["cross_node_bytes"] or not row["kinds"].get(crossing):
            problems.append(f"{name}: no quantized collective crossed a node ({row['kinds']})")
        if "losses" in ref:
            row["final_loss_gap"] = row["losses"][-1] / ref["losses"][-1] - 1
            if abs(row["final_loss_gap"]) > _FOUR_LOSS_GAP:
                problems.append(f"{name}: final loss {row['losses'][-1]:.4f} against FSDP2's "
                                f"{ref['losses'][-1]:.4f}")
    out["diloco overlap 2x2"] = _diloco_verdict([r["diloco"] for r in ranks], problems)
    if problems:
        raise StepFailed("; ".join(problems), out)
    return out


# In order of value; each with the most seconds it may take (the budget may give it less).
STEPS = {
    "environment": (step_environment, 60),
    "step_cost": (step_step_cost, 220),
    "step_profile": (step_step_profile, 150),
    "exactness_sweep": (step_exactness_sweep, 150),
    "bandwidth": (step_bandwidth, 100),
    "fsdp_hooks": (step_fsdp_hooks, 100),
    "fsdp_one_rank": (step_fsdp_one_rank, 80),
    "layouts": (step_layouts, 150),
    "four_ranks": (step_four_ranks, 150),
    "kernel_tests": (step_kernel_tests, 200),
    "tiles": (step_tiles, 100),
}
_MIN_STEP_S = 20  # a step is not started with less left than this


def _summary_line(name: str, rec: dict) -> str:
    r = rec.get("result") or {}
    if rec["status"] != "ok":
        what = rec.get("error", "").splitlines()[0][:90] if rec.get("error") else ""
    elif name == "environment":
        what = f"{r.get('device')} {r.get('capability', '')} torch {r.get('torch')} " \
               f"triton {r.get('triton')} peak {r.get('peak_gbps') or '?'} GB/s"
    elif name == "kernel_tests":
        what = r.get("summary", "")
    elif name == "exactness_sweep":
        what = f"{r.get('comparisons')} comparisons bit-exact"
    elif name == "bandwidth":
        what = f"clone {r.get('clone_gbps', 0):.0f} GB/s; goal missed by " \
               f"{len(r.get('goal_missed', []))} kernels"
    elif name == "step_profile":
        what = "; ".join(f"{k}: GPU busy {v['profile'].get('gpu_busy_ms', 0):.0f} of "
                         f"{v['profile']['wall_ms']:.0f} ms, ours "
                         f"{v['profile'].get('ours_ms', 0):.0f} ms, "
                         f"{v['profile'].get('launches_per_step', 0):.0f} launches/step"
                         for k, v in r.items())
    elif name == "tiles":
        what = "; ".join(f"TILE {k}: {sum(v >= GOAL for v in rows.values())} of {len(rows)} "
                         f"kernels at >= {GOAL}x clone" for k, rows in r.get("x_clone", {}).items())
    elif name == "step_cost":
        def unverified(row: dict) -> str:  # runs before 2026-12-06 lack it
            u = row.get("unverified")
            return f" ({100 * u['codec_share']:.1f}% unverified)" if u else ""

        what = "; ".join(f"{row['shape']['name']} W={row['world']}: codec "
                         f"{100 * row['codec_share']:.1f}%{unverified(row)}"
                         for row in r.get("rows", []))
    elif name == "four_ranks":
        same = [k for k, v in r.get("collectives", {}).items()
                if "error" not in v and all(v.values())]
        what = f"{len(same)} of {len(r.get('collectives', {}))} collectives as on the CPU; " + \
            "; ".join(f"{k}: " + ("raised" if "error" in v else f"final loss {v['losses'][-1]:.4f}")
                      for k, v in r.get("training", {}).items())
        if "diloco overlap 2x2" in r:
            dl = r["diloco overlap 2x2"]
            what += "; diloco overlap " + ("equal to in-line" if dl["equal_to_in_line"]
                                           else "DIFFERS")
        if "gloo_coalesced_all_gather" in r:
            what += f"; torch's coalesced gloo all-gather gave {r['gloo_coalesced_all_gather']}"
    elif name == "layouts":
        def layout(v: dict) -> str:
            if "error" in v:
                return "raised"
            if "equal_to_in_line" in v:
                return "equal to in-line" if v["equal_to_in_line"] else "DIFFERS"
            return ", ".join(f"{kind} {n}" for kind, n in v["kinds"].items())

        what = "; ".join(f"{k}: {layout(v)}" for k, v in r.get("layouts", {}).items())
    else:
        what = ", ".join(f"{p}" for p in r.get("presets", {}))
    return f"{name:16s} {rec['status']:7s} {rec.get('seconds', 0):7.1f}s  {what}"


def _summary(results: dict) -> str:
    lines = [f"# GPU check {'(dry run) ' if results['dry_run'] else ''}{results['started']}", "",
             f"budget {results['budget']:.0f} s, spent {results.get('seconds', 0):.0f} s", "",
             "```", f"{'step':16s} {'status':7s} {'time':>8s}  result"]
    lines += [_summary_line(n, rec) for n, rec in results["steps"].items()]
    lines.append("```")
    cost = (results["steps"].get("step_cost", {}).get("result") or {}).get("rows")
    if cost:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import gpu_step_cost

        lines += ["", "## Step cost (fake backend; formula in benchmarks/gpu_step_cost.py)", "",
                  gpu_step_cost.table(cost)]
    bench = results["steps"].get("bandwidth", {}).get("result") or {}
    if bench.get("cases"):
        lines += ["", "## Kernel bandwidth (device time; host time of a call beside it)", "",
                  "| kernel | GB/s | x clone | x peak | host us per call |",
                  "|---|---|---|---|---|"]
        for row in bench["cases"]:
            if "gbps" in row:
                xp = f"{row['x_peak']:.2f}" if "x_peak" in row else "-"
                flag = "" if row.get("goal_met", True) else " (< goal)"
                host = f"{row['host_us']:.0f}" if "host_us" in row else "-"  # older runs lack it
                if row.get("host_bound"):
                    host += " (host-bound)"
                lines.append(f"| {row['case']} | {row['gbps']:.1f} | {row['x_copy']:.2f}{flag} "
                             f"| {xp} | {host} |")
    if bench.get("diagnostics"):
        lines += ["", "## Where slow kernels' time goes (diagnostic rows: one cost left out)", "",
                  "| row | ms | against | ms | left out | its share of that row's time |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {d['case']} | {d['ms']:.3f} | {d['against']} | {d['against_ms']:.3f} "
                  f"| {d['leaves_out']} | {100 * d['share']:.0f}% |" for d in bench["diagnostics"]]
    tiles = (results["steps"].get("tiles", {}).get("result") or {}).get("x_clone") or {}
    if tiles:
        cols = {f"TILE {k}": tiles[k] for k in sorted(tiles, key=int)}
        own = {row["case"]: row["x_copy"] for row in bench.get("cases", []) if "x_copy" in row}
        if own:  # step 5 measured the kernels' own tiles
            cols[f"own (encoders {bench.get('group_tile', bench.get('tile'))}, others "
                 f"{bench.get('tile')})"] = own
        names = list(cols)
        lines += ["", "## Kernel bandwidth by tile (x clone)", "",
                  "| kernel | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(names)]
        for case in dict.fromkeys(k for c in names for k in cols[c]):
            cells = [f"{cols[c][case]:.2f}" if case in cols[c] else "-" for c in names]
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _run_child(args: argparse.Namespace) -> int:
    """One step, in this process; its record goes to ``--result``."""
    import tempfile

    # Beside the result, in the parent's work folder, which the parent removes even when it
    # has to kill this process; removed here too when the step ends.
    with tempfile.TemporaryDirectory(prefix=f"{args.step}_",
                                     dir=Path(args.result).resolve().parent) as tmp:
        return _run_step(args, {"dry_run": args.dry_run, "tmp": tmp, "limit": args.limit,
                                "partial": args.result + ".partial",
                                "t0": time.perf_counter()})


def _run_step(args: argparse.Namespace, ctx: dict) -> int:
    """Run the step and write its record (status, result or error, seconds)."""
    env_file = Path(args.result).with_name("environment.ctx.json")
    if env_file.is_file():
        ctx.update(json.loads(env_file.read_text()))
    fn, _ = STEPS[args.step]
    t0 = time.perf_counter()
    rec: dict = {}
    try:
        rec["result"] = fn(ctx)
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded for the parent
        if isinstance(e, StepFailed):
            rec["result"] = e.result
        rec["status"] = "FAILED"
        rec["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        print(rec["error"], flush=True)
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.result).write_text(json.dumps(rec, indent=1, default=str))
    if args.step == "environment" and rec["status"] == "ok":
        env_file.write_text(json.dumps({"peak_gbps": rec["result"].get("peak_gbps")}))
    return 0


def main() -> int:
    args = _args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.path.insert(0, str(ROOT))
    if args.step:
        return _run_child(args)
    import shutil
    import tempfile

    wanted = [s for s in args.only.split(",") if s] or list(STEPS)
    unknown = set(wanted) - set(STEPS)
    if unknown:
        print(f"unknown steps {sorted(unknown)}; known: {', '.join(STEPS)}")
        return 2
    wanted = [s for s in STEPS if s in wanted]  # always in order of value
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "results" / "gpu_check")
    out_dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _provenance

    _provenance.record(out_dir)  # provenance.json, COMMANDS.md: the command, commit, load
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        results = _run_steps(args, wanted, out_dir, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + _summary(results))
    print(f"total {results['seconds']:.0f} s (budget {args.budget:.0f} s); results: {out_dir}")
    return 0 if all(r["status"] == "ok" for r in results["steps"].values()) else 1


def _run_steps(args: argparse.Namespace, wanted: list, out_dir: Path, work: Path) -> dict:
    """Each step in its own process, within what is left of the budget; the results are saved
    to ``out_dir`` as each ends, and returned."""
    import signal

    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.dry_run,
                     "budget": args.budget, "steps": {}}
    log = open(out_dir / "log.txt", "w")
    t_all = time.perf_counter()

    def save() -> None:
        results["seconds"] = round(time.perf_counter() - t_all, 1)
        (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
        (out_dir / "summary.md").write_text(_summary(results))

    for name in wanted:
        left = args.budget - (time.perf_counter() - t_all)
        limit = min(STEPS[name][1], left)
        if limit < _MIN_STEP_S:
            results["steps"][name] = {"status": "skipped", "error": f"budget: {left:.0f} s left"}
            save()
            continue
        print(f"== {name} (at most {limit:.0f} s)", flush=True)
        log.write(f"== {name} (at most {limit:.0f} s)\n")
        log.flush()
        result_file = work / f"{name}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--step", name,
               "--result", str(result_file), "--limit", str(limit)]
        if args.dry_run:
            cmd.append("--dry-run")
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            text += f"\n(killed after {limit:.0f} s)"
        print(text[-8000:], flush=True)
        log.write(text)
        log.flush()
        if result_file.is_file():
            rec = json.loads(result_file.read_text())
        else:
            rec = {"status": "FAILED" if proc.returncode != -signal.SIGKILL else "timeout",
                   "error": f"the step's process ended ({proc.returncode}) without a result: "
                            f"{text.strip().splitlines()[-1][:300] if text.strip() else ''}"}
            partial = Path(str(result_file) + ".partial")
            if partial.is_file():  # what the step stored before it was stopped
                rec["result"] = json.loads(partial.read_text())
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        results["steps"][name] = rec
        save()
    log.close()
    save()
    return results


if __name__ == "__main__":
    sys.exit(main())
