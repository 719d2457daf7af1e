"""Small-scale reproduction of SDP4Bit Table 1: final validation loss per quantization scheme.

Trains the same small character-level GPT (``_model.GPT``) with the same seed, initial weights
and batches under each scheme, on 4 gloo ranks arranged as 2 nodes x 2 (``ranks_per_node=2``, so
the two-level gradient schemes really take an intra-node and an inter-node hop), with plain
FSDP2 and ``fsdp_qcomm.enable``. "baseline" is FSDP2 with its own collectives (no hooks).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/accuracy.py [--data PATH] [--steps N]
        [--seeds N] [--schemes A,B] [--out DIR] [--fresh] [--report-only] ...

``--seeds N`` trains every scheme under seeds ``--seed``, ``--seed + 1``, ... (the seed fixes
the initial weights, the batches and the quantizers' random bits) and reports the mean and
standard deviation of the final validation loss per scheme and the gap to the baseline paired
by seed, with its 95% interval and a verdict: "within +0.5%" (upper bound at most +0.5%),
"worse" (lower bound above 0) or "undecided" (``_seeds.verdict``, ``docs/accuracy_method.md``).
Every (scheme, seed) run is stored as soon as it finishes (``DIR/runs/``, ``_seeds.RunStore``):
an interrupted sweep resumes where it stopped, and a long sweep can be split by scheme or seed
over several invocations with the same ``--out`` (``--report-only`` rebuilds the table from
what is stored). Writes ``DIR/{table.md, loss_curves.png, results.json}`` and prints the table.
Expected shape of the result (the paper's): SDP4Bit within ~0.5% of baseline, qW (direct
4-bit weights) clearly worse, TLq-HS no worse than TLq.

Rows are ``SCHEMES`` entries: a label, a ``QCommConfig`` preset (None: FSDP's own collectives),
field overrides and the mesh (``hsdp=True``: shard inside a node, replicate across nodes,
``_model.hsdp_mesh``). Adding a row is one line, e.g.
``"SDP4Bit HSDP 2x2": Scheme("sdp4bit", hsdp=True)``.

``--experts E --expert-parallel P`` trains the mixture-of-experts flavour of the model
(``_model``: E experts per rank in every block; with P > 1 the rank in position e of each group
of P holds expert set e, sharded over the ranks of that set, the dense weights over all ranks).
Each rank evaluates with its own experts and every score is the mean over the ranks, so each
expert set counts equally. Every hooked run records the bytes per training step of each kind of
traffic, dense and expert groups apart (``traffic``); ``DIR/bytes.md`` tabulates them for MoE
stores (``write_traffic``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's fsdp_qcomm
sys.path.insert(0, str(HERE))

import _provenance  # noqa: E402
from _plotting import pyplot  # noqa: E402
from _seeds import (  # noqa: E402
    RunStore,
    SetupMismatch,
    fmt_interval,
    fmt_spread,
    paired_gap_pct,
    seed_list,
    spread,
    verdict,
)


@dataclass(frozen=True)
class Scheme:
    """One row: a ``QCommConfig`` preset (None: FSDP's own collectives, no hooks), extra
    ``QCommConfig`` fields, and the mesh (``hsdp``: shard inside a node, replicate across
    nodes; else plain FSDP over all ranks)."""

    preset: Optional[str]
    overrides: dict[str, Any] = field(default_factory=dict)
    hsdp: bool = False

    def describe(self) -> str:
        text = self.preset or "(FSDP default)"
        if self.overrides:
            text += " " + ", ".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))
        if self.hsdp:
            text += ", HSDP"
        return text


#: row label (as in the paper's table) -> Scheme
SCHEMES: dict[str, Scheme] = {
    "baseline": Scheme(None),
    "qW": Scheme("qw4"),
    "qWD": Scheme("qwd"),
    "TLq": Scheme("tlq"),
    "TLq-HS": Scheme("tlq_hs"),
    "SDP4Bit": Scheme("sdp4bit"),
    "QSDP (8/8)": Scheme("qsdp"),
    "ZeRO++": Scheme("zeropp"),
    # Multi-node HSDP: shard inside a node, replicate across nodes (4-bit replica all-reduce)
    "SDP4Bit HSDP 2x2": Scheme("sdp4bit", hsdp=True),
}
BASELINE = "baseline"

# arguments that change what a run computes: runs stored under other values are refused
_SETUP_ARGS = ("steps", "dim", "layers", "heads", "seq", "batch", "lr", "warmup", "eval_every",
               "eval_batches", "val_seed", "world", "ranks_per_node")
# added later: part of the setup only when not at their default, so stores made before they
# existed stay valid
_SETUP_ARGS_NEW = {"fix": [], "eval_full": False, "full_last": 0, "lr_final": 0.1, "bpe": 0,
                   "experts": 0, "expert_parallel": 1}
#: the parts of a run that its seed sets, each of which ``--fix`` can hold at ``--seed``
SEED_PARTS = ("init", "data", "quant")


def add_scoring_args(ap: argparse.ArgumentParser) -> None:
    """The evaluation and scoring options (``--eval-full``, ``--full-last``,
    ``--scored-evals-only``, ``--tail``), shared with ``diloco.py``; ``check_scoring_args``
    checks them after parsing."""
    ap.add_argument("--eval-full", action="store_true",
                    help="also evaluate on the whole held-out split (non-overlapping windows) "
                         "at every evaluation (the last --full-last ones); the table then "
                         "scores runs on it")
    ap.add_argument("--full-last", type=int, default=0, metavar="N",
                    help="with --eval-full: only the last N evaluations use the whole split "
                         "(0: all); it costs about 20 training steps of the default model")
    ap.add_argument("--scored-evals-only", action="store_true",
                    help="with --eval-full --full-last N: evaluate only at the last N "
                         "evaluation steps, the ones the score reads; the sampled evaluations "
                         "in between draw the loss curve only, and leaving them out changes no "
                         "bit of the training (tests/test_benchmarks.py), so runs with and "
                         "without share a store")
    ap.add_argument("--tail", type=int, default=1,
                    help="score of a run: the mean of its last TAIL evaluations (1: the final "
                         "one); a report setting, not stored with the runs")


def check_scoring_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse combinations of ``add_scoring_args``'s options that cannot be meant."""
    if a.tail < 1:
        ap.error(f"--tail {a.tail} must be >= 1")
    if a.full_last and not a.eval_full:
        ap.error("--full-last needs --eval-full")
    if a.scored_evals_only and not (a.eval_full and a.full_last):
        ap.error("--scored-evals-only needs --eval-full and --full-last N (the evaluations "
                 "the score reads)")


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="text or JSONL file (default: tinyshakespeare)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=8, help="validation batches per rank")
    ap.add_argument("--seed", type=int, default=1234, help="first seed")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per scheme: --seed, --seed+1, ...")
    ap.add_argument("--val-seed", type=int, default=1234,
                    help="picks the held-out batches, the same for every scheme and seed")
    ap.add_argument("--fix", default="",
                    help="comma-separated parts of a run held at --seed for every seed, the "
                         "others following the run's seed: " + ", ".join(SEED_PARTS) +
                         " (initial weights, training batches, the quantizers' random bits); "
                         "for variance experiments")
    add_scoring_args(ap)
    ap.add_argument("--lr-final", type=float, default=0.1,
                    help="the cosine schedule ends at this fraction of --lr")
    ap.add_argument("--bpe", type=int, default=0, metavar="VOCAB",
                    help="train on the main job's BPE corpus (fsdp_qcomm.titan_common.data, "
                         "tokenizer of vocabulary VOCAB, e.g. 8192) instead of --data's "
                         "characters")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--experts", type=int, default=0, metavar="E",
                    help="mixture of experts: E experts per rank in every block, top-2 routed, "
                         "hidden 4*dim/E each (0: the dense MLP)")
    ap.add_argument("--expert-parallel", type=int, default=1, metavar="P",
                    help="with --experts: P expert sets, set e on the ranks in position e of "
                         "each group of P inside a node, sharded over those ranks (their own "
                         "FSDP mesh); P must divide --ranks-per-node")
    ap.add_argument("--schemes", default=None,
                    help="comma-separated subset of: " + ", ".join(SCHEMES) + " (default: all; "
                         "with --expert-parallel, all but the HSDP rows)")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "accuracy"))
    ap.add_argument("--fresh", action="store_true",
                    help="recompute the requested runs even if --out holds them")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: rebuild the table from the runs stored in --out")
    a = ap.parse_args(argv)
    if a.schemes is None:
        a.schemes = ",".join(k for k, v in SCHEMES.items() if not (v.hsdp
                                                                  and a.expert_parallel > 1))
    a.schemes = [s.strip() for s in a.schemes.split(",") if s.strip()]
    bad = [s for s in a.schemes if s not in SCHEMES]
    if bad:
        ap.error(f"unknown scheme(s) {bad}; choose from {list(SCHEMES)}")
    if a.world % a.ranks_per_node:
        ap.error(f"--world {a.world} is not a multiple of --ranks-per-node {a.ranks_per_node}")
    if a.seeds < 1:
        ap.error(f"--seeds {a.seeds} must be >= 1")
    check_scoring_args(ap, a)
    a.fix = sorted({x.strip() for x in a.fix.split(",") if x.strip()})
    if set(a.fix) - set(SEED_PARTS):
        ap.error(f"--fix {a.fix}: choose from {', '.join(SEED_PARTS)}")
    if a.bpe and a.data:
        ap.error("--bpe and --data exclude each other")
    _check_experts(ap, a)
    return a


def _check_experts(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The MoE options make a model and a layout that exist, before any rank starts."""
    if a.experts < 0 or a.expert_parallel < 1:
        ap.error(f"--experts {a.experts} must be >= 0 and --expert-parallel "
                 f"{a.expert_parallel} >= 1")
    if a.experts and (4 * a.dim) % a.experts:
        ap.error(f"--experts {a.experts} must divide 4 * --dim = {4 * a.dim} (each expert's "
                 "hidden width)")
    if a.expert_parallel > 1:
        if not a.experts:
            ap.error("--expert-parallel needs --experts")
        from _model import check_expert_layout

        try:
            check_expert_layout(a.world, a.ranks_per_node, a.expert_parallel)
        except ValueError as e:
            ap.error(str(e))
        hsdp = [s for s in a.schemes if SCHEMES[s].hsdp]
        if hsdp:
            ap.error(f"rows {hsdp} use an HSDP mesh, which --expert-parallel does not combine "
                     "with (the dense weights shard over every rank)")


def shape_of(a: argparse.Namespace, vocab: int):
    """The run's model shape (``_model.GPTShape``)."""
    from _model import GPTShape

    return GPTShape(vocab, a.dim, a.layers, a.heads, a.seq, experts=a.experts,
                    expert_parallel=a.expert_parallel)


def load_data(a: argparse.Namespace):
    """The run's dataset: the BPE corpus with ``--bpe``, else ``--data``'s characters."""
    from _model import BPEData, CharData

    return BPEData(a.bpe) if a.bpe else CharData(a.data)


def seeds_of(a: argparse.Namespace, seed: int) -> dict[str, int]:
    """The seeds of a run's parts: the run's seed, or ``--seed`` for the parts in ``--fix``."""
    return {part: a.seed if part in a.fix else seed for part in SEED_PARTS}


def _setup(a: argparse.Namespace) -> dict[str, Any]:
    data = load_data(a)  # fails here, with the message, before spawning ranks
    out = {k: getattr(a, k) for k in _SETUP_ARGS}
    out.update({k: getattr(a, k) for k, v in _SETUP_ARGS_NEW.items() if getattr(a, k) != v})
    out["data"] = data.digest()
    return out


def _lr(step: int, a: argparse.Namespace) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = (step - a.warmup) / max(1, a.steps - a.warmup)
    lo = a.lr_final
    return a.lr * (lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * frac)))


def _val_loss(model, data, a, rank: int, shape) -> float:
    """Mean loss on ``eval_batches`` held-out batches per rank, the same batches for every
    scheme and seed (``--val-seed``): seeds vary the training, not the yardstick. The mean is
    over every rank: with experts, each rank's own expert set, every set on as many ranks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    total = torch.zeros(1)
    with torch.no_grad():
        for i in range(a.eval_batches):
            x, y = data.batch("val", a.batch, shape.seq, a.val_seed, i, rank)
            logits = model(x)
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten())
    dist.all_reduce(total)
    return total.item() / (a.eval_batches * dist.get_world_size())


def _evals_left(step: int, a: argparse.Namespace) -> int:
    """How many evaluations come after the one at ``step``."""
    later = range(step + 1, a.steps + 1)
    return sum(1 for s in later if s % a.eval_every == 0 or s == a.steps)


def _full_val_loss(model, data, a, rank: int, world: int, seq: int, expert_sets: int = 1):
    """Mean loss over every non-overlapping window of the held-out split, and the per-window
    losses (the same tensor on every rank). Rank r takes windows r, r + world, ...; with
    ``expert_sets`` P > 1 (expert parallelism: rank r holds set r % P) every set evaluates the
    whole split, over its world / P ranks, and both are means over the sets (each on as many
    ranks): the model of every rank scored on every window."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    n = data.val_windows(seq)
    members = world // expert_sets
    per = torch.zeros(expert_sets, n, dtype=torch.float64)
    mine = list(range(rank // expert_sets, n, members))
    step = 64
    with torch.no_grad():
        for i in range(0, -(-n // members), step):
            # every rank runs the same number of forwards (FSDP gathers are collective)
            idx = mine[i:i + step] or [0]
            x, y = data.val_window(idx, seq)
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            if mine[i:i + step]:
                per[rank % expert_sets, idx] = loss.view(len(idx), seq).mean(1).double()
    dist.all_reduce(per)
    if expert_sets == 1:  # the dense runs' computation, bit for bit
        return per[0].mean().item(), per[0]
    return per.mean().item(), per.mean(0)


def _evaluates(step: int, a: argparse.Namespace) -> tuple[bool, bool]:
    """(sampled, whole split): which evaluations run after ``step`` steps."""
    at = step % a.eval_every == 0 or step == a.steps
    full = at and a.eval_full and (not a.full_last or _evals_left(step, a) < a.full_last)
    return (full if a.scored_evals_only else at), full


class Evaluations:
    """A run's evaluations after its training steps (``_evaluates``: the sampled held-out
    batches and the whole held-out split), their curves, and their seconds added to ``timing``
    (``eval_sampled_s``, ``eval_full_s``). ``diloco.py`` runs them on the weights the replicas
    share."""

    def __init__(self, a: argparse.Namespace, data, shape, rank: int, world: int,
                 timing: dict[str, float]) -> None:
        self.a, self.data, self.shape, self.rank, self.world = a, data, shape, rank, world
        self.timing = timing
        self.val: list = []
        self.full: list = []
        self.windows = None
        # expert parallelism: every expert set scores the whole split (_full_val_loss)
        self.expert_sets = shape.expert_parallel if getattr(shape, "experts", 0) else 1

    def due(self, step: int) -> bool:
        """Whether any evaluation runs after ``step`` steps."""
        return any(_evaluates(step, self.a))

    def run(self, step: int, model) -> str:
        """The evaluations due after ``step`` steps; returns their part of the log line."""
        sampled, whole = _evaluates(step, self.a)
        t2 = time.perf_counter()
        if sampled:
            self.val.append((step, _val_loss(model, self.data, self.a, self.rank, self.shape)))
        t3 = time.perf_counter()
        self.timing["eval_sampled_s"] += t3 - t2
        text = f" val {self.val[-1][1]:.4f}" if self.val else ""
        if whole:
            loss_full, self.windows = _full_val_loss(model, self.data, self.a, self.rank,
                                                     self.world, self.shape.seq,
                                                     self.expert_sets)
            self.full.append((step, loss_full))
            text += f" full {loss_full:.4f}"
        self.timing["eval_full_s"] += time.perf_counter() - t3
        return text

    def record(self) -> dict[str, Any]:
        """A run record's evaluation fields: ``val``, ``final_val`` and, with ``--eval-full``,
        ``val_full`` and the last whole-split evaluation's loss per held-out window (what the
        eval-set-size experiment resamples: results/accuracy_variance)."""
        rec: dict[str, Any] = {"val": self.val, "final_val": self.val[-1][1]}
        if self.a.eval_full:
            rec.update(val_full=self.full,
                       val_full_windows=[round(v, 5) for v in self.windows.tolist()])
        return rec


def _train_one(rank: int, world: int, a: argparse.Namespace, data, shape, label: str,
               seed: int) -> dict:
    """One scheme under one seed, from the seed's initial weights and batches. ``timing``
    splits its wall time: building the model and installing the hooks, the training steps, the
    sampled and the whole-split evaluations."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from _model import build_fsdp_gpt, hsdp_mesh

    import fsdp_qcomm

    row = getattr(a, "row_defs", SCHEMES)[label]  # rows added by other scripts travel in a
    seeds = seeds_of(a, seed)
    t0 = time.perf_counter()
    timing = {"setup_s": 0.0, "train_s": 0.0, "eval_sampled_s": 0.0, "eval_full_s": 0.0}
    model = build_fsdp_gpt(shape, seeds["init"],
                           hsdp_mesh(a.ranks_per_node) if row.hsdp else None,
                           ranks_per_node=a.ranks_per_node)
    handle = traffic = None
    if row.preset is not None:
        cfg = fsdp_qcomm.QCommConfig.preset(
            row.preset, ranks_per_node=a.ranks_per_node, seed=seeds["quant"], **row.overrides
        )
        handle = fsdp_qcomm.enable(model, cfg)
        traffic = StepTraffic(handle)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    train_curve = []
    evals = Evaluations(a, data, shape, rank, world, timing)
    timing["setup_s"] = time.perf_counter() - t0
    for step in range(a.steps):
        t1 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = _lr(step, a)
        x, y = data.batch("train", a.batch, a.seq, seeds["data"], step, rank)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        train_curve.append(lt.item() / world)
        if traffic is not None:
            traffic.step_done()
        timing["train_s"] += time.perf_counter() - t1
        if evals.due(step + 1):
            if traffic is not None:
                traffic.evaluated()
            shown = evals.run(step + 1, model)
            if rank == 0:
                print(f"  [{label} seed {seed}] step {step + 1}/{a.steps}: train "
                      f"{train_curve[-1]:.4f}{shown} ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
    rec = {"train": train_curve, **evals.record(), "seconds": time.perf_counter() - t0,
           "seeds": seeds, "timing": {k: round(v, 2) for k, v in timing.items()}}
    if handle is not None:
        rec["stats"] = {k: v for k, v in handle.stats().items() if k != "notes"}
        rec["gather_modes"] = handle.gather_modes()
        rec["traffic"] = traffic.record()
        handle.disable()
    return rec


# ---- bytes per training step, per kind of traffic ------------------------------------------------
#: what the traffic record calls the parameter groups: those on the model's own mesh, and the
#: stats tag of the MoE experts' mesh (``_model.EXPERT_DIM``); a group on another mesh keeps its tag
GROUPS = {"": "dense", "edp": "expert"}
#: the record's kinds of traffic, by ``comm_stats`` collective: the weight gather, the second hop
#: of a node-sharded qWD reference's gather (fp32 slices inside a node; FSDP2 has no such hop),
#: the gradient reduction (HSDP's replica all-reduce included), and what none is (agreement
#: codes, level tables)
TRAFFIC_KINDS = {"weight": "weight", "weight_intra": "weight_intra", "grad": "grad",
                 "replica": "grad"}


def _counters(handle) -> dict[str, dict[str, int]]:
    """The integer counters of ``handle.stats()``, per stats kind."""
    from fsdp_qcomm.titan_common.comm_stats import NOT_KINDS

    return {kind: {f: v for f, v in entry.items() if type(v) is int}
            for kind, entry in handle.stats().items() if kind not in NOT_KINDS}


class StepTraffic:
    """The handle's counters summed over the training steps that follow no evaluation. An
    evaluation's forwards gather too, and under qWD they send the weight change the next
    training forward would have sent, so the evaluations and the step right after each are left
    out: what is left is what a training step costs."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.last = _counters(handle)
        self.clean = True
        self.steps = 0
        self.total: dict[str, dict[str, int]] = {}

    def step_done(self) -> None:
        now = _counters(self.handle)
        if self.clean:
            for kind, fields in now.items():
                mine, before = self.total.setdefault(kind, {}), self.last.get(kind, {})
                for f, v in fields.items():
                    mine[f] = mine.get(f, 0) + v - before.get(f, 0)
            self.steps += 1
        self.last, self.clean = now, True

    def evaluated(self) -> None:
        self.clean = False

    def record(self) -> dict[str, Any]:
        """``{"steps": n, GROUP: {KIND: {"sent", "baseline", "cross_node"}}}``: bytes per
        counted step this rank handed to the process group, what FSDP2's own collective would
        have been handed for the same calls (fp32 here: ``baseline_bytes``), and the bytes sent
        to other nodes. Groups: ``GROUPS``; kinds: ``TRAFFIC_KINDS``, else ``other``."""
        from fsdp_qcomm.titan_common.comm_stats import collective_named, split_stats

        out: dict[str, Any] = {"steps": self.steps}
        for name, c in split_stats(self.total).items():
            if name.startswith("kind:"):
                continue
            base, _, tag = name.partition(":")
            kind = out.setdefault(GROUPS.get(tag, tag), {}).setdefault(
                TRAFFIC_KINDS.get(base, "other"), {"sent": 0.0, "baseline": 0.0,
                                                   "cross_node": 0.0})
            per = 1 / max(1, self.steps)
            kind["sent"] += c.get("sent", 0.0) * per
            kind["cross_node"] += c.get("cross_node_bytes", 0.0) * per
            if collective_named(name).counts_baseline:
                kind["baseline"] += c.get("baseline", 0.0) * per
        return out


def _train_all(rank: int, world: int, a: argparse.Namespace, store: RunStore,
               todo: list) -> None:
    """Runs on every rank: each pending (scheme, seed) in turn; rank 0 stores each result as
    soon as it is done, so an interrupted sweep loses at most the run in progress."""
    data = load_data(a)
    shape = shape_of(a, data.vocab)
    done: dict[tuple, dict] = {}
    for label, seed in todo:
        key = _effective(a, label, seed)
        if key in done:  # the same computation as a run already made: not trained again
            rec = dict(done[key], same_as_seed=done[key].get("same_as_seed", done[key]["_seed"]))
        else:
            clock = _provenance.RunClock() if rank == 0 else None
            rec = _train_one(rank, world, a, data, shape, label, seed)
            rec["_seed"] = seed
            if clock is not None:
                rec["provenance"] = clock.done()
            done[key] = rec
        rec = {k: v for k, v in rec.items() if k != "_seed"}
        rec["params"], rec["vocab"] = shape.params(), data.vocab
        if shape.experts:
            rec["params_all_experts"] = shape.params_all_experts()
        if rank == 0:
            store.save(label, seed, _row(label, getattr(a, "row_defs", None)), rec)
            left = len(todo) - todo.index((label, seed)) - 1
            print(f"{label} seed {seed}: final val loss {rec['final_val']:.5f}"
                  + (f", full {rec['val_full'][-1][1]:.5f}" if "val_full" in rec else "")
                  + (f" (same computation as seed {rec['same_as_seed']})"
                     if "same_as_seed" in rec else f" in {rec['seconds']:.0f} s")
                  + f"; {left} run(s) left, about {left * rec['seconds'] / 60:.0f} min",
                  flush=True)


#: the rows of the bytes table: (group, kind of traffic) -> label
TRAFFIC_ROWS = {("dense", "weight"): "dense weight gather",
                ("dense", "grad"): "dense gradient reduction",
                ("expert", "weight"): "expert weight gather",
                ("expert", "grad"): "expert gradient reduction"}
#: labels of the kinds beyond TRAFFIC_ROWS' (after the group's name)
_KIND_LABELS = {"weight_intra": "weight gather's hop inside a node (fp32 slices of the "
                                "node-sharded qWD reference)",
                "other": "other (agreement codes, level tables)"}
_EMPTY = {"sent": 0.0, "baseline": 0.0, "cross_node": 0.0}


def _traffic_mean(runs: dict[int, dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (group, kind): the mean over a row's runs of their bytes per step."""
    recs = [r["traffic"] for r in runs.values() if "traffic" in r]
    out: dict[tuple[str, str], dict[str, float]] = {}
    for t in recs:
        for group, kinds in t.items():
            if group == "steps":
                continue
            for kind, v in kinds.items():
                mine = out.setdefault((group, kind), dict(_EMPTY))
                for f in mine:
                    mine[f] += v[f] / len(recs)
    return out


def _fsdp2_cross(a: argparse.Namespace, row: Scheme, group: str, kind: str,
                 baseline: float) -> float:
    """What FSDP2's own fp32 collective sends to other nodes, by the library's convention (a
    gather sends the shard to each remote member, a reduce-scatter the remote members' rows),
    for rank 0 of a flat layout (the dense group: every rank; the expert group: rank 0's set,
    ``_model.expert_groups``). NaN where that does not apply (HSDP, another group)."""
    from _model import expert_groups

    if row.hsdp or group not in ("dense", "expert"):
        return float("nan")
    ranks = (list(range(a.world)) if group == "dense"
             else expert_groups(a.world, a.ranks_per_node, a.expert_parallel)[0])
    remote = sum(1 for r in ranks if r // a.ranks_per_node != 0)
    if kind == "weight":
        return baseline * remote
    return baseline * remote / len(ranks) if kind == "grad" else 0.0


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.3f}" if base else "-"


def traffic_table(a: argparse.Namespace, label: str, row: Scheme,
                  runs: dict[int, dict[str, Any]]) -> str:
    """One hooked row's bytes per training step and rank, per kind of traffic, against FSDP2's
    fp32 collectives for the same calls (``StepTraffic.record``)."""
    mean = _traffic_mean(runs)
    lines = [f"| traffic | FSDP2 fp32 bytes/step | {label} bytes/step | ratio | FSDP2 fp32 "
             f"node-crossing | {label} node-crossing | ratio |", "|---|---|---|---|---|---|---|"]
    rows = dict(TRAFFIC_ROWS)
    rows.update({k: f"{k[0]} {_KIND_LABELS.get(k[1], k[1])}" for k in sorted(mean)
                 if k not in rows})
    total = dict(_EMPTY, fsdp2_cross=0.0)
    for key, name in rows.items():
        v = mean.get(key, _EMPTY)
        cross = _fsdp2_cross(a, row, *key, v["baseline"])
        for f in _EMPTY:
            total[f] += v[f]
        total["fsdp2_cross"] += cross
        lines.append(_traffic_line(name, v, cross))
    lines.append(_traffic_line("**total**", total, total["fsdp2_cross"]))
    return "\n".join(lines)


def _traffic_line(name: str, v: dict[str, float], fsdp2_cross: float) -> str:
    known = fsdp2_cross == fsdp2_cross  # NaN: no convention for this layout
    return (f"| {name} | {v['baseline']:,.0f} | {v['sent']:,.0f} | "
            f"{_ratio(v['sent'], v['baseline'])} | "
            f"{f'{fsdp2_cross:,.0f}' if known else '-'} | {v['cross_node']:,.0f} | "
            f"{_ratio(v['cross_node'], fsdp2_cross) if known else '-'} |")


def traffic_md(a: argparse.Namespace, stored: dict[str, Any]) -> Optional[str]:
    """The bytes tables of every stored row whose runs carry ``traffic``, with the setup
    paragraph of ``describe_setup``; None when none does."""
    hooked = {label: e for label, e in stored.items()
              if any("traffic" in r for r in e["runs"].values())}
    if not hooked:
        return None
    first = next(iter(next(iter(stored.values()))["runs"].values()))
    parts = [f"# Bytes per training step and rank, by kind of traffic\n\n"
             f"{describe_setup(a, first)}\n"]
    for label, e in hooked.items():
        runs, row = e["runs"], scheme_of(e["row"])
        steps = [r["traffic"]["steps"] for r in runs.values() if "traffic" in r]
        counted = f"{min(steps)}" if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}"
        parts.append(f"## {label} ({row.describe()}), mean of {len(steps)} run(s), "
                     f"{counted} steps counted each\n\n"
                     f"{traffic_table(a, label, row, runs)}\n")
    parts.append(
        "Rank 0's counters (the ranks of a group send alike), per training step, counting the "
        "steps that follow no evaluation (an evaluation's forwards gather too; under qWD they "
        "send the weight change the next training forward would have). Bytes/step: what the "
        "hooks hand to the process group (a gather's input, a reduce-scatter's rows); "
        "node-crossing: the part addressed to other nodes, what the slow link carries. "
        "FSDP2 fp32: what FSDP2's own collective is handed for the same calls (the hooks' "
        "`baseline_bytes`); the baseline row runs FSDP2's collectives without hooks, so it "
        "counts nothing itself. FSDP2's node-crossing bytes by the library's convention (a "
        "gather sends the shard to each remote member of its group, a reduce-scatter the remote "
        "members' rows). Dense groups shard over all ranks; expert groups over the ranks of one "
        "expert set (`_model.expert_groups`).\n")
    return "\n".join(parts)


def write_traffic(a: argparse.Namespace, store: RunStore) -> Optional[str]:
    """``DIR/bytes.md`` for an MoE store (``traffic_md``); returns it (None: not written)."""
    if not a.experts:
        return None
    md = traffic_md(a, store.all())
    if md is not None:
        (Path(a.out) / "bytes.md").write_text(md)
    return md


def _effective(a: argparse.Namespace, label: str, seed: int) -> tuple:
    """What a (row, seed) run computes: with ``--fix init,data`` an unquantized row's runs are
    one computation whatever their seed (its quantizer seed does nothing)."""
    row = getattr(a, "row_defs", SCHEMES)[label]
    s = seeds_of(a, seed)
    return (label, s["init"], s["data"], s["quant"] if row.preset is not None else None)


def scheme_of(row: dict[str, Any]) -> Scheme:
    """The Scheme of a stored row definition (``_row``)."""
    return Scheme(**{k: v for k, v in row.items() if k != "config"})


def _row(label: str, defs: Optional[dict[str, Scheme]] = None) -> dict[str, Any]:
    """A row's definition as stored with its runs: the Scheme and, for fsdp_qcomm rows, the
    resolved QCommConfig, so a changed preset cannot pass for the stored one."""
    s = (defs or SCHEMES)[label]
    row = asdict(s)
    if s.preset is not None:
        from fsdp_qcomm import QCommConfig

        # the fields that differ from the defaults: a field added later (with a default that
        # keeps the old behaviour) does not make stored runs look different
        default = QCommConfig().to_dict()
        row["config"] = {k: v for k, v in QCommConfig.preset(s.preset, **s.overrides)
                         .to_dict().items() if v != default.get(k)}
    return row


def score(rec: dict[str, Any], tail: int = 1, full: Optional[bool] = None) -> float:
    """A run's score: the mean of its last ``tail`` evaluations, on the whole held-out split
    when the run has it (``full=None``) or when ``full`` asks for it, else on the sampled
    validation batches. ``tail=1`` on sampled batches is ``final_val``."""
    use_full = ("val_full" in rec) if full is None else full
    curve = rec["val_full"] if use_full else rec["val"]
    if len(curve) < tail:
        raise ValueError(f"a run has {len(curve)} evaluations, fewer than --tail {tail}")
    return sum(v for _, v in curve[-tail:]) / tail


def score_name(tail: int, full: bool) -> str:
    where = "the whole held-out split" if full else "the sampled validation batches"
    what = "final validation loss" if tail == 1 else f"mean of the last {tail} evaluations"
    return f"{what} on {where}"


def _summary(stored: dict[str, dict[str, Any]], tail: int = 1) -> dict[str, Any]:
    """Per row: seeds, scores (``score``), their spread, and the gap to the baseline paired by
    seed with its 95% interval and verdict. Scored on the whole held-out split if every run has
    it, else on the sampled batches."""
    full = all("val_full" in r for e in stored.values() for r in e["runs"].values())
    base = stored.get(BASELINE, {}).get("runs", {})
    base_final = {s: score(r, tail, full) for s, r in base.items()}
    order = [k for k in SCHEMES if k in stored] + sorted(k for k in stored if k not in SCHEMES)
    out = {}
    for label in order:
        runs = stored[label]["runs"]
        final = {s: score(r, tail, full) for s, r in sorted(runs.items())}
        gap = None if label == BASELINE else paired_gap_pct(final, base_final)
        out[label] = {
            "row": stored[label]["row"], "seeds": sorted(final), "final_val": final,
            "score": score_name(tail, full),
            "final_val_spread": spread(list(final.values())).as_dict(),
            "gap_pct_vs_baseline": None if gap is None else gap.as_dict(),
            "verdict": None if label == BASELINE else verdict(gap),
            "seconds_mean": sum(r["seconds"] for r in runs.values()) / len(runs),
        }
    return out


def _table(summary: dict[str, Any]) -> str:
    from _seeds import Spread

    lines = ["| scheme | preset | seeds | val loss (mean ± sd) | vs baseline, paired "
             "(mean ± sd) | 95% interval of the gap | verdict | wall s (shared CPU) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in summary.items():
        row = scheme_of(r["row"])
        fv = Spread(**{k: v for k, v in r["final_val_spread"].items() if k != "beyond_noise"})
        g = r["gap_pct_vs_baseline"]
        gap = None if g is None else Spread(**{k: v for k, v in g.items() if k != "beyond_noise"})
        lines.append(f"| {label} | {row.describe()} | {len(r['seeds'])} | {fmt_spread(fv)} | "
                     f"{'-' if label == BASELINE else fmt_spread(gap, 2, '%')} | "
                     f"{'-' if label == BASELINE else fmt_interval(gap)} | "
                     f"{'-' if label == BASELINE else r['verdict']} | "
                     f"{r['seconds_mean']:.0f} |")
    return "\n".join(lines)


def _mean_curve(curves: list[list]) -> tuple[list, list, list]:
    """Pointwise mean and sd of curves of (step, value) pairs, at the steps every curve has
    (runs made with ``--scored-evals-only`` have only the scored ones)."""
    maps = [dict((int(st), v) for st, v in c) for c in curves]
    steps = sorted(set.intersection(*(set(m) for m in maps)))
    stats = [spread([m[st] for m in maps]) for st in steps]
    return steps, [s.mean for s in stats], [s.sd for s in stats]


def _plot(summary: dict, stored: dict, path: Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed (pip install matplotlib, or the 'bench' extra): "
              "no plot", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 20
    for label in summary:
        runs = list(stored[label]["runs"].values())
        trains = [list(enumerate(r["train"], 1)) for r in runs]
        steps, tr, _ = _mean_curve(trains)
        smooth = [sum(tr[max(0, i - w + 1):i + 1]) / len(tr[max(0, i - w + 1):i + 1])
                  for i in range(len(tr))]
        ax1.plot(steps, smooth, label=label, lw=1.2)
        steps, vals, sds = _mean_curve([r["val"] for r in runs])
        line, = ax2.plot(steps, vals, marker="o", ms=3, label=label, lw=1.2)
        if len(runs) > 1:
            ax2.fill_between(steps, [v - d for v, d in zip(vals, sds)],
                             [v + d for v, d in zip(vals, sds)], color=line.get_color(),
                             alpha=0.15)
    ax1.set(title=f"train loss ({w}-step mean, mean over seeds)", xlabel="step", ylabel="loss")
    ax2.set(title="validation loss (mean ± sd over seeds)", xlabel="step", ylabel="loss")
    finals = [r["final_val_spread"]["mean"] for r in summary.values()]
    ax2.set_ylim(min(finals) - 0.1, max(finals) + 0.4)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _pending(a: argparse.Namespace, store: RunStore) -> list[tuple[str, int]]:
    """(scheme, seed) runs to train: all requested with --fresh, else those not stored."""
    todo = []
    for seed in seed_list(a.seed, a.seeds):
        for label in a.schemes:
            row = _row(label, getattr(a, "row_defs", None))
            if a.fresh or store.load(label, seed, row) is not None:
                if a.fresh:
                    todo.append((label, seed))
                continue
            # the same computation stored under another seed (``_effective``): copy it
            twin = next((s for s in store.seeds(label) if s != seed
                         and _effective(a, label, s) == _effective(a, label, seed)), None)
            rec = None if twin is None else store.load(label, twin, row)
            if rec is not None:
                store.save(label, seed, row, dict(rec, same_as_seed=rec.get("same_as_seed",
                                                                             twin)))
            else:
                todo.append((label, seed))
    return todo


def cpu_estimate(store: RunStore, todo: list, steps: int) -> str:
    """The time the pending runs should take, from the seconds per step of the runs already
    in the store (the machine's load changes it)."""
    done = [r for e in store.all().values() for r in e["runs"].values()
            if "same_as_seed" not in r]
    if not done:
        return f"{len(todo)} run(s) x {steps} steps; no stored run to time them by yet"
    per_step = sum(r["seconds"] for r in done) / (len(done) * steps)
    return (f"{len(todo)} run(s) x {steps} steps at {per_step:.3f} s/step (mean of {len(done)} "
            f"stored run(s)): about {len(todo) * steps * per_step / 60:.0f} min wall")


def describe_data(a: argparse.Namespace) -> str:
    """The run's dataset in words (``load_data``'s; diloco.py's tables say it too)."""
    return (f"the main job's BPE corpus (pystdlib, vocab {a.bpe})" if a.bpe
            else f"characters of {a.data or 'tinyshakespeare'}")


def describe_setup(a: argparse.Namespace, first: dict[str, Any]) -> str:
    """One paragraph: model, data, schedule, mesh and evaluation of a table's runs."""
    data = describe_data(a)
    evals = (f"{a.eval_batches * a.world} sampled held-out batches of {a.batch}"
             + ((" and the whole held-out split" + (f" (last {a.full_last} evaluations)"
                                                    if a.full_last else ""))
                if a.eval_full else "")
             + f", every {a.eval_every} steps, the same for every run")
    fixed = (f"; {', '.join(a.fix)} held at seed {a.seed} for every run" if a.fix else "")
    return (f"model: {first['params'] / 1e6:.2f}M params{' per rank' if a.experts else ''} "
            f"(dim {a.dim}, {a.layers} layers, "
            f"{a.heads} heads, vocab {first['vocab']}{_describe_experts(a, first)}), {data}, "
            f"seq {a.seq}, batch "
            f"{a.batch}/rank, AdamW lr {a.lr} cosine to {a.lr_final:g}x, {a.steps} steps, "
            f"{a.world} ranks as {a.world // a.ranks_per_node} nodes x {a.ranks_per_node}; "
            f"evaluation: {evals}{fixed}")


def _describe_experts(a: argparse.Namespace, first: dict[str, Any]) -> str:
    """The MoE part of ``describe_setup`` (empty for the dense model)."""
    if not a.experts:
        return ""
    from _model import ROUTE_TOP_K

    text = (f"; MoE: {a.experts} experts per rank in every block, top-"
            f"{min(ROUTE_TOP_K, a.experts)} routed, hidden {4 * a.dim // a.experts}")
    if a.expert_parallel > 1:
        total = first.get("params_all_experts")
        text += (f", expert parallelism {a.expert_parallel} (set e on the ranks in position e "
                 "of each group of "
                 f"{a.expert_parallel} inside a node, sharded over them; no token dispatch: "
                 "each rank routes its own tokens)"
                 + (f", {total / 1e6:.2f}M params over all expert sets" if total else "")
                 + "; each rank evaluates with its own set, every score averages the sets")
    return text


def report_md(title: str, a: argparse.Namespace, stored: dict, summary: dict, table: str,
              trained: int, wall: float, store: RunStore) -> str:
    first = next(iter(next(iter(stored.values()))["runs"].values()))
    how = next(iter(summary.values()))["score"]
    from _seeds import CLAIM_PCT, WORSE_ABOVE_PCT

    return (f"# {title}\n\n{describe_setup(a, first)}\n\nScore of a run: {how}.\n\n"
            f"{table}\n\n"
            "A seed sets the initial weights, the training batches and the quantizers' random "
            "bits (unless --fix holds some); the gap to the baseline is paired by seed, its 95% "
            f"interval is Student's t over the seeds. Verdict: \"within +{CLAIM_PCT}%\" when "
            f"the interval's upper bound is at most +{CLAIM_PCT}%, \"worse\" when its lower "
            f"bound is above {WORSE_ABOVE_PCT:+g}%, else \"undecided\".\n\n"
            + (f"With --fix {','.join(a.fix)} every run shares those parts: the gaps and "
               "verdicts here hold for that one realization (a variance experiment), not for "
               "the scheme.\n\n" if a.fix else "")
            + f"This invocation: {trained} run(s) trained in {wall / 60:.1f} min; the table covers "
            f"every run stored in {store.dir}.\n")


def main(argv=None) -> int:
    a = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fsdp_qcomm.testing import run_ranks

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prov = _provenance.record(out_dir, argv=None if argv is None else [__file__, *argv])
    store = RunStore(out_dir, _setup(a))
    try:
        todo = [] if a.report_only else _pending(a, store)
        store.all()  # refuse before training, not after, if --out holds other settings
    except SetupMismatch as e:
        print(f"accuracy: {e}", file=sys.stderr)
        return 2
    print(f"accuracy: {len(a.schemes)} schemes x {a.seeds} seed(s) x {a.steps} steps, "
          f"{a.world} ranks ({a.ranks_per_node} per node), gloo, CPU: {len(todo)} run(s) to "
          f"train, the rest stored in {store.dir}; estimate: "
          f"{cpu_estimate(store, todo, a.steps)}", flush=True)
    t0 = time.perf_counter()
    if todo:
        run_ranks(_train_all, a.world, a, store, todo, timeout=12 * 3600)
    wall = time.perf_counter() - t0
    prov.note(trained_runs=len(todo), train_wall_s=round(wall, 1))
    stored = store.all()
    if not stored:
        print(f"no runs stored in {store.dir}: nothing to report", file=sys.stderr)
        return 1
    summary = _summary(stored, a.tail)
    md = report_md("SDP4Bit Table 1, small-scale reproduction", a, stored, summary,
                   _table(summary), len(todo), wall, store)
    (out_dir / "table.md").write_text(md)
    write_traffic(a, store)
    res = {"setup": store.setup, "schemes": summary, "runs": stored,
           "args": {k: v for k, v in vars(a).items()}}
    (out_dir / "results.json").write_text(json.dumps(res, indent=1))
    first = next(iter(next(iter(stored.values()))["runs"].values()))
    plotted = _plot(summary, stored, out_dir / "loss_curves.png",
                    f"{first['params'] / 1e6:.2f}M-param {'BPE' if a.bpe else 'char'} GPT, "
                    f"{a.world} ranks, {a.steps} steps")
    print("\n" + md)
    print(f"written: {out_dir}/table.md, results.json" + (", loss_curves.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
