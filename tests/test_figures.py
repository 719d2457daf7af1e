"""Every measured figure in README.md, recipes/ and benchmarks/ READMEs and docs/ cites a
committed results folder (``benchmarks/check_figures.py``), and every committed results folder
says how it was made (``provenance.json``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import check_figures as cf  # noqa: E402

COMMITTED = {"results/demo", "results/demo/table.md", "results/other"}


def _problems(tmp_path, text: str) -> list[str]:
    md = tmp_path / "doc.md"
    md.write_text(text)
    problems, _ = cf.check([md], root=tmp_path, committed=COMMITTED)
    return [f"{p.line}: {p.figure} ({p.why})" for p in problems]


def test_the_repository_s_figures_are_all_cited():
    problems, cited = cf.check(cf.doc_files(ROOT))
    assert cited, "no figure found: the heuristic or the file list is broken"
    assert not problems, "\n".join(map(str, problems))


def test_every_committed_results_folder_has_its_provenance():
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "results"], capture_output=True,
                           text=True, check=True).stdout.split()
    folders = sorted({f.split("/")[1] for f in files})
    assert folders
    for name in folders:
        assert f"results/{name}/provenance.json" in files, name
        assert f"results/{name}/COMMANDS.md" in files, name
        doc = json.loads((ROOT / "results" / name / "provenance.json").read_text())
        assert doc["invocations"], name
        for e in doc["invocations"]:
            for key in ("command", "git_commit", "start", "end", "loadavg_start",
                        "loadavg_end", "cpu_count"):
                assert key in e, (name, key)  # a value, or "not recorded at the time"


def test_a_cited_figure_passes_and_an_uncited_one_fails(tmp_path):
    assert _problems(tmp_path, "sdp4bit is 3.38x faster (`results/demo`).\n") == []
    assert _problems(tmp_path, "sdp4bit is 3.38x faster.\n") == [
        "1: 3.38x (cites no committed results folder)"]
    # the paragraph counts, not only the line
    assert _problems(tmp_path, "It took 4.2 min\nand sent 14.0 MB (results/demo/table.md).\n") \
        == []
    # a paragraph further away does not
    assert _problems(tmp_path, "See results/demo.\n\nIt took 4.2 min.\n") == [
        "3: 4.2 min (cites no committed results folder)"]


def test_a_citation_of_a_folder_that_is_not_committed_fails(tmp_path):
    got = _problems(tmp_path, "Loss +0.36% (`results/frontier_gone`).\n")
    assert "1: results/frontier_gone (cites a results path that is not committed)" in got
    assert "1: +0.36% (cites no committed results folder)" in got
    # a file that is not in the committed folder is not a citation either
    got = _problems(tmp_path, "Loss +0.36% (`results/demo/missing.json`).\n")
    assert "1: results/demo/missing.json (cites a results path that is not committed)" in got
    # placeholders are not citations
    assert _problems(tmp_path, "Outputs go to `results/<name>/` or `results/x/...`.\n") == []


def test_tables_are_covered_by_their_row_caption_or_section_lead(tmp_path):
    table = "| scheme | step s |\n|---|---|\n| sdp4bit | 0.401 |\n"
    assert _problems(tmp_path, table) == ["3: 0.401 (cites no committed results folder)"]
    assert _problems(tmp_path, "Measured (`results/demo`):\n\n" + table) == []
    assert _problems(tmp_path, "| scheme | step s |\n|---|---|\n"
                               "| sdp4bit | 0.401 (results/demo) |\n| zeropp | 0.468 |\n") == [
        "4: 0.468 (cites no committed results folder)"]
    # a section's lead paragraph covers its subsections; a document title's lead does not
    doc = ("# Title\n\nAll in results/demo.\n\n## Speed\n\nCommand and `results/other`.\n\n"
           "### link 1gbit\n\n" + table + "\n## Other\n\nIt took 4.2 min.\n")
    assert _problems(tmp_path, doc) == ["17: 4.2 min (cites no committed results folder)"]


def test_what_is_not_a_measured_figure(tmp_path):
    text = ("Tested on torch 2.13 and 2.14.1; 4 bits, 8-bit codes, groups of 2048, lr=0.002.\n\n"
            "The goal: at most 3.0 bits, within +0.5%, the 2.5-bit stretch, a 95% interval,\n"
            "at least 0.7x of clone, a 2x2 mesh and 4x8-bit rows.\n\n"
            "| width | bits |\n|---|---|\n| 4 | 4 |\n")
    assert _problems(tmp_path, text) == []
    # what is one: non-integer bits, percentages, ratios, times, sizes, long decimals
    found = cf.figures("2.67 bits, +0.36%, x0.181, 29x, 3m20s, 83 s, 716 KiB, 3.25 GB/s, "
                       "415,156 bytes, loss 1.84973, gap 1.65e-4", in_table_row=False)
    assert found == ["2.67 bits", "+0.36%", "x0.181", "29x", "3m20s", "83 s", "716 KiB",
                     "3.25 GB/s", "415,156 bytes", "1.84973", "1.65e-4"]


def test_not_measured_markers(tmp_path):
    # the whole block, with a reason
    assert _problems(tmp_path, "The formula gives 4.016 bits and 14.7 MB. "
                               "<!-- not measured: wire formula -->\n") == []
    # only the quoted figures
    got = _problems(tmp_path, 'Formula 4.016 bits; measured 4.049 bits. '
                              '<!-- not measured "4.016 bits": wire formula -->\n')
    assert got == ["1: 4.049 bits (cites no committed results folder)"]
    # in a table's caption: the table
    assert _problems(tmp_path, "Formula: <!-- not measured: (1 + 1/world) P -->\n\n"
                               "| world | MB |\n|---|---|\n| 2 | 14.7 MB |\n") == []
    # in a row: that row
    assert _problems(tmp_path, "| a | b |\n|---|---|\n"
                               "| paper | 35.81 <!-- not measured: the paper's --> |\n") == []
    # a marker written in a code span (documentation) is not a marker
    got = _problems(tmp_path, "Mark it with `<!-- not measured: REASON -->`: it took 83 s.\n")
    assert got == ["1: 83 s (cites no committed results folder)"]
    # a marker needs a reason
    got = _problems(tmp_path, "It took 83 s. <!-- not measured -->\n")
    assert any("needs ': REASON'" in g for g in got)
    assert "1: 83 s (cites no committed results folder)" in got


def test_figures_in_a_generated_table_block_are_not_reported(tmp_path):
    # benchmarks/tables.py renders the block from results (its --check keeps it so)
    block = ("<!-- table:demo -->\n| what | result |\n|---|---|\n| speed | 6.27x, 1.479 s |\n"
             "<!-- /table:demo -->\n")
    assert _problems(tmp_path, block + "\nTyped by hand: 4.06x.\n") == [
        "7: 4.06x (cites no committed results folder)"]
    # a results path cited inside must still be committed
    got = _problems(tmp_path, block.replace("6.27x", "6.27x (results/gone)"))
    assert got == ["4: results/gone (cites a results path that is not committed)"]
    # a marker shown in a code span is text: the figures around it are checked
    assert _problems(tmp_path, "Markers: `<!-- table:demo -->`, 83 s.\n") == [
        "1: 83 s (cites no committed results folder)"]


def test_command_line_exit_status(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text("About 20 s to compile.\n")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "check_figures.py"), str(bad)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "20 s" in r.stdout


@pytest.mark.parametrize("line,row,want", [
    ("median 0.531 s vs 0.45 and 1.84973", False, ["0.531 s", "1.84973"]),
    ("| hsdp | 0.818 | 1.00x | 87.16 |", True, ["0.818", "1.00x", "87.16"]),
    ("version 0.2.2 and torchtitan 0.3.0", False, []),
])
def test_figure_tokens(line, row, want):
    assert cf.figures(line, in_table_row=row) == want
