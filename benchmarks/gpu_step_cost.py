"""What ``enable(sdp4bit)`` adds to a training step on one GPU, and what that implies per link.

One process is rank 0 of a W-rank job through torch's ``fake`` backend (its collectives return
at once and move no data), so a step's time is the GPU's work alone: FSDP2's copies, the model,
the optimizer and, with ``enable``, our quantize / Hadamard / dequantize kernels. The same
Llama-shaped model and step are timed without and with ``enable``; the difference is what the
codec costs on the GPU. Values are not checked (what the gathers return is not data).

Per configuration (shape, W, G ranks per node) it records:

* ``ms``: median step time (CUDA events, after warm-up), without and with ``enable``;
  ``codec_share``: (with - without) / with; ``unverified``: the same with
  ``verify_weight_writes=False`` (no change agreement, whose host read before each root
  forward drains the GPU's queue), so the difference is what that read costs;
* ``peak_gib``: ``torch.cuda.max_memory_allocated`` over the timed steps (the node-sharded
  qWD reference of ``weight_reference="node"`` is part of "with");
* ``host_syncs``: two steps after the warm-up run under ``torch.cuda.set_sync_debug_mode``
  ("warn", each warning recorded with the Python frames that caused it); "none" or where;
* ``cross_node_bytes``: per step, what this rank sends to other nodes: measured by the hooks
  (``handle.stats()``, the timed steps only) with ``enable``; for FSDP2 bf16 weights / fp32
  gradients, the least any algorithm must move: each node must receive what its G ranks lack,
  ``(W - G) / W * P * (2 * 2 + 4)`` bytes per node, spread over its G ranks' links (two bf16
  all-gathers, forward and the backward re-gather, and one fp32 reduce-scatter of P padded
  parameters), the same accounting as the hooks' (which send each remote node only its part);
* ``implied_step_s``: for each link speed L (Gbit/s per GPU between nodes), the step time
  ``T = T_gpu + B / L`` (no overlap of communication and compute: an upper bound) and
  ``max(T_gpu, B / L)`` (perfect overlap: a lower bound), for FSDP2 and for ``enable``.

    python benchmarks/gpu_step_cost.py [--shapes 1B,8B-4L] [--worlds 8:1,64:8] [--steps 8]
        [--json FILE]

``--dry-run``: a tiny shape, fp32, on the CPU (every figure computed, none meaningful).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _provenance
LINKS_GBIT = (25, 100, 400)


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-style decoder: RMSNorm, grouped-query attention, SwiGLU, untied head."""

    name: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int

    @property
    def params(self) -> int:
        hd = self.dim // self.heads
        attn = self.dim * (self.heads * hd) * 2 + self.dim * (self.kv_heads * hd) * 2
        block = attn + 3 * self.dim * self.ffn + 2 * self.dim
        return self.layers * block + 2 * self.vocab * self.dim + self.dim


SHAPES = {
    # Llama 3.2 1B (untied head here), and Llama 3 8B with 4 of its 32 layers
    "1B": LlamaShape("1B", 2048, 16, 32, 8, 8192, 128256, 2048, 4),
    "8B-4L": LlamaShape("8B-4L", 4096, 4, 32, 8, 14336, 128256, 2048, 2),
    "tiny": LlamaShape("tiny", 64, 2, 4, 2, 160, 257, 32, 2),
}


class _Block(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        hd = s.dim // s.heads
        self.heads, self.kv_heads, self.hd = s.heads, s.kv_heads, hd
        self.attn_norm = nn.RMSNorm(s.dim)
        self.wq = nn.Linear(s.dim, s.heads * hd, bias=False)
        self.wk = nn.Linear(s.dim, s.kv_heads * hd, bias=False)
        self.wv = nn.Linear(s.dim, s.kv_heads * hd, bias=False)
        self.wo = nn.Linear(s.heads * hd, s.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(s.dim)
        self.w1 = nn.Linear(s.dim, s.ffn, bias=False)
        self.w3 = nn.Linear(s.dim, s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.blocks = nn.ModuleList(_Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.dim)
        self.head = nn.Linear(s.dim, s.vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def baseline_cross_node_bytes(padded_params: int, world: int, per_node: int) -> float:
    """FSDP2 bf16 weights / fp32 gradients, per rank per step: two all-gathers (forward and
    the backward re-gather) of 2-byte weights and one reduce-scatter of 4-byte gradients; each
    node receives the ``(world - per_node) / world`` of them it lacks, over ``per_node``
    links."""
    return (world - per_node) / world * padded_params * (2 * 2 + 4) / per_node


def implied(t_gpu_s: float, cross_bytes: float) -> dict:
    """Step time per link speed: no overlap (``T_gpu + B / L``) and perfect overlap."""
    out = {}
    for gbit in LINKS_GBIT:
        comm = cross_bytes * 8 / (gbit * 1e9)
        out[f"{gbit}gbit"] = {"serial_s": t_gpu_s + comm, "overlap_s": max(t_gpu_s, comm),
                              "comm_s": comm}
    return out


def _init_fake(world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


#: the one designed host read of a training step (``verify_weight_writes``, on by default):
#: the ranks' agreed change codes decide which collectives run (``fsdp/change_tracker.py``)
AGREEMENT_READ = "change_tracker.py"


def host_syncs(fn) -> dict:
    """Runs ``fn`` under ``set_sync_debug_mode("warn")`` (the step completes either way) and
    sorts the synchronizing calls it made: ``agreement`` (the designed read before each root
    forward) and ``other`` (each with its innermost frames and the nearest frames outside
    torch); ``ok``: no other."""
    import warnings

    found: list[tuple[bool, str]] = []
    show = warnings.showwarning
    inside = False

    def record(message, category, filename, lineno, file=None, line=None):
        if not inside or "synchroniz" not in str(message):  # enabling the mode warns once
            return show(message, category, filename, lineno, file, line)
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
        ours = [f for f in stack if "/torch/" not in f.filename or "/fsdp/" in f.filename]

        def name(fs):
            return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                               for f in reversed(fs))

        agreement = any(AGREEMENT_READ in f.filename and f.name == "agree" for f in stack)
        found.append((agreement, f"{name(stack[-2:])} (from {name(ours[-2:])})"))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        inside = True
        try:
            fn()
        finally:
            inside = False
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = show
    torch.cuda.synchronize()
    other = [w for a, w in found if not a]
    return {"agreement": sum(a for a, _ in found), "other": len(other),
            "other_sites": list(dict.fromkeys(other))[:4], "ok": not other}


def describe_syncs(s) -> str:
    if not isinstance(s, dict):
        return str(s)
    text = f"{s['agreement']} agreement read(s)" if s["agreement"] else "none"
    if s["other"]:
        text += f", {s['other']} other: " + " | ".join(s["other_sites"])
    return text


def build_step(shape: LlamaShape, world: int, per_node: int, preset: Optional[str], dev: str,
               param_dtype: Optional[torch.dtype] = None, overrides: Optional[dict] = None):
    """Rank 0 of ``world`` fake ranks: the model sharded per block and at its root, bf16
    parameters on CUDA (fp32 on the CPU unless ``param_dtype``), fp32 reduction, ``enable``
    when ``preset`` is given (with the config fields ``overrides``), AdamW, one batch. Returns
    ``(step, handle or None, padded parameters)``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fsdp_qcomm

    cuda = dev == "cuda"
    _init_fake(world)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama(shape)
    if param_dtype is None:
        param_dtype = torch.bfloat16 if cuda else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    padded = sum(p.to_local().numel() for p in model.parameters()) * world
    handle = None
    if preset is not None:
        handle = fsdp_qcomm.enable(model, fsdp_qcomm.QCommConfig.preset(
            preset, ranks_per_node=per_node, **(overrides or {})))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    g = torch.Generator(device=dev).manual_seed(1)
    idx = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), device=dev, generator=g)

    def step() -> None:
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, handle, padded


def run_one(shape: LlamaShape, world: int, per_node: int, preset: Optional[str], steps: int,
            warmup: int, dev: str, profile: bool = False,
            overrides: Optional[dict] = None) -> dict:
    """One model, one configuration: timed steps, peak memory, host syncs, bytes; with
    ``profile``, where two more steps spend their time (``profile_steps``); ``overrides``:
    config fields."""
    cuda = dev == "cuda"
    step, handle, padded = build_step(shape, world, per_node, preset, dev, overrides=overrides)
    for _ in range(max(1, warmup)):
        step()
    syncs = "not checked (CPU)"
    if cuda:
        torch.cuda.synchronize()
        syncs = host_syncs(lambda: (step(), step()))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = _cross_node(handle)  # the timed steps' bytes only (the first gather is full)
    times = []
    for _ in range(steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    out: dict[str, Any] = {
        "preset": preset or "fsdp2", "world": world, "ranks_per_node": per_node,
        "steps": steps, "ms": statistics.median(times), "ms_all": [round(t, 3) for t in times],
        "host_syncs": syncs, "padded_params": padded,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    if profile:
        out["profile"] = profile_steps(step, dev)
    if handle is not None:
        st = handle.stats()
        kinds = {k: v for k, v in st.items() if isinstance(v, dict) and "calls" in v}
        out["kinds"] = {k: {"calls": v["calls"], "bits_per_element":
                            round(v.get("bits_per_element", 0.0), 3)} for k, v in kinds.items()}
        out["cross_node_bytes_per_step"] = (_cross_node(handle) - before) / steps
        out["notes"] = st.get("notes", [])
        handle.disable()
    dist.destroy_process_group()
    return out


def _our_kernels() -> set[str]:
    """The Triton kernels' function names (``kernels/*.py``)."""
    import re

    names = set()
    for f in (ROOT / "kernels").glob("*.py"):
        names |= set(re.findall(r"^def (\w+_kernel)\(", f.read_text(), re.M))
    return names


def profile_steps(step, dev: str, steps: int = 2, top: int = 15) -> dict:
    """Where ``steps`` training steps spend their time: the GPU kernels by total time (ours
    marked) and launches per step, the share of the wall time the GPU is busy (idle gaps mean
    the CPU cannot launch fast enough, or a host sync), and the Python functions of fsdp_qcomm
    by cumulative CPU time (``cProfile``, one more step)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    ours = _our_kernels()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    out: dict[str, Any] = {"steps": steps, "wall_ms": wall_ms}
    if dev == "cuda":
        kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
                   and "CUDA" in str(e.device_type)]
        spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        busy, end = 0.0, float("-inf")
        for a, b in spans:
            if b > end:
                busy += b - max(a, end)
                end = b
        first = spans[0][0] if spans else 0.0
        out["gpu_busy_ms"] = busy / 1e3
        # against gpu_codec_model.py's count of the launches enable() adds (docs/gpu_path.md)
        out["launches_per_step"] = len(kernels) / steps
        out["gpu_span_ms"] = (end - first) / 1e3 if spans else 0.0
        by: dict[str, list[float]] = {}
        for e in kernels:
            by.setdefault(e.name, [0, 0.0])
            by[e.name][0] += 1
            by[e.name][1] += (e.time_range.end - e.time_range.start) / 1e3
        rows = sorted(by.items(), key=lambda kv: -kv[1][1])
        out["kernels"] = [{"name": n[:120], "ours": any(k in n for k in ours), "count": c,
                           "ms": round(ms, 3)} for n, (c, ms) in rows[:top]]
        out["ours_ms"] = round(sum(ms for n, (c, ms) in rows if any(k in n for k in ours)), 3)
        out["all_kernels_ms"] = round(sum(ms for _, (c, ms) in rows), 3)
    pr = cProfile.Profile()
    pr.enable()
    step()
    if dev == "cuda":
        torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    funcs = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        if file.startswith((str(ROOT / "fsdp_qcomm"), str(ROOT / "kernels"))):
            funcs.append({"function": f"{Path(file).parent.name}/{Path(file).name}:{line} {fn}",
                          "calls": nc, "cumulative_ms": round(ct * 1e3, 3),
                          "own_ms": round(tt * 1e3, 3)})
    funcs.sort(key=lambda f: -f["cumulative_ms"])
    out["python_top"] = funcs[:top]
    out["python_step_ms"] = round(st.total_tt * 1e3, 3)
    return out


def _free(dev: str) -> None:
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def _cross_node(handle) -> int:
    if handle is None:
        return 0
    return sum(v.get("cross_node_bytes", 0) for v in handle.stats().values()
               if isinstance(v, dict) and "calls" in v)


def compare(shape: LlamaShape, world: int, per_node: int, steps: int, warmup: int,
            dev: str, preset: str = "sdp4bit") -> dict:
    """FSDP2 alone against FSDP2 + ``enable(preset)``, same shape and W; and ``enable`` again
    with ``verify_weight_writes=False`` (``unverified``): no change agreement, so no host read
    before each root forward. What the agreement's read costs the step is the difference."""
    base = run_one(shape, world, per_node, None, steps, warmup, dev)
    _free(dev)
    q = run_one(shape, world, per_node, preset, steps, warmup, dev)
    _free(dev)
    u = run_one(shape, world, per_node, preset, steps, warmup, dev,
                overrides={"verify_weight_writes": False})
    _free(dev)
    q_cross = q["cross_node_bytes_per_step"]
    b_cross = baseline_cross_node_bytes(base["padded_params"], world, per_node)
    res = {
        "shape": asdict(shape), "params": shape.params, "world": world,
        "ranks_per_node": per_node, "preset": preset, "fsdp2": base, "enabled": q,
        "codec_ms": q["ms"] - base["ms"],
        "codec_share": (q["ms"] - base["ms"]) / q["ms"] if q["ms"] else None,
        "unverified": {"ms": u["ms"], "ms_all": u["ms_all"], "host_syncs": u["host_syncs"],
                       "codec_share": (u["ms"] - base["ms"]) / u["ms"] if u["ms"] else None},
        "cross_node_bytes_per_step": {"fsdp2": b_cross, preset: q_cross},
        "bytes_ratio": b_cross / q_cross if q_cross else None,
        "implied_step_s": {"fsdp2": implied(base["ms"] / 1e3, b_cross),
                           preset: implied(q["ms"] / 1e3, q_cross)},
    }
    if base["peak_gib"] is not None:
        res["peak_gib"] = {"fsdp2": base["peak_gib"], preset: q["peak_gib"]}
    return res


def table(rows: list[dict]) -> str:
    lines = ["| shape | W x G | FSDP2 ms | sdp4bit ms | codec share | codec share without the "
             "agreement (ms) | peak GiB FSDP2 / sdp4bit | host syncs | GB/step to other nodes "
             "FSDP2 / sdp4bit | step s at 25 / 100 / 400 Gbit/s, FSDP2 -> sdp4bit (serial) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, q = r["fsdp2"], r["enabled"]
        peak = r.get("peak_gib")
        peak_s = f"{peak['fsdp2']:.1f} / {peak[r['preset']]:.1f}" if peak else "-"
        cb = r["cross_node_bytes_per_step"]
        imp = r["implied_step_s"]
        links = " / ".join(f"{imp['fsdp2'][f'{g}gbit']['serial_s']:.2f} -> "
                           f"{imp[r['preset']][f'{g}gbit']['serial_s']:.2f}" for g in LINKS_GBIT)
        u = r.get("unverified")  # runs before 2026-12-06 lack it
        u_s = f"{100 * u['codec_share']:.1f}% ({u['ms']:.1f})" if u else "-"
        lines.append(
            f"| {r['shape']['name']} ({r['params'] / 1e9:.2f}B) | {r['world']} x "
            f"{r['ranks_per_node']} | {b['ms']:.1f} | {q['ms']:.1f} | "
            f"{100 * r['codec_share']:.1f}% | {u_s} | {peak_s} | "
            f"{describe_syncs(q['host_syncs'])[:60]} | "
            f"{cb['fsdp2'] / 1e9:.2f} / {cb[r['preset']] / 1e9:.2f} | {links} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1B,8B-4L")
    p.add_argument("--worlds", default="8:1,64:8", help="W:G pairs (G ranks per node)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--preset", default="sdp4bit")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds; configurations that would start after it are skipped")
    p.add_argument("--dry-run", action="store_true", help="tiny shape, CPU, fp32")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if a.json:
        import _provenance

        _provenance.record(Path(a.json).resolve().parent,
                           argv=None if argv is None else [__file__, *argv])
    dev = "cpu" if a.dry_run or not torch.cuda.is_available() else "cuda"
    shapes = ["tiny"] if a.dry_run else [s for s in a.shapes.split(",") if s]
    worlds = [tuple(int(v) for v in w.split(":")) for w in a.worlds.split(",") if w]
    steps, warmup = (2, 1) if a.dry_run else (a.steps, a.warmup)
    t0 = time.perf_counter()
    rows, skipped, failed = [], [], []
    per = None
    for s in shapes:
        for world, g in worlds:
            spent = time.perf_counter() - t0
            if a.budget and per is not None and spent + per > a.budget:
                skipped.append(f"{s} W={world} G={g}: budget")
                continue
            t1 = time.perf_counter()
            try:
                rows.append(compare(SHAPES[s], world, g, steps, warmup, dev, a.preset))
            except Exception as e:  # noqa: BLE001 - recorded; the other configurations run
                failed.append(f"{s} W={world} G={g}: {type(e).__name__}: {e}\n"
                              f"{traceback.format_exc()[-2500:]}")
                print(failed[-1], flush=True)
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            per = max(per or 0.0, time.perf_counter() - t1)
            if rows:
                print(table(rows[-1:]), flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(
                    {"device": dev, "rows": rows, "skipped": skipped, "failed": failed,
                     "links_gbit": LINKS_GBIT}, indent=1, default=str))
    if rows:
        print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
