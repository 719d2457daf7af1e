"""Bytes on the wire per training step, per collective and per scheme, with two cross-checks.

Trains the benchmark GPT for a few steps on 4 local gloo ranks (2 nodes x 2, so two-level
gradient schemes take both hops) under each scheme and reports, per rank and step:

* per collective kind (weight_allgather, grad_intra, grad_inter): calls, bytes sent, logical
  elements, bits per element, and the ratio against FSDP2's own collectives with bf16 weights /
  fp32 gradients and with fp32 / fp32 (FSDP's bytes follow from the same element counts);
* cross-check 1: the package's counters (``handle.stats()``) against the bytes of the tensors
  actually handed to ``torch.distributed`` (every collective is wrapped and counted);
* cross-check 2 (``--cluster-json results/cluster_speed/results.json``): the bytes that really
  crossed the emulated inter-node link (veth counters, from ``cluster_speed.py``) next to the
  package's counters for the same run.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/wire_bytes.py [--steps 2] [--dim 256]
        [--microbatches K] [--hsdp [--all-reduce-every-microbatch]]
        [--cluster-json results/cluster_speed/results.json]

``--microbatches K`` accumulates gradients over K micro-batches per optimizer step
(``set_requires_gradient_sync(False)`` on all but the last): bytes are then per optimizer step.

``--hsdp``: the 4 ranks as HSDP, 2 replicas (one per node) x 2 shards (inside a node); with
``--microbatches K`` the loop calls ``model.set_requires_all_reduce(micro == K - 1)`` (the
reduce-scatter inside the node runs every micro-batch, the all-reduce across nodes once per
step), or nothing with ``--all-reduce-every-microbatch`` (FSDP2's default, what torchtitan did
before fsdp_qcomm's adapters skipped it). Adds a table of node-crossing bytes per optimizer
step: the package's ``cross_node_bytes`` for the hooked schemes; for FSDP2's own HSDP, the ring
all-reduce volume ``2 (R - 1) / R`` times the bytes handed to ``all_reduce`` on the R-rank
replica group (all of it to the other node for R = 2), which is also what the package's
unquantized replica hop would count.

Writes ``results/wire_bytes/{table.md, results.json, bits.png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _provenance  # noqa: E402
from _plotting import pyplot  # noqa: E402

SCHEMES = ["baseline", "qw4", "qwd", "tlq", "tlq_hs", "sdp4bit", "qsdp", "zeropp"]
_PER_STEP = ("calls", "sent_bytes", "recv_bytes", "elements", "baseline_bytes",
             "cross_node_bytes", "sending_calls", "sending_elements")
_PG_FUNCS = ("all_gather_single", "reduce_scatter_single", "all_to_all_single",
             "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="counted steps (after 1 warm-up)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=1,
                    help="micro-batches per optimizer step (gradient accumulation)")
    ap.add_argument("--hsdp", action="store_true",
                    help="HSDP: 2 replicas (one per node) x 2 shards inside a node")
    ap.add_argument("--all-reduce-every-microbatch", action="store_true",
                    help="--hsdp with --microbatches: do not skip the all-reduce across "
                         "replicas on the first micro-batches (FSDP2's default)")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--cluster-json", default=None,
                    help="results.json of cluster_speed.py: add the veth link cross-check")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "wire_bytes"))
    a = ap.parse_args(argv)
    a.schemes = [s.strip() for s in a.schemes.split(",") if s.strip()]
    bad = [s for s in a.schemes if s != "baseline" and s not in _presets()]
    if bad:
        ap.error(f"unknown scheme(s) {bad}; choose from {SCHEMES}")
    if a.microbatches < 1:
        ap.error(f"--microbatches {a.microbatches} must be >= 1")
    if a.all_reduce_every_microbatch and not a.hsdp:
        ap.error("--all-reduce-every-microbatch needs --hsdp")
    if a.cluster_json and not Path(a.cluster_json).is_file():
        ap.error(f"--cluster-json {a.cluster_json}: no such file; run "
                 "benchmarks/cluster_speed.py first (as root)")
    return a


def _presets() -> dict:
    from fsdp_qcomm import QCommConfig

    return QCommConfig.PRESETS


class _PgCounter:
    """Bytes of the input tensor of every ``torch.distributed`` collective, per function."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.bytes: dict[str, int] = {}
        self.on = False
        for name in _PG_FUNCS:
            fn = getattr(dist, name)
            setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        import torch.distributed as dist

        def counted(*args, **kwargs):
            if self.on:
                if name == "all_reduce":  # (tensor, op, group): one-rank groups move nothing
                    t = kwargs.get("tensor", args[0] if args else None)
                    group = kwargs.get("group", args[2] if len(args) > 2 else None)
                    if dist.get_world_size(group) < 2:
                        return fn(*args, **kwargs)
                else:
                    t = kwargs.get("input", kwargs.get("input_tensor"))
                    if t is None:
                        t = args[1]
                self.bytes[name] = self.bytes.get(name, 0) + t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return counted


def _rank_fn(rank: int, world: int, a: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    from _model import GPTShape, build_fsdp_gpt, hsdp_mesh

    import fsdp_qcomm

    pg = _PgCounter()
    shape = GPTShape(a.vocab, a.dim, a.layers, a.heads, a.seq)
    out: dict = {"params": shape.params(), "schemes": {}}
    for label in a.schemes:
        model = build_fsdp_gpt(shape, 0, hsdp_mesh(2) if a.hsdp else None)
        handle = None
        if label != "baseline":
            handle = fsdp_qcomm.enable(
                model, fsdp_qcomm.QCommConfig.preset(label, ranks_per_node=2, seed=0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        for step in range(1 + a.steps):
            if step == 1:  # after the warm-up (qWD's first gather is at full precision)
                pg.bytes.clear()
                pg.on = True
                if handle is not None:
                    handle.reset_stats()
            for m in range(a.microbatches):
                last = m == a.microbatches - 1
                if not a.hsdp:
                    model.set_requires_gradient_sync(last)
                elif not a.all_reduce_every_microbatch:
                    model.set_requires_all_reduce(last)  # one all-reduce across nodes per step
                x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
                F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        pg.on = False
        out["schemes"][label] = {
            "pg": {k: v / a.steps for k, v in pg.bytes.items()},
            "stats": ({k: {f: (x / a.steps if f in _PER_STEP else x)
                           for f, x in v.items()}
                       for k, v in handle.stats().items() if k not in ("notes", "summary")}
                      if handle is not None else {}),
            "modes": handle.gather_modes() if handle is not None else {},
            "summary": handle.stats()["summary"] if handle is not None else {},
        }
        if handle is not None:
            handle.disable()
        del model, opt
    return out


def _reference(base: dict) -> dict:
    """FSDP2's own bytes per rank and step, from the baseline run's process-group counts
    (``ar_fp32``: HSDP's all-reduce across replicas, 0 without HSDP)."""
    ag = base["pg"].get("all_gather_single", 0) + base["pg"].get("all_gather_into_tensor", 0)
    rs = base["pg"].get("reduce_scatter_single", 0) + base["pg"].get("reduce_scatter_tensor", 0)
    ar = base["pg"].get("all_reduce", 0)
    return {"ag_fp32": ag, "rs_fp32": rs, "ar_fp32": ar, "bf16_fp32": ag / 2 + rs + ar,
            "fp32_fp32": ag + rs + ar}


REPLICAS = 2  # --hsdp: one replica per node


def _cross_node_table(sch: dict, ref: dict) -> tuple[str, dict]:
    """--hsdp: bytes this rank sends to the other node per optimizer step."""
    ring = 2 * (REPLICAS - 1) / REPLICAS
    fsdp = ring * ref["ar_fp32"]
    rows = ["| scheme | node-crossing bytes/step | vs FSDP2's HSDP | all-reduces across "
            "replicas per step (calls of all modules) | how counted |", "|---|---|---|---|---|"]
    out = {}
    for label, r in sch.items():
        if label == "baseline":
            cross, calls, how = fsdp, "-", (f"ring volume {ring:g} x the {ref['ar_fp32']:,.0f} "
                                            "bytes handed to all_reduce")
        else:
            cross = r["summary"]["cross_node_bytes"] / max(1, r["summary"]["steps"])
            rep = r["stats"].get("grad_replica", {})
            calls, how = f"{rep.get('calls', 0):.0f}", "stats()['summary'] cross_node_bytes"
        out[label] = cross
        rows.append(f"| {label} | {cross:,.0f} | {cross / fsdp:.3f} (1/{fsdp / cross:.1f}) | "
                    f"{calls} | {how} |" if cross and fsdp else
                    f"| {label} | {cross:,.0f} | - | {calls} | {how} |")
    return "\n".join(rows), out


def _tables(res: dict, a: argparse.Namespace) -> tuple[str, dict]:
    sch = res["schemes"]
    if "baseline" not in sch:
        raise SystemExit("the FSDP reference needs the baseline scheme: keep it in --schemes")
    ref = _reference(sch["baseline"])
    ag_el = ref["ag_fp32"] / 4  # weight elements FSDP gathers per step (fp32 = 4 bytes)
    rs_el = ref["rs_fp32"] / 4
    rows = ["| scheme | collective | calls/step | sending calls/step | bytes/step | "
            "elements/step | bits/elem | bits/elem when sending | vs FSDP bf16 | vs FSDP fp32 |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    totals = ["| scheme | weight B/step | grad B/step | total B/step | vs FSDP bf16 W/fp32 G | "
              "vs FSDP fp32/fp32 | pg bytes == counters |", "|---|---|---|---|---|---|---|"]
    summary = {}
    for label, r in sch.items():
        st = r["stats"]
        pg_total = sum(r["pg"].values())
        if "weight_allgather" in st:
            w = st["weight_allgather"]["sent_bytes"]
        else:
            w = ref["ag_fp32"]
        gkinds = [k for k in ("grad_intra", "grad_inter") if k in st]
        g = sum(st[k]["sent_bytes"] for k in gkinds) if gkinds else \
            r["pg"].get("reduce_scatter_single", 0) + r["pg"].get("reduce_scatter_tensor", 0)
        # HSDP: the all-reduce across replicas (the package's hop, else FSDP's own)
        g += st["grad_replica"]["sent_bytes"] if "grad_replica" in st else \
            r["pg"].get("all_reduce", 0)
        for kind, s in st.items():
            if kind.startswith("weight_allgather"):
                fb16, f32 = s["elements"] * 2, s["elements"] * 4
            elif kind == "grad_replica":  # against FSDP's fp32 all-reduce across replicas
                fb16 = f32 = ref["ar_fp32"] or 1
            else:  # against FSDP's fp32 reduce-scatter of the same gradients
                fb16 = f32 = rs_el * 4
            rows.append(f"| {label} | {kind} | {s['calls']:.0f} | {s['sending_calls']:.0f} | "
                        f"{s['sent_bytes']:,.0f} | {s['elements']:,.0f} | "
                        f"{s['bits_per_element']:.3f} | {s['sending_bits_per_element']:.3f} | "
                        f"{s['sent_bytes'] / fb16:.3f} | {s['sent_bytes'] / f32:.3f} |")
        if label == "baseline":
            rows.append(f"| baseline | FSDP all-gather (fp32) | - | - | {ref['ag_fp32']:,.0f} | "
                        f"{ag_el:,.0f} | 32.000 | 32.000 | 2.000 | 1.000 |")
            rows.append(f"| baseline | FSDP reduce-scatter (fp32) | - | - | "
                        f"{ref['rs_fp32']:,.0f} | {rs_el:,.0f} | 32.000 | 32.000 | 1.000 | 1.000 |")
            if ref["ar_fp32"]:
                rows.append(f"| baseline | FSDP all-reduce across replicas (fp32) | - | - | "
                            f"{ref['ar_fp32']:,.0f} | {ref['ar_fp32'] / 4:,.0f} | 32.000 | "
                            "32.000 | 1.000 | 1.000 |")
        counted = sum(s["sent_bytes"] for s in st.values())
        hooked = {"all_gather_single": "weight_allgather" in st or "grad_replica" in st,
                  "all_to_all_single": bool(gkinds) or "grad_replica" in st}
        pg_hooked = sum(v for k, v in r["pg"].items() if hooked.get(k))
        check = "n/a (no hooks)" if not st else (
            "yes" if abs(pg_hooked - counted) <= 0 else f"NO: {pg_hooked:,.0f} vs {counted:,.0f}")
        total = w + g
        summary[label] = {"weight": w, "grad": g, "total": total, "pg_total": pg_total,
                          "vs_bf16": total / ref["bf16_fp32"], "vs_fp32": total / ref["fp32_fp32"]}
        totals.append(f"| {label} | {w:,.0f} | {g:,.0f} | {total:,.0f} | "
                      f"{total / ref['bf16_fp32']:.3f} (/{ref['bf16_fp32'] / total:.2f}) | "
                      f"{total / ref['fp32_fp32']:.3f} (/{ref['fp32_fp32'] / total:.2f}) | "
                      f"{check} |")
    layout = ("HSDP: 2 replicas (one per node) x 2 shards inside a node" if a.hsdp
              else "flat FSDP")
    accumulate = ""
    if a.microbatches > 1:
        accumulate = (" Micro-batches: " + (
            "set_requires_gradient_sync(False) on all but the last." if not a.hsdp else
            "FSDP2's default, an all-reduce across replicas every micro-batch."
            if a.all_reduce_every_microbatch else
            "set_requires_all_reduce(micro == last): one all-reduce across replicas per "
            "step."))
    md = (f"Per rank and optimizer step ({a.microbatches} micro-batch(es) each), {a.steps} "
          f"steps after 1 warm-up; {res['params'] / 1e6:.2f}M-param GPT, 4 ranks = 2 nodes "
          f"x 2, {layout}.{accumulate}\n\n"
          "### Totals\n\n" + "\n".join(totals) +
          "\n\n### Per collective\n\n" + "\n".join(rows) + "\n\n"
          "bits/elem = 8 x bytes sent / logical elements (the package's definition); the "
          "weight all-gather's elements include the gathers of unchanged weights (backward "
          "re-gathers, later micro-batches), which send nothing under qWD; 'when sending' "
          "counts only the gathers that sent. "
          "Gradient hops are compared with FSDP's whole fp32 reduce-scatter input (the "
          "replica hop with FSDP's all-reduce input).\n")
    if a.hsdp:
        table, cross = _cross_node_table(sch, ref)
        md += "\n### Node-crossing bytes per optimizer step (HSDP)\n\n" + table + "\n"
        for label, v in cross.items():
            summary[label]["cross_node"] = v
    return md, summary


def _link_table(cluster: dict) -> str:
    """Measured veth bytes against a crossing model built from the counters: gloo's ring
    all-gather over 4 ranks in 2 nodes carries (world-1) shards over each of the 2 node
    boundaries = 1.5x the bytes all ranks pass in; the inter-node all-to-all (2-rank groups for
    two-level, 4 ranks for one-level) sends half of each rank's input to the other node; the
    intra-node hop never crosses. FSDP's own reduce-scatter is gloo-internal: its crossing
    factor is what the baseline implies."""
    out = ["| link | scheme | veth bytes/step | modeled crossing bytes/step | veth / modeled | "
           "veth vs baseline |", "|---|---|---|---|---|---|"]
    notes = []
    for rate, r in cluster["rates"].items():
        base = r["schemes"].get("baseline")
        rs_factor = None
        if base is not None:
            pg = base["pg_bytes_outside_per_step_all_ranks"]
            ag = pg.get("all_gather_single", 0) + pg.get("all_gather_into_tensor", 0)
            rs = pg.get("reduce_scatter_single", 0) + pg.get("reduce_scatter_tensor", 0)
            if rs:
                rs_factor = (base["link_bytes_per_step"] - 1.5 * ag) / rs
        for label, s in r["schemes"].items():
            st = s["stats_per_step_all_ranks"]
            pg = s["pg_bytes_outside_per_step_all_ranks"]
            ag = st["weight_allgather"]["sent_bytes"] if "weight_allgather" in st else \
                pg.get("all_gather_single", 0) + pg.get("all_gather_into_tensor", 0)
            rs = pg.get("reduce_scatter_single", 0) + pg.get("reduce_scatter_tensor", 0)
            model = 1.5 * ag + 0.5 * st.get("grad_inter", {}).get("sent_bytes", 0)
            if rs and rs_factor is not None:
                model += rs_factor * rs
            link = s["link_bytes_per_step"]
            vb = f"{link / base['link_bytes_per_step']:.3f}" if base else "-"
            out.append(f"| {rate} | {label} | {link:,.0f} | {model:,.0f} | "
                       f"{link / model:.3f} | {vb} |" if model else
                       f"| {rate} | {label} | {link:,.0f} | - | - | {vb} |")
        if rs_factor is not None:
            notes.append(f"{rate}: {rs_factor:.2f}")
    if notes:
        out.append("\nFSDP's fp32 reduce-scatter runs inside gloo, so its crossing factor (veth "
                   "bytes per byte all ranks pass in) is the one the baseline implies: "
                   + ", ".join(notes) + ". It is used for the baseline (whose veth/modeled is "
                   "therefore 1 by construction) and for schemes that keep FSDP's "
                   "reduce-scatter. 0.75 = 3 full gradient buffers per step over 2 node "
                   "boundaries: the volume of a ring all-reduce, twice a ring reduce-scatter's.")
    return "\n".join(out)


def main(argv=None) -> int:
    a = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fsdp_qcomm.testing import run_ranks

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _provenance.record(out, argv=None if argv is None else [__file__, *argv])
    t0 = time.perf_counter()
    res = run_ranks(_rank_fn, 4, a, timeout=1800)[0]
    md, summary = _tables(res, a)
    md = "# Bytes on the wire per step\n\n" + md
    if a.cluster_json:
        cluster = json.loads(Path(a.cluster_json).read_text())
        md += ("\n### Cross-check against the emulated inter-node link (cluster_speed.py)\n\n"
               + _link_table(cluster) + "\n\nOnly inter-node traffic crosses the veth; "
               "intra-node hops stay on each namespace's loopback. veth bytes include TCP/IP "
               "headers and gloo's control messages.\n")
    res["summary"] = summary
    res["wall_seconds"] = time.perf_counter() - t0
    md += f"\nWall time: {res['wall_seconds']:.0f} s.\n"
    (out / "table.md").write_text(md)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    plt = pyplot()
    if plt is None:
        print("matplotlib missing (pip install matplotlib): no plot", file=sys.stderr)
    else:
        labels = list(summary)
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar(labels, [summary[lab]["vs_bf16"] for lab in labels])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(ylabel="bytes / FSDP (bf16 W, fp32 G)", title="bytes sent per step vs FSDP2")
        fig.tight_layout()
        fig.savefig(out / "bits.png", dpi=120)
    print(md)
    print(f"written: {out}/table.md, results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
