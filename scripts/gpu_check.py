"""The GPU path checked in one run on a single-GPU machine (``scripts/gpu_check.sh`` runs this).

Steps, each timed and recorded whatever the others do:

1. ``environment``: torch, triton, CUDA, the device, its peak memory bandwidth (NVML's memory
   clock x bus width, else a table of known parts);
2. ``kernel_tests``: ``pytest tests/test_kernels.py`` for real: its bit-exactness tests run on
   CUDA tensors, and the ahead-of-time compile tests;
3. ``exactness_sweep``: every kernel against the torch codec (``torch_codec`` on the CPU), bit
   for bit, over all widths 2..8, group sizes from 8 to 4104, both scalings and roundings, the
   three scale dtypes and odd lengths (NaN/Inf/-0 groups included);
4. ``bandwidth``: ``benchmarks/gpu_kernels_bench.py`` at 64M elements: each kernel against
   ``torch.clone`` and against the device's peak; goal >= 70% of clone for every
   quantize/dequantize kernel;
5. ``fsdp_one_rank``: FSDP2 on one rank over NCCL, ``enable()`` with each preset, against a run
   without ``enable()``: the weights must be bit-identical (one rank: FSDP2 calls no
   collective, so nothing may change), bf16 mixed precision;
6. ``fsdp_hooks``: the hooks on CUDA inside FSDP2: a two-rank group of torch's ``fake``
   backend on the one GPU (its collectives move no data, so values are not checked) for each
   preset: kernels on FSDP's streams, stats against the wire-format formulas, no host sync
   after the first step (``torch.cuda.set_sync_debug_mode("error")``), an asynchronous unshard
   waited on another stream.

Writes one JSON file (``--out``, default ``results/gpu_check/<device>.json``) and prints a
summary table; exit status 1 if a step failed. ``--dry-run`` (or ``GPU_CHECK_DRY_RUN=1``) runs
the same steps on the CPU with small sizes: the Triton interpreter for the kernels, gloo for
NCCL; only the CUDA calls themselves are left out (``tests/test_gpu_check.py`` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
# Every named preset, and QSDP's learned levels on both sides.
PRESETS = ("baseline", "sdp4bit", "qsdp", "zeropp", "qw4", "qwd", "tlq", "tlq_hs", "W4G4-learned")
GOAL = 0.7  # of torch.clone's bandwidth, for quantize / dequantize kernels at 64M elements
# Peak DRAM bandwidth (GB/s) of parts NVML may not describe.
_KNOWN_PEAK = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB":
               2039, "A100 80GB PCIe": 1935, "A100": 1555, "B200": 8000, "L40S": 864}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   default=os.environ.get("GPU_CHECK_DRY_RUN") == "1",
                   help="CPU only, small sizes: the interpreter for kernels, gloo for NCCL")
    p.add_argument("--out", default="", help="results file (JSON)")
    p.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
    return p.parse_args()


# ---- helpers ----------------------------------------------------------------------------------
def _digest(t) -> str:
    from fsdp_qcomm.testing import digest

    return digest(t.detach().cpu())


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
    import torch
    import triton

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda,
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


def step_kernel_tests(ctx: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "test_kernels.py")]
    if ctx["dry_run"]:  # a few tests under the interpreter (the whole file: CI does it)
        env["TRITON_INTERPRET"] = "1"
        cmd += ["-k", "two_level_pipeline or groups_larger_than_a_tile"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode:
        raise RuntimeError(f"pytest failed: {last}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    return {"summary": last}


def step_exactness_sweep(ctx: dict) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from _codec_cases import fitted_levels, level_rows, sample_rows

    import fsdp_qcomm.kernels as K
    from fsdp_qcomm import QuantSpec
    from fsdp_qcomm.codec import RngKey, torch_codec, wire

    dev = "cpu" if ctx["dry_run"] else "cuda"
    key = RngKey(11, 5, 3, 1)
    sdts = ("float32", "bfloat16", "float16")
    # Every width with two group sizes each, so every group size meets several widths (each
    # (width, group size) pair is a Triton compile; tests/test_kernels.py covers more pairings
    # at short lengths); odd lengths, one spanning many tiles and groups.
    groups = (8, 24, 40, 128, 1024, 2048, 4104)
    pairs = [(b, groups[(2 * b + k) % len(groups)]) for b in range(2, 9) for k in (0, 3)]
    lengths = (7, 203, 20011)
    if ctx["dry_run"]:
        pairs, lengths = [(4, 8), (4, 40)], (203,)
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

    for c, (bits, gs) in enumerate(pairs):
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
    if failures:
        raise RuntimeError(f"{len(failures)} of {checked} comparisons differ: {failures[:20]}")
    return {"comparisons": checked, "pairs": pairs, "lengths": list(lengths)}


def step_bandwidth(ctx: dict) -> dict:
    out = Path(ctx["tmp"]) / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_kernels_bench.py"), "--json", str(out)]
    if ctx["dry_run"]:
        cmd += ["--interpret", "--numel", "8192", "--check-numel", "2048",
                "--only", "quantize 4b g128"]
    else:
        cmd += ["--numel", str(64 * 1024 * 1024), "--iters", "20"]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=900)
    print(proc.stdout[-6000:], flush=True)
    if not out.is_file():
        raise RuntimeError(f"the benchmark wrote no results:\n{proc.stderr[-3000:]}")
    res = json.loads(out.read_text())
    peak = ctx.get("peak_gbps")
    below = []
    for row in res["cases"]:
        if "gbps" in row and peak:
            row["x_peak"] = row["gbps"] / peak
        kind = row["case"].split(" ", 1)[0]
        if "x_copy" in row and kind in ("quantize", "dequantize", "quantize_levels",
                                        "dequantize_levels"):
            row["goal_met"] = row["x_copy"] >= GOAL
            if not row["goal_met"]:
                below.append(f"{row['case']}: {row['x_copy']:.2f}x")
    res["peak_gbps"] = peak
    res["clone_x_peak"] = res["clone_gbps"] / peak if peak else None
    res["goal"] = f">= {GOAL}x clone for quantize/dequantize kernels"
    res["goal_missed"] = below
    if proc.returncode or res["failures"]:
        raise RuntimeError(f"kernel exactness failed in the benchmark: {res['failures']}")
    return res


def _model(torch, d: int, layers: int):
    import torch.nn as nn

    sys.path.insert(0, str(ROOT / "tests"))
    from _models import MLPBlock

    torch.manual_seed(0)
    return nn.Sequential(*[MLPBlock(d, 2 * d + 3) for _ in range(layers)], nn.LayerNorm(d),
                         nn.Linear(d, 97))


def _shard(torch, model, mixed: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {}
    if mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for block in list(model)[:-2]:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def _train(torch, model, dev: str, steps: int, rank: int = 0, guard: Callable | None = None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, model[0].norm.normalized_shape[0], generator=g).to(dev)
        y = torch.randint(0, 97, (8,), generator=g).to(dev)
        with (guard(step) if guard is not None else _nullcontext()):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return [float(v) for v in losses]


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


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
        ref_losses = _train(torch, ref, dev, steps)
        want = {n: _digest(p.to_local()) for n, p in ref.named_parameters()}
        out = {"backend": dist.get_backend(), "steps": steps, "presets": {}}
        bad = []
        for name in PRESETS:
            model = _model(torch, d, layers).to(dev)
            _shard(torch, model, mixed=dev == "cuda")
            handle = fsdp_qcomm.enable(model, fsdp_qcomm.QCommConfig.preset(name))
            losses = _train(torch, model, dev, steps)
            got = {n: _digest(p.to_local()) for n, p in model.named_parameters()}
            calls = {k: v["calls"] for k, v in handle.stats().items()
                     if isinstance(v, dict) and "calls" in v}
            handle.disable()
            equal = got == want and losses == ref_losses
            out["presets"][name] = {"weights_equal_unhooked": equal, "calls": calls,
                                    "final_loss": losses[-1]}
            if not equal:
                bad.append(name)
        if bad:
            raise RuntimeError(f"weights differ from the run without enable() for {bad}")
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

    def guard(step: int):
        if dev == "cuda" and step >= 1:
            return _SyncDebug(torch)
        return _nullcontext()

    out = {"backend": "fake", "world": world, "steps": steps, "presets": {}}
    problems = []
    try:
        for name in PRESETS:
            model = _model(torch, d, layers).to(dev)
            _shard(torch, model, mixed=dev == "cuda")
            cfg = fsdp_qcomm.QCommConfig.preset(name, ranks_per_node=1)
            handle = fsdp_qcomm.enable(model, cfg)
            _train(torch, model, dev, steps, guard=guard)
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
            row = {"modes": modes, "kinds": {k: {"calls": v["calls"], "bits_per_element":
                                                round(v["bits_per_element"], 3)}
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
            raise RuntimeError("; ".join(problems))
        return out
    finally:
        dist.destroy_process_group()


class _SyncDebug:
    """``torch.cuda.set_sync_debug_mode("error")`` for the duration of a step."""

    def __init__(self, torch) -> None:
        self.torch = torch

    def __enter__(self):
        self.torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, *exc):
        self.torch.cuda.set_sync_debug_mode("default")
        return False


STEPS = {
    "environment": step_environment,
    "kernel_tests": step_kernel_tests,
    "exactness_sweep": step_exactness_sweep,
    "bandwidth": step_bandwidth,
    "fsdp_one_rank": step_fsdp_one_rank,
    "fsdp_hooks": step_fsdp_hooks,
}


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
    else:
        what = ", ".join(f"{p}" for p in r.get("presets", {}))
    return f"{name:16s} {rec['status']:7s} {rec['seconds']:7.1f}s  {what}"


def main() -> int:
    args = _args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.path.insert(0, str(ROOT))
    import tempfile

    ctx = {"dry_run": args.dry_run, "tmp": tempfile.mkdtemp(prefix="gpu_check_")}
    wanted = [s for s in args.only.split(",") if s] or list(STEPS)
    unknown = set(wanted) - set(STEPS)
    if unknown:
        print(f"unknown steps {sorted(unknown)}; known: {', '.join(STEPS)}")
        return 2
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
    t_all = time.perf_counter()
    for name in wanted:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        rec: dict = {}
        try:
            rec["result"] = STEPS[name](ctx)
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded; the other steps still run
            rec["status"] = "FAILED"
            rec["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(rec["error"], flush=True)
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        results["steps"][name] = rec
    results["seconds"] = round(time.perf_counter() - t_all, 1)
    results["dry_run"] = args.dry_run
    env = results["steps"].get("environment", {}).get("result") or {}
    device = str(env.get("device", "unknown")).replace(" ", "_").replace("(", "").replace(")", "")
    out = Path(args.out) if args.out else ROOT / "results" / "gpu_check" / f"{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print("\n" + f"{'step':16s} {'status':7s} {'time':>8s}  result")
    for name, rec in results["steps"].items():
        print(_summary_line(name, rec))
    bench = results["steps"].get("bandwidth", {}).get("result") or {}
    if bench.get("cases"):
        print(f"\n{'kernel':46s} {'GB/s':>8s} {'x clone':>8s} {'x peak':>7s}")
        for row in bench["cases"]:
            if "gbps" in row:
                xp = f"{row['x_peak']:.2f}" if "x_peak" in row else "-"
                flag = "" if row.get("goal_met", True) else "  < goal"
                print(f"{row['case']:46s} {row['gbps']:8.1f} {row['x_copy']:8.2f} {xp:>7s}{flag}")
    print(f"\ntotal {results['seconds']:.0f} s (budget 480 s); results: {out}")
    return 0 if all(r["status"] == "ok" for r in results["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
