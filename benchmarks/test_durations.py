"""Where the test suite's time goes: run pytest with ``--durations=0`` and write the per-module
and per-test table (setup, call and teardown summed per test).

    OMP_NUM_THREADS=1 python benchmarks/test_durations.py --out results/test_durations [--all]
    python benchmarks/test_durations.py --from OUTPUT.txt --name NAME --out results/test_durations

``--all`` times both tiers (tests/conftest.py). ``--from`` renders a pytest output captured
before (its provenance is what its ``--note`` says). Writes ``OUT/NAME.md`` (NAME: ``quick``,
``all`` or ``--name``) and the raw output ``OUT/NAME_pytest.txt``; the run is recorded in
``OUT/provenance.json`` (``benchmarks/_provenance.py``: commit, load average during the run).
Run it on an idle machine: a figure taken beside other work is not the suite's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _provenance  # noqa: E402

_LINE = re.compile(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+)")
_SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).*) in ([0-9.]+)s")


def parse(text: str) -> tuple[dict[str, float], str, float]:
    """(seconds per test node id, pytest's summary line, pytest's wall seconds)."""
    per: dict[str, float] = defaultdict(float)
    summary, wall = "", 0.0
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            per[m.group(3)] += float(m.group(1))
            continue
        m = _SUMMARY.match(line.strip())
        if m:
            summary, wall = m.group(1), float(m.group(2))
    return dict(per), summary, wall


def render(per: dict[str, float], summary: str, wall: float, title: str, top: int = 40) -> str:
    mods: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for node, t in per.items():
        mod, _, test = node.partition("::")
        mods[mod].append((t, test))
    listed = sum(per.values())
    lines = [f"# {title}", "", f"pytest: {summary} in {wall:.1f} s (wall); the table sums the "
             f"setup, call and teardown times pytest lists (>= 5 ms): {listed:.1f} s.", "",
             "| module | tests listed | seconds | share | slowest test (s) |",
             "|---|---|---|---|---|"]
    for mod, tests in sorted(mods.items(), key=lambda kv: -sum(t for t, _ in kv[1])):
        tot = sum(t for t, _ in tests)
        t0, name = max(tests)
        lines.append(f"| {mod} | {len(tests)} | {tot:.1f} | {100 * tot / listed:.1f}% | "
                     f"{name} ({t0:.1f}) |")
    lines += ["", f"The {top} slowest tests:", "", "| seconds | test |", "|---|---|"]
    for node, t in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {t:.2f} | {node} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "results" / "test_durations")
    ap.add_argument("--all", action="store_true", help="both tiers (FSDP_QCOMM_TEST_ALL=1)")
    ap.add_argument("--from", dest="src", type=Path, default=None,
                    help="render this captured pytest output instead of running pytest")
    ap.add_argument("--name", default=None, help="the table's file name (without .md)")
    ap.add_argument("--note", default="", help="with --from: where the output came from")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    name = a.name or ("all" if a.all else "quick")
    rec = _provenance.record(a.out, argv=None if argv is None else [__file__, *argv],
                             notes=a.note)
    if a.src is not None:
        text = a.src.read_text()
    else:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        if a.all:
            env["FSDP_QCOMM_TEST_ALL"] = "1"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--durations=0",
                               "-p", "no:cacheprovider"], cwd=REPO, env=env,
                              capture_output=True, text=True)
        text = proc.stdout + proc.stderr
        rec.note(pytest_exit=proc.returncode, pytest_wall_s=round(time.perf_counter() - t0, 1))
        if proc.returncode:
            print(text[-5000:], file=sys.stderr)
    (a.out / f"{name}_pytest.txt").write_text(text)
    per, summary, wall = parse(text)
    if not per:
        print("no --durations lines in the output", file=sys.stderr)
        return 1
    md = render(per, summary, wall, f"Test durations: {name}")
    (a.out / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
