"""Where a quantized training step's time goes, component by component, in a live 4-rank run.

Trains the cluster benchmark's GPT on 4 local gloo ranks laid out as 2 nodes x 2 (no link
emulation: this measures the CPU work, which is what sets the quantized step on these
machines) and times, per rank and step, the exclusive time of each component:

* ``codec``: the wire format's encode/decode entry points (``codec.cpu_native``,
  ``codec.torch_codec``);
* ``digest``: the change tracker's shard digests (``change_tracker.content_changes``);
* ``agreement``: the agreement round on what changed (``Agreement.agree``, its digests and
  collective excluded);
* ``consistency``: the cross-rank weight checksums (``consistency_check_every``);
* ``levels``: learned-level table fits and syncs (``LevelSync.table``);
* ``comm intra`` / ``comm inter``: blocked in a ``torch.distributed`` collective (or its
  ``wait``) whose group lies inside one node / spans nodes, inside the hooks or outside them
  (FSDP2's own collectives);
* ``hook glue``: the rest of the time inside the hooks (``QuantizedAllGather``,
  ``QuantizedReduceScatter``, ``ReplicaAllReduce``, the deferred decode of an async gather):
  Python bookkeeping, buffer copies, layout work; per call in ``glue us/call``;
* ``session``: the root forward's pre-hook (installed-hook checks; the agreement is its own
  line);
* ``rest``: the step minus all of the above on the training thread (compute, optimizer, FSDP2).

Time on ``grad_overlap``'s background thread is reported separately (it overlaps backward).

A scheme may carry ``QCommConfig`` overrides after a ``+``: ``sdp4bit+weight_reference=full``
or ``sdp4bit+verify_weight_writes=false+weight_reference=full``, so one table shows what each
safety or memory feature costs. Besides the wall-clock components, each row has the CPU
seconds per step of all ranks together (process CPU time, every thread: what sets the step on a
machine whose cores the ranks share).

``--against REF`` runs the same measurement on the code of another commit (a ``git worktree``
of REF: its ``fsdp_qcomm`` and ``benchmarks/_model.py``), alternating with this checkout's, in
one invocation on one machine: the before/after table of a change. Components the other code
does not have are "-".

    OMP_NUM_THREADS=1 python benchmarks/step_profile.py [--schemes sdp4bit,hsdp_sdp4bit]
        [--steps 8] [--warmup 2] [--against 9b1c2ce] [--out results/step_profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: label -> (preset, mesh); the cluster benchmark's rows
SCHEMES = {"baseline": (None, "flat"), "sdp4bit": ("sdp4bit", "flat"),
           "lowbit": ("lowbit", "flat"), "bf16": ("bf16", "flat"),
           "hsdp": (None, "hsdp"), "hsdp_sdp4bit": ("sdp4bit", "hsdp")}
CATEGORIES = ("codec", "digest", "agreement", "consistency", "levels", "comm intra",
              "comm inter", "hook glue", "session")


def parse_scheme(text: str) -> tuple[str, dict]:
    """``name[+field=value...]`` -> (a ``SCHEMES`` name, ``QCommConfig`` overrides); values
    are read as Python literals where they parse (``full`` stays a string, ``false`` is
    False), and the overrides are checked by building the config."""
    import ast

    from fsdp_qcomm import QCommConfig

    name, *parts = text.split("+")
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r} in {text!r}; choose from {list(SCHEMES)}")
    overrides = {}
    for part in parts:
        field, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"{text!r}: write overrides as +field=value (got {part!r})")
        low = value.lower()
        if low in ("true", "false"):
            overrides[field] = low == "true"
            continue
        try:
            overrides[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[field] = value
    preset = SCHEMES[name][0]
    if overrides and preset is None:
        raise ValueError(f"{text!r}: FSDP2's own collectives take no QCommConfig overrides")
    if overrides:
        QCommConfig.preset(preset, ranks_per_node=2, **overrides)  # names a bad field or value
    return name, overrides


# ---- the profiler (inside each rank) ----------------------------------------------------------
class _Prof:
    """Exclusive time per category and thread kind, from a per-thread stack of open calls."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.excl: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()

    def _stack(self) -> list:
        s = getattr(self.local, "stack", None)
        if s is None:
            s = self.local.stack = []
        return s

    def run(self, cat: str, fn, args, kwargs):
        stack = self._stack()
        frame = [cat, 0.0]
        stack.append(frame)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            stack.pop()
            where = "" if threading.current_thread() is threading.main_thread() else "bg:"
            with self.lock:
                self.excl[where + cat] += dt - frame[1]
                self.calls[where + cat] += 1
            if stack:
                stack[-1][1] += dt

    def reset(self) -> None:
        with self.lock:
            self.excl.clear()
            self.calls.clear()


PROF = _Prof()


def _wrap(fn, cat: str):
    if getattr(fn, "_step_profiled", False):
        return fn

    def wrapped(*args, **kwargs):
        return PROF.run(cat, fn, args, kwargs)

    wrapped._step_profiled = True
    wrapped.__name__ = getattr(fn, "__name__", "wrapped")
    return wrapped


def _patch_everywhere(owner, name: str, cat: str) -> bool:
    """Wrap ``owner.name`` and every loaded fsdp_qcomm module attribute that is the same
    function (``from x import f`` copies)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return False
    w = _wrap(fn, cat)
    setattr(owner, name, w)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("fsdp_qcomm") and getattr(
                mod, name, None) is fn:
            setattr(mod, name, w)
    return True


def _instrument(rpn: int) -> list[str]:
    """Wrap what exists in this code version; returns the components found."""
    import importlib

    import torch.distributed as dist

    found = []

    def mod(name):
        try:
            return importlib.import_module(name)
        except ImportError:
            return None

    for impl in ("fsdp_qcomm.codec.cpu_native", "fsdp_qcomm.codec.torch_codec"):
        m = mod(impl)
        for f in ("quantize", "dequantize", "reduce_requantize", "reduce_dequantize",
                  "quantize_levels", "dequantize_levels_sum"):
            if m is not None and _patch_everywhere(m, f, "codec"):
                found.append("codec")
    ct = mod("fsdp_qcomm.fsdp.change_tracker")
    if ct is not None:
        if hasattr(ct, "content_changes"):
            ct.content_changes = _wrap(ct.content_changes, "digest")
            found.append("digest")
        if hasattr(getattr(ct, "Agreement", None), "agree"):
            ct.Agreement.agree = _wrap(ct.Agreement.agree, "agreement")
            found.append("agreement")
    cons = mod("fsdp_qcomm.fsdp.consistency")
    if cons is not None and any([_patch_everywhere(cons, f, "consistency")
                                 for f in ("consistency_error", "stop_everywhere")]):
        found.append("consistency")
    ls = mod("fsdp_qcomm.collectives.level_sync")
    if ls is not None and hasattr(getattr(ls, "LevelSync", None), "table"):
        ls.LevelSync.table = _wrap(ls.LevelSync.table, "levels")
        found.append("levels")
    for modname, cls, meth in (("fsdp_qcomm.fsdp.all_gather", "QuantizedAllGather", "__call__"),
                               ("fsdp_qcomm.fsdp.reduce_scatter", "QuantizedReduceScatter",
                                "__call__"),
                               ("fsdp_qcomm.fsdp.reduce_scatter", "QuantizedReduceScatter",
                                "_reduce"),
                               ("fsdp_qcomm.fsdp.hsdp", "ReplicaAllReduce", "__call__"),
                               ("fsdp_qcomm.fsdp.hsdp", "ReplicaAllReduce", "_reduce"),
                               ("fsdp_qcomm.collectives.weight_gather", "_DeferredWork", "wait")):
        m = mod(modname)
        c = getattr(m, cls, None) if m is not None else None
        if c is not None and hasattr(c, meth):
            setattr(c, meth, _wrap(getattr(c, meth), "hook glue"))
    sess = mod("fsdp_qcomm.fsdp.session")
    if sess is not None and hasattr(getattr(sess, "Session", None), "_before_root_forward"):
        sess.Session._before_root_forward = _wrap(sess.Session._before_root_forward, "session")
        found.append("session")

    def group_cat(group) -> str:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        return "comm intra" if len({r // rpn for r in ranks}) == 1 else "comm inter"

    class TimedWork(dist.Work):
        def __init__(self, inner, cat):
            super().__init__()
            self.inner, self.cat = inner, cat

        def wait(self, *a):
            if self.inner is not None:
                inner, self.inner = self.inner, None
                PROF.run(self.cat, inner.wait, a, {})
            return True

        def is_completed(self):
            return self.inner is None or self.inner.is_completed()

    for name in ("all_gather_single", "all_to_all_single", "reduce_scatter_single",
                 "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                 "all_gather", "reduce_scatter"):
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_step_profiled", False):
            continue

        def timed(*args, _fn=fn, **kwargs):
            cat = group_cat(kwargs.get("group"))
            work = PROF.run(cat, _fn, args, kwargs)
            return TimedWork(work, cat) if isinstance(work, dist.Work) else work

        timed._step_profiled = True
        setattr(dist, name, timed)
    return sorted(set(found) | {"comm intra", "comm inter", "hook glue"})


def _rank(rank: int, world: int, a: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(a["repo"], "benchmarks"))
    from _model import GPTShape, build_fsdp_gpt, hsdp_mesh

    import fsdp_qcomm

    rpn = 2
    found = _instrument(rpn)
    torch.set_num_threads(1)
    shape = GPTShape(a["vocab"], a["dim"], a["layers"], a["heads"], a["seq"])
    name, overrides = parse_scheme(a["scheme"])
    preset, layout = SCHEMES[name]
    model = build_fsdp_gpt(shape, 0, hsdp_mesh(rpn) if layout == "hsdp" else None)
    handle = None
    if preset is not None:
        handle = fsdp_qcomm.enable(model, fsdp_qcomm.QCommConfig.preset(
            preset, ranks_per_node=rpn, seed=0, grad_overlap=a["grad_overlap"], **overrides))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator().manual_seed(rank)
    steps, cpu, per_step = [], [], []
    for step in range(a["warmup"] + a["steps"]):
        dist.barrier()
        PROF.reset()
        c0 = time.process_time()
        t0 = time.perf_counter()
        x = torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), generator=g)
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        dc = time.process_time() - c0
        if step >= a["warmup"]:
            steps.append(dt)
            cpu.append(dc)
            per_step.append({"excl": dict(PROF.excl), "calls": dict(PROF.calls)})
    if handle is not None:
        handle.disable()
    return {"steps": steps, "cpu": cpu, "per_step": per_step, "found": found}


def _worker(argv: list[str]) -> int:
    a = json.loads(argv[0])
    sys.path.insert(0, a["repo"])
    from fsdp_qcomm.testing import run_ranks

    res = run_ranks(_rank, 4, a, timeout=1800)
    Path(a["json_out"]).write_text(json.dumps(res))
    return 0


def _summary(ranks: list[dict]) -> dict:
    med = statistics.median
    n = len(ranks[0]["steps"])
    step = [max(r["steps"][i] for r in ranks) for i in range(n)]
    cats = sorted({k for r in ranks for s in r["per_step"] for k in s["excl"]})
    out = {"median_step_s": med(step), "found": ranks[0]["found"], "excl_s": {},
           "calls_per_step": {},
           # CPU seconds of all ranks (all threads) per step: the sum of each rank's median
           "cpu_s_all_ranks": sum(med(r["cpu"]) for r in ranks) if "cpu" in ranks[0] else None}
    for c in cats:  # mean over ranks of each rank's median per step
        out["excl_s"][c] = statistics.fmean(med([s["excl"].get(c, 0.0) for s in r["per_step"]])
                                            for r in ranks)
        out["calls_per_step"][c] = statistics.fmean(
            med([s["calls"].get(c, 0) for s in r["per_step"]]) for r in ranks)
    main = sum(v for k, v in out["excl_s"].items() if not k.startswith("bg:"))
    mean_step = statistics.fmean(med(r["steps"]) for r in ranks)
    out["excl_s"]["rest"] = max(0.0, mean_step - main)
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def _table(results: dict, versions: list[str]) -> str:
    lines = []
    for scheme, by_version in results.items():
        lines += [f"### {scheme}", "",
                  "| component (ms per step, exclusive) | " + " | ".join(versions) + " |",
                  "|---|" + "---|" * len(versions)]
        keys = [*CATEGORIES, "rest"]
        extra = sorted({k for v in by_version.values() for k in v["excl_s"] if k.startswith(
            "bg:")})
        for k in keys + extra:
            row = []
            for ver in versions:
                s = by_version.get(ver)
                present = s is not None and (k in s["excl_s"]) and (
                    k.split(":")[-1] in s["found"] or k == "rest" or k.startswith("bg:"))
                row.append(_fmt(s["excl_s"][k]) if present else "-")
            lines.append(f"| {k} | " + " | ".join(row) + " |")
        glue = []
        for ver in versions:
            s = by_version.get(ver)
            calls = s["calls_per_step"].get("hook glue", 0) if s else 0
            glue.append(f"{1e6 * s['excl_s']['hook glue'] / calls:.0f}" if s and calls else "-")
        lines.append("| hook glue us/call | " + " | ".join(glue) + " |")
        lines.append("| CPU ms per step, all ranks | " + " | ".join(
            _fmt(by_version[v].get("cpu_s_all_ranks")) if v in by_version else "-"
            for v in versions) + " |")
        lines.append("| **median step** | " + " | ".join(
            f"**{_fmt(by_version[v]['median_step_s'])}**" if v in by_version else "-"
            for v in versions) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return _worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default="sdp4bit,hsdp_sdp4bit")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--grad-overlap", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--against", default=None, metavar="REF",
                    help="also measure the code of this commit, alternating, in this run")
    ap.add_argument("--out", default=str(REPO / "results" / "step_profile"))
    a = ap.parse_args(argv)
    schemes = [s for s in a.schemes.split(",") if s]
    for s in schemes:
        try:
            parse_scheme(s)
        except ValueError as e:
            ap.error(str(e))
    sys.path.insert(0, str(HERE))
    import _provenance

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _provenance.record(out, argv=[__file__, *argv])
    versions = {"this checkout": str(REPO)}
    if a.against:
        tree = Path(f"/tmp/step_profile_{a.against}")
        if not tree.exists():
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree),
                            a.against], check=True, capture_output=True)
        versions[a.against] = str(tree)
    results: dict = {}
    for scheme in schemes:
        results[scheme] = {}
        for ver, repo in versions.items():  # alternating: the same machine state for both
            if "+" in scheme and ver != "this checkout":
                continue  # overrides name this checkout's fields; older code may lack them
            cfg = dict(scheme=scheme, steps=a.steps, warmup=a.warmup, dim=a.dim,
                       layers=a.layers, heads=a.heads, seq=a.seq, vocab=a.vocab, batch=a.batch,
                       grad_overlap=a.grad_overlap, repo=repo,
                       json_out=str(out / "raw_{}_{}.json".format(
                           scheme.replace("+", "__").replace("=", "-"), ver.replace(" ", "_"))))
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo)
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
                return 1
            ranks = json.loads(Path(cfg["json_out"]).read_text())
            results[scheme][ver] = _summary(ranks)
            print(f"{scheme} [{ver}]: median step {results[scheme][ver]['median_step_s']:.3f} s",
                  flush=True)
    md = (f"# Where a step's time goes\n\n{a.dim}-dim, {a.layers}-layer GPT, batch {a.batch} x "
          f"{a.seq} per rank, 4 gloo ranks as 2 nodes x 2 on one machine (no link emulation), "
          f"grad_overlap={a.grad_overlap}; per rank and step, the exclusive time of each "
          f"component (median over {a.steps} steps after {a.warmup}, mean over ranks); 'bg:' "
          "rows ran on grad_overlap's background thread, beside backward.\n\n"
          + _table(results, list(versions)))
    (out / "table.md").write_text(md)
    (out / "results.json").write_text(json.dumps({"args": vars(a), "results": results},
                                                 indent=1))
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
