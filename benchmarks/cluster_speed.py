"""Step time on an emulated two-node cluster whose network link is the bottleneck.

Builds two "nodes" on this machine: network namespaces joined by a veth pair, each end shaped
with ``tc ... tbf rate R`` (default 1 Gbit/s), a torchrun per namespace (``--nnodes 2
--nproc_per_node 2``, rendezvous on the first node's veth address, ``GLOO_SOCKET_IFNAME`` = the
veth). Inside a namespace both local ranks bind the same veth address, so their traffic takes
the namespace's loopback; only inter-node traffic crosses the shaped link. One launch per link
rate trains the same GPT under each scheme side by side (baseline = FSDP2's own collectives) and
records, per scheme:

* median step time and the speedup over baseline;
* where the time goes (``_timing``): exposed communication, quantization (hook time minus the
  communication inside hooks), the rest (compute, optimizer, framework);
* the veth byte counters (``/sys/class/net/<veth>/statistics``) over the timed steps, next to
  the package's own counters (``handle.stats()``), for the wire-bytes cross-check
  (``benchmarks/wire_bytes.py --cluster-json`` turns this into its link table);
* two lower bounds on the step: the CPU floor (CPU seconds of all ranks per step over the cores
  they share) and the link floor (bytes of the link's busier direction per step over its rate),
  and the floor, the larger of the two. Computation and transfers overlap, so the step can be
  close to the larger bound; their sum is not a bound (earlier tables printed it as a
  "compute+bytes floor", and most rows ran below it).

DiLoCo rows (``--schemes diloco-set``: HSDP in fp32 and with sdp4bit, DiLoCo H=8 and H=32 with
4-bit outer gradients, Streaming DiLoCo H=32 with 2 fragments and delay 1; by name also
``streaming_h32_f4d6`` and ``streaming_h32_f2d12``, whose longer delays hide a slow link's
all-reduce behind more inner steps) shard each node by
itself and sync the nodes every H inner steps (``fsdp_qcomm.diloco``, the rows of
``benchmarks/diloco.py``). They time ``--diloco-steps`` steps (whole outer periods, default 64:
2 outer steps at H=32), and each figure per step is the median over outer periods of the
period's mean: the outer sync counted once per H steps, as its bytes are.

Everything it creates (two namespaces, one veth pair, their qdiscs) carries this process's
id and is removed on exit, error or Ctrl-C. Needs root, ``ip`` and ``tc``.

    sudo OMP_NUM_THREADS=1 python benchmarks/cluster_speed.py [--rates 1gbit[,100mbit,10gbit]]
        [--schemes baseline,sdp4bit,zeropp,qsdp] [--steps 5] [--warmup 2] [--batch 1]
        [--diloco-steps 64]

Writes ``results/cluster_speed/{table.md, results.json, breakdown.png}``.
``python benchmarks/cluster_speed.py --retable results/cluster_speed/results.json`` rewrites
that folder's ``table.md`` from its ``results.json`` (no root, no run: after a change to how
the table is computed).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import _provenance  # noqa: E402
from _baselines import FSDP2_BF16_BF16, FSDP2_BF16_FP32  # noqa: E402
from _plotting import pyplot  # noqa: E402

ADDR0, ADDR1 = "10.77.0.1", "10.77.0.2"
PORT = 29577

#: label -> (QCommConfig preset, the QCommConfig fields of an emulated FSDP2 baseline
#: (``_baselines``: its exact bytes, fp32 compute; ``--grad-overlap`` does not apply), or None
#: for FSDP2's own fp32 collectives; mesh). Flat rows shard over all 4 ranks; "hsdp" rows shard
#: inside a node and replicate across the two nodes. ``baseline_thread``: fsdp-qcomm's baseline
#: preset with the background reduction thread (grad_overlap): unquantized, so it isolates the
#: gain of quantization from the thread's.
SCHEMES = {"baseline": (None, "flat"), "fsdp2_bf16": (FSDP2_BF16_FP32, "flat"),
           "fsdp2_bf16_bf16": (FSDP2_BF16_BF16, "flat"), "bf16": ("bf16", "flat"),
           "sdp4bit": ("sdp4bit", "flat"), "lowbit": ("lowbit", "flat"),
           # the whole qWD reference on every rank (1 + 1/world of the parameters, no gather
           # of reference slices inside the node: on gloo that gather is loopback TCP)
           "sdp4bit_fullref": ({"preset": "sdp4bit", "weight_reference": "full"}, "flat"),
           "zeropp": ("zeropp", "flat"), "qsdp": ("qsdp", "flat"), "qwd": ("qwd", "flat"),
           "tlq_hs": ("tlq_hs", "flat"), "qw4": ("qw4", "flat"), "tlq": ("tlq", "flat"),
           "baseline_thread": ("baseline", "flat"),
           "hsdp": (None, "hsdp"), "hsdp_fsdp2_bf16": (FSDP2_BF16_FP32, "hsdp"),
           "hsdp_fsdp2_bf16_bf16": (FSDP2_BF16_BF16, "hsdp"), "hsdp_bf16": ("bf16", "hsdp"),
           "hsdp_baseline_thread": ("baseline", "hsdp"),
           "hsdp_sdp4bit": ("sdp4bit", "hsdp"), "hsdp_lowbit": ("lowbit", "hsdp"),
           # the hops inside a node quantized too (8-bit gradients, qWD gathers), as the code of
           # 9b1c2ce did on every hop: the like-for-like row against it; on gloo the node's
           # fp32 hop is loopback TCP, on a GPU node it is NVLink and stays FSDP2's by default
           "hsdp_sdp4bit_intra": ({"preset": "sdp4bit", "quantize_intra_node": True}, "hsdp")}
#: DiLoCo rows (issue 28): each node is one replica group (FSDP2 over its own ranks, no per-step
#: node-crossing collective) and the replicas sync every H inner steps through
#: ``fsdp_qcomm.diloco``; each is ``benchmarks/diloco.py``'s row of that label (its
#: ``DiLoCoConfig`` fields, the package's outer optimizer defaults), compared with the HSDP rows.
DILOCO = {"diloco_h8": "DiLoCo H8 4b", "diloco_h32": "DiLoCo H32 4b",
          "streaming_h32_f2d1": "Streaming H32 F2 d1 4b",
          "streaming_h32_f4d6": "Streaming H32 F4 d6 4b",
          "streaming_h32_f2d12": "Streaming H32 F2 d12 4b"}
SCHEMES.update({label: (None, "diloco") for label in DILOCO})
DEFAULT_SCHEMES = "baseline,sdp4bit,zeropp,qsdp"
HSDP_SCHEMES = "hsdp,hsdp_baseline_thread,hsdp_sdp4bit,sdp4bit"
#: DiLoCo next to per-step HSDP in fp32 and with sdp4bit (issue 28)
DILOCO_SCHEMES = "hsdp,hsdp_sdp4bit,diloco_h8,diloco_h32,streaming_h32_f2d1"
#: what users run instead (issue 29): FSDP2 in fp32, bf16/fp32, bf16/bf16, then the presets
USER_SCHEMES = ("baseline,fsdp2_bf16,fsdp2_bf16_bf16,bf16,sdp4bit,lowbit,hsdp,hsdp_fsdp2_bf16,"
                "hsdp_fsdp2_bf16_bf16,hsdp_bf16,hsdp_sdp4bit,hsdp_lowbit")
#: the FSDP2 baselines each row's speedup is given against, per mesh
REFERENCES = {"flat": ("baseline", "fsdp2_bf16", "fsdp2_bf16_bf16"),
              "hsdp": ("hsdp", "hsdp_fsdp2_bf16", "hsdp_fsdp2_bf16_bf16")}
REFERENCES["diloco"] = REFERENCES["hsdp"]  # the per-step training DiLoCo replaces


def diloco_row(label: str):
    """A DiLoCo row's ``diloco.Row`` (``DILOCO``: ``diloco.py``'s row of that label); its
    ``config(seed)`` is the ``DiLoCoConfig`` the row runs."""
    import diloco

    return diloco.ROWS[DILOCO[label]]


def diloco_fields(label: str) -> dict:
    """The ``DiLoCoConfig`` fields a DiLoCo row sets."""
    return dict(diloco_row(label).diloco)


def _timed_window_ok(warmup: int, fields: dict) -> bool:
    """Whether no outer all-reduce launched in the warm-up is still to be merged when the timed
    steps start (its bytes would be split across the window's edge)."""
    period = fields["sync_every"] // fields.get("fragments", 1)
    delay = fields.get("delay", 0)
    return not any(t % period == 0 for t in range(max(1, warmup - delay + 1), warmup + 1))


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1gbit",
                    help="comma-separated tc rates, e.g. 100mbit,1gbit,10gbit (default 1gbit)")
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES,
                    help=f"comma-separated subset of {', '.join(SCHEMES)}; 'hsdp-set' = "
                         f"{HSDP_SCHEMES}; 'user-set' = {USER_SCHEMES}; 'diloco-set' = "
                         f"{DILOCO_SCHEMES}")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per per-step scheme")
    ap.add_argument("--diloco-steps", type=int, default=64,
                    help="timed steps per DiLoCo row: whole outer periods, a multiple of every "
                         "DiLoCo row's H (default 64: 2 outer steps at H=32, 8 at H=8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per scheme")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences per rank per step (1: the link, not this machine's CPU, "
                         "bounds the compressed schemes; see benchmarks/README.md)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grad-overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="quantized schemes reduce gradients on a background thread "
                         "(QCommConfig.grad_overlap; FSDP's own reduce-scatter cannot)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per link rate")
    ap.add_argument("--out", default=str(REPO / "results" / "cluster_speed"))
    ap.add_argument("--retable", default="", metavar="RESULTS_JSON",
                    help="run nothing: rewrite table.md next to this results.json from it")
    # internal: the per-rank worker that torchrun starts inside a namespace
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ifname", default="", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.schemes = [s.strip() for s in a.schemes.replace("hsdp-set", HSDP_SCHEMES)
                 .replace("user-set", USER_SCHEMES).replace("diloco-set", DILOCO_SCHEMES)
                 .split(",") if s.strip()]
    bad = [s for s in a.schemes if s not in SCHEMES]
    if bad:
        ap.error(f"unknown scheme(s) {bad}; choose from {list(SCHEMES)}")
    for label in (s for s in a.schemes if s in DILOCO):
        f = diloco_fields(label)
        if a.diloco_steps < f["sync_every"] or a.diloco_steps % f["sync_every"]:
            ap.error(f"--diloco-steps {a.diloco_steps}: {label} syncs every {f['sync_every']} "
                     "steps; time whole outer periods (a positive multiple of it)")
        if not _timed_window_ok(a.warmup, f):
            ap.error(f"--warmup {a.warmup}: {label}'s outer all-reduce launched in the warm-up "
                     "is merged inside the timed steps; pick another --warmup")
    a.rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    for r in a.rates:
        _rate_bps(r, ap.error)
    return a


def _rate_bps(rate: str, error=None) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        msg = f"link rate {rate!r} not understood; write it as tc does: 100mbit, 1gbit, 10gbit"
        if error:
            error(msg)
        raise ValueError(msg)
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


# ---------------------------------------------------------------------------------------------
# worker (one per rank, started by torchrun inside a namespace)
# ---------------------------------------------------------------------------------------------
def _veth_bytes(ifname: str) -> tuple[int, int]:
    base = Path("/sys/class/net") / ifname / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE))
    from _model import GPTShape, build_fsdp_gpt, hsdp_mesh
    from _timing import install

    import fsdp_qcomm
    from fsdp_qcomm.diloco import DiLoCo

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    rpn = int(os.environ["LOCAL_WORLD_SIZE"])
    totals = install()
    shape = GPTShape(a.vocab, a.dim, a.layers, a.heads, a.seq)
    results = {"params": shape.params(), "world": world, "ranks_per_node": rpn, "schemes": {}}
    for label in a.schemes:
        preset, layout = SCHEMES[label]
        handle = dl = None
        timed, period = a.steps, 1
        if layout == "diloco":  # one replica group per node, synced every H inner steps
            fields = diloco_fields(label)
            timed, period = a.diloco_steps, fields["sync_every"]
            mesh = hsdp_mesh(rpn)
            model = build_fsdp_gpt(shape, a.seed, mesh["shard"])
            dl = DiLoCo(model, diloco_row(label).config(a.seed), replicas=mesh)
        else:
            model = build_fsdp_gpt(shape, a.seed, hsdp_mesh(rpn) if layout == "hsdp" else None)
        # nodes emulated on one host: the node size must be explicit (topology)
        if isinstance(preset, dict) and "preset" in preset:  # a preset with overrides
            fields = {k: v for k, v in preset.items() if k != "preset"}
            cfg = fsdp_qcomm.QCommConfig.preset(preset["preset"], ranks_per_node=rpn,
                                                seed=a.seed, grad_overlap=a.grad_overlap,
                                                **fields)
            handle = fsdp_qcomm.enable(model, cfg)
        elif isinstance(preset, dict):  # an emulated FSDP2 baseline: its own grad_overlap
            cfg = fsdp_qcomm.QCommConfig(**preset, ranks_per_node=rpn, seed=a.seed)
            handle = fsdp_qcomm.enable(model, cfg)
        elif preset is not None:
            cfg = fsdp_qcomm.QCommConfig.preset(preset, ranks_per_node=rpn, seed=a.seed,
                                                grad_overlap=a.grad_overlap)
            handle = fsdp_qcomm.enable(model, cfg)
        # foreach: one multi-tensor kernel per Adam op; the CPU default (a Python loop over
        # parameters, each a DTensor dispatch) costs ~70 ms of CPU per rank and step here.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        g = torch.Generator().manual_seed(a.seed * 1000 + rank)
        steps, comm_in, comm_out, hook, comm_by, cpu = [], [], [], [], [], []
        before, pg0, outer0 = None, {}, 0
        for step in range(a.warmup + timed):
            if step == a.warmup:
                dist.barrier()
                before = _veth_bytes(a.ifname) if local == 0 else (0, 0)
                pg0 = dict(totals.bytes_outside)
                if handle is not None:
                    handle.reset_stats()
                if dl is not None:
                    dl.reset_stats()
                    outer0 = dl.outer_steps
            s0 = totals.snapshot()
            c0 = time.process_time()  # CPU seconds of all this rank's threads
            t0 = time.perf_counter()
            x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dl is not None:
                dl.step()  # launches and merges the outer all-reduces after this inner step
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            s1 = totals.snapshot()
            if step >= a.warmup:
                steps.append(dt)
                cpu.append(dc)
                comm_in.append(s1["comm_in_hook"] - s0["comm_in_hook"])
                comm_out.append(s1["comm_outside"] - s0["comm_outside"])
                hook.append(s1["hook"] - s0["hook"])
                comm_by.append({k: v - s0["comm_by"].get(k, 0.0)
                                for k, v in s1["comm_by"].items()})
        if dl is not None:
            # an all-reduce launched in the window and still in flight: its bytes are the
            # window's (merged here, untimed; none is, when the window is whole periods)
            dl.finish()
        dist.barrier()
        after = _veth_bytes(a.ifname) if local == 0 else (0, 0)
        if dl is not None:
            stats = {k: v for k, v in dl.stats().items() if k not in ("notes", "summary")}
        elif handle is not None:
            stats = {k: v for k, v in handle.stats().items() if k not in ("notes", "summary")}
        else:
            stats = None
        mine = {
            "rank": rank, "steps": steps, "comm_in_hook": comm_in, "comm_outside": comm_out,
            "hook": hook, "comm_by": comm_by, "cpu": cpu, "pg_bytes_outside": {
                k: v - pg0.get(k, 0) for k, v in totals.bytes_outside.items()
                if k in ("all_gather_single", "reduce_scatter_single", "all_to_all_single",
                         "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")},
            "veth_tx": after[0] - before[0], "veth_rx": after[1] - before[1],
            "stats": stats,
            "gather_modes": handle.gather_modes() if handle is not None else None,
            "outer_steps": None if dl is None else dl.outer_steps - outer0,
            "shard_numel": sum(p.to_local().numel() for p in model.parameters()),
            "numel": sum(p.numel() for p in model.parameters()),
        }
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            results["schemes"][label] = _summarize(everyone, timed, period)
            r = results["schemes"][label]
            if dl is not None:
                print(f"  {label}: H={period}, {r['outer_steps']} outer steps in {timed} timed "
                      f"steps, median inner step {r['median_inner_step_s']:.3f} s", flush=True)
            print(f"  {label}: median step {r['median_step_s']:.3f} s (comm "
                  f"{r['comm_s']:.3f}, quant {r['quant_s']:.3f}, rest {r['rest_s']:.3f}); link "
                  f"{r['link_bytes_per_step'] / 1e6:.2f} MB/step; CPU all ranks "
                  f"{r['cpu_all_ranks_s']:.3f} s; blocked in "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["comm_by_s"].items()), flush=True)
        if handle is not None:
            handle.disable()
        if dl is not None:
            dl.close()
        del model, opt
    if rank == 0:
        Path(a.json_out).write_text(json.dumps(results, indent=1))
    # Everyone leaves together: a rank still tearing down its gloo pairs while node 0's
    # torchrun (which hosts the store) exits aborts with "terminate called".
    dist.barrier()
    dist.destroy_process_group()


def _per_period(xs: list[float], period: int) -> list[float]:
    """Means of consecutive runs of ``period`` values (``period`` 1: the values themselves)."""
    return [statistics.fmean(xs[i:i + period]) for i in range(0, len(xs), period)]


def _summarize(ranks: list[dict], n: int, period: int = 1) -> dict:
    """One row from every rank's record of ``n`` timed steps. ``period``: a DiLoCo row's H
    (``n`` is a multiple of it): its per-step figures are medians over outer periods of the
    period's mean, so each counts its outer sync once, amortized over H steps (a median over
    single steps would leave the syncs out); per-step rows have ``period`` 1, a median over
    steps."""
    med = statistics.median
    # The step is as slow as its slowest rank: take the per-step max over ranks.
    step = [max(r["steps"][i] for r in ranks) for i in range(n)]
    per = lambda xs: med(_per_period(xs, period))  # noqa: E731
    mean = lambda key: statistics.fmean(per(r[key]) for r in ranks)  # noqa: E731
    comm_in, comm_out, hook = mean("comm_in_hook"), mean("comm_outside"), mean("hook")
    m = per(step)
    stats: dict = {}
    for r in ranks:
        for kind, v in (r["stats"] or {}).items():
            s = stats.setdefault(kind, {"calls": 0, "sent_bytes": 0, "recv_bytes": 0,
                                        "elements": 0, "baseline_bytes": 0,
                                        "cross_node_bytes": 0})
            for f in s:
                s[f] += v.get(f, 0)
    extra = {} if period == 1 else {
        "period_steps": period, "median_inner_step_s": med(step),
        "outer_steps": ranks[0].get("outer_steps")}
    return {
        "median_step_s": m, "step_s": step,
        "comm_s": comm_in + comm_out, "quant_s": hook - comm_in,
        "rest_s": max(0.0, statistics.fmean(per(r["steps"]) for r in ranks) - hook - comm_out),
        "link_bytes_per_step": sum(r["veth_tx"] for r in ranks) / n,
        # the link is full duplex: the busier direction bounds the time on it
        "link_busier_direction_bytes_per_step": max(r["veth_tx"] for r in ranks) / n,
        "link_rx_bytes_per_step": sum(r["veth_rx"] for r in ranks) / n,
        "stats_per_step_all_ranks": {k: {f: x / n for f, x in s.items()}
                                     for k, s in stats.items()},
        "pg_bytes_outside_per_step_all_ranks": {
            k: sum(r["pg_bytes_outside"].get(k, 0) for r in ranks) / n
            for k in sorted({k for r in ranks for k in r["pg_bytes_outside"]})},
        # CPU seconds all ranks spent per step (median), and that over the cores: a step cannot
        # be shorter than cpu_all_ranks_s / cores, whatever the link does.
        "cpu_all_ranks_s": sum(per(r["cpu"]) for r in ranks),
        "comm_by_s": {  # mean over ranks of each rank's median blocked time per collective
            k: statistics.fmean(per([c.get(k, 0.0) for c in r["comm_by"]]) for r in ranks)
            for k in sorted({k for r in ranks for c in r["comm_by"] for k in c})},
        "gather_modes": ranks[0]["gather_modes"],
        "numel": ranks[0]["numel"], "shard_numel": [r["shard_numel"] for r in ranks],
        **extra,
    }


# ---------------------------------------------------------------------------------------------
# orchestrator (root, on the host)
# ---------------------------------------------------------------------------------------------
class _Cluster:
    """Two namespaces and a shaped veth pair, named after this process, removed by ``close``."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"qc{tag}a", f"qc{tag}b")
        self.veth = (f"qcv{tag}a", f"qcv{tag}b")
        self.made: list[str] = []

    @staticmethod
    def _sh(*cmd: str) -> None:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")

    def up(self) -> None:
        for ns in self.ns:
            self._sh("ip", "netns", "add", ns)
            self.made.append(ns)
            self._sh("ip", "-n", ns, "link", "set", "lo", "up")
        self._sh("ip", "link", "add", self.veth[0], "netns", self.ns[0], "type", "veth",
                 "peer", "name", self.veth[1], "netns", self.ns[1])
        for ns, dev, addr in zip(self.ns, self.veth, (ADDR0, ADDR1)):
            self._sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            self._sh("ip", "-n", ns, "link", "set", dev, "up")

    def shape(self, rate: str) -> None:
        bps = _rate_bps(rate)
        # Bucket: at least 64 KiB (one GSO super-packet) and 4 ms of traffic at the rate.
        burst = max(64 * 1024, int(bps / 8 * 0.004))
        for ns, dev in zip(self.ns, self.veth):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev,
                            "root"], capture_output=True)
            self._sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", rate, "burst", str(burst), "latency", "100ms")

    def close(self) -> None:
        # Deleting a namespace deletes the veth end in it, and with it the pair and qdiscs.
        while self.made:
            ns = self.made.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _preflight() -> None:
    problems = []
    if os.geteuid() != 0:
        problems.append("it must run as root (it creates network namespaces): use sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` is not installed (iproute2)")
    if problems:
        sys.exit("cluster_speed.py cannot run here: " + "; ".join(problems))


def _run_rate(cl: _Cluster, a: argparse.Namespace, rate: str, json_out: Path) -> dict:
    cl.shape(rate)
    procs = []
    fwd = ["--schemes", ",".join(a.schemes), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--diloco-steps", str(a.diloco_steps),
           "--dim", str(a.dim), "--layers", str(a.layers), "--heads", str(a.heads),
           "--seq", str(a.seq), "--vocab", str(a.vocab), "--batch", str(a.batch),
           "--seed", str(a.seed), "--grad-overlap" if a.grad_overlap else "--no-grad-overlap"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    try:
        for node, (ns, dev) in enumerate(zip(cl.ns, cl.veth)):
            cmd = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}",
                   sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc_per_node", "2", "--node_rank", str(node), "--master_addr", ADDR0,
                   "--master_port", str(PORT), str(Path(__file__).resolve()), "--worker",
                   "--ifname", dev, "--json-out", str(json_out)] + fwd
            log = None if node == 0 else open(json_out.with_suffix(".node1.log"), "w")
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log,
                                          stderr=subprocess.STDOUT if log else None))
        deadline = time.monotonic() + a.timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {rate} run did not finish within {a.timeout:.0f} s")
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"a torchrun exited with {[p.poll() for p in procs]} at "
                                   f"{rate}; node 0's output is above, node 1's is in "
                                   f"{json_out.with_suffix('.node1.log')}")
            time.sleep(0.5)
    finally:
        for p in procs:  # only the process groups this script started
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"torchrun exit codes {[p.returncode for p in procs]} at {rate}")
    return json.loads(json_out.read_text())


def _tables(res: dict) -> str:
    out = []
    for rate, r in res["rates"].items():
        sch = r["schemes"]
        out.append(f"### link {rate}\n")
        out.append("| scheme | median step s | speedup vs FSDP2 fp32 / bf16-fp32 / bf16-bf16 | "
                   "comm s | quant s | compute+rest s | comm share | link MB/step | link bytes "
                   "vs FSDP2 fp32 / bf16-fp32 / bf16-bf16 | CPU s, all ranks | CPU floor s | "
                   "link floor s | floor s (larger) | step / floor |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        cores = res.get("cores") or 1
        for label, s in sch.items():
            # HSDP rows against FSDP2's own HSDP, flat rows against FSDP2's flat sharding, each
            # against the FSDP2 baselines this run measured (fp32, bf16/fp32, bf16/bf16)
            refs = [sch.get(k) for k in REFERENCES[SCHEMES[label][1]]]
            sp = " / ".join(f"{ref['median_step_s'] / s['median_step_s']:.2f}x" if ref else "-"
                            for ref in refs)
            ratio = " / ".join(f"{s['link_bytes_per_step'] / ref['link_bytes_per_step']:.3f}"
                               if ref and ref["link_bytes_per_step"] else "-" for ref in refs)
            share = s["comm_s"] / s["median_step_s"]
            cpu = s.get("cpu_all_ranks_s", float("nan"))
            busier = s.get("link_busier_direction_bytes_per_step", s["link_bytes_per_step"] / 2)
            link_s = 8 * busier / _rate_bps(rate)
            floor = max(cpu / cores, link_s)  # both are lower bounds; their sum is not
            name = label
            if "period_steps" in s:  # DiLoCo: its H, the syncs timed, the inner step alone
                name += (f" (H={s['period_steps']}, {s['outer_steps']} outer steps timed; "
                         f"median inner step {s['median_inner_step_s']:.3f} s)")
            out.append(f"| {name} | {s['median_step_s']:.3f} | {sp} | {s['comm_s']:.3f} | "
                       f"{s['quant_s']:.3f} | {s['rest_s']:.3f} | {100 * share:.0f}% | "
                       f"{s['link_bytes_per_step'] / 1e6:.2f} | {ratio} | {cpu:.3f} | "
                       f"{cpu / cores:.3f} | {link_s:.3f} | {floor:.3f} | "
                       f"{s['median_step_s'] / floor:.2f} |")
        out.append("")
    return "\n".join(out)


def _plot(res: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        print("matplotlib missing (pip install matplotlib): no plot", file=sys.stderr)
        return False
    rates = list(res["rates"])
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        sch = res["rates"][rate]["schemes"]
        labels = list(sch)
        parts = [("comm_s", "exposed communication"), ("quant_s", "quantization"),
                 ("rest_s", "compute + rest")]
        bottom = [0.0] * len(labels)
        for key, name in parts:
            vals = [sch[lab][key] for lab in labels]
            ax.bar(labels, vals, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(labels, [sch[lab]["median_step_s"] for lab in labels], color="k", zorder=3,
                   label="median step")
        ax.set(title=f"link {rate}", ylabel="seconds per step")
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['params'] / 1e6:.1f}M-param GPT, 2 nodes x 2 ranks, batch "
                 f"{res['args']['batch']}x{res['args']['seq']} per rank, fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _markdown(res: dict, retabled: bool = False) -> str:
    a = res["args"]
    return (f"# Step time on an emulated 2-node cluster (veth + tc tbf)\n\n"
            f"{res['params'] / 1e6:.2f}M-param GPT (dim {a['dim']}, {a['layers']} layers), fp32 "
            f"compute; the FSDP2 bf16-fp32 and bf16-bf16 rows send exactly the bytes FSDP2 sends "
            f"under MixedPrecisionPolicy(bf16, fp32 / bf16) (benchmarks/_baselines.py, "
            f"tests/test_cast.py) while computing in fp32, "
            f"batch {a['batch']}x{a['seq']} per rank, 2 nodes x 2 ranks (gloo), median of "
            f"{a['steps']} steps after {a['warmup']} warm-up; quantized schemes with "
            f"grad_overlap={a['grad_overlap']}; comm = exposed (blocked) communication of the "
            f"training thread, quant = hook time minus the communication inside hooks (with "
            f"grad_overlap the gradient codec runs on its own thread and is not counted); CPU "
            f"floor = CPU seconds of all ranks (all threads) per step over the {res['cores']} "
            f"cores they share; link floor = bytes per step of the link's busier direction over "
            f"the link rate; floor = the larger of the two, a lower bound on the step (CPU work "
            f"and transfers overlap, so their sum is not one)."
            + (f" DiLoCo rows (one replica group per node, synced every H inner steps; "
               f"{a.get('diloco_steps')} timed steps after the same warm-up, whole outer "
               f"periods): each per-step figure is the median over outer periods of the "
               f"period's mean, so the outer sync is counted once per H steps; their speedup and "
               f"link bytes are against the HSDP baselines; quant = time in the outer "
               f"all-reduce minus its blocked communication (on the training thread only: "
               f"Streaming DiLoCo's runs on its overlap thread)."
               if any("period_steps" in s for r in res["rates"].values()
                      for s in r["schemes"].values()) else "")
            + (" Tables rewritten from results.json by `--retable` after the run; every "
               "measured value is the run's." if retabled else "")
            + f"\n\n{_tables(res)}\n"
            f"Wall time: {res['wall_seconds'] / 60:.1f} min.\n")


def _retable(path: Path) -> int:
    res = json.loads(path.read_text())
    _provenance.record(path.parent)
    md = _markdown(res, retabled=True)
    (path.parent / "table.md").write_text(md)
    print(md)
    print(f"written: {path.parent}/table.md (from {path})")
    return 0


def main(argv=None) -> int:
    a = _args(argv)
    if a.worker:
        _worker(a)
        return 0
    if a.retable:
        return _retable(Path(a.retable))
    _preflight()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _provenance.record(out, argv=None if argv is None else [__file__, *argv])
    cl = _Cluster()
    atexit.register(cl.close)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit("cluster_speed.py: stopped by signal"))
    t0 = time.perf_counter()
    # CPU floor = the ranks' CPU seconds over the cores they share: no step can be shorter.
    res: dict = {"rates": {}, "cores": len(os.sched_getaffinity(0))}
    try:
        cl.up()
        for rate in a.rates:
            print(f"link {rate}: {', '.join(a.schemes)} ({a.warmup}+{a.steps} steps each)",
                  flush=True)
            r = _run_rate(cl, a, rate, out / f"raw_{rate}.json")
            res["params"] = r["params"]
            res["rates"][rate] = r
    finally:
        cl.close()
    res["wall_seconds"] = time.perf_counter() - t0
    res["args"] = {k: v for k, v in vars(a).items()
                   if k not in ("worker", "ifname", "json_out", "retable")}
    md = _markdown(res)
    (out / "table.md").write_text(md)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    plotted = _plot(res, out / "breakdown.png")
    print("\n" + md)
    print(f"written: {out}/table.md, results.json" + (", breakdown.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
