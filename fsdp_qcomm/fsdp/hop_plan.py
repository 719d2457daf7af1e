"""Which of a module's collectives fsdp-qcomm quantizes, and why: a pure decision.

The rule: quantize what crosses nodes. A collective whose members all share one node (a
one-node gather group, HSDP's weight all-gather and reduce-scatter inside a node) stays
unquantized (FSDP2's own reduction; for weights, a plain gather through the hook, no reference
and no codec work) unless ``QCommConfig.quantize_intra_node`` asks otherwise. So on a 2-D HSDP
mesh the presets quantize exactly the all-reduce across replicas, the only traffic that crosses
nodes. A two-level gradient reduction whose second hop crosses nodes keeps its first, intra-node
hop quantized (SDP4Bit's 8-bit hop: it is what makes the node's sum cheap to re-quantize).

qWD's reference is node-sharded (``collectives.weight_gather.NodeShardedQwd``) when
``weight_reference="node"`` and the gather group spans at least two nodes of at least two of its
members each, the same number on every node; otherwise (one member per node: the node shard is
the whole reference; unequal nodes) it is full, and the plan says so.

``plan_module`` takes the node layouts of a module's gather, reduce-scatter and replica groups
(``topology.NodeLayout``, the same on every rank) and returns a ``ModulePlan``; ``notes`` turns
the plans of all modules into the lines ``handle.stats()["notes"]`` shows.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from ..collectives.topology import NodeLayout
from ..config import QCommConfig


@dataclass(frozen=True)
class ModulePlan:
    """What ``enable`` installs on one FSDP module.

    weights: the all-gather's configuration (``weight_scheme="none"``: a plain gather);
        ``node_reference``: qWD keeps a node-sharded reference.
    reduce_scatter: the reduce-scatter hook's configuration, or None for FSDP2's own.
    replica: the HSDP all-reduce hook's configuration, or None for FSDP2's own (or no HSDP).
    why: one line per collective, for the notes.
    kept_inside: the collectives the configuration would quantize that stay FSDP2's own
        because their members share one node (``quantize_intra_node=False``).
    """

    weights: QCommConfig
    node_reference: bool
    reduce_scatter: Optional[QCommConfig]
    replica: Optional[QCommConfig]
    why: tuple[str, ...]
    kept_inside: tuple[str, ...] = ()


_PLAIN_WEIGHTS = dict(weight_scheme="none", weight_levels="uniform", weight_hadamard=False,
                      bit_budget=None)
_PLAIN_GRADS = dict(grad_scheme="none", grad_levels="uniform", grad_hadamard=False,
                    grad_error_feedback="none", grad_error_feedback_decay=1.0,
                    bit_budget=None)


def _where(layout: NodeLayout) -> str:
    if layout.num_nodes == 1:
        return f"its {layout.size} rank(s) share one node"
    per = {len(n) for n in layout.nodes}
    local = f"{per.pop()}" if len(per) == 1 else "unequal numbers of"
    return f"{layout.num_nodes} nodes of {local} rank(s)"


def plan_module(
    run: QCommConfig, gather: NodeLayout, reduce_scatter: NodeLayout,
    replicas: Optional[NodeLayout], gloo: bool = False,
) -> ModulePlan:
    """Decide one module's collectives (see the module docstring). ``replicas``: the HSDP
    replica group's layout (None without HSDP or with a single replica). ``gloo``: the
    reduce-scatter runs on gloo, which rejects the PREMUL_SUM op FSDP passes once a gradient
    divide factor is set (possibly after ``enable``): an unquantized reduce-scatter then still
    goes through the hook (a plain one, which applies the factor itself) when gradients are
    otherwise handled by fsdp-qcomm."""
    why = []
    inside: list[str] = []
    intra_ok = run.quantize_intra_node
    # ---- weights
    weights = run
    node_reference = False
    if gather.size == 1:  # nothing to hook: no reference, no tracker, no agreement
        weights = dataclasses.replace(run, **_PLAIN_WEIGHTS, weight_reuse_unchanged=False)
        if run.weight_scheme != "none":
            why.append("weight all-gather: none, a group of one rank (FSDP2 runs no collective)")
    elif run.weight_scheme != "none":
        if gather.num_nodes > 1 or intra_ok:
            text = (f"weight all-gather: {run.weight_scheme} {run.weight_bits}-bit"
                    if run.weight_scheme != "bf16" else "weight all-gather: bf16 (16-bit)")
            if run.weight_scheme == "qwd":
                node_reference = (run.weight_reference == "node" and gather.regular
                                  and gather.num_nodes > 1 and gather.local_size > 1)
                if node_reference:
                    text += ", node-sharded reference (1/{} of the parameters)".format(
                        gather.local_size)
                elif run.weight_reference == "node" and gather.num_nodes > 1:
                    text += (", full reference (one rank per node)" if gather.regular
                             else ", full reference (nodes hold unequal numbers of the group)")
                else:
                    text += ", full reference"
            why.append(f"{text}: {_where(gather)}")
        else:
            weights = dataclasses.replace(run, **_PLAIN_WEIGHTS)
            inside.append("weight all-gather")
            why.append(f"weight all-gather: unquantized, {_where(gather)} "
                       "(quantize_intra_node=False)")
    # ---- gradients
    rs = None
    if run.grad_scheme != "none" and reduce_scatter.size == 1:
        why.append("gradient reduce-scatter: none, a group of one rank (FSDP2 runs no "
                   "collective)")
    elif run.grad_scheme != "none" and (reduce_scatter.num_nodes > 1 or intra_ok):
        rs = run
        hops = {"two_level": f"two-level, {run.grad_intra_bits}-bit inside then "
                             f"{run.grad_inter_bits}-bit across nodes",
                "one_level": f"one hop, {run.grad_inter_bits}-bit",
                "bf16": "one hop, bf16 rows summed in fp32"}[run.grad_scheme]
        why.append(f"gradient reduce-scatter: {hops}: {_where(reduce_scatter)}")
    else:
        if run.grad_overlap or (gloo and run.grad_scheme != "none"):
            rs = dataclasses.replace(run, **_PLAIN_GRADS)
        if run.grad_scheme != "none":
            inside.append("gradient reduce-scatter")
            why.append(f"gradient reduce-scatter: unquantized, {_where(reduce_scatter)} "
                       "(quantize_intra_node=False)")
    replica = None
    if replicas is not None:
        if run.grad_scheme != "none" and (replicas.num_nodes > 1 or intra_ok):
            replica = run
            what = ("bf16, fp32 sums" if run.grad_scheme == "bf16"
                    else f"{run.replica_spec(replicas.num_nodes > 1).bits}-bit")
            why.append(f"HSDP all-reduce across replicas: quantized {what}: {_where(replicas)}")
        elif run.grad_overlap:
            replica = dataclasses.replace(run, **_PLAIN_GRADS)
            if run.grad_scheme != "none":
                inside.append("HSDP all-reduce across replicas")
            why.append(f"HSDP all-reduce across replicas: unquantized, {_where(replicas)}")
        else:
            if run.grad_scheme != "none":
                inside.append("HSDP all-reduce across replicas")
            why.append(f"HSDP all-reduce across replicas: FSDP2's own, unquantized, "
                       f"{_where(replicas)}")
    return ModulePlan(weights, node_reference, rs, replica, tuple(why), tuple(inside))


def notes(plans: dict[str, ModulePlan]) -> list[str]:
    """One note per distinct decision, naming the modules it applies to."""
    by_line: dict[str, list[str]] = defaultdict(list)
    for label, plan in plans.items():
        for line in plan.why:
            by_line[line].append(label)
    return [module_list(line, labels) for line, labels in by_line.items()]


def module_list(line: str, labels: list[str]) -> str:
    """``line`` with the modules it applies to: ``... [6 module(s): a, b, c, d and 2 more]``."""
    shown = ", ".join(labels[:4]) + (f" and {len(labels) - 4} more" if len(labels) > 4 else "")
    return f"{line} [{len(labels)} module(s): {shown}]"


def nothing_quantized_hint(plans: dict[str, ModulePlan], run: QCommConfig) -> Optional[str]:
    """The line a user needs when the configuration asks for quantization and no collective of
    any module gets it because every group lies inside one node (``quantize_intra_node=False``):
    without it, ``enable`` on one machine looks like it worked and sends FSDP2's bytes. None
    otherwise (a one-rank world has nothing to quantize at all)."""
    asks = run.weight_scheme != "none" or run.grad_scheme != "none"
    if not asks or not any(p.kept_inside for p in plans.values()):
        return None
    if any(p.weights.weight_scheme != "none"
           or (p.reduce_scatter is not None and p.reduce_scatter.grad_scheme != "none")
           or (p.replica is not None and p.replica.grad_scheme != "none")
           for p in plans.values()):
        return None
    return ("no collective crosses a node, so fsdp-qcomm quantizes nothing and every byte "
            "stays FSDP2's own: only traffic between nodes is quantized by default. To quantize "
            "inside a node as well (GPUs linked by PCIe only, or to try the codecs on one "
            "machine), pass quantize_intra_node=True; if these ranks are in fact on several "
            "nodes, set ranks_per_node (or LOCAL_WORLD_SIZE) to the ranks per node")


__all__ = ["ModulePlan", "module_list", "nothing_quantized_hint", "notes", "plan_module"]
