"""Memory per rank, by category, measured from the live tensors of real multi-rank runs, and the
formula's projection to 7B, 13B and 70B models on 8 nodes x 8 GPUs.

Each row trains a small GPT (odd sizes, token embedding tied to the output layer) for
``--steps`` AdamW steps on gloo CPU ranks laid out as nodes (``QCommConfig.ranks_per_node``),
then, after the last optimizer step with the gradients still held, adds up per rank:

* ``params``: FSDP2's sharded parameters (the storages of the parameters' local shards,
  padding included);
* ``grads``: their sharded gradients (likewise);
* ``optimizer``: AdamW's states (``exp_avg``, ``exp_avg_sq``, ``step``);
* ``reference``: the qWD reference, ``handle.reference_bytes()``;
* ``error_feedback``: the gradient residuals' live buffers (views of them in
  ``handle.state_dict()``), checked equal to ``stats()["summary"]["error_feedback_bytes"]``
  and ``handle.kept_bytes()["error_feedback"]``;
* ``level_tables``: learned level tables (``handle.kept_bytes()["level_tables"]``);

and, from ``torch.profiler`` (``profile_memory=True``, started before the model is built): the
bytes of CPU tensors the rank holds at the measurement (``live``) and at most during the run
(``peak``): the largest "Total Allocated" of the profiler's memory events, which the CPU
allocator reports on every allocation and free as the running total of the bytes allocated
since profiling began and not yet freed (gloo's own buffers are not tensors and do not count).
On CUDA the peak would be ``torch.cuda.max_memory_allocated``; these rows run on CPU ranks.

The script asserts, for every measured row, that the categories equal the formula that the
projection uses, evaluated on the small model's padded parameter count (FSDP2 pads each
parameter's first dimension to a multiple of the shard group): ``params = grads = P_pad / S``
fp32 values (S = the shard group's size: the world, or the ranks per node under HSDP),
AdamW ``2 P_pad / S`` plus its ``step`` scalars, and the reference

* ``weight_reference="full"``: ``(1 + 1/world) P_pad`` in the all-gather dtype;
* ``weight_reference="node"`` (the default): ``P_pad / G`` (G ranks per node; at most the
  issue's bound ``(1/G + 1/world) P``);
* HSDP with the presets: 0 (the weight gather stays inside the node, unquantized).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/memory.py [--layouts 2x2,2x3,3x2]
        [--rows fsdp2,sdp4bit_full,...] [--steps 4] [--out results/memory]

Writes ``<out>/{table.md, results.json}`` and records the invocation (``provenance.json``,
``COMMANDS.md``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _provenance  # noqa: E402

GB = 1e9
#: nominal parameter counts of the projected models
MODELS = {"7B": 7e9, "13B": 13e9, "70B": 70e9}
PROJECTED_NODES, PROJECTED_GPUS = 8, 8
MASTER_ITEMSIZE = 4  # fp32 master parameters, gradients and AdamW states
ADAM_STATES = 2  # exp_avg, exp_avg_sq


# --------------------------------------------------------------------------- the formula
def reference_fraction(nodes: int, gpus: int, reference: Optional[str], hsdp: bool) -> float:
    """The qWD reference per rank as a fraction of the parameters (in the all-gather dtype).

    ``reference``: None (no qWD), "full" or "node"; ``hsdp``: the presets keep no reference
    under HSDP (the gather is inside a node). A node-sharded reference needs at least 2 nodes
    of at least 2 ranks; otherwise the reference is full (``fsdp/hop_plan.py``)."""
    if reference is None or hsdp:
        return 0.0
    world = nodes * gpus
    if reference == "node" and nodes > 1 and gpus > 1:
        return 1.0 / gpus
    if reference in ("node", "full"):
        return 1.0 + 1.0 / world
    raise ValueError(f"reference must be None, 'full' or 'node', got {reference!r}")


def per_rank_bytes(params: float, nodes: int, gpus: int, *, reference: Optional[str],
                   hsdp: bool = False, param_itemsize: int = 2,
                   master_itemsize: int = MASTER_ITEMSIZE) -> dict[str, float]:
    """Bytes per rank by category for ``params`` parameters (pass FSDP2's padded count to
    compare with a measurement) on ``nodes`` x ``gpus`` ranks: FSDP2 shards over every rank
    (flat) or over the ranks of a node (``hsdp``, replicated across nodes); master parameters,
    gradients and AdamW's two states in ``master_itemsize``; the qWD reference
    (:func:`reference_fraction`) in ``param_itemsize`` (the all-gather dtype: the
    ``param_dtype`` of the mixed-precision policy). ``extra`` is what fsdp_qcomm adds."""
    shard = gpus if hsdp else nodes * gpus
    out = {
        "params": params * master_itemsize / shard,
        "grads": params * master_itemsize / shard,
        "optimizer": ADAM_STATES * params * master_itemsize / shard,
        "reference": reference_fraction(nodes, gpus, reference, hsdp) * params * param_itemsize,
    }
    out["fsdp2"] = out["params"] + out["grads"] + out["optimizer"]
    out["extra"] = out["reference"]
    out["total"] = out["fsdp2"] + out["extra"]
    return out


def padded_params(shapes: list[tuple[int, ...]], shard: int) -> int:
    """FSDP2's padded parameter count: each parameter's first dimension rounded up to a
    multiple of the shard group's size (``padded_sharded_param_size``)."""
    total = 0
    for s in shapes:
        rest = math.prod(s[1:]) if len(s) > 1 else 1
        total += shard * -(-s[0] // shard) * rest
    return total


PROJECTED_ROWS = (
    # label, reference, hsdp
    ("FSDP2 alone, flat over 64", None, False),
    ("sdp4bit flat, full reference (before)", "full", False),
    ("sdp4bit flat, node reference (now)", "node", False),
    ("FSDP2 HSDP 8 x 8", None, True),
    ("sdp4bit HSDP 8 x 8 (replica hop only)", "node", True),
)


def projection(models: dict[str, float] = MODELS, nodes: int = PROJECTED_NODES,
               gpus: int = PROJECTED_GPUS) -> dict[str, dict[str, dict[str, float]]]:
    """``{model: {row label: per_rank_bytes(...)}}`` with a bf16 ``param_dtype``."""
    return {name: {label: per_rank_bytes(p, nodes, gpus, reference=ref, hsdp=hsdp)
                   for label, ref, hsdp in PROJECTED_ROWS}
            for name, p in models.items()}


def projection_table(proj: dict) -> str:
    rows = ["| model | layout, comm | FSDP2 params | grads | AdamW | qWD reference | "
            "per GPU | extra over FSDP2 |", "|---|---|---|---|---|---|---|---|"]
    for model, by_row in proj.items():
        for label, b in by_row.items():
            rows.append(f"| {model} | {label} | {b['params'] / GB:.2f} GB | "
                        f"{b['grads'] / GB:.2f} GB | {b['optimizer'] / GB:.2f} GB | "
                        f"{b['reference'] / GB:.2f} GB | {b['total'] / GB:.2f} GB | "
                        f"{b['extra'] / GB:.2f} GB |")
    return "\n".join(rows)


# --------------------------------------------------------------------------- measured rows
@dataclass(frozen=True)
class Row:
    name: str
    describe: str
    preset: Optional[str] = None  # None: FSDP2 alone
    overrides: dict = field(default_factory=dict)
    hsdp: bool = False
    bf16: bool = False  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)

    @property
    def reference(self) -> Optional[str]:
        if self.preset is None:
            return None
        from fsdp_qcomm import QCommConfig

        cfg = QCommConfig.preset(self.preset, **self.overrides)
        return cfg.weight_reference if cfg.weight_scheme == "qwd" else None


ROWS = {r.name: r for r in (
    Row("fsdp2", "FSDP2 alone"),
    Row("sdp4bit_full", "sdp4bit, weight_reference=\"full\" (before)", "sdp4bit",
        {"weight_reference": "full"}),
    Row("sdp4bit_node", "sdp4bit, node reference (now the default)", "sdp4bit"),
    Row("sdp4bit_node_bf16", "sdp4bit, node reference, bf16 param_dtype", "sdp4bit", bf16=True),
    Row("lowbit", "lowbit (node reference, learned levels)", "lowbit"),
    Row("lowbit_ef", "lowbit + grad_error_feedback=\"inter\"", "lowbit",
        {"grad_error_feedback": "inter"}),
    Row("hsdp_fsdp2", "HSDP, FSDP2 alone", hsdp=True),
    Row("hsdp_sdp4bit", "HSDP, sdp4bit (replica all-reduce only)", "sdp4bit", hsdp=True),
)}
DEFAULT_ROWS = {"2x2": list(ROWS),
                "2x3": ["fsdp2", "sdp4bit_full", "sdp4bit_node", "hsdp_sdp4bit"],
                "3x2": ["fsdp2", "sdp4bit_full", "sdp4bit_node", "hsdp_sdp4bit"]}
CATEGORIES = ("params", "grads", "optimizer", "reference", "error_feedback", "level_tables")


def _shape(a):
    from _model import GPTShape

    return GPTShape(a.vocab, a.dim, a.layers, a.heads, a.seq, tied=True)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def memory_timeline(events: list[dict], mark: str) -> tuple[int, int]:
    """(peak, live at the ``mark`` range's start) from a chrome trace's events.

    Every ``[memory]`` event carries the CPU allocator's running "Total Allocated" after that
    allocation (``Bytes`` > 0) or free (< 0). The allocator keeps that total across profiler
    sessions and cannot subtract what is freed while no session records, so the session's
    level before its first event (``Total Allocated - Bytes`` of that event) is the zero."""
    t_mark = min(e["ts"] for e in events if e.get("name") == mark)
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not mem:
        return 0, 0
    zero = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    peak = max(e["args"]["Total Allocated"] for e in mem) - zero
    before = [e for e in mem if e["ts"] <= t_mark]
    live = (before[-1]["args"]["Total Allocated"] - zero) if before else 0
    return int(peak), int(live)


def _trace_memory(path: str, mark: str) -> tuple[int, int]:
    doc = json.loads(Path(path).read_text())
    return memory_timeline(doc["traceEvents"] if isinstance(doc, dict) else doc, mark)


def _measure(rank: int, world: int, a, row: Row, nodes: int, gpus: int) -> dict:
    import torch
    import torch.nn.functional as F
    from _model import GPT, hsdp_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.profiler import ProfilerActivity, profile, record_function

    import fsdp_qcomm
    from fsdp_qcomm.fsdp.residual_state import residual_buffers

    shape = _shape(a)
    out: dict[str, Any] = {}
    # The previous row's tensors that only the cycle collector frees (Python 3.13 left some to
    # it) would be freed inside this row's session, and their frees subtracted from its live
    # bytes: free them first, and this row's own inside its session.
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = GPT(shape)
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if row.bf16 else MixedPrecisionPolicy())
        kw = {"mp_policy": mp}
        if row.hsdp:
            kw["mesh"] = hsdp_mesh(gpus)
        for blk in model.blocks:
            fully_shard(blk, **kw)
        fully_shard(model, **kw)
        handle = None
        if row.preset is not None:
            handle = fsdp_qcomm.enable(model, fsdp_qcomm.QCommConfig.preset(
                row.preset, ranks_per_node=gpus, **row.overrides))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        for step in range(a.steps):
            if step:
                opt.zero_grad(set_to_none=True)
            if step == 1 and handle is not None:
                handle.reset_stats()  # node-crossing bytes per step after the first gathers
            x = torch.randint(0, shape.vocab, (a.batch, shape.seq + 1), generator=g)
            logits = model(x[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step()
        with record_function("memory_measurement"):
            params = list(model.parameters())
            out["params"] = _storage_bytes(params)
            out["grads"] = _storage_bytes(p.grad for p in params if p.grad is not None)
            out["optimizer"] = _storage_bytes(v for st in opt.state.values() for v in st.values()
                                              if torch.is_tensor(v))
            kept = handle.kept_bytes() if handle is not None else {}
            out["reference"] = handle.reference_bytes() if handle is not None else 0
            # the residuals' live buffers (handle.state_dict() holds copies of them)
            out["error_feedback"] = _storage_bytes(
                v for i in handle._installs
                for v in residual_buffers(i.reduction_hooks, i.group).values()
            ) if handle is not None else 0
            out["level_tables"] = kept.get("level_tables", 0)
            assert kept.get("reference", 0) == out["reference"]
            assert kept.get("error_feedback", 0) == out["error_feedback"]
            if handle is not None:
                assert handle.stats()["summary"]["error_feedback_bytes"] == out["error_feedback"]
            if handle is not None:
                st = handle.stats()
                out["cross_node_bytes_per_step"] = st["summary"]["cross_node_bytes_per_step"]
                out["notes"] = st["notes"]
        if handle is not None:  # free the row's tensors while the session records the frees
            handle.disable()
        del model, opt, params, handle
        gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        out["peak"], out["live"] = _trace_memory(path, "memory_measurement")
    return out


def _rank_fn(rank: int, world: int, a, nodes: int, gpus: int, rows: list[str]) -> dict:
    return {name: _measure(rank, world, a, ROWS[name], nodes, gpus) for name in rows}


def _param_shapes(a) -> list[tuple[int, ...]]:
    from _model import GPT

    return [tuple(p.shape) for p in GPT(_shape(a)).parameters()]


def expected(a, row: Row, nodes: int, gpus: int) -> dict[str, float]:
    """The formula on the small model: ``per_rank_bytes`` of its padded parameter count."""
    shard = gpus if row.hsdp else nodes * gpus
    p_pad = padded_params(_param_shapes(a), shard)
    return per_rank_bytes(p_pad, nodes, gpus, reference=row.reference, hsdp=row.hsdp,
                          param_itemsize=2 if row.bf16 else 4)


def check(a, layout: str, row: Row, m: dict, nodes: int, gpus: int, params: int) -> list[str]:
    """The measured row against the formula; returns failures (empty: it matches)."""
    want = expected(a, row, nodes, gpus)
    n_tensors = len(_param_shapes(a))
    bad = []
    for cat in ("params", "grads", "reference"):
        if m[cat] != want[cat]:
            bad.append(f"{layout} {row.name}: {cat} measured {m[cat]:,} != formula "
                       f"{want[cat]:,.0f}")
    # AdamW (rank 0, whose chunks are whole): the two states plus one fp32 step scalar per
    # parameter tensor
    if m["optimizer"] != want["optimizer"] + 4 * n_tensors:
        bad.append(f"{layout} {row.name}: optimizer measured {m['optimizer']:,} != formula "
                   f"{want['optimizer']:,.0f} + {n_tensors} step scalars")
    if row.reference == "node" and not row.hsdp and nodes > 1 and gpus > 1:
        bound = (1 / gpus + 1 / (nodes * gpus)) * params * (2 if row.bf16 else 4)
        if m["reference"] > bound:
            bad.append(f"{layout} {row.name}: reference {m['reference']:,} above the bound "
                       f"(1/G + 1/world) P = {bound:,.0f}")
    return bad


def _fmt(n: float) -> str:
    return f"{n / 1e3:,.1f} KB"


def _layout(s: str) -> tuple[int, int]:
    n, g = (int(x) for x in s.lower().split("x"))
    return n, g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="2x2",
                    help="nodes x ranks per node, comma-separated (e.g. 2x2,2x3,3x2)")
    ap.add_argument("--rows", default=None,
                    help=f"rows to run (default per layout: {DEFAULT_ROWS}); any of {list(ROWS)}")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=97)
    ap.add_argument("--dim", type=int, default=90)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--seq", type=int, default=33)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out", default=str(HERE.parent / "results" / "memory"))
    a = ap.parse_args(argv)
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    for lay in layouts:
        try:
            _layout(lay)
        except ValueError:
            ap.error(f"--layouts: {lay!r} is not NODESxGPUS")
    rows = None if a.rows is None else [r.strip() for r in a.rows.split(",") if r.strip()]
    if rows is not None and [r for r in rows if r not in ROWS]:
        ap.error(f"unknown row(s) {[r for r in rows if r not in ROWS]}; choose from {list(ROWS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fsdp_qcomm.testing import run_ranks

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _provenance.record(out, argv=None if argv is None else [__file__, *argv])
    t0 = time.perf_counter()
    shape = _shape(a)
    params = shape.params()
    model_bytes = params * 4
    res: dict[str, Any] = {"shape": asdict(shape), "params": params, "steps": a.steps,
                           "layouts": {}}
    failures: list[str] = []
    md = [f"# Memory per rank by category\n\nGPT {params:,} parameters (vocab {a.vocab}, dim "
          f"{a.dim}, {a.layers} layers, {a.heads} heads, seq {a.seq}, token embedding tied to "
          f"the output layer; fp32 unless noted: {model_bytes / 1e3:,.1f} KB unsharded), "
          f"{a.steps} AdamW steps of {a.batch} x {a.seq} tokens per rank, gloo CPU ranks; "
          "categories after the last optimizer step with the gradients held (rank 0; every "
          "rank's are listed in results.json); x model = over the unsharded model's fp32 "
          "bytes. peak / live: CPU tensor bytes from torch.profiler's memory events (largest "
          "and at the measurement \"Total Allocated\", counted from before the model was "
          "built), the largest over the ranks.\n"]
    for lay in layouts:
        nodes, gpus = _layout(lay)
        world = nodes * gpus
        names = rows or DEFAULT_ROWS.get(lay, list(ROWS))
        t1 = time.perf_counter()
        per_rank = run_ranks(_rank_fn, world, a, nodes, gpus, names, timeout=3600)
        wall = time.perf_counter() - t1
        lay_res: dict[str, Any] = {"nodes": nodes, "ranks_per_node": gpus, "wall_s": wall,
                                   "rows": {}}
        md.append(f"\n## {nodes} nodes x {gpus} ranks ({world} ranks; {wall:.0f} s)\n")
        md.append("| row | params | grads | AdamW | qWD reference (x model) | error feedback "
                  "| level tables | node-crossing B/step | peak | live | reference = formula |")
        md.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for name in names:
            row = ROWS[name]
            m0 = per_rank[0][name]
            for r, ranks_rows in enumerate(per_rank):  # every rank keeps the same bytes
                m = ranks_rows[name]
                for cat in CATEGORIES:
                    # AdamW's states are unpadded: the last ranks of a parameter hold less
                    if cat != "optimizer" and m[cat] != m0[cat]:
                        failures.append(f"{lay} {name}: rank {r} {cat} {m[cat]} != rank 0's "
                                        f"{m0[cat]}")
            bad = check(a, lay, row, m0, nodes, gpus, params)
            failures += bad
            want = expected(a, row, nodes, gpus)
            peak = max(r[name]["peak"] for r in per_rank)
            live = max(r[name]["live"] for r in per_rank)
            cross = m0.get("cross_node_bytes_per_step")
            md.append(
                f"| {row.describe} | {_fmt(m0['params'])} | {_fmt(m0['grads'])} | "
                f"{_fmt(m0['optimizer'])} | {_fmt(m0['reference'])} "
                f"({m0['reference'] / model_bytes:.3f}) | {_fmt(m0['error_feedback'])} | "
                f"{m0['level_tables']:,} B | "
                f"{'-' if cross is None else f'{cross:,.0f}'} | {_fmt(peak)} | {_fmt(live)} | "
                f"{'yes' if not bad else 'NO'} ({want['reference'] / model_bytes:.3f}) |")
            lay_res["rows"][name] = {"row": asdict(row), "reference_kind": row.reference,
                                     "per_rank": per_rank_list(per_rank, name),
                                     "formula": want, "peak_max": peak, "live_max": live,
                                     "matches_formula": not bad}
        res["layouts"][lay] = lay_res
    proj = projection()
    res["projection"] = {"nodes": PROJECTED_NODES, "gpus_per_node": PROJECTED_GPUS,
                         "models": MODELS, "param_itemsize": 2,
                         "master_itemsize": MASTER_ITEMSIZE, "bytes": proj}
    md.append(f"\n## Projection: {PROJECTED_NODES} nodes x {PROJECTED_GPUS} GPUs, bf16 "
              "param_dtype, fp32 master parameters, gradients and AdamW states\n")
    md.append("The formula the measured rows were checked against (`per_rank_bytes`), on the "
              "nominal parameter counts; GB = 1e9 bytes. Reference: full `(1 + 1/64) P x 2 "
              "B`, node `P / 8 x 2 B`, HSDP 0.\n")
    md.append(projection_table(proj))
    res["failures"] = failures
    res["wall_seconds"] = time.perf_counter() - t0
    md.append(f"\nChecks: {'every measured row equals the formula' if not failures else 'FAILED'}"
              f"; wall time {res['wall_seconds']:.0f} s.\n")
    md.extend(f"- {f}" for f in failures)
    text = "\n".join(md) + "\n"
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    print(text)
    print(f"written: {out}/table.md, results.json")
    return 1 if failures else 0


def per_rank_list(per_rank: list[dict], name: str) -> list[dict]:
    return [{k: v for k, v in r[name].items() if k != "notes"} | {"notes": r[name].get("notes")}
            for r in per_rank]


if __name__ == "__main__":
    sys.exit(main())
