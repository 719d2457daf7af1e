"""benchmarks/campaign.py: a campaign file's jobs, run one at a time into resumable stores, each
run with its own provenance; and the claim it relies on to share a store with older runs:
leaving out the unscored evaluations changes no bit of the training."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _seeds  # noqa: E402
import accuracy  # noqa: E402
import campaign  # noqa: E402

from fsdp_qcomm.testing import run_ranks  # noqa: E402

TINY = ["--dim", "16", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2",
        "--steps", "6", "--warmup", "2", "--eval-every", "2", "--eval-batches", "1",
        "--eval-full", "--full-last", "2", "--tail", "2"]


@pytest.fixture
def data(tmp_path) -> Path:
    p = tmp_path / "d.txt"
    p.write_text("to be or not to be, that is the question. " * 400)
    return p


def _campaign(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(textwrap.dedent(body))
    return p


def test_jobs_run_seed_by_seed_and_bad_files_name_the_fix(tmp_path, data):
    args = json.dumps([*TINY, "--data", str(data)])
    good = _campaign(tmp_path, f"""
        [workloads.w]
        kind = "accuracy"
        out = "{tmp_path / 'out'}"
        args = {args}
        [rows."W3 G2/64"]
        preset = "sdp4bit"
        overrides = {{ weight_bits = 3, grad_inter_bits = 2, grad_group_size = 64 }}
        [[jobs]]
        workload = "w"
        rows = ["baseline", "W3 G2/64"]
        seeds = "7-8"
        [[jobs]]
        workload = "w"
        rows = ["qW"]
        seeds = [3]
        """)
    workloads, rows, jobs = campaign.load(good)
    # every row of a seed before the next seed: an interrupted campaign leaves pairs
    assert [(j.row, j.seed) for j in jobs] == [("baseline", 7), ("W3 G2/64", 7), ("baseline", 8),
                                               ("W3 G2/64", 8), ("qW", 3)]
    assert workloads["w"].rows == ["baseline", "W3 G2/64", "qW"]
    kind = campaign._Kind(workloads["w"], rows)
    assert kind.a.row_defs["W3 G2/64"].overrides["grad_group_size"] == 64
    assert kind.row("W3 G2/64")["config"]["grad_inter_bits"] == 2

    def refused(body: str, match: str) -> None:
        with pytest.raises(campaign.CampaignError, match=match):
            w, r, _ = campaign.load(_campaign(tmp_path, body))
            for k in (campaign._Kind(x, r) for x in w.values()):
                k.check_rows()

    head = f'[workloads.w]\nkind = "accuracy"\nout = "{tmp_path}"\nargs = {args}\n'
    refused(head + '[[jobs]]\nworkload = "v"\nrows = ["baseline"]\nseeds = [1]\n',
            "workload 'v' is not one of")
    refused(head + '[[jobs]]\nworkload = "w"\nrows = ["nope"]\nseeds = [1]\n',
            r"unknown rows \['nope'\]; add them under \[rows\]")
    refused(head + '[[jobs]]\nworkload = "w"\nrows = ["qW"]\nseeds = "9-3"\n',
            "ends before it starts")
    refused('[workloads.w]\nkind = "accuracy"\nout = "x"\nargs = ["--out", "y"]\n',
            "the folder, the seeds and the rows come from out and the jobs")
    refused(head + '[rows.bad]\npreset = "sdp4bit"\noverrides = { grad_levels = "learned" }\n'
            '[[jobs]]\nworkload = "w"\nrows = ["bad"]\nseeds = [1]\n',
            "row 'bad': QCommConfig.grad_levels='learned' needs grad_scheme='one_level'")
    refused(head + '[rows.SDP4Bit]\npreset = "qwd"\n'
            '[[jobs]]\nworkload = "w"\nrows = ["SDP4Bit"]\nseeds = [1]\n',
            "redefines a built-in row")


def _diloco_campaign(tmp_path: Path, data: Path) -> Path:
    """benchmarks/campaigns/diloco.toml with its store and its data under tmp_path: the test
    reads no results folder and needs no tinyshakespeare."""
    text = (BENCH / "campaigns" / "diloco.toml").read_text()
    text = text.replace('out = "results/diloco_640"', f'out = "{tmp_path / "out"}"')
    text = text.replace('args = ["--steps"', f'args = ["--data", "{data}", "--steps"')
    assert str(tmp_path / "out") in text and str(data) in text
    p = tmp_path / "diloco.toml"
    p.write_text(text)
    return p


def test_the_diloco_campaign_parses_and_plans_without_training(tmp_path, data, capsys):
    c = _diloco_campaign(tmp_path, data)
    workloads, rows, jobs = campaign.load(c)
    # the verdict job names the sweep's seeds of HSDP and of the lr 0.7 rows again: once each
    assert len(jobs) == len(set(jobs)) == 64
    # the sweep comes first (H = 8 at lr 1.0 on one seed: it diverged), then the verdicts, then
    # the momentum checks on 2 seeds, and the best of them to 5 seeds
    group = [j.note[:3] for j in jobs]
    assert group == ["(a)"] * 17 + ["(b)"] * 34 + ["(a)"] * 4 + ["(c)"] * 6 + ["(d)"] * 3
    assert {j.seed for j in jobs if j.note[:3] in ("(a)", "(c)")} == {1234, 1235}
    assert {j.seed for j in jobs if j.note[:3] == "(b)"} == set(range(1234, 1239))
    best = "DiLoCo H32 2b lr0.7 m0.8"
    assert sorted(j.seed for j in jobs if j.row == best) == list(range(1234, 1239))
    assert [j.seed for j in jobs if j.row == "DiLoCo H8 4b lr1.0"] == [1234]
    kind = campaign._Kind(workloads["dl640"], rows)
    kind.check_rows()
    a = kind.a
    # H = 32 makes at least 20 outer steps; every evaluation follows an outer step of every H;
    # scored like the accuracy workload: the mean of the last 3 whole-split evaluations
    assert a.steps // 32 >= 20 and a.steps % 32 == 0 and a.eval_every % 32 == 0
    assert (a.eval_full, a.full_last, a.tail) == (True, 3, 3)
    assert a.budget_row in a.row_defs
    lrs = {a.row_defs[r].config(0).outer_lr for r in a.row_defs if r.startswith("DiLoCo H32 4b")}
    assert lrs == {0.3, 0.5, 0.7, 1.0}
    assert campaign.main([str(c), "--plan"]) == 0
    assert "64 job(s), 0 stored, 64 to train" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # planned: nothing trained, nothing written


def test_diloco_rows_of_a_campaign_carry_their_outer_settings_to_the_config(tmp_path, data):
    import diloco

    head = f"""
        [workloads.d]
        kind = "diloco"
        out = "{tmp_path / 'out'}"
        args = ["--data", "{data}", "--steps", "64", "--eval-every", "32"]
        """
    jobs = """
        [[jobs]]
        workload = "d"
        rows = ["HSDP", "{label}"]
        seeds = [3]
        """
    good = _campaign(tmp_path, head + """
        [rows."H16 lr0.5 m0.8"]
        diloco = { sync_every = 16, bits = 4, outer_lr = 0.5, outer_momentum = 0.8 }
        """ + jobs.replace("{label}", "H16 lr0.5 m0.8"))
    w, r, _ = campaign.load(good)
    kind = campaign._Kind(w["d"], r)
    kind.check_rows()
    row = diloco.rows_of(kind.a)["H16 lr0.5 m0.8"]  # what the ranks read (a travels to them)
    cfg = row.config(3)
    assert (cfg.sync_every, cfg.bits, cfg.outer_lr, cfg.outer_momentum, cfg.seed) == \
        (16, 4, 0.5, 0.8, 3)
    assert kind.row("H16 lr0.5 m0.8")["diloco"]["outer_lr"] == 0.5  # stored with its runs
    assert row.describe() == "DiLoCo H=16, 4-bit outer, outer lr 0.5, momentum 0.8"

    def refused(fields: str, label: str, match: str) -> None:
        bad = _campaign(tmp_path, head + f'[rows."{label}"]\ndiloco = {{ {fields} }}\n'
                        + jobs.replace("{label}", label))
        with pytest.raises(campaign.CampaignError, match=match):
            w, r, _ = campaign.load(bad)
            campaign._Kind(w["d"], r).check_rows()

    # before anything trains: a typo, the run's seed set by the row, a config that cannot be
    refused("sync_every = 16, outer_lrr = 0.5", "typo", r"unknown DiLoCoConfig field\(s\) "
            r"\['outer_lrr'\]")
    refused("sync_every = 16, seed = 1", "seeded", "seed is the run's seed")
    refused("sync_every = 16, outer_momentum = 1.0", "m1", "outer_momentum=1.0 must be in")


def test_pending_runs_train_once_each_with_provenance_and_tables(tmp_path, data):
    out = tmp_path / "out"
    args = json.dumps([*TINY, "--data", str(data), "--scored-evals-only"])
    c = _campaign(tmp_path, f"""
        [workloads.w]
        kind = "accuracy"
        out = "{out}"
        args = {args}
        [[jobs]]
        workload = "w"
        rows = ["baseline", "SDP4Bit"]
        seeds = [5]
        """)
    assert campaign.main([str(c)]) == 0
    stored = _seeds.RunStore(out, {}).dir
    runs = sorted(p.name for p in stored.glob("*.json"))
    assert runs == ["SDP4Bit__seed5.json", "baseline__seed5.json"]
    rec = json.loads((stored / "SDP4Bit__seed5.json").read_text())["record"]
    prov = rec["provenance"]
    assert prov["git_commit"] and len(prov["loadavg_start"]) == 3 and prov["wall_s"] > 0
    assert set(rec["timing"]) == {"setup_s", "train_s", "eval_sampled_s", "eval_full_s"}
    # only the scored evaluations (the last --full-last 2 of steps 2, 4, 6) ran
    assert [s for s, _ in rec["val"]] == [4, 6] and [s for s, _ in rec["val_full"]] == [4, 6]
    table = (out / "table.md").read_text()
    assert "| SDP4Bit | sdp4bit | 1 |" in table and (out / "provenance.json").is_file()
    mtime = (stored / "SDP4Bit__seed5.json").stat().st_mtime_ns
    assert campaign.main([str(c)]) == 0  # resumed: nothing left to train
    assert (stored / "SDP4Bit__seed5.json").stat().st_mtime_ns == mtime


def test_a_diloco_campaign_trains_scores_and_stores_its_runs(tmp_path, data):
    """diloco.py's loop through the campaign runner (4 ranks as 2 x 2): accuracy.py's
    evaluations on the replicas' shared weights (only the scored ones here), the last after
    finish() (Streaming's in-flight fragment merged), each run's provenance and timing, and
    the table's +1.0% verdict column."""
    out = tmp_path / "out"
    args = json.dumps(["--data", str(data), "--dim", "16", "--layers", "1", "--heads", "2",
                       "--seq", "16", "--batch", "2", "--steps", "8", "--warmup", "2",
                       "--eval-every", "4", "--eval-batches", "1", "--eval-full",
                       "--full-last", "2", "--tail", "2", "--scored-evals-only",
                       "--budget-row", "Streaming H4 F2 d1"])
    c = _campaign(tmp_path, f"""
        [workloads.d]
        kind = "diloco"
        out = "{out}"
        args = {args}
        [rows."Streaming H4 F2 d1"]
        diloco = {{ sync_every = 4, bits = 4, fragments = 2, delay = 1, outer_lr = 0.5 }}
        [[jobs]]
        workload = "d"
        rows = ["HSDP", "Streaming H4 F2 d1"]
        seeds = [5]
        """)
    assert campaign.main([str(c)]) == 0
    stored = _seeds.RunStore(out, {}).dir
    rec = json.loads((stored / "Streaming_H4_F2_d1__seed5.json").read_text())["record"]
    assert rec["provenance"]["git_commit"] and rec["timing"]["train_s"] > 0
    assert [s for s, _ in rec["val"]] == [4, 8] and [s for s, _ in rec["val_full"]] == [4, 8]
    # syncs after steps 2, 4, 6 and 8; the last one's merge (due after step 9) by finish()
    assert rec["outer_steps"] == 4
    table = (out / "table.md").read_text()
    assert "| Streaming H4 F2 d1 | DiLoCo H=4, 4-bit outer, 2 fragments, delay 1, outer lr " \
        "0.5 | 1 |" in table and "verdict (+1.0%)" in table


def _train_rows(rank: int, world: int, a, rows: list[str]) -> list[dict]:
    import accuracy as acc
    from _model import GPTShape

    data = acc.load_data(a)
    shape = GPTShape(data.vocab, a.dim, a.layers, a.heads, a.seq)
    return [acc._train_one(rank, world, a, data, shape, label, 11) for label in rows]


def test_leaving_out_unscored_evaluations_changes_no_training_bit(data):
    """The claim that lets --scored-evals-only runs share a store with runs that evaluated on
    sampled batches every --eval-every steps: the training losses and the scored losses are
    bit for bit the same, for an unhooked run, qWD (its evaluation gathers send the
    differences the next training forward would), learned levels and direct weights."""
    rows = ["baseline", "SDP4Bit", "W2-learned G3", "qW"]
    runs = {}
    for extra in ([], ["--scored-evals-only"]):
        a = accuracy._args([*TINY, "--data", str(data), *extra])
        a.row_defs = accuracy.SCHEMES | {"W2-learned G3": accuracy.Scheme(
            "sdp4bit", dict(weight_bits=2, weight_levels="learned", grad_inter_bits=3))}
        runs[bool(extra)] = run_ranks(_train_rows, 4, a, rows, timeout=300)[0]
    for label, every, scored in zip(rows, runs[False], runs[True]):
        assert len(every["val"]) == 3 and len(scored["val"]) == 2, label
        assert every["train"] == scored["train"], label
        assert every["val_full"] == scored["val_full"], label
        assert every["val"][1:] == scored["val"], label
