"""The docs' result tables, rendered from the committed results folders.

A table is a named function (``TABLES``) that reads files the benchmarks wrote under
``results/`` (``results.json``, ``runs/``, ``gpu_check.json``) and returns markdown. In any
markdown file, a table sits between two marker lines, each alone on its line (indented like the
table, if the table is in a list item)::

    <!-- table:NAME -->
    | ... the rendered table ... |
    <!-- /table:NAME -->

Rendering keeps the markers and replaces everything between them, so a figure in such a block
cannot drift from its source: ``--check`` (CI, ``tests/test_tables.py``) fails when a block
differs from what the results say. ``benchmarks/check_figures.py`` does not scan these blocks'
figures (they come from results by construction); the figures typed by hand elsewhere it still
does. Markers inside fenced code or in a code span (not alone on their line) are text, not
markers. Links to ``docs/`` and ``results/`` in a table are written relative to the file it is
rendered into.

    python benchmarks/tables.py                 # rewrite every file that has markers
    python benchmarks/tables.py --check         # exit 1 and show the difference if any is stale
    python benchmarks/tables.py --file F [--check]
    python benchmarks/tables.py --list          # the tables, what each reads
    python benchmarks/tables.py --show NAME     # print one table

Files scanned by default: ``DOC_GLOBS`` (the README, ``docs/``, ``benchmarks/`` and
``recipes/`` markdown; never ``results/``, whose ``table.md`` files are benchmark outputs).
This script writes no results folder (so it records no ``_provenance``) and imports neither
torch nor the benchmarks: the statistics are ``_seeds``'s.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _seeds  # noqa: E402

ROOT = HERE.parent
DOC_GLOBS = ("*.md", "docs/**/*.md", "benchmarks/**/*.md", "recipes/**/*.md")

_OPEN = re.compile(r"([ \t]*)<!--\s*table:([\w.\-]+)\s*-->\s*")
_CLOSE = re.compile(r"[ \t]*<!--\s*/table:([\w.\-]+)\s*-->\s*")
_FENCE = re.compile(r"\s*(```|~~~)")


# ---- the registry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Table:
    name: str
    sources: tuple[str, ...]  # the results folders it reads (results/<name>)
    build: Callable[[Path], str]  # results root -> markdown table

    @property
    def doc(self) -> str:
        return (self.build.__doc__ or "").strip().split("\n\n")[0]


TABLES: dict[str, Table] = {}


def table(name: str, *sources: str):
    """Register ``fn(results_root) -> markdown`` as table ``name``, reading ``sources``."""
    def register(fn: Callable[[Path], str]) -> Callable[[Path], str]:
        if name in TABLES:
            raise ValueError(f"table {name!r} registered twice")
        TABLES[name] = Table(name, tuple(sources), fn)
        return fn
    return register


class TableError(ValueError):
    """Markers that do not pair up, an unknown table, or results that contradict each other."""


_READ: list[set[str]] = []  # while ``sources_read`` runs: the results folders opened


def _reading(folder: str) -> None:
    for seen in _READ:
        seen.add(folder.split("/")[0])


def sources_read(name: str, results: Path = ROOT / "results") -> set[str]:
    """The results folders table ``name`` really opens when it is built (``Table.sources``
    must name them all: ``tests/test_tables.py``)."""
    _READ.append(set())
    try:
        TABLES[name].build(results)
    finally:
        seen = _READ.pop()
    return seen


def _json(results: Path, rel: str) -> dict:
    _reading(rel)
    p = results / rel
    if not p.is_file():
        raise TableError(f"results/{rel} is missing (a table reads it)")
    return json.loads(p.read_text())


def _md(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _link(path: str) -> str:
    """``[path](path)``: a repository-relative link (``render`` makes it file-relative)."""
    return f"[{path}]({path})"


def _rate(rate: str) -> tuple[float, str]:
    """tc's ``100mbit`` -> (bits per second, "100 Mbit/s")."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise TableError(f"link rate {rate!r} not understood")
    unit = m.group(2)
    return (float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit],
            f"{m.group(1)} {unit.upper()}bit/s" if unit else f"{m.group(1)} bit/s")


def _millions(n: float) -> str:
    """Parameter counts to two decimals, a trailing 0 dropped: 0.82M, 1.91M, 3.31M, 10.87M."""
    s = f"{n / 1e6:.2f}"
    return (s[:-1] if s.endswith("0") else s) + "M"


# ---- accuracy: results.json of a seed sweep, checked against its run store -----------------------
@dataclass(frozen=True)
class Gap:
    gap: _seeds.Spread
    verdict: str
    params: int
    setup: dict

    @property
    def cell(self) -> str:
        """``+0.23% [+0.05, +0.40], 10 seeds: **within +0.5%**``."""
        lo, hi = _seeds.interval(self.gap)
        return (f"{self.gap.mean:+.2f}% [{lo:+.2f}, {hi:+.2f}], {self.gap.n} seeds: "
                f"**{self.verdict}**")


def accuracy_gap(results: Path, folder: str, label: str, base: str = "baseline",
                 gap_key: str = "gap_pct_vs_baseline",
                 claim_pct: float = _seeds.CLAIM_PCT) -> Gap:
    """Row ``label``'s gap to ``base`` in ``results/<folder>``, paired by seed
    (``_seeds.paired_gap_pct`` on the stored per-seed scores, ``_seeds.verdict`` at
    ``claim_pct``), checked against the stored summary's ``gap_key`` (DiLoCo's reports store
    ``gap_pct_vs_hsdp``, judged at +1.0%).

    The stored summary must agree with what it summarizes: the seeds of ``results.json`` must
    be those of the run store (``runs/``: a sweep that added seeds without rebuilding its report
    fails here) and its gap and verdict those computed again here."""
    res = _json(results, f"{folder}/results.json")
    rows = res["rows"]
    for k in (label, base):
        if k not in rows:
            raise TableError(f"results/{folder}/results.json has no row {k!r}")
    _reading(folder)
    stored = _seeds.RunStore(results / folder, res["setup"]).all()
    for k in (label, base):
        runs = sorted(stored.get(k, {}).get("runs", {}))
        if runs != sorted(rows[k]["seeds"]):
            raise TableError(f"results/{folder}: row {k!r} has seeds {rows[k]['seeds']} in "
                             f"results.json but {runs} in runs/; rebuild the report "
                             "(--report-only)")
    final, base_final = _scores(rows, label), _scores(rows, base)
    gap = _seeds.paired_gap_pct(final, base_final)
    verdict = _seeds.verdict(gap, claim_pct)
    want = rows[label].get(gap_key) or {}
    if (gap is None or not math.isclose(gap.mean, want.get("mean", math.nan), abs_tol=1e-9)
            or verdict != rows[label].get("verdict")):
        raise TableError(f"results/{folder}: row {label!r}'s stored gap / verdict "
                         f"({want.get('mean')}, {rows[label].get('verdict')}) differ from its "
                         f"scores' ({None if gap is None else gap.mean}, {verdict})")
    params = {r["params"] for e in stored.values() for r in e["runs"].values() if "params" in r}
    if len(params) != 1:
        raise TableError(f"results/{folder}: runs disagree on the model size: {params}")
    return Gap(gap, verdict, params.pop(), res["setup"])


def _workload(g: Gap, kind: str) -> str:
    s = g.setup
    return (f"{_millions(g.params)}-param {kind} GPT, {s['steps']} steps, "
            f"{s['world'] // s['ranks_per_node']} nodes x {s['ranks_per_node']}")


# ---- speed: cluster_speed.py's results.json ------------------------------------------------------
#: cluster_speed.py's REFERENCES: each mesh's FSDP2 baselines (bf16/fp32, bf16/bf16)
_SPEED_REFS = {"flat": ("fsdp2_bf16", "fsdp2_bf16_bf16"),
               "hsdp": ("hsdp_fsdp2_bf16", "hsdp_fsdp2_bf16_bf16")}


def _mesh(label: str) -> str:
    return "hsdp" if label.startswith("hsdp") else "flat"


@dataclass(frozen=True)
class Speed:
    step_s: float
    vs: tuple[float, float]  # speedup over FSDP2 bf16/fp32 and bf16/bf16 (same mesh)
    ref_step_s: float  # FSDP2 bf16/fp32's step
    link_mb: float
    floor_s: float
    floor_kind: str  # "CPU" or "link"
    rate: str  # "100 Mbit/s"


def speed(results: Path, folder: str, label: str, rate: str) -> Speed:
    """One row of cluster_speed.py's table, computed as ``cluster_speed._tables`` does: the
    speedup is the reference's median step over the row's; the floor is the larger of the CPU
    floor (CPU seconds of all ranks over the cores) and the link floor (the busier direction's
    bytes over the rate)."""
    res = _json(results, f"{folder}/results.json")
    if rate not in res["rates"]:
        raise TableError(f"results/{folder}/results.json has no rate {rate!r}")
    sch = res["rates"][rate]["schemes"]
    for k in (label, *_SPEED_REFS[_mesh(label)]):
        if k not in sch:
            raise TableError(f"results/{folder}/results.json: no {k!r} at {rate}")
    s = sch[label]
    refs = [sch[k] for k in _SPEED_REFS[_mesh(label)]]
    bps, rate_text = _rate(rate)
    cpu = s["cpu_all_ranks_s"] / (res.get("cores") or 1)
    link = 8 * s.get("link_busier_direction_bytes_per_step", s["link_bytes_per_step"] / 2) / bps
    return Speed(s["median_step_s"], tuple(r["median_step_s"] / s["median_step_s"] for r in refs),
                 refs[0]["median_step_s"], s["link_bytes_per_step"] / 1e6, max(cpu, link),
                 "CPU" if cpu >= link else "link", rate_text)


# ---- the tables ----------------------------------------------------------------------------------
# ---- DiLoCo: diloco.py's results.json (per-seed scores, gaps to HSDP, twins) -------------------
DILOCO = "diloco_640"
#: the DiLoCo row closest to HSDP at >= 30x fewer bytes, and its fp32 twin (docs/diloco.md)
DILOCO_BEST = "DiLoCo H32 2b lr0.7 m0.8"
DILOCO_LONG = "diloco_2560"  # the same workload at 4x the steps (80 outer steps at H=32)
DILOCO_CLAIM_PCT = 1.0  # diloco.py's CLAIM_PCT: a DiLoCo row is "within" at +1.0% of HSDP


_DILOCO_TWIN_CLAIM_PCT = 0.5  # diloco.py's QUANTIZER_CLAIM_PCT: the quantizer's part
DILOCO_BEST_TWIN = "DiLoCo H32 fp32 lr0.7 m0.8"  # DILOCO_BEST's fp32 twin


def _scores(rows: dict, label: str) -> dict[int, float]:
    """A row's per-seed scores from a report's ``rows``."""
    return {int(s): v for s, v in rows[label]["final_val"].items()}


def diloco_gap(results: Path, folder: str, label: str) -> Gap:
    """A DiLoCo report's row against HSDP (``accuracy_gap`` at DiLoCo's tolerance)."""
    return accuracy_gap(results, folder, label, base="HSDP", gap_key="gap_pct_vs_hsdp",
                        claim_pct=DILOCO_CLAIM_PCT)


def diloco_best(results: Path) -> tuple[Gap, Gap, _seeds.Spread, float]:
    """``DILOCO_BEST``'s gap to HSDP and its fp32 twin's (the twin ``gap_pct_vs_fp32_twin``
    names), both recomputed from the per-seed scores and checked against the stored summary;
    the row's paired gap to the twin, checked likewise; how many times fewer node-crossing
    bytes it sends than HSDP + sdp4bit."""
    def gap(label: str) -> Gap:
        return diloco_gap(results, DILOCO, label)

    rows = _json(results, f"{DILOCO}/results.json")["rows"]
    stored = rows[DILOCO_BEST].get("gap_pct_vs_fp32_twin") or {}
    if "twin" not in stored:
        raise TableError(f"results/{DILOCO}: row {DILOCO_BEST!r} has no fp32 twin stored")
    mine, twin = gap(DILOCO_BEST), gap(stored["twin"])
    vs_twin = _seeds.paired_gap_pct(
        _scores(rows, DILOCO_BEST), _scores(rows, stored["twin"]))
    if vs_twin is None or not math.isclose(vs_twin.mean, stored.get("mean", math.nan),
                                           abs_tol=1e-9):
        raise TableError(f"results/{DILOCO}: row {DILOCO_BEST!r}'s stored gap to its fp32 "
                         f"twin ({stored.get('mean')}) differs from its scores' "
                         f"({None if vs_twin is None else vs_twin.mean}); rebuild the report")
    return mine, twin, vs_twin, rows[DILOCO_BEST]["times_fewer_than_sdp4bit"]


def diloco_longer(results: Path) -> Optional[tuple[Gap, Gap]]:
    """``DILOCO_BEST``'s and its fp32 twin's gaps to HSDP at 4x the steps (``DILOCO_LONG``),
    once both are stored on every seed HSDP has there (None before)."""
    try:
        rows = _json(results, f"{DILOCO_LONG}/results.json")["rows"]
    except TableError:
        return None
    seeds = rows.get("HSDP", {}).get("seeds", [])
    pair = (DILOCO_BEST, DILOCO_BEST_TWIN)
    if len(seeds) < 2 or any(rows.get(k, {}).get("seeds") != seeds for k in pair):
        return None
    return diloco_gap(results, DILOCO_LONG, pair[0]), diloco_gap(results, DILOCO_LONG, pair[1])


@table("readme", "accuracy_300", "accuracy_bpe500", "cluster_speed_user", "wire_bytes_k1",
       "memory", "gpu_check", DILOCO, DILOCO_LONG)
def readme(results: Path) -> str:
    """README.md's summary: one row per headline figure, with its note and results folder."""
    rows = []

    def row(what: str, result: str, doc: str, folder: str) -> None:
        rows.append([what, result, _link(doc), _link(f"results/{folder}")])

    acc = "docs/accuracy_method.md"
    g = accuracy_gap(results, "accuracy_300", "SDP4Bit")
    row(f"accuracy, {_workload(g, 'char')}", f"sdp4bit {g.cell}", acc, "accuracy_300")
    g = accuracy_gap(results, "accuracy_bpe500", "SDP4Bit")
    row(f"accuracy, second workload: {_workload(g, 'BPE')}", f"sdp4bit {g.cell}", acc,
        "accuracy_bpe500")
    d, twin, vs_twin, fewer = diloco_best(results)
    whose = {_seeds.within(_DILOCO_TWIN_CLAIM_PCT): "DiLoCo's",
             _seeds.WORSE: "partly the quantizer's"}.get(
                 _seeds.verdict(vs_twin, _DILOCO_TWIN_CLAIM_PCT), "undecided")
    lo, hi = _seeds.interval(d.gap)
    longer = diloco_longer(results)
    if longer is None:
        row(f"DiLoCo across sites, H=32, 2-bit outer, {fewer:.1f}x fewer bytes than HSDP + "
            "sdp4bit", f"{d.gap.mean:+.2f}% [{lo:+.2f}, {hi:+.2f}] vs HSDP: **{d.verdict}**; "
            f"fp32 outer {twin.gap.mean:+.2f}%: the gap is {whose}", "docs/diloco.md", DILOCO)
    else:  # the trend with run length: both rows, at both lengths
        ld, lt = longer
        llo, lhi = _seeds.interval(ld.gap)
        row(f"DiLoCo H=32, 2-bit outer ({fewer:.1f}x fewer bytes than HSDP + sdp4bit), "
            f"{d.setup['steps']} -> {ld.setup['steps']} steps",
            f"{d.gap.mean:+.2f}% **{d.verdict}** -> {ld.gap.mean:+.2f}% [{llo:+.2f}, {lhi:+.2f}] "
            f"**{ld.verdict}**; {whose.split()[-1]}: fp32 {twin.gap.mean:+.2f}% -> "
            f"{lt.gap.mean:+.2f}%",
            "docs/diloco.md", DILOCO)
        rows[-1][-1] += f", {_link(f'results/{DILOCO_LONG}')}"

    res = _json(results, "cluster_speed_user/results.json")
    size = _millions(res["params"])
    for label, mesh, doc in (("sdp4bit", "flat FSDP over 4 ranks (2 emulated nodes x 2)",
                              "docs/cpu_path.md"),
                             ("hsdp_sdp4bit", "HSDP 2x2 (2 emulated nodes)", "docs/hsdp.md")):
        sp = speed(results, "cluster_speed_user", label, "100mbit")
        row(f"speed, {mesh}, {sp.rate}, {size} GPT",
            f"sdp4bit {sp.step_s:.3f} s vs FSDP2 bf16/fp32 {sp.ref_step_s:.3f} s: "
            f"**{sp.vs[0]:.2f}x**", doc, "cluster_speed_user")

    wb = _json(results, "wire_bytes_k1/results.json")
    s = wb["summary"]["sdp4bit"]
    row(f"bytes per step vs FSDP2 bf16 weights / fp32 gradients, {_millions(wb['params'])} GPT",
        f"sdp4bit **{s['vs_bf16']:.3f}x** ({s['total'] / 1e6:#.3g} MB per rank and step)",
        "docs/weight_allgather.md", "wire_bytes_k1")

    m = memory_rows(results)
    node, fsdp2 = m["sdp4bit_node"], m["fsdp2"]
    lay = _json(results, "memory/results.json")["layouts"]["2x2"]
    row(f"memory kept by fsdp_qcomm per rank, {lay['nodes']} nodes x {lay['ranks_per_node']}, "
        "over the unsharded model's bytes",
        f"sdp4bit **{node.kept:.3f}** (node-sharded reference); FSDP2's own parameter shard "
        f"{fsdp2.shard:.3f}", "docs/weight_allgather.md", "memory")

    env, cost = gpu_step_cost_rows(results)
    one_b = [r for r in cost if r["shape"]["name"] == "1B"]
    goal = _gpu_goal(cost)
    shares = ", ".join(f"{100 * r['codec_share']:.1f}% at W={r['world']}" for r in one_b)
    row(f"GPU: one {env['device'].removeprefix('NVIDIA ')}, torch "
        f"{'.'.join(env['torch'].split('.')[:2])}: codec's share of a bf16 step, 1B Llama-shaped",
        f"{shares} (goal <= {goal})", "docs/gpu_path.md", GPU_CHECK)
    return _md(["what", "result", "note", "results"], rows)


@table("diloco_twins", DILOCO)
def diloco_twins(results: Path) -> str:
    """Each quantized DiLoCo row against its fp32 twin (same H, outer lr and momentum), paired
    by seed, beside both rows' gaps to HSDP (docs/diloco.md): the quantizer's part of the gap
    and DiLoCo's own. Every figure is recomputed from the per-seed scores."""
    rows = _json(results, f"{DILOCO}/results.json")["rows"]
    out = []
    for label, r in rows.items():
        stored = r.get("gap_pct_vs_fp32_twin")
        if not stored:
            continue
        twin = stored["twin"]
        scores = [_scores(rows, k) for k in (label, twin)]
        vs = _seeds.paired_gap_pct(*scores)
        if vs is None or not math.isclose(vs.mean, stored["mean"], abs_tol=1e-9):
            raise TableError(f"results/{DILOCO}: {label!r} against its fp32 twin {twin!r}: stored "
                             f"{stored['mean']}, scores say {None if vs is None else vs.mean}")
        gaps = []
        for k in (label, twin):
            g = diloco_gap(results, DILOCO, k)
            gaps.append(f"{g.gap.mean:+.2f}% ({g.gap.n})")
        word = _seeds.verdict(vs, _DILOCO_TWIN_CLAIM_PCT)
        out.append([label, twin, *gaps, f"{vs.mean:+.2f}% {_seeds.fmt_interval(vs)}, "
                    f"{vs.n} seeds", word if word == _seeds.UNDECIDED else f"**{word}**"])
    if not out:
        raise TableError(f"results/{DILOCO}: no quantized row has a stored fp32 twin")
    out.sort(key=lambda r: (r[1], r[0]))  # grouped by twin
    return _md(["quantized row", "fp32 twin", "row vs HSDP (seeds)", "twin vs HSDP (seeds)",
                "row vs twin, paired [95% interval]",
                f"quantizer's part (+{_DILOCO_TWIN_CLAIM_PCT}%)"], out)


#: the workloads DILOCO_BEST and its fp32 twin ran on (benchmarks/campaigns/diloco_gap.toml):
#: the 640-step one, 4x its steps, and the second (BPE) workload
DILOCO_WORKLOADS = (DILOCO, DILOCO_LONG, "diloco_bpe640")


@table("diloco_workloads", *DILOCO_WORKLOADS)
def diloco_workloads(results: Path) -> str:
    """``DILOCO_BEST`` and its fp32 twin on each workload of ``DILOCO_WORKLOADS``: their gaps
    to HSDP and to each other, paired by seed and recomputed from the per-seed scores
    (docs/diloco.md): does the gap shrink with outer steps, and does it hold on other text? A
    workload the campaign has not trained yet says so."""
    twin = DILOCO_BEST_TWIN
    out = []
    for folder in DILOCO_WORKLOADS:
        try:
            res = _json(results, f"{folder}/results.json")
        except TableError:
            res = None
        rows = (res or {}).get("rows", {})
        if not all(k in rows for k in ("HSDP", DILOCO_BEST, twin)):
            have = [k for k in ("HSDP", DILOCO_BEST, twin) if k in rows]
            out.append([_link(f"results/{folder}"), "in progress (diloco_gap.toml): stored "
                        + (", ".join(have) if have else "nothing yet"), *["-"] * 5])
            continue
        gaps = [diloco_gap(results, folder, k) for k in (DILOCO_BEST, twin)]
        vs = _seeds.paired_gap_pct(*[_scores(rows, k) for k in (DILOCO_BEST, twin)])
        s = res["setup"]
        data = "BPE" if s.get("bpe") else "char"
        fewer = (rows["HSDP"]["cross_node_bytes_per_step"]
                 / rows[DILOCO_BEST]["cross_node_bytes_per_step"])
        def pct(g: _seeds.Spread) -> str:
            if g.n < 2:
                return f"{g.mean:+.2f}% (1 seed)"
            lo, hi = _seeds.interval(g)
            return f"{g.mean:+.2f}% [{lo:+.2f}, {hi:+.2f}]"

        cells = [f"{pct(g.gap)}: {g.verdict}" for g in gaps]
        out.append([_link(f"results/{folder}"),
                     f"{_millions(gaps[0].params)}-param {data} GPT, {s['steps']} steps "
                     f"({s['steps'] // 32} outer)",
                     " / ".join(str(g.gap.n) for g in gaps), *cells,
                     pct(vs), f"{fewer:.0f}x"])
    return _md(["results", "workload", "seeds (2-bit / fp32)",
                "2-bit, momentum 0.8, vs HSDP [95%]: verdict",
                "fp32 twin vs HSDP [95%]: verdict", "2-bit vs fp32, paired [95%]",
                "fewer node-crossing bytes than HSDP (fp32)"], out)


#: the screen of why 2-bit outer gradients beat fp32 (H=32, momentum 0.8; docs/diloco.md), each
#: row with the row that holds its diagnostics (a diagnostics row trains bit-identically)
DILOCO_WHY = (
    ("DiLoCo H32 fp32 lr0.7 m0.8", "fp32 outer gradients, outer lr 0.7",
     "DiLoCo H32 fp32 lr0.7 m0.8 diag"),
    ("DiLoCo H32 fp32 lr0.3 m0.8", "fp32, outer lr 0.3", None),
    ("DiLoCo H32 fp32 lr0.5 m0.8", "fp32, outer lr 0.5", None),
    ("DiLoCo H32 fp32 lr1.0 m0.8", "fp32, outer lr 1.0", None),
    ("DiLoCo H32 fp32 lr1.2 m0.8", "fp32, outer lr 1.2", None),
    ("DiLoCo H32 4b lr0.7 m0.8", "4-bit, stochastic rounding, Hadamard",
     "DiLoCo H32 4b lr0.7 m0.8 diag"),
    ("DiLoCo H32 2b lr0.7 m0.8", "2-bit, stochastic rounding, Hadamard",
     "DiLoCo H32 2b lr0.7 m0.8 diag"),
    ("DiLoCo H32 2b lr0.7 m0.8 nearest", "2-bit, nearest rounding, Hadamard", None),
    ("DiLoCo H32 2b lr0.7 m0.8 noH", "2-bit, stochastic rounding, no Hadamard", None),
    ("DiLoCo H32 fp32+noise0.7 lr0.7 m0.8", "fp32 + Gaussian noise 0.7x its rms",
     "DiLoCo H32 fp32+noise0.7 lr0.7 m0.8"),
    ("DiLoCo H32 fp32+noise1.4 lr0.7 m0.8", "fp32 + Gaussian noise 1.4x its rms",
     "DiLoCo H32 fp32+noise1.4 lr0.7 m0.8"),
)
DILOCO_WHY_SEEDS = (1234, 1235)


@table("diloco_why", DILOCO)
def diloco_why(results: Path) -> str:
    """The outer step at H=32, momentum 0.8, on the screen's seeds: each setting's paired gap to
    HSDP and, where measured (``DiLoCoConfig.diagnostics``), what the used mean was against the
    exact fp32 one, averaged over the outer steps and seeds (docs/diloco.md). Rows the campaign
    has not stored yet are left out."""
    res = _json(results, f"{DILOCO}/results.json")
    rows, runs = res["rows"], res["runs"]
    _reading(DILOCO)
    base = _scores(rows, "HSDP")
    out = []
    for label, what, diag in DILOCO_WHY:
        if label not in rows:
            continue
        mine = {int(s): v for s, v in rows[label]["final_val"].items()
                if int(s) in DILOCO_WHY_SEEDS}
        g = _seeds.paired_gap_pct(mine, base)
        if g is None:
            continue
        if diag not in (None, label) and diag in rows:
            theirs = rows[diag]["final_val"]
            if any(theirs[s] != v for s, v in rows[label]["final_val"].items() if s in theirs):
                raise TableError(f"results/{DILOCO}: {diag!r} must train bit-identically to "
                                 f"{label!r} (diagnostics change no weight) but scores apart")
        steps = [d for s, r in (runs.get(diag, {}).get("runs", {}) if diag else {}).items()
                 if int(s) in DILOCO_WHY_SEEDS for d in r.get("diagnostics", [])]

        def avg(key: str) -> str:
            vals = [d[key] for d in steps if d.get(key) is not None]
            return f"{sum(vals) / len(vals):.2f}" if vals else "-"

        seeds = ", ".join(f"{100 * (mine[s] / base[s] - 1):+.2f}%" for s in sorted(mine))
        out.append([what, f"{g.mean:+.2f}% ({seeds})", avg("relative_error"), avg("cosine"),
                    avg("mean_quantized_norm"), avg("update_norm")])
    return _md(["outer gradient", "gap to HSDP, mean (per seed)",
                "relative error to the fp32 mean", "cosine", "used mean's norm",
                "applied update's norm"], out)


@table("speed_user", "cluster_speed_user")
def speed_user(results: Path) -> str:
    """The emulated two-node cluster against FSDP2 bf16/fp32 and bf16/bf16 (docs/results.md)."""
    picks = [("hsdp_fsdp2_bf16", "100mbit", "HSDP 2x2, FSDP2 bf16/fp32"),
             ("hsdp_fsdp2_bf16_bf16", "100mbit", "HSDP 2x2, FSDP2 bf16/bf16"),
             ("hsdp_bf16", "100mbit", "HSDP 2x2, `bf16` preset"),
             ("hsdp_sdp4bit", "100mbit", "HSDP 2x2, `sdp4bit`"),
             ("hsdp_lowbit", "100mbit", "HSDP 2x2, `lowbit`"),
             ("fsdp2_bf16", "100mbit", "flat over 4 ranks, FSDP2 bf16/fp32"),
             ("sdp4bit", "100mbit", "flat over 4 ranks, `sdp4bit`"),
             ("hsdp_fsdp2_bf16", "1gbit", "HSDP 2x2, FSDP2 bf16/fp32"),
             ("hsdp_sdp4bit", "1gbit", "HSDP 2x2, `sdp4bit`"),
             ("sdp4bit", "1gbit", "flat over 4 ranks, `sdp4bit`")]
    rows = []
    for label, rate, name in picks:
        sp = speed(results, "cluster_speed_user", label, rate)
        bold = "**" if label.endswith("sdp4bit") and rate == "100mbit" else ""
        rows.append([name, sp.rate, f"{bold}{sp.step_s:.3f}{bold}",
                     f"{bold}{sp.vs[0]:.2f}x{bold}", f"{bold}{sp.vs[1]:.2f}x{bold}",
                     f"{sp.link_mb:.1f}", f"{sp.floor_s:.3f} ({sp.floor_kind})"])
    return _md(["layout, comm", "link", "step s", "vs FSDP2 bf16/fp32", "vs FSDP2 bf16/bf16",
                "MB/step on the link", "floor s (CPU or link)"], rows)


# ---- memory: memory.py's results.json ------------------------------------------------------------
@dataclass(frozen=True)
class Kept:
    shard: float  # FSDP2's parameter shard, over the unsharded model's bytes
    reference: float
    error_feedback: float
    level_table_bytes: int

    @property
    def kept(self) -> float:
        return self.reference + self.error_feedback  # level tables: bytes, listed apart


def memory_rows(results: Path, layout: str = "2x2") -> dict[str, Kept]:
    """Rank 0's categories of each row of ``layout``, over the unsharded model's fp32 bytes
    (memory.py's "x model"; every rank keeps the same, which memory.py checked)."""
    res = _json(results, "memory/results.json")
    if res.get("failures"):
        raise TableError(f"results/memory: the run reported failures: {res['failures']}")
    model = res["params"] * 4
    out = {}
    for name, r in res["layouts"][layout]["rows"].items():
        m = r["per_rank"][0]
        out[name] = Kept(m["params"] / model, m["reference"] / model,
                         m["error_feedback"] / model, int(m["level_tables"]))
    return out


def _frac(x: float) -> str:
    return "0" if x == 0 else f"{x:.3f}"


@table("memory_2x2", "memory")
def memory_2x2(results: Path) -> str:
    """What each rank keeps, 2 nodes x 2, over the unsharded model's bytes (docs/results.md)."""
    m = memory_rows(results)
    picks = [(("fsdp2",), "FSDP2 alone"),
             (("sdp4bit_full",), 'sdp4bit, `weight_reference="full"` (before)'),
             (("sdp4bit_node",), "sdp4bit (node-sharded reference, the default)"),
             (("sdp4bit_node_bf16",), "same, bf16 `param_dtype`"),
             (("lowbit",), "lowbit (node reference, learned levels)"),
             (("lowbit_ef",), 'lowbit + `grad_error_feedback="inter"`'),
             (("hsdp_fsdp2", "hsdp_sdp4bit"), "HSDP 2 x 2, FSDP2 alone or sdp4bit")]
    rows = []
    for names, text in picks:
        got = {m[n] for n in names}
        if len(got) != 1:
            raise TableError(f"results/memory: rows {names} differ; one table row shows both")
        k = got.pop()
        kept = _frac(k.kept) + (f" (+{k.level_table_bytes} B level tables)"
                                if k.level_table_bytes else "")
        rows.append([text, f"{k.shard:.3f}", _frac(k.reference), _frac(k.error_feedback), kept])
    return _md(["2 nodes x 2", "FSDP2 param shard", "qWD reference", "error feedback",
                "kept by fsdp_qcomm"], rows)


@table("memory_projection", "memory")
def memory_projection(results: Path) -> str:
    """memory.py's per-rank formula projected to 8 nodes x 8 GPUs, bf16 ``param_dtype``."""
    proj = _json(results, "memory/results.json")["projection"]
    n = f"{proj['nodes']} x {proj['gpus_per_node']}"
    rows = []
    for model, by in proj["bytes"].items():
        flat = by[f"FSDP2 alone, flat over {proj['nodes'] * proj['gpus_per_node']}"]
        full = by["sdp4bit flat, full reference (before)"]
        node = by["sdp4bit flat, node reference (now)"]
        hsdp = by[f"sdp4bit HSDP {n} (replica hop only)"]
        plain = by[f"FSDP2 HSDP {n}"]
        if any(hsdp[k] != plain[k] for k in ("params", "grads", "optimizer")):
            raise TableError(f"results/memory: {model}: HSDP with and without sdp4bit keep "
                             "different FSDP2 states")
        extra = "0" if hsdp["extra"] == 0 else f"{hsdp['extra'] / 1e9:.2f} GB"
        rows.append([model, f"{flat['total'] / 1e9:.2f} GB", f"+{full['extra'] / 1e9:.2f} GB",
                     f"+{node['extra'] / 1e9:.2f} GB", f"{hsdp['total'] / 1e9:.2f} GB, +{extra}"])
    return _md(["model", "FSDP2 flat: params + grads + AdamW", "full reference (before)",
                "node reference (now)", f"HSDP {n} with the presets"], rows)


@table("wire_bytes", "wire_bytes_k1")
def wire_bytes(results: Path) -> str:
    """Bytes per rank and step, 3.31M GPT, 1 micro-batch (benchmarks/README.md)."""
    res = _json(results, "wire_bytes_k1/results.json")
    rows = []
    for name, s in res["summary"].items():
        if name == "baseline":
            continue
        st = res["schemes"][name]["stats"]
        w = st["weight_allgather"]
        if "grad_intra" in st:
            grad = (f"{st['grad_intra']['bits_per_element']:.3f} / "
                    f"{st['grad_inter']['bits_per_element']:.3f}")
        elif "grad_inter" in st:
            grad = f"{st['grad_inter']['bits_per_element']:.3f} (one hop)"
        else:
            grad = "fp32"
        rows.append([name, f"{s['total'] / 1e6:#.3g} MB", f"{s['vs_bf16']:.3f}",
                     f"{s['vs_fp32']:.3f}",
                     f"{w['bits_per_element']:.3f} / {w['sending_bits_per_element']:.3f}", grad])
    return _md(["scheme", "total bytes/step", "vs FSDP bf16 W / fp32 G", "vs FSDP fp32 / fp32",
                "weight bits/elem (all gathers / gathers that send)",
                "grad bits/elem (intra / inter)"], rows)


# ---- GPU: gpu_check.json's step_cost -------------------------------------------------------------
GPU_CHECK = "gpu_check/h100_2026-12-06"  # the latest run: README's figure
GPU_CHECK_FIRST = "gpu_check/h200_2026-12-04"


def gpu_step_cost_rows(results: Path, folder: str = GPU_CHECK) -> tuple[dict, list[dict]]:
    """(the environment step's result, step_cost's rows) of a committed GPU check (the first
    one's rows were recorded although its step FAILED on the host-sync check)."""
    doc = _json(results, f"{folder}/gpu_check.json")
    if doc.get("dry_run"):
        raise TableError(f"results/{folder}: a dry run, not a GPU's figures")
    env = doc["steps"]["environment"]["result"]
    cost = doc["steps"]["step_cost"]["result"]
    if cost.get("device") != "cuda":  # gpu_step_cost.py steps in bf16 on CUDA, fp32 elsewhere
        raise TableError(f"results/{folder}: step_cost ran on {cost.get('device')!r}")
    return env, cost["rows"]


def _gpu_goal(rows: list[dict]) -> str:
    goals = {m.group(1) for r in rows if r.get("goal")
             for m in [re.search(r"<=\s*(\d+(?:\.\d+)?%)", r["goal"])] if m}
    if len(goals) != 1:
        raise TableError(f"step_cost's goal is not one figure: {goals}")
    return goals.pop()


def _gpu_step_cost(results: Path, folder: str) -> str:
    _, rows = gpu_step_cost_rows(results, folder)
    out = []
    for r in rows:
        name = r["shape"]["name"]
        name = re.sub(r"^(\w+)-(\d+)L$", r"\1, \2 layers", name)
        b = r["cross_node_bytes_per_step"]
        out.append([name, f"{r['world']} x {r['ranks_per_node']}", f"{r['fsdp2']['ms']:.1f}",
                    f"{r['enabled']['ms']:.1f}", f"{100 * r['codec_share']:.1f}%",
                    f"{b['fsdp2'] / 1e9:.2f} / {b[r['preset']] / 1e9:.2f}"])
    return _md(["shape", "W x G", "FSDP2 ms", "with sdp4bit ms", "codec share",
                "GB/step to other nodes, FSDP2 / sdp4bit"], out)


@table("gpu_step_cost", GPU_CHECK.split("/")[0])
def gpu_step_cost(results: Path) -> str:
    """What enable(sdp4bit) adds to a bf16 step on the latest GPU run (docs/gpu_path.md)."""
    return _gpu_step_cost(results, GPU_CHECK)


@table("gpu_step_cost_first", GPU_CHECK_FIRST.split("/")[0])
def gpu_step_cost_first(results: Path) -> str:
    """The same on the first GPU run, one H200 (docs/gpu_path.md)."""
    return _gpu_step_cost(results, GPU_CHECK_FIRST)


# ---- markers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    name: str
    indent: str
    open_line: int  # 0-based line index of the opening marker
    close_line: int  # of the closing marker


def blocks(text: str) -> list[Block]:
    """The marked blocks of a markdown text, in order. Raises ``TableError`` for a marker
    without its partner, nested or crossed markers."""
    out: list[Block] = []
    cur: Optional[tuple[str, str, int]] = None
    fence: Optional[str] = None
    for i, line in enumerate(text.split("\n")):
        f = _FENCE.match(line)
        if f and cur is None:
            if fence is None:
                fence = f.group(1)
            elif f.group(1) == fence:
                fence = None
            continue
        if fence is not None:
            continue
        o, c = _OPEN.fullmatch(line), _CLOSE.fullmatch(line)
        if o:
            if cur is not None:
                raise TableError(f"line {i + 1}: table:{o.group(2)} opens inside table:{cur[0]} "
                                 f"(line {cur[2] + 1})")
            cur = (o.group(2), o.group(1), i)
        elif c:
            if cur is None or c.group(1) != cur[0]:
                raise TableError(f"line {i + 1}: /table:{c.group(1)} closes no open "
                                 f"table:{c.group(1)}")
            out.append(Block(cur[0], cur[1], cur[2], i))
            cur = None
    if cur is not None:
        raise TableError(f"line {cur[2] + 1}: table:{cur[0]} is never closed "
                         f"(<!-- /table:{cur[0]} -->)")
    return out


def generated_lines(lines: list[str]) -> set[int]:
    """1-based numbers of the lines inside marked blocks, markers included (check_figures
    skips their figures); empty if the markers do not pair up (``--check`` reports that)."""
    try:
        found = blocks("\n".join(lines))
    except TableError:
        return set()
    return {n + 1 for b in found for n in range(b.open_line, b.close_line + 1)}


def _relink(md: str, rel_dir: str) -> str:
    """Repository-relative link targets (``](docs/..)``, ``](results/..)``) made relative to
    ``rel_dir`` (the rendered file's folder, relative to the repository)."""
    if rel_dir in ("", "."):
        return md
    return re.sub(r"\]\(((?:docs|results|benchmarks|recipes|examples)/[^)\s]*|[\w.\-]+\.md)\)",
                  lambda m: "](" + os.path.relpath(m.group(1), rel_dir).replace(os.sep, "/")
                  + ")", md)


def render(name: str, results: Path = ROOT / "results", rel_dir: str = "") -> str:
    """Table ``name``'s markdown, its links relative to ``rel_dir``."""
    if name not in TABLES:
        raise TableError(f"unknown table {name!r} (known: {', '.join(sorted(TABLES))})")
    return _relink(TABLES[name].build(results), rel_dir)


def fill(text: str, results: Path = ROOT / "results", rel_dir: str = "",
         cache: Optional[dict] = None) -> tuple[str, list[tuple[str, str, str]]]:
    """``text`` with every marked block rendered again, and ``(name, old, new)`` per block
    whose content changed."""
    lines = text.split("\n")
    cache = {} if cache is None else cache
    changed = []
    for b in reversed(blocks(text)):  # from the end: earlier line numbers stay valid
        key = (b.name, str(results), rel_dir)
        if key not in cache:
            cache[key] = render(b.name, results, rel_dir)
        new = [b.indent + ln if ln else ln for ln in cache[key].split("\n")]
        old = lines[b.open_line + 1:b.close_line]
        if old != new:
            changed.append((b.name, "\n".join(old), "\n".join(new)))
            lines[b.open_line + 1:b.close_line] = new
    return "\n".join(lines), changed[::-1]


def doc_files(root: Path = ROOT) -> list[Path]:
    """The markdown files of ``DOC_GLOBS`` that hold at least one marker."""
    seen: dict[Path, None] = {}  # ordered, each file once
    for pattern in DOC_GLOBS:
        for p in sorted(root.glob(pattern)):
            if p.is_file() and blocks_or_error(p):
                seen.setdefault(p, None)
    return list(seen)


def blocks_or_error(path: Path) -> bool:
    """Whether ``path`` has marked blocks (True also when its markers are malformed, so that
    the caller reports them)."""
    try:
        return bool(blocks(path.read_text()))
    except TableError:
        return True


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def _rel_dir(path: Path, root: Path) -> str:
    """The folder of ``path`` relative to the repository ("" at its root or outside it: links
    stay repository-relative)."""
    try:
        return os.path.dirname(str(path.resolve().relative_to(root.resolve())))
    except ValueError:
        return ""


def check_file(path: Path, root: Path = ROOT, results: Optional[Path] = None,
               cache: Optional[dict] = None) -> list[str]:
    """Problems of one file: a diff per stale block, or why it cannot be rendered."""
    rel = _rel(path, root)
    try:
        _, changed = fill(path.read_text(), results or root / "results", _rel_dir(path, root),
                          cache)
    except (TableError, KeyError) as e:
        return [f"{rel}: {type(e).__name__}: {e}"]
    out = []
    for name, old, new in changed:
        diff = difflib.unified_diff(old.split("\n"), new.split("\n"),
                                    f"{rel} (table:{name}, as written)",
                                    f"{rel} (table:{name}, from results/)", lineterm="", n=0)
        out.append(f"{rel}: table:{name} differs from what the results say:\n"
                   + "\n".join(diff))
    return out


def write_file(path: Path, root: Path = ROOT, results: Optional[Path] = None,
               cache: Optional[dict] = None) -> list[str]:
    """Render every block of ``path`` in place; the names of the blocks that changed."""
    text, changed = fill(path.read_text(), results or root / "results", _rel_dir(path, root),
                         cache)
    if changed:
        path.write_text(text)
    return [name for name, _, _ in changed]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a block differs from its results")
    ap.add_argument("--file", action="append", default=[], metavar="F",
                    help="only this markdown file (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the tables and their sources")
    ap.add_argument("--show", metavar="NAME", help="print one table's markdown")
    a = ap.parse_args(argv)
    if a.list:
        for t in TABLES.values():
            print(f"{t.name}: {t.doc} (reads {', '.join('results/' + s for s in t.sources)})")
        return 0
    if a.show:
        try:
            print(render(a.show))
        except TableError as e:
            print(f"tables: {e}", file=sys.stderr)
            return 1
        return 0
    paths = [Path(f) for f in a.file] if a.file else doc_files(ROOT)
    cache: dict = {}
    problems = []
    for p in paths:
        if not p.is_file():
            problems.append(f"{p}: no such file")
            continue
        if a.check:
            problems += check_file(p, cache=cache)
            continue
        try:
            names = write_file(p, cache=cache)
        except TableError as e:
            problems.append(f"{_rel(p, ROOT)}: {e}")
            continue
        if names:
            print(f"{_rel(p, ROOT)}: rendered {', '.join('table:' + n for n in names)}")
    for msg in problems:
        print(msg)
    if a.check and problems:
        print("tables: run `python benchmarks/tables.py` to render them from results/",
              file=sys.stderr)
    print(f"tables: {len(paths)} file(s) with markers, {len(problems)} problem(s)",
          file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
