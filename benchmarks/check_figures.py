"""Every measured figure in the docs must cite a committed results folder.

Scans README.md, recipes/README.md, benchmarks/README.md and docs/*.md (or the files given),
finds the figures that state measurements, and checks that each is cited: a ``results/<dir>``
path that is committed (``git ls-files results``) appears

* on the figure's own line, table row or in its block (paragraph, list item, code block), or
* in the caption of its table or code block (the paragraph right before it), or
* in the lead paragraph (the first block after the heading) of its section or of an enclosing
  section of level 2 or deeper (a document's title section does not count: it would cover the
  whole file).

It prints every uncited figure as ``file:line: figure | context`` and every citation of a
``results/`` path that is not committed, and exits 1 if there is any (``--list`` also prints
the cited figures with their citation).

What counts as a figure (the heuristic; code spans and code blocks included):

* a percentage (``+0.36%``, ``87%``);
* a ratio written with ``x`` (``3.38x``, ``~15x``, ``x0.181``; not ``2x2``);
* a duration (``0.531 s``, ``4.2 min``, ``32.3 ms``, ``3m20s``);
* a size in bytes (``14.0 MB``, ``3.25 GB/s``, ``716 KiB``, ``415,156 bytes``);
* a non-integer number of bits (``2.67 bits``, ``4.25-bit``, ``2.44b/el``): integer widths
  (``4 bits``, ``3-bit``) are design settings, not measurements;
* in table rows (not the header): any number with two or more decimals or a thousands
  separator (losses, bits, bytes); in other text: a number with three or more decimals
  (``1.84973``) or a mantissa with an exponent (``1.65e-4``).

Not scanned for figures: the tables between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``
marker lines, which ``benchmarks/tables.py`` renders from the results folders (its ``--check``
keeps them equal to their sources, so their figures come from results by construction); a
``results/`` path cited there must still be committed. This script checks what is still typed by
hand.

Not figures: version numbers (``2.14.1``, ``torch 2.13``), a number right after ``=``, "95%"
before "interval" or "confidence", and thresholds: a figure right after ``>=``, ``<=``, "at
least", "at most", "more/less than", "within", "under", "below", "above", "up to", "target"
or "goal" (``within +0.5%``), or right before "goal", "target", "stretch" or "budget" (``the
3.0-bit goal``).

Marking a figure as not a measurement (design constants, formulas, a paper's published numbers,
a test's asserted bound), always with a reason, in an HTML comment (invisible when rendered):

* ``<!-- not measured: REASON -->`` in a block exempts every figure of that block; in a table's
  caption, every figure of the table;
* ``<!-- not measured "4.016 bits" "4.13 bits": REASON -->`` exempts only the quoted figures
  (written as they appear) in that block (or table, from its caption).

    python benchmarks/check_figures.py [--list] [FILE.md ...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tables import generated_lines  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "recipes/README.md", "benchmarks/README.md", "docs/*.md")

_NUM = r"\d+(?:[.,]\d+)*"
_FIGURES = [
    re.compile(rf"[+\-−±~]?{_NUM}\s?%"),
    re.compile(r"~?(?<![\w.])\d+(?:\.\d+)?x(?![\w])"),
    re.compile(r"(?<![\w.])x\d+(?:\.\d+)?(?![\w.])"),
    re.compile(r"(?<![\w.])\d+m\d+(?:\.\d+)?s\b"),
    re.compile(rf"(?<![\w.]){_NUM}\s?(?:ms|µs|us|ns|s|sec|seconds?|min|minutes?|h|hours?)\b"),
    re.compile(rf"(?<![\w.]){_NUM}\s?[KMGT]i?B(?:/s(?:tep)?)?\b"),
    re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+\.\d+|\d{3,})\s?bytes\b"),
    re.compile(r"(?<![\w.])\d+\.\d+[\s-]?(?:bits?\b|b/el\b|b\b)"),
]
_TABLE_NUMBER = re.compile(r"(?<![\w.])(?:\d+\.\d{2,}|\d{1,3}(?:,\d{3})+)(?![\w.]|\.\d)")
_TEXT_NUMBER = re.compile(r"(?<![\w.])(?:\d+\.\d{3,}(?:e[-+]?\d+)?|\d\.\d+e[-+]?\d+)(?![\w.]|\.\d)")
_VERSION = re.compile(r"(?:torch|triton|torchtitan|python|cuda|version|release|v)\s*[\d./]*$",
                      re.I)
_THRESHOLD = re.compile(r"(?:>=|<=|≥|≤|\bat least|\bat most|\bmore than|\bless than|\bfewer than"
                        r"|\bwithin|\bunder|\bbelow|\babove|\bup to|\btarget|\bgoal)\W{0,3}$",
                        re.I)
_CITE = re.compile(r"(?<![\w/])results/([\w.\-]+)((?:/[\w.\-<>*{}]+)*)/?")
_MARK = re.compile(r"<!--\s*not measured((?:\s+\"[^\"]+\")*)\s*:\s*([^>]*?)\s*-->", re.I)
_MARK_ANY = re.compile(r"<!--\s*not measured\b[^>]*-->", re.I)
_QUOTED = re.compile(r"\"([^\"]+)\"")


@dataclass
class Block:
    kind: str  # heading, para, item, table, code
    start: int  # 1-based line number
    lines: list[str]
    level: int = 0  # heading level
    caption: Optional["Block"] = None
    leads: list["Block"] = field(default_factory=list)  # enclosing sections' lead blocks

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass
class Problem:
    path: str
    line: int
    figure: str
    context: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.figure} | {self.context} ({self.why})"


def _blocks(lines: list[str]) -> list[Block]:
    """Split markdown into headings, paragraphs, list items, tables and fenced code blocks;
    attach each table's / code block's caption and each block's enclosing section leads."""
    out: list[Block] = []
    cur: Optional[Block] = None
    fence = False
    for i, raw in enumerate(lines, 1):
        s = raw.strip()
        if fence:
            cur.lines.append(raw)
            if s.startswith("```"):
                fence, cur = False, None
            continue
        if s.startswith("```"):
            cur = Block("code", i, [raw])
            out.append(cur)
            fence = True
            continue
        if not s:
            cur = None
            continue
        if re.match(r"#{1,6}\s", s):
            out.append(Block("heading", i, [raw], level=len(s) - len(s.lstrip("#"))))
            cur = None
            continue
        if s.startswith("|"):
            if cur is None or cur.kind != "table":
                cur = Block("table", i, [])
                out.append(cur)
            cur.lines.append(raw)
            continue
        if re.match(r"([-*+]|\d+[.)])\s", s):
            cur = Block("item", i, [raw])
            out.append(cur)
            continue
        if cur is None or cur.kind in ("table", "heading"):
            cur = Block("para", i, [raw])
            out.append(cur)
        else:
            cur.lines.append(raw)
    # captions and section leads
    stack: list[tuple[int, Optional[Block]]] = []  # (heading level, its lead block)
    prev: Optional[Block] = None
    after_heading = False
    for b in out:
        if b.kind == "heading":
            while stack and stack[-1][0] >= b.level:
                stack.pop()
            stack.append((b.level, None))
            b.leads = [lead for lvl, lead in stack[:-1] if lvl >= 2 and lead is not None]
            after_heading = True
            prev = b
            continue
        if after_heading and stack:
            stack[-1] = (stack[-1][0], b)
            after_heading = False
        if b.kind in ("table", "code") and prev is not None and prev.kind in ("para", "item"):
            b.caption = prev
        b.leads = [lead for lvl, lead in stack if lvl >= 2 and lead is not None and lead is not b]
        prev = b
    # a heading is covered by its own section's lead too
    for j, b in enumerate(out):
        if b.kind == "heading" and j + 1 < len(out) and out[j + 1].kind != "heading" \
                and b.level >= 2:
            b.leads = b.leads + [out[j + 1]]
    return out


def figures(line: str, in_table_row: bool) -> list[str]:
    """The figure texts of one line (after removing HTML comments)."""
    line = re.sub(r"<!--.*?-->", " ", line)
    spans: list[tuple[int, int]] = []
    pats = list(_FIGURES) + [_TABLE_NUMBER if in_table_row else _TEXT_NUMBER]
    for pat in pats:
        for m in pat.finditer(line):
            a, b = m.span()
            before = line[max(0, a - 16):a]
            text = m.group(0)
            if re.search(r"\d\.\d+\.\d", line[max(0, a - 3):b + 3]):
                continue  # a version number
            if _VERSION.search(before):
                continue
            if before.rstrip().endswith("=") or _THRESHOLD.search(before):
                continue
            if text.strip().endswith("%") and re.match(r"\s*(interval|confidence|CI)\b",
                                                       line[b:]):
                continue
            if re.match(r"\W{0,3}(goal|target|stretch|budget)\b", line[b:], re.I):
                continue
            if any(a < y and x < b for x, y in spans):
                continue  # overlaps a figure found by an earlier pattern
            spans.append((a, b))
    return [re.sub(r"\s+", " ", line[a:b].strip()) for a, b in sorted(spans)]


def committed_results(root: Path) -> set[str]:
    """Committed paths under results/ (files and every folder above them)."""
    r = subprocess.run(["git", "-C", str(root), "ls-files", "results"], capture_output=True,
                       text=True, check=True)
    out: set[str] = set()
    for p in r.stdout.split():
        parts = p.split("/")
        for k in range(2, len(parts) + 1):
            out.add("/".join(parts[:k]))
    return out


def _citations(text: str, committed: set[str]) -> tuple[list[str], list[str]]:
    """(committed results paths cited in ``text``, cited paths that are not committed)."""
    good, bad = [], []
    for m in _CITE.finditer(text):
        path = "results/" + m.group(1) + m.group(2)
        if re.search(r"[<>*{}]|\.\.\.", path):
            continue  # a placeholder, not a citation
        path = path.rstrip("/.")
        if path in committed:
            good.append(path)
        else:
            bad.append(path)
    return good, bad


def _marks(block: Optional[Block]) -> tuple[bool, set[str], list[str]]:
    """(whole block exempt, exempt figure texts, malformed markers) of a block."""
    if block is None:
        return False, set(), []
    whole, listed, bad = False, set(), []
    text = re.sub(r"`[^`\n]*`", " ", block.text)  # a marker shown in a code span is not one
    for m in _MARK_ANY.finditer(text):
        mm = _MARK.fullmatch(m.group(0))
        if mm is None or not mm.group(2).strip():
            bad.append(m.group(0))
            continue
        quoted = _QUOTED.findall(mm.group(1))
        if quoted:
            listed |= {re.sub(r"\s+", " ", q.strip()) for q in quoted}
        else:
            whole = True
    return whole, listed, bad


def check_file(path: Path, committed: set[str], rel: str) -> tuple[list[Problem], list[tuple]]:
    lines = path.read_text().splitlines()
    generated = generated_lines(lines)  # rendered from results by benchmarks/tables.py
    problems: list[Problem] = []
    cited: list[tuple] = []
    for b in _blocks(lines):
        own_marks = _marks(b)
        cap_marks = _marks(b.caption) if b.kind == "table" else (False, set(), [])
        for bad_mark in own_marks[2]:
            problems.append(Problem(rel, b.start, bad_mark, "", "a not-measured marker needs "
                                    "': REASON' (and quoted figures, if any, before it)"))
        scope_blocks = [b] + ([b.caption] if b.caption else []) + b.leads
        for k, line in enumerate(b.lines):
            lineno = b.start + k
            good_here, bad_here = _citations(line, committed)
            for p in bad_here:
                problems.append(Problem(rel, lineno, p, line.strip()[:100],
                                        "cites a results path that is not committed"))
            if lineno in generated:
                continue
            is_row = b.kind == "table"
            if is_row and (k == 0 or re.fullmatch(r"\|?[\s:|-]+\|?", line.strip())):
                continue  # header and separator rows
            figs = figures(line, is_row)
            if not figs:
                continue
            if is_row:
                texts = [line] + ([b.caption.text] if b.caption else []) + \
                    [lead.text for lead in b.leads]
            else:
                texts = [blk.text for blk in scope_blocks]
            cites = [c for t in texts for c in _citations(t, committed)[0]]
            row_marks = _marks(Block("row", lineno, [line])) if is_row else (False, set(), [])
            for f in figs:
                exempt = any(m[0] for m in (own_marks if not is_row else row_marks, cap_marks)) \
                    or any(f in m[1] for m in (own_marks, cap_marks, row_marks))
                if exempt:
                    continue
                if cites:
                    cited.append((rel, lineno, f, cites[0]))
                else:
                    problems.append(Problem(rel, lineno, f, line.strip()[:100],
                                            "cites no committed results folder"))
    return problems, cited


def doc_files(root: Path) -> list[Path]:
    out: list[Path] = []
    for pattern in DOCS:
        out += sorted(root.glob(pattern))
    return out


def check(paths: Iterable[Path], root: Path = ROOT,
          committed: Optional[set[str]] = None) -> tuple[list[Problem], list[tuple]]:
    committed = committed_results(root) if committed is None else committed
    problems: list[Problem] = []
    cited: list[tuple] = []
    for p in paths:
        try:
            rel = str(Path(p).resolve().relative_to(root.resolve()))
        except ValueError:
            rel = str(p)
        pr, ci = check_file(Path(p), committed, rel)
        problems += pr
        cited += ci
    return problems, cited


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help=f"markdown files (default: {', '.join(DOCS)})")
    ap.add_argument("--list", action="store_true", help="also print the cited figures")
    a = ap.parse_args(argv)
    paths = [Path(f) for f in a.files] or doc_files(ROOT)
    problems, cited = check(paths)
    if a.list:
        for rel, line, fig, cite in cited:
            print(f"{rel}:{line}: {fig} <- {cite}")
    for p in problems:
        print(p)
    print(f"check_figures: {len(cited)} cited figure(s), {len(problems)} problem(s) in "
          f"{len(paths)} file(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
