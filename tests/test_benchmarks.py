"""Benchmark helpers that must fail clearly or count exactly (no ranks, no network, < 5 s)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _model  # noqa: E402
import _provenance  # noqa: E402
import _seeds  # noqa: E402
import accuracy  # noqa: E402
import cluster_speed  # noqa: E402


def test_rate_parsing_and_refusal():
    assert cluster_speed._rate_bps("1gbit") == 1e9
    assert cluster_speed._rate_bps("100mbit") == 1e8
    assert cluster_speed._rate_bps("2.5gbit") == 2.5e9
    with pytest.raises(ValueError, match="100mbit, 1gbit"):
        cluster_speed._rate_bps("1gbps")


def test_cluster_table_floor_is_the_larger_bound_not_the_sum():
    s = {"median_step_s": 0.5, "comm_s": 0.1, "quant_s": 0.0, "rest_s": 0.4,
         "link_bytes_per_step": 2.5e7, "link_busier_direction_bytes_per_step": 2.5e7,
         "cpu_all_ranks_s": 0.8}
    res = {"cores": 2, "rates": {"1gbit": {"schemes": {"baseline": s}}}}
    row = [ln for ln in cluster_speed._tables(res).splitlines() if ln.startswith("| baseline")][0]
    # CPU floor 0.8 / 2 = 0.4 s, link floor 8 * 25 MB / 1 Gbit/s = 0.2 s: the floor is 0.4 s
    assert row.endswith("| 0.800 | 0.400 | 0.200 | 0.400 | 1.25 |"), row


def test_cluster_rows_give_speedup_and_bytes_against_each_fsdp2_baseline_measured():
    def row(step, link):
        return {"median_step_s": step, "comm_s": 0.1, "quant_s": 0.0, "rest_s": 0.1,
                "link_bytes_per_step": link, "link_busier_direction_bytes_per_step": link / 2,
                "cpu_all_ranks_s": 0.2}

    sch = {"baseline": row(2.0, 4e6), "fsdp2_bf16": row(1.5, 3e6), "sdp4bit": row(1.0, 5e5),
           "hsdp": row(3.0, 2e6), "hsdp_sdp4bit": row(1.0, 2e5)}
    table = cluster_speed._tables({"cores": 2, "rates": {"100mbit": {"schemes": sch}}})
    lines = {ln.split(" | ")[0][2:]: ln for ln in table.splitlines() if ln.startswith("| ")}
    # flat rows against the flat baselines this run measured (bf16/bf16 not run: "-")
    assert "| 2.00x / 1.50x / - |" in lines["sdp4bit"]
    assert "| 0.125 / 0.167 / - |" in lines["sdp4bit"]
    assert "| 3.00x / - / - |" in lines["hsdp_sdp4bit"]  # HSDP rows against HSDP baselines
    assert set(cluster_speed.USER_SCHEMES.split(",")) <= set(cluster_speed.SCHEMES)


def test_cluster_diloco_rows_build_their_configs_and_time_whole_outer_periods():
    from fsdp_qcomm.diloco import DiLoCoConfig

    a = cluster_speed._args(["--schemes", "diloco-set"])
    assert a.schemes == ["hsdp", "hsdp_sdp4bit", "diloco_h8", "diloco_h32", "streaming_h32_f2d1"]
    cfg = {label: cluster_speed.diloco_row(label).config(a.seed) for label in cluster_speed.DILOCO}
    assert all(isinstance(c, DiLoCoConfig) and c.seed == a.seed for c in cfg.values())
    assert (cfg["diloco_h8"].sync_every, cfg["diloco_h32"].sync_every) == (8, 32)
    s = cfg["streaming_h32_f2d1"]
    assert (s.sync_every, s.fragments, s.delay, s.bits) == (32, 2, 1, 4)
    for label, c in cfg.items():
        assert cluster_speed.SCHEMES[label][1] == "diloco"
        # the default window is whole outer periods, at least 2 outer steps of every row
        assert a.diloco_steps % c.sync_every == 0 and a.diloco_steps // c.sync_every >= 2
    with pytest.raises(SystemExit):  # 48 steps are 1.5 outer periods of H=32
        cluster_speed._args(["--schemes", "diloco_h32", "--diloco-steps", "48"])
    with pytest.raises(SystemExit):  # launched after warm-up step 16, merged inside the window
        cluster_speed._args(["--schemes", "streaming_h32_f2d1", "--warmup", "16"])


def test_cluster_diloco_row_counts_its_outer_sync_once_per_period():
    def rank(steps, cpu):
        n = len(steps)
        return {"steps": steps, "cpu": cpu, "comm_in_hook": [0.0] * n,
                "comm_outside": [0.0] * n, "hook": [0.0] * n, "comm_by": [{}] * n,
                "stats": {"outer_allreduce": {"calls": 1, "sent_bytes": 800}},
                "veth_tx": 8e6, "veth_rx": 8e6, "pg_bytes_outside": {}, "gather_modes": None,
                "numel": 10, "shard_numel": 5, "outer_steps": 2}

    # H = 8, two outer periods: the sync step is the slow one
    ranks = [rank(([0.1] * 7 + [0.9]) * 2, ([0.05] * 7 + [0.25]) * 2) for _ in range(4)]
    s = cluster_speed._summarize(ranks, 16, period=8)
    assert s["median_step_s"] == pytest.approx(0.2)  # (7 x 0.1 + 0.9) / 8: the sync amortized
    assert s["median_inner_step_s"] == pytest.approx(0.1)
    assert (s["period_steps"], s["outer_steps"]) == (8, 2)
    assert s["cpu_all_ranks_s"] == pytest.approx(4 * 0.075)
    assert s["stats_per_step_all_ranks"]["outer_allreduce"]["sent_bytes"] == 4 * 800 / 16
    # a per-step row (period 1) is the median over steps, as before: the sync left out
    assert cluster_speed._summarize(ranks, 16)["median_step_s"] == pytest.approx(0.1)
    hsdp = {"median_step_s": 0.4, "comm_s": 0.1, "quant_s": 0.0, "rest_s": 0.3,
            "link_bytes_per_step": 8e7, "link_busier_direction_bytes_per_step": 4e7,
            "cpu_all_ranks_s": 0.8}
    table = cluster_speed._tables({"cores": 2, "rates": {"1gbit": {"schemes": {
        "hsdp": hsdp, "diloco_h8": s}}}})
    line = next(ln for ln in table.splitlines() if ln.startswith("| diloco_h8"))
    assert "(H=8, 2 outer steps timed; median inner step 0.100 s) | 0.200 | 2.00x / - / - |" \
        in line  # against the HSDP baselines
    # link: 4 x 8 MB over 16 steps, 0.025 of HSDP's; floor: CPU 0.3 / 2 cores > link 0.004 s
    assert "| 2.00 | 0.025 / - / - |" in line
    assert line.endswith("| 0.300 | 0.150 | 0.004 | 0.150 | 1.33 |"), line


def test_missing_data_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data"):
        _model.CharData(str(tmp_path / "nope.txt"))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ValueError, match="at least 10000"):
        _model.CharData(str(short))


def test_chardata_jsonl_split_and_batches(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join('{"text": "%s"}' % ("hello world " * 20) for _ in range(100)))
    d = _model.CharData(str(f))
    assert len(d.train) + len(d.val) == len("\n".join(["hello world " * 20] * 100))
    x, y = d.batch("train", 4, 16, seed=1, step=3, rank=2)
    x2, y2 = d.batch("train", 4, 16, seed=1, step=3, rank=2)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # same batch for every scheme
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert not torch.equal(x, d.batch("train", 4, 16, seed=1, step=3, rank=1)[0])


def test_param_count_matches_model():
    shape = _model.GPTShape(vocab=65, dim=64, layers=3, heads=4, seq=32)
    model = _model.GPT(shape)
    assert shape.params() == sum(p.numel() for p in model.parameters())


# ---- several seeds: statistics and the run store ----------------------------------------------
def test_spread_and_paired_gap():
    s = _seeds.spread([1.0, 2.0, 3.0])
    assert (s.n, s.mean, s.sd) == (3, 2.0, 1.0)
    assert s.ci95 == pytest.approx(4.303 / 3 ** 0.5)  # t(0.975, 2 df) * sd / sqrt(n)
    one = _seeds.spread([5.0])
    assert one.sd == 0.0 and one.beyond_noise is None
    # paired by seed: only common seeds count; a steady +1% gap is beyond noise, a +-1% one not
    gap = _seeds.paired_gap_pct({1: 2.02, 2: 3.03, 3: 1.01, 9: 7.0}, {1: 2.0, 2: 3.0, 3: 1.0})
    assert gap.n == 3 and gap.mean == pytest.approx(1.0) and gap.beyond_noise
    noisy = _seeds.paired_gap_pct({1: 2.02, 2: 2.98}, {1: 2.0, 2: 3.0})
    assert noisy.beyond_noise is False
    assert _seeds.paired_gap_pct({1: 1.0}, {2: 1.0}) is None
    assert _seeds.fmt_spread(s, 2) == "2.00 ± 1.00"
    assert _seeds.fmt_verdict(gap).endswith("beyond seed noise")
    with pytest.raises(ValueError, match="at least one seed"):
        _seeds.seed_list(3, 0)
    assert _seeds.seed_list(1234, 3) == [1234, 1235, 1236]


def test_run_store_resumes_splits_and_refuses_other_settings(tmp_path):
    setup = {"steps": 60, "dim": 32}
    store = _seeds.RunStore(tmp_path, setup)
    row = {"preset": "sdp4bit", "overrides": {}, "replicate": 1}
    assert store.load("SDP4Bit", 1, row) is None
    store.save("SDP4Bit", 1, row, {"final_val": 2.5})
    store.save("baseline", 1, {"preset": None}, {"final_val": 2.4})
    # a later invocation with the same settings (another scheme or seed) sees both
    again = _seeds.RunStore(tmp_path, dict(setup))
    assert again.load("SDP4Bit", 1, row) == {"final_val": 2.5}
    assert sorted(again.all()) == ["SDP4Bit", "baseline"]
    assert list(tmp_path.joinpath("runs").glob("*.tmp")) == []
    # other settings or another definition of a row: refused, naming what differs
    with pytest.raises(_seeds.SetupMismatch, match="steps: stored 60, now 1000.*another --out"):
        _seeds.RunStore(tmp_path, {"steps": 1000, "dim": 32}).all()
    with pytest.raises(_seeds.SetupMismatch, match="rename the row or pass --fresh"):
        again.load("SDP4Bit", 1, {**row, "replicate": 2})


def test_paired_stores_gap_of_one_row_across_two_stores(tmp_path):
    import paired_stores

    setup = {"steps": 60, "dim": 32}
    row = {"preset": "lowbit", "overrides": {}}

    def store(name, finals, other=None):
        st = _seeds.RunStore(tmp_path / name, setup)
        for seed, v in finals.items():  # last 2 whole-split evaluations: v + 0.1, v - 0.1
            st.save("lowbit", seed, row, {"val": [[50, 9.0]],
                                          "val_full": [[40, 9.0], [50, v + 0.1], [60, v - 0.1]]})
        if other:
            st.save("other", 1, row, {"val_full": [[60, 1.0]]})
        return tmp_path / name

    before = store("before", {1: 2.0, 2: 2.5, 3: 4.0}, other=True)
    after = store("after", {1: 2.02, 2: 2.525, 3: 4.04, 4: 1.0})
    res = paired_stores.compare(before, after, "lowbit", tail=2)
    # +1% on each of the 3 seeds both hold (seed 4 only after: listed, not paired)
    gap = res["gap_pct"]
    assert gap["n"] == 3 and gap["mean"] == pytest.approx(1.0) and gap["sd"] == pytest.approx(0)
    assert res["seeds"][4] == {"before": None, "after": 1.0}
    assert res["summary"].endswith("+1.000% ± 0.000%, [+1.000, +1.000]%, before lower")
    assert "| 4 | - | 1.00000 |" in paired_stores.report(res, before, after)
    # the sampled batches when asked; the stores' settings must agree
    assert paired_stores.compare(before, after, "lowbit", 1, False)["gap_pct"]["mean"] == 0
    _seeds.RunStore(tmp_path / "long", {**setup, "steps": 90}).save("lowbit", 1, row, {})
    with pytest.raises(SystemExit, match=r"setups differ in steps \(60 against 90\)"):
        paired_stores.compare(before, tmp_path / "long", "lowbit")
    with pytest.raises(SystemExit, match="holds no run of row 'missing'"):
        paired_stores.compare(before, after, "missing")


def test_accuracy_rows_resume_and_table(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("to be or not to be, that is the question. " * 400)
    a = accuracy._args(["--data", str(data), "--seeds", "2", "--schemes", "baseline,SDP4Bit",
                        "--out", str(tmp_path / "out")])
    store = _seeds.RunStore(tmp_path / "out", accuracy._setup(a))
    assert accuracy._pending(a, store) == [("baseline", 1234), ("SDP4Bit", 1234),
                                           ("baseline", 1235), ("SDP4Bit", 1235)]
    for seed, (b, q) in {1234: (2.0, 2.02), 1235: (3.0, 3.03)}.items():
        for label, v in (("baseline", b), ("SDP4Bit", q)):
            store.save(label, seed, accuracy._row(label),
                       {"final_val": v, "seconds": 10.0, "train": [v], "val": [[1, v]]})
    assert accuracy._pending(a, store) == []  # resumed: nothing left to train
    # split by seed: another --seed is the same setup (the held-out batches stay the same)
    later = accuracy._args(["--data", str(data), "--seed", "1236", "--out", str(a.out)])
    assert accuracy._setup(later) == store.setup
    assert accuracy._pending(later, store) == [(s, 1236) for s in accuracy.SCHEMES]
    fresh = accuracy._args(["--data", str(data), "--fresh", "--schemes", "SDP4Bit",
                            "--out", str(tmp_path / "out")])
    assert accuracy._pending(fresh, store) == [("SDP4Bit", 1234)]
    summary = accuracy._summary(store.all())
    assert list(summary) == ["baseline", "SDP4Bit"]
    g = summary["SDP4Bit"]["gap_pct_vs_baseline"]
    assert g["n"] == 2 and g["mean"] == pytest.approx(1.0) and g["sd"] == pytest.approx(0.0)
    table = accuracy._table(summary)
    assert "| SDP4Bit | sdp4bit | 2 | 2.52500 ± 0.71418 | +1.00% ± 0.00% |" in table
    # extra rows are one line: a preset, overrides and the mesh
    row = accuracy.Scheme("sdp4bit", {"grad_pipeline_chunks": 2}, hsdp=True)
    assert row.describe() == "sdp4bit grad_pipeline_chunks=2, HSDP"
    with pytest.raises(SystemExit):
        accuracy._args(["--seeds", "0"])


# ---- provenance: every invocation that wrote to a results folder --------------------------------
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _invoke(tmp_path, body: str, *args: str):
    import subprocess

    script = tmp_path / "bench_stub.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(BENCH)!r})\nimport _provenance\n"
                      + body)
    # the recorded command carries the caller's ENV_KEYS (FSDP_QCOMM_NATIVE=1 from a repeat
    # loop, ...): only OMP_NUM_THREADS=1, so the command the test asserts is the same anywhere
    drop = {"SUDO_USER", "PYTHONPATH", *_provenance.ENV_KEYS}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_provenance_appends_every_invocation_in_order(tmp_path):
    out = tmp_path / "results" / "demo"
    ok = _invoke(tmp_path, f"_provenance.record({str(out)!r})\nprint('done')\n", "--steps", "3")
    assert ok.returncode == 0, ok.stderr
    bad = _invoke(tmp_path, f"_provenance.record({str(out)!r})\nraise RuntimeError('boom')\n",
                  "--seed", "7 8")
    assert bad.returncode == 1
    doc = json.loads((out / "provenance.json").read_text())
    first, second = doc["invocations"]
    assert first["command"].startswith("OMP_NUM_THREADS=1 python ")
    assert first["command"].endswith("bench_stub.py --steps 3")
    assert second["command"].endswith("bench_stub.py --seed '7 8'")  # a shell command line
    assert first["status"] == "ended without an exception"
    assert second["status"] == "exception: RuntimeError: boom"
    for e in (first, second):
        assert len(e["git_commit"]) == 40 and isinstance(e["git_dirty"], bool)
        assert e["start"] <= e["end"] and e["wall_s"] >= 0
        assert len(e["loadavg_start"]) == len(e["loadavg_end"]) == 3
        assert e["cpu_count"] == os.cpu_count() and e["load_samples"] >= 1
    md = (out / "COMMANDS.md").read_text()
    assert md.index("--steps 3") < md.index("--seed") and "load average" in md
    assert sorted(p.name for p in out.iterdir()) == ["COMMANDS.md", "provenance.json"]


def test_provenance_render_marks_what_was_not_recorded():
    doc = {"folder": "results/old", "reconstructed": True, "added_in": ["abc1234"],
           "invocations": [{"command": "python benchmarks/x.py --out results/old",
                            "git_commit": _provenance.NOT_RECORDED,
                            "start": _provenance.NOT_RECORDED, "source": "commit abc1234"}]}
    md = _provenance.render(doc)
    assert "Reconstructed after the fact" in md and "abc1234" in md
    assert f"commit: {_provenance.NOT_RECORDED}" in md
    assert f"at start: {_provenance.NOT_RECORDED}" in md  # absent fields say so too


def test_every_benchmark_that_writes_results_records_its_provenance():
    # check_figures.py and tables.py read results and docs; they write no results folder
    writers = [p for p in sorted(BENCH.glob("*.py"))
               if not p.name.startswith("_") and p.name not in ("check_figures.py", "tables.py")]
    assert writers, BENCH
    missing = [p.name for p in writers if "_provenance.record(" not in p.read_text()]
    assert not missing, f"benchmarks that write results without _provenance.record: {missing}"


# ---- verdicts: what a row's interval settles ---------------------------------------------------
def _gap(mean: float, sd: float, n: int) -> "_seeds.Spread":
    t = {2: 12.706, 3: 4.303, 5: 2.776}[n]
    return _seeds.Spread(n, mean, sd, t * sd / n ** 0.5)


@pytest.mark.parametrize("mean, sd, n, want", [
    (0.07, 0.10, 3, "within +0.5%"),   # the quieter check's sdp4bit: [-0.18, +0.32]
    (1.27, 0.28, 3, "worse"),          # its lowbit: [+0.57, +1.97]
    (8.09, 0.76, 3, "worse"),          # qW
    (0.36, 0.66, 3, "undecided"),      # the committed frontier's lowbit: [-1.28, +2.00]
    (0.30, 0.05, 3, "within +0.5%"),   # [+0.18, +0.42]: above 0, yet within the tolerance
    (0.20, 0.10, 2, "undecided"),      # 2 seeds: t = 12.7 makes the interval wide
    (0.20, 0.00, 1, "undecided"),      # one seed: no interval
])
def test_verdict_from_the_interval(mean, sd, n, want):
    s = _gap(mean, sd, n) if n > 1 else _seeds.spread([mean])
    assert _seeds.verdict(s) == want


def test_verdict_thresholds_are_the_named_constants():
    assert (_seeds.CLAIM_PCT, _seeds.WORSE_ABOVE_PCT) == (0.5, 0.0)
    assert _seeds.WITHIN == "within +0.5%"
    # exactly on a bound: the upper bound may equal +0.5%; a lower bound of exactly 0 is not
    # "worse"
    on_claim = _seeds.Spread(3, 0.4, 0.0, 0.1)
    assert _seeds.verdict(on_claim) == _seeds.WITHIN
    on_zero = _seeds.Spread(3, 0.6, 0.0, 0.6)
    assert _seeds.verdict(on_zero) == _seeds.UNDECIDED
    assert _seeds.verdict(None) == _seeds.UNDECIDED
    # another tolerance is a parameter (DiLoCo's +1.0%), not a second copy of the rule
    wider = _seeds.Spread(3, 0.5, 0.0, 0.5)  # [+0.00, +1.00]
    assert _seeds.verdict(wider) == _seeds.UNDECIDED
    assert _seeds.verdict(wider, claim_pct=1.0) == _seeds.within(1.0) == "within +1.0%"
    assert _seeds.verdict(_seeds.Spread(3, 1.5, 0.0, 0.3), claim_pct=1.0) == _seeds.WORSE
    assert _seeds.fmt_interval(_seeds.Spread(3, 0.4, 0.0, 0.1)) == "[+0.30, +0.50]%"
    assert _seeds.fmt_interval(_seeds.spread([1.0])) == "1 seed"


def test_scores_seed_parts_and_provenance(tmp_path):
    rec = {"val": [[100, 3.0], [200, 2.0]], "val_full": [[100, 2.9], [200, 2.1]]}
    assert accuracy.score(rec) == 2.1  # the whole held-out split when the run has it
    assert accuracy.score(rec, tail=2) == pytest.approx(2.5)
    assert accuracy.score(rec, full=False) == 2.0
    with pytest.raises(ValueError, match="fewer than --tail 3"):
        accuracy.score(rec, tail=3)
    data = tmp_path / "d.txt"
    data.write_text("to be or not to be, that is the question. " * 400)
    a = accuracy._args(["--data", str(data), "--fix", "init,data", "--seed", "7"])
    assert accuracy.seeds_of(a, 9) == {"init": 7, "data": 7, "quant": 9}
    # with init and data held, an unquantized row is one computation for every seed
    assert accuracy._effective(a, "baseline", 8) == accuracy._effective(a, "baseline", 9)
    assert accuracy._effective(a, "SDP4Bit", 8) != accuracy._effective(a, "SDP4Bit", 9)
    # new settings join the setup only when not at their default: older stores stay valid
    plain = accuracy._setup(accuracy._args(["--data", str(data)]))
    assert "fix" not in plain and "eval_full" not in plain
    assert accuracy._setup(a)["fix"] == ["data", "init"]
    with pytest.raises(SystemExit):
        accuracy._args(["--fix", "weights"])
    # a sweep notes what it trained in its _provenance entry (no second provenance format)
    assert not hasattr(_seeds, "Provenance")
    out = tmp_path / "results" / "out"
    ok = _invoke(tmp_path, f"rec = _provenance.record({str(out)!r})\n"
                           "rec.note(trained_runs=2, train_wall_s=1.5)\n", "--steps", "3")
    assert ok.returncode == 0, ok.stderr
    (inv,) = json.loads((out / "provenance.json").read_text())["invocations"]
    assert inv["trained_runs"] == 2 and inv["train_wall_s"] == 1.5
    assert inv["status"] == "ended without an exception" and inv["end"]
    assert "trained_runs: 2; train_wall_s: 1.5" in (out / "COMMANDS.md").read_text()


def test_frontier_reuses_a_run_only_when_it_is_the_same_computation(tmp_path):
    import frontier

    data = tmp_path / "d.txt"
    data.write_text("to be or not to be, that is the question. " * 400)
    plain = frontier._args(["--data", str(data), "--rows", "baseline,SDP4Bit",
                            "--out", str(tmp_path / "all")])
    store = _seeds.RunStore(tmp_path / "all", accuracy._setup(plain))
    for label in ("baseline", "SDP4Bit"):
        for seed in (1234, 1235):
            store.save(label, seed, accuracy._row(label),
                       {"final_val": 2.0, "seconds": 1.0, "train": [2.0], "val": [[1, 2.0]],
                        "seeds": accuracy.seeds_of(plain, seed)})
    fixed = frontier._args(["--data", str(data), "--rows", "baseline,SDP4Bit", "--seeds", "2",
                            "--fix", "init,data", "--reuse", str(tmp_path / "all"),
                            "--out", str(tmp_path / "quant_only")])
    mine = _seeds.RunStore(tmp_path / "quant_only", accuracy._setup(fixed))
    # seed 1234 with init and data held at 1234 is the plain run of seed 1234; seed 1235 is not
    assert frontier._copy_reused(fixed, mine) == 2
    assert sorted(mine.all()["SDP4Bit"]["runs"]) == [1234]
    rec = mine.load("SDP4Bit", 1234, accuracy._row("SDP4Bit"))
    assert rec["copied_from"] == "all/runs/SDP4Bit__seed1234.json"
    # the unquantized row of seed 1235 is the same computation as seed 1234's: not retrained
    assert accuracy._pending(fixed, mine) == [("SDP4Bit", 1235)]
    assert mine.load("baseline", 1235, accuracy._row("baseline"))["same_as_seed"] == 1234


def test_diloco_report_scores_like_accuracy_and_judges_at_one_percent(tmp_path):
    import diloco

    data = tmp_path / "d.txt"
    data.write_text("to be or not to be, that is the question. " * 400)
    a = diloco._args(["--data", str(data), "--steps", "64", "--eval-every", "32", "--eval-full",
                      "--full-last", "2", "--tail", "2", "--out", str(tmp_path / "out"),
                      "--budget-row", "DiLoCo H32 4b"])
    store = _seeds.RunStore(tmp_path / "out", diloco.setup_of(a))
    assert store.setup["eval_full"] and store.setup["full_last"] == 2
    gaps = {"DiLoCo H32 4b": (0.6, 0.7, 0.8), "DiLoCo H8 4b": (3.0, 3.5, 4.0)}
    for i, seed in enumerate((1, 2, 3)):
        for label, g in (("HSDP", None), *gaps.items()):
            v = 2.0 * (1 + (g[i] if g else 0.0) / 100)
            store.save(label, seed, diloco._row(label), {
                "train": [3.0] * 64, "val": [[32, 9.0], [64, 9.0]], "final_val": 9.0,
                "val_full": [[32, v], [64, v]], "cross_node_bytes_per_step": 100.0,
                "seconds": 1.0, "timing": {"train_s": 6.4}, "params": 1000, "vocab": 20})
    md = diloco.write_report(a, store)
    rows = {ln.split(" | ")[0][2:]: ln for ln in md.splitlines() if ln.startswith("| ")}
    # scored on the whole split (the sampled 9.0 is not read): H32 +0.70% [+0.45, +0.95]
    assert "| +0.70% ± 0.10% | [+0.45, +0.95]% | within +1.0% |" in rows["DiLoCo H32 4b"]
    assert "| worse |" in rows["DiLoCo H8 4b"] and rows["HSDP"].endswith("| 0.100 |")
    assert "mean of the last 2 evaluations on the whole held-out split" in md


def test_diloco_bpe_workload_enters_the_setup_only_when_set(tmp_path, monkeypatch):
    """diloco.py's --bpe is accuracy.py's: the data comes from ``accuracy.load_data`` and the
    setup gains ``bpe`` and the token streams' digest; without it the setup is the char
    stores' own (no ``bpe`` key, the file's digest: results/diloco_640 stays valid)."""
    import diloco

    data = tmp_path / "d.txt"
    data.write_text("to be or not to be, that is the question. " * 400)
    char = diloco.setup_of(diloco._args(["--data", str(data)]))
    assert list(char) == [*diloco._SETUP_ARGS, "data"]
    assert char["data"] == _seeds.file_digest(data)

    class FakeBPE:  # BPEData without building the corpus
        def __init__(self, vocab: int) -> None:
            self.vocab = vocab

        def digest(self) -> str:
            return f"pystdlib bpe{self.vocab} sha256:0"

    monkeypatch.setattr(accuracy, "load_data", lambda a: FakeBPE(a.bpe) if a.bpe else None)
    bpe = diloco.setup_of(diloco._args(["--bpe", "2048"]))
    assert {k: bpe.pop(k) for k in ("bpe", "data")} == {"bpe": 2048,
                                                       "data": "pystdlib bpe2048 sha256:0"}
    assert bpe == {k: v for k, v in char.items() if k != "data"}
    with pytest.raises(SystemExit):
        diloco._args(["--bpe", "2048", "--data", str(data)])


def test_diloco_benchmark_gives_accuracy_its_schedule_arguments():
    """benchmarks/diloco.py trains with accuracy.py's learning-rate schedule and evaluation:
    its parsed arguments carry every field those read (a field added to accuracy.py once made
    every DiLoCo run fail at its first step)."""
    import diloco

    a = diloco._args(["--steps", "100", "--lr-final", "0.2"])
    assert accuracy._lr(0, a) == pytest.approx(a.lr / a.warmup)
    assert accuracy._lr(a.steps, a) == pytest.approx(a.lr * 0.2)
    for field in ("batch", "eval_batches", "val_seed"):
        assert hasattr(a, field), field


def test_diloco_noise_row_is_the_benchmarks_own_and_seeded_per_shard():
    """A row's ``noise`` (issue 44's control: Gaussian noise on the fp32 outer gradient) never
    reaches ``DiLoCoConfig``, must be > 0, keeps the row out of the fp32-twin pairing, and
    draws the same noise on every replica of a shard: different across shards, outer steps,
    fragments and seeds, of ``noise`` times the rms of the mean it is added to."""
    import diloco

    fields = dict(sync_every=32, bits=32, hadamard=False, error_feedback=False, outer_lr=0.7,
                  outer_momentum=0.8)
    row = diloco.Row(diloco={**fields, "noise": 1.4})
    cfg = row.config(7)
    assert (cfg.bits, cfg.seed, row.noise) == (None, 7, 1.4)
    assert row.describe() == ("DiLoCo H=32, fp32 outer + Gaussian noise 1.4x its rms, "
                              "outer lr 0.7, momentum 0.8")
    assert diloco._twin_key(row.diloco) == diloco._twin_key(fields)
    for bad in (0, -0.5, float("nan"), True, "1.4"):
        with pytest.raises(ValueError, match="noise"):
            diloco.Row(diloco={**fields, "noise": bad}).config(0)
    # a 2-bit row pairs with the plain fp32 row, not with the noise row stored before it
    runs = {1: {"val": [[32, 2.0]]}, 2: {"val": [[32, 2.1]]}}
    stored = {label: {"row": {"diloco": d}, "runs": runs} for label, d in (
        ("noise", {**fields, "noise": 1.4}), ("fp32", fields),
        ("2b", {**fields, "bits": 2, "hadamard": True}))}
    summary: dict = {}
    diloco._quantizer_part(stored, type("A", (), {"tail": 1})(), False, summary)
    assert summary["2b"]["gap_pct_vs_fp32_twin"]["twin"] == "fp32" and "noise" not in summary

    class Frag:
        def __init__(self, index: int) -> None:
            self.index, self.seen = index, []

        def outer_step(self, avg: torch.Tensor) -> None:
            self.seen.append(avg)

    class Stub:  # what add_outer_noise reads of a DiLoCo
        def __init__(self, shard: int) -> None:
            self.group_rank, self.fragments = shard, [Frag(0), Frag(1)]

    def noise_of(shard: int, seed: int = 3) -> list[list[torch.Tensor]]:
        dl = Stub(shard)
        diloco.add_outer_noise(dl, 1.4, seed)
        for _ in range(2):
            for f in dl.fragments:
                buf = torch.full((4000,), -2.0)
                f.outer_step(buf)
                assert f.seen[-1] is buf  # changed in place, then the original step
        return [[t + 2.0 for t in f.seen] for f in dl.fragments]

    a, replica, other, reseeded = noise_of(0), noise_of(0), noise_of(1), noise_of(0, seed=4)
    flat = [t for f in a for t in f]
    assert all(torch.equal(x, y) for x, y in zip(flat, [t for f in replica for t in f]))
    for x in (*flat[1:], *(t for f in other for t in f), *(t for f in reseeded for t in f)):
        assert not torch.equal(flat[0], x)
    for t in flat:  # rms(buf) = 2: noise of rms 2.8
        assert t.pow(2).mean().sqrt().item() == pytest.approx(2.8, rel=0.05)
        assert abs(t.mean().item()) < 0.15


def test_kernel_sass_counts_opcodes_and_the_main_path():
    import kernel_sass

    listing = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 BRA 0x40 ;                           /* 0x0000000000008947 */
        /*0020*/                   NOP ;                                 /* 0x0000000000007918 */
        /*0030*/                   LOP3.LUT R2, R2, 0xff, RZ, 0xc0, !PT ; /* 0x000000ff02027812 */
        /*0040*/                   EXIT ;                                /* 0x000000000000794d */
        /*0050*/                   MUFU.RCP R3, R4 ;                     /* 0x0000000400037308 */
        /*0060*/                   RET.REL.NODEC R2 0x0 ;                /* 0x0000000002007950 */
    """
    ops, main = kernel_sass._opcodes(listing)
    assert ops == ["LDC", "BRA", "LOP3", "EXIT", "MUFU", "RET"]
    assert main == 4  # the subroutine after the last EXIT is not the main path
    # the division's MUFU.RCP sits in the subroutine: no conversion on the main path
    assert kernel_sass.conversions(ops[:main]) == 0 and kernel_sass.conversions(ops) == 1
    assert kernel_sass.conversions(["F2I", "I2FP", "FRND", "FADD"]) == 3
    row = {"kernel": "k", "instructions": 6, "main_path": 4, "per_element": 0.5,
           "conversions_per_element": 0.1, "registers": 8, "shared_bytes": 0,
           "memory": dict.fromkeys(kernel_sass.MEMORY, 0)}
    lines = kernel_sass._table([row], 90).splitlines()
    assert lines[-1] == "| k | 6 (4) | 0.5 | 0.1 | 8 | 0 | " + " | ".join("0" * 8) + " |"
    assert lines[-2].count("---") == lines[-3].count("|") - 1  # one separator per column


# ---- gpu_kernels_bench: what its CUDA timing brackets --------------------------------------------
class _Stream:
    """One CUDA stream on a simulated clock: work queued at host time t starts at
    max(t, the end of the work before it); events take the time their turn comes."""

    def __init__(self, rate):
        self.host = 0.0  # the simulated perf_counter
        self.free = 0.0  # when the queued work ends
        self.rate = rate  # sleep cycles per second

    def queue(self, seconds):
        start = max(self.host, self.free)
        self.free = start + seconds
        return start

    def torch(self):
        from types import SimpleNamespace

        stream = self

        class Event:
            def __init__(self, enable_timing):
                self.t = None

            def record(self):
                self.t = stream.queue(0.0)

            def synchronize(self):
                stream.host = max(stream.host, self.t)

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3  # ms, as torch

        return SimpleNamespace(cuda=SimpleNamespace(
            Event=Event, _sleep=lambda cycles: self.queue(cycles / self.rate),
            synchronize=lambda: setattr(self, "host", max(self.host, self.free))))


@pytest.mark.parametrize("host_s, device_s", [(80e-6, 120e-6), (3e-3, 0.5e-3)])
def test_gpu_kernels_bench_times_the_device_work_without_the_host_time(monkeypatch, host_s,
                                                                       device_s):
    """A call that spends host_s in Python before queueing device_s of GPU work: the events
    bracket device_s alone (an idle stream would give host_s + device_s), and the host time
    is reported beside it, also when it outlasts the default 1 ms sleep."""
    import gpu_kernels_bench as b

    stream = _Stream(rate=1.7e9)
    monkeypatch.setattr(b.time, "perf_counter", lambda: stream.host)
    monkeypatch.setattr(b, "_SLEEP_RATE", [])

    def call():
        stream.host += host_s
        stream.queue(device_s)

    t = b._time(stream.torch(), "cuda", call, 5)
    assert t.device == pytest.approx(device_s, rel=1e-6)
    assert t.host == pytest.approx(host_s, rel=1e-6)
    assert not t.host_bound
    assert b._SLEEP_RATE[0] == pytest.approx(1.7e9, rel=1e-6)


def test_gpu_kernels_bench_diagnostic_rows_write_what_their_rows_write():
    """Each diagnostic row and the row it is held against are cases, and write the same number
    of bytes from inputs of the same values (the torch codec on the CPU), so the share of time
    a diagnostic saves is the cost it leaves out. (``--no-diagnostics``, which the tile sweep
    passes, is checked by the dry run's tile list in ``tests/test_gpu_check.py``.)"""
    import gpu_kernels_bench as b

    from fsdp_qcomm import QuantSpec, codec
    from fsdp_qcomm.codec import RngKey, torch_codec

    cases = {c.name: c for c in b._cases(torch, QuantSpec, RngKey, torch_codec, codec)}
    assert {n for n, c in cases.items() if c.diagnostic} == set(b.DIAGNOSTICS)
    for name, (against, _) in b.DIAGNOSTICS.items():
        assert against in cases and not cases[against].diagnostic
        outs = []
        for c in (cases[name], cases[against]):
            d = c.make(2, 4096, "cpu", True)  # True: inputs encoded by the torch codec
            outs.append(c.run(torch_codec, d))
        assert outs[0].shape == outs[1].shape and outs[0].dtype == outs[1].dtype, name


# ---- gpu_codec_model: the codec's GPU work counted on the CPU ---------------------------------
def test_gpu_codec_model_counts_bytes_of_copies_views_and_in_place_ops():
    import gpu_codec_model as m

    x, y = torch.zeros(8), torch.ones(8)
    aten = torch.ops.aten
    assert m._op_bytes(aten.copy_.default, (x, y), {}, x) == 64  # src read, dst written
    assert m._op_bytes(aten.add_.Tensor, (x, y), {}, x) == 96  # both read, x written
    assert m._op_bytes(aten.view.default, (x, [2, 4]), {}, x.view(2, 4)) == 0
    assert m._op_bytes(aten.empty.memory_format, ([8],), {}, torch.empty(8)) == 0
    big = m.padded_params(m.SHAPES["1B"], 8)
    assert abs(big - m.SHAPES["1B"].params) < 1e-3 * big  # padding is small at this size


def test_gpu_codec_model_one_rank_per_node_step_adds_no_pass_beside_the_codec():
    """At one rank per node (qWD's full reference), what ``enable`` adds to a step beyond its
    codec kernels: no FSDP-side pass (AVG is divided in the last hop's decode), no copies around
    qWD's own row (its decode updates the kept reference), the agreement's digests in one
    launch and the optimizer step's in another; only the backward re-gather's restore of the
    own slot copies."""
    import gpu_codec_model as m

    shape = m.SHAPES["tiny"]
    base, _ = m.count_step(shape, 2, 1, None, warmup=1)
    enabled, _ = m.count_step(shape, 2, 1, "sdp4bit", warmup=1)

    def launches(c, where):
        return {(site, op): v[2] for (site, op), v in c.ops.items() if where(site) and v[2]}

    fsdp = lambda site: site == m._OTHER  # noqa: E731
    assert launches(enabled, fsdp) == launches(base, fsdp)
    glue = launches(enabled, lambda site: site != m._OTHER)
    copies = {k: v for k, v in glue.items() if k[1] == "aten.copy_"}
    assert list(copies) == [("fsdp_qcomm/collectives/weight_gather.py:reuse", "aten.copy_")]
    assert copies[next(iter(copies))] == shape.layers  # the backward re-gathers (not the root)
    calls = {k: v[0] for (k, _), v in enabled.codec.items()}
    assert calls["digest float32"] == 2  # the agreement's, the optimizer step's: all groups each
    decode = next(k for k in calls if k.startswith("dequantize_segments"))
    assert calls[decode] == shape.layers + 1


def test_gpu_codec_model_counts_each_kernel_once_per_step_and_prices_it():
    import gpu_codec_model as m

    shape = m.SHAPES["tiny"]
    base, n = m.count_step(shape, 4, 2, None, warmup=1)
    enabled, n2 = m.count_step(shape, 4, 2, "sdp4bit", warmup=1)
    assert n == n2 and not base.codec
    kernels = {k for k, _ in enabled.codec}
    # two hops of TLq-HS (hop 1 encodes its rows in send order, with no gather after it) and
    # qWD's encode / decode-and-add, each gathered group once
    assert any(k.startswith("quantize_ordered 8b g128 +H32") for k in kernels), kernels
    assert not [op for (site, op), (_, nbytes, _) in enabled.ops.items()
                if "grad_reduce" in site and nbytes], enabled.ops
    assert any(k.startswith("reduce_requantize k=2 8b->4b") for k in kernels), kernels
    assert any(k.startswith("dequantize_segments 4b g2048 +=") for k in kernels), kernels
    calls = {k: v[0] for (k, _), v in enabled.codec.items()}
    hop1 = next(v for k, v in calls.items() if k.startswith("quantize_ordered 8b"))
    assert hop1 == shape.layers + 1  # one reduce-scatter per FSDP group and step
    for kind in ("dequantize_segments", "quantize_segments"):
        n = next(v for k, v in calls.items() if k.startswith(kind))
        assert n == shape.layers + 1, kind  # one launch per gathered group, not per parameter
    from gpu_step_cost import Llama

    params = sum(1 for _ in Llama(shape).parameters())
    assert calls["digest float32"] == 2  # one launch for every group: agreement, step
    old, _ = m.count_step(shape, 4, 2, "sdp4bit", warmup=1, torch_digest=True)
    assert not any(k.startswith("digest") for k, _ in old.codec)
    torch_formula = [v for (s, _), v in old.ops.items() if s.endswith(":_torch_digest")]
    assert sum(v[2] for v in torch_formula) >= 6 * params  # six passes per shard, or more
    bw = {"clone_gbps": 1.0, "cases": [{"case": r, "gbps": 1.0} for _, r in enabled.codec
                                       if r != m.CLONE_ROW]}
    priced = m.price(base, enabled, 2.0, bw)
    moved = sum(v[2] for v in enabled.codec.values())
    assert priced["kernel_ms"] == pytest.approx(2 * moved / 1e9 * 1e3)
    assert priced["floor_ms"] == pytest.approx(
        priced["kernel_ms"] + priced["glue_ms"] + priced["fsdp_model_optimizer_change"]["ms"])


def test_gpu_codec_model_times_the_hooks_host_work_without_the_codec():
    import gpu_codec_model as m

    h = m.host_ms(m.SHAPES["tiny"], 4, 2, "sdp4bit", steps=1, rounds=1)
    assert set(h) == {"fsdp2", "sdp4bit", "added", "runs", "added_range"}
    assert h["fsdp2"] > 0 and h["sdp4bit"] > 0 and h["added"] == h["sdp4bit"] - h["fsdp2"]
