"""The docs' result tables are rendered from the committed results folders
(``benchmarks/tables.py``): every marked block equals what its results say, rendering replaces
only the block, a doctored figure is caught, and every table cites committed folders."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tables  # noqa: E402

RESULTS = ROOT / "results"
LINK = re.compile(r"\[([^\]]+)\]\(([^)]+)\)")


def _committed_files() -> list[str]:
    return subprocess.run(["git", "-C", str(ROOT), "ls-files", "results"], capture_output=True,
                          text=True, check=True).stdout.split()


def _rows(md: str) -> list[str]:
    return [ln for ln in md.split("\n")[2:] if ln.startswith("|")]


# ---- (a) the repository as it is ---------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_every_table_renders_from_the_committed_results(name):
    md = tables.render(name)
    header, sep, *rows = md.split("\n")
    assert rows and sep == "|" + "---|" * header.count(" | ") + "---|"
    assert all(r.count(" | ") == header.count(" | ") for r in rows), md


def test_check_passes_on_the_repository():
    files = tables.doc_files(ROOT)  # only the files that have markers
    problems = [msg for f in files for msg in tables.check_file(f)]
    assert not problems, "\n".join(problems)
    assert tables.main(["--check"]) == 0


# ---- (b) rendering replaces only the block -------------------------------------------------------
def test_rendering_replaces_only_the_block(tmp_path):
    doc = tmp_path / "doc.md"
    before = "# Title\n\nIntro with 3.38x typed by hand.\n\n"
    after = "\n\nAfter the table.\n<!-- /table:nothing --> is text here\n"
    doc.write_text(before + "<!-- table:speed_user -->\n| stale | 1.00x |\nmore stale\n"
                   "<!-- /table:speed_user -->" + after)
    assert tables.write_file(doc) == ["speed_user"]
    text = doc.read_text()
    assert text == (before + "<!-- table:speed_user -->\n" + tables.render("speed_user")
                    + "\n<!-- /table:speed_user -->" + after)
    assert tables.write_file(doc) == [] and doc.read_text() == text  # idempotent
    assert tables.check_file(doc) == []


def test_empty_block_indented_block_and_markers_that_are_text(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("- item:\n\n  <!-- table:wire_bytes -->\n  <!-- /table:wire_bytes -->\n\n"
                   "A code span `<!-- table:readme -->` and a fence:\n\n```\n"
                   "<!-- table:readme -->\n```\n")
    tables.write_file(doc)
    lines = doc.read_text().split("\n")
    rendered = tables.render("wire_bytes").split("\n")
    assert lines[3:3 + len(rendered)] == ["  " + ln for ln in rendered]  # the list item's indent
    assert lines[3 + len(rendered)] == "  <!-- /table:wire_bytes -->"
    assert [b.name for b in tables.blocks(doc.read_text())] == ["wire_bytes"]


def test_links_are_relative_to_the_rendered_file():
    md = tables.render("readme", rel_dir="docs")
    assert "[docs/hsdp.md](hsdp.md)" in md
    assert "[results/memory](../results/memory)" in md


@pytest.mark.parametrize("text, why", [
    ("<!-- table:readme -->\n| a |\n", "never closed"),
    ("<!-- /table:readme -->\n", "closes no open"),
    ("<!-- table:readme -->\n<!-- table:memory_2x2 -->\n", "opens inside"),
    ("<!-- table:nonesuch -->\n<!-- /table:nonesuch -->\n", "unknown table"),
])
def test_malformed_markers_and_unknown_tables_are_reported(tmp_path, text, why):
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    (msg,) = tables.check_file(doc)
    assert why in msg and "doc.md" in msg


# ---- (c) a doctored figure is caught -------------------------------------------------------------
def test_a_doctored_figure_in_a_block_is_caught(tmp_path):
    doc = tmp_path / "README.md"
    good = "<!-- table:readme -->\n" + tables.render("readme") + "\n<!-- /table:readme -->\n"
    assert "**6.27x**" in good  # the flat speedup, results/cluster_speed_user
    doc.write_text(good.replace("**6.27x**", "**6.72x**"))
    (msg,) = tables.check_file(doc)
    assert "README.md: table:readme differs" in msg
    assert "-| speed, flat FSDP" in msg and "6.72x" in msg
    assert "+| speed, flat FSDP" in msg and "6.27x" in msg
    assert doc.read_text() == good.replace("**6.27x**", "**6.72x**")  # --check writes nothing
    assert tables.main(["--check", "--file", str(doc)]) == 1


def _copy_results(tmp_path: Path, *folders: str) -> Path:
    out = tmp_path / "results"
    for f in folders:
        shutil.copytree(RESULTS / f, out / f)
    return out


def test_a_changed_result_changes_the_table(tmp_path):
    res = _copy_results(tmp_path, "cluster_speed_user")
    p = res / "cluster_speed_user" / "results.json"
    doc = json.loads(p.read_text())
    doc["rates"]["100mbit"]["schemes"]["hsdp_sdp4bit"]["median_step_s"] = 2.0
    p.write_text(json.dumps(doc))
    md = tables.render("speed_user", results=res)
    assert "| HSDP 2x2, `sdp4bit` | 100 Mbit/s | **2.000** | **2.20x** |" in md
    page = tmp_path / "page.md"
    page.write_text("<!-- table:speed_user -->\n" + tables.render("speed_user")
                    + "\n<!-- /table:speed_user -->\n")
    assert tables.check_file(page, results=res)  # the page no longer says what results do


def test_a_report_older_than_its_run_store_is_refused(tmp_path):
    res = _copy_results(tmp_path, "accuracy_bpe500")
    (res / "accuracy_bpe500" / "runs" / "SDP4Bit__seed1238.json").unlink()
    with pytest.raises(tables.TableError, match="rebuild the report"):
        tables.accuracy_gap(res, "accuracy_bpe500", "SDP4Bit")
    res = _copy_results(tmp_path / "b", "accuracy_bpe500")
    p = res / "accuracy_bpe500" / "results.json"
    doc = json.loads(p.read_text())
    doc["rows"]["SDP4Bit"]["verdict"] = "worse"
    p.write_text(json.dumps(doc))
    with pytest.raises(tables.TableError, match="differ from its scores"):
        tables.accuracy_gap(res, "accuracy_bpe500", "SDP4Bit")


# ---- (d) every table cites committed results -----------------------------------------------------
def test_every_table_cites_committed_results_folders():
    files = _committed_files()
    folders = {"/".join(f.split("/")[:k]) for f in files for k in range(2, f.count("/") + 1)}
    for name, t in tables.TABLES.items():
        assert t.sources and {f"results/{s}" for s in t.sources} <= folders, name
        # the sources named are the folders the table really reads
        assert tables.sources_read(name) == set(t.sources), name
    # the README's table: every row links its note and the committed folder of its figure
    rows = _rows(tables.render("readme"))
    assert 1 <= len(rows) <= 8
    for row in rows:
        what, result, note, cited = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(what) < 90 and len(result) < 90, row
        (text, target), = LINK.findall(note)
        assert text == target and target.startswith("docs/") and (ROOT / target).is_file(), row
        links = LINK.findall(cited)
        assert links, row
        for text, target in links:  # a row with a trend cites each run length's folder
            assert text == target and target in folders, row
            assert target.split("/")[1] in tables.TABLES["readme"].sources, row



def test_diloco_tables_check_what_they_pair(tmp_path):
    """The DiLoCo twin gap and a diagnostics row's bit-identical training are checked against
    the per-seed scores, not copied from the report."""
    res = _copy_results(tmp_path, tables.DILOCO)
    p = res / tables.DILOCO / "results.json"
    doc = json.loads(p.read_text())
    assert "DiLoCo H32 fp32 lr0.7 m0.8" in tables.render("diloco_twins", results=res)
    doc["rows"][tables.DILOCO_BEST]["gap_pct_vs_fp32_twin"]["mean"] += 0.5
    p.write_text(json.dumps(doc))
    with pytest.raises(tables.TableError, match="fp32 twin"):
        tables.render("diloco_twins", results=res)
    with pytest.raises(tables.TableError, match="fp32 twin"):
        tables.diloco_best(res)  # the README's row
    res = _copy_results(tmp_path / "b", tables.DILOCO)
    p = res / tables.DILOCO / "results.json"
    doc = json.loads(p.read_text())
    label, _, diag = tables.DILOCO_WHY[0]
    doc["rows"][diag]["final_val"]["1234"] += 1e-6
    p.write_text(json.dumps(doc))
    with pytest.raises(tables.TableError, match="bit-identically"):
        tables.render("diloco_why", results=res)


def test_diloco_workloads_recomputes_and_names_what_is_missing(tmp_path):
    """The longer-run / second-workload table recomputes each gap from the per-seed scores and
    says which workloads the campaign has not trained, rather than leaving them out."""
    res = _copy_results(tmp_path, tables.DILOCO)
    text = tables.render("diloco_workloads", results=res)
    lines = [ln for ln in text.splitlines() if ln.startswith("| [results/")]
    assert len(lines) == len(tables.DILOCO_WORKLOADS)
    assert "20 outer" in lines[0] and "in progress" not in lines[0]
    assert all("stored nothing yet" in ln for ln in lines[1:])
    p = res / tables.DILOCO / "results.json"
    doc = json.loads(p.read_text())
    doc["rows"][tables.DILOCO_BEST]["final_val"]["1234"] *= 1.01
    p.write_text(json.dumps(doc))
    with pytest.raises(tables.TableError, match="stored gap"):
        tables.render("diloco_workloads", results=res)
