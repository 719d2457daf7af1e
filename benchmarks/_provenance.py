"""How a results folder was made: every invocation that wrote to it, in order.

A benchmark that writes to ``results/<name>/`` calls ``record(folder)`` once it knows its
output folder. That appends one entry to ``<folder>/provenance.json`` and rewrites the
human-readable ``<folder>/COMMANDS.md`` from it:

* ``command``: the invocation as a shell command line (the environment variables that change
  what the benchmarks do, ``sudo`` when run through it, ``python``, the script's path relative
  to the repository, its arguments), and ``argv`` / ``cwd`` / ``python`` as they were;
* ``git_commit`` and ``git_dirty`` (tracked files modified or files git does not ignore added;
  ``git_dirty_files`` names up to 20 of them), or "unknown" with git's error;
* ``start`` / ``end`` (UTC, ISO 8601), ``wall_s``;
* ``loadavg_start`` / ``loadavg_end`` (``os.getloadavg()``: 1, 5 and 15 min), the largest and
  mean 1-min load average sampled every ``SAMPLE_S`` seconds during the run, ``cpu_count`` and
  the CPUs this process may use;
* ``status``: "running" until the process exits, then "ended without an exception" (the exit
  status itself is not seen from ``atexit``) or "exception: <type>: <msg>"; ``end`` and
  ``loadavg_end`` read ``RUNNING`` until then, so a file committed mid-run (a campaign commits
  as it goes) is complete, and an entry still at "running" when its process is gone was killed
  (a signal, a timeout, the machine).

The entry is written at the start (so an interrupted run still leaves its command behind) and
completed at interpreter exit. Several invocations sharing a folder (a sweep split over
``--schemes`` or ``--seed``) each append their own entry; a lock on the folder serializes the
updates.
Processes forked or spawned by the benchmark (ranks) do not write.

``python benchmarks/_provenance.py --out results/<name> -- <command ...>`` records a command
that is not one of these scripts (a test run, a torchrun job): it runs the command, tees its
output to ``<folder>/output.txt`` and records it like a script would.

Folders committed before this helper existed carry a ``provenance.json`` written after the fact
from git history (``"reconstructed": true``): what is known, with its source, and
``NOT_RECORDED`` for what was not recorded at the time. Folders made by the ``accuracy``
branch, which recorded its invocations in a format of its own (``argv``, ``commit``, ``dirty``,
``start``, ``end``, load averages) plus a hand-written ``commands.sh``, carry those records
converted to this format (``"converted_from"`` says from what; a field that format did not
have is ``NOT_RECORDED``).

A script can add what it knows about its own run to its entry with ``Recorder.note`` (the
accuracy sweeps add ``trained_runs`` and ``train_wall_s``, the training part of ``wall_s``).
"""

from __future__ import annotations

import atexit
import datetime as _dt
import fcntl
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
FILE = "provenance.json"
COMMANDS = "COMMANDS.md"
NOT_RECORDED = "not recorded at the time"
RUNNING = "running: not ended when this file was written"
SAMPLE_S = 15.0
#: environment variables that change what a benchmark does or how fast it runs
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "FSDP_QCOMM_NATIVE",
            "FSDP_QCOMM_DEVICE", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES",
            "FSDP_QCOMM_FT_FSDP")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _git(*args: str) -> tuple[int, str]:
    try:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 1, str(e)
    # not strip(): porcelain lines start with a space ("M" in the second column)
    return r.returncode, (r.stdout if r.returncode == 0 else r.stderr).rstrip()


def git_state() -> dict[str, Any]:
    """The checkout's commit and whether tracked files differ from it."""
    rc, head = _git("rev-parse", "HEAD")
    head = head.strip()
    if rc:
        return {"git_commit": f"unknown ({head or 'git failed'})", "git_dirty": "unknown"}
    rc, st = _git("status", "--porcelain")  # results/ is ignored: its outputs do not count
    if rc:
        return {"git_commit": head, "git_dirty": f"unknown ({st})"}
    files = [line[3:] for line in st.splitlines() if line.strip()]
    out: dict[str, Any] = {"git_commit": head, "git_dirty": bool(files)}
    if files:
        out["git_dirty_files"] = files[:20] + ([f"... {len(files) - 20} more"]
                                               if len(files) > 20 else [])
    return out


def _rel(path: str) -> str:
    """A script path relative to the repository (as the README's commands write it)."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path


def command_line(argv: Sequence[str], env: Optional[dict[str, str]] = None,
                 python: bool = True) -> str:
    """``argv`` as a shell command line, prefixed by the relevant environment variables (and
    ``sudo`` when run through it)."""
    env = os.environ if env is None else env
    parts = [f"{k}={shlex.quote(env[k])}" for k in ENV_KEYS if k in env]
    words = list(argv)
    if python and words:
        words = ["python", _rel(words[0]), *words[1:]]
    prefix = ["sudo"] if env.get("SUDO_USER") and hasattr(os, "geteuid") and os.geteuid() == 0 \
        else []
    return " ".join(prefix + parts + [shlex.join(words)])


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


@contextmanager
def _locked(folder: Path):
    """Serialize read-modify-write of the folder's provenance (a lock on the folder itself,
    so no lock file is left behind)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def read(folder: str | Path, prefix: str = "") -> dict[str, Any]:
    """The folder's provenance (an empty record if there is none yet)."""
    p = Path(folder) / (prefix + FILE)
    if p.is_file():
        return json.loads(p.read_text())
    return {"folder": _rel(str(folder)), "invocations": []}


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "/".join(str(x) for x in v)
    return str(v)


def render(doc: dict[str, Any]) -> str:
    """``COMMANDS.md``: the invocations of ``provenance.json`` in order, for people."""
    lines = [f"# How `{doc.get('folder', '?')}` was made", ""]
    if doc.get("reconstructed"):
        lines += ["Reconstructed after the fact from git history (the run did not record its "
                  f"provenance); \"{NOT_RECORDED}\" marks what was not recorded."
                  + (f" {doc['note']}" if doc.get("note") else ""), ""]
        if doc.get("added_in"):
            lines += [f"Files added in commit(s): {', '.join(doc['added_in'])}.", ""]
    else:
        lines += ["Every invocation that wrote to this folder, in order (generated by "
                  "`benchmarks/_provenance.py` from `provenance.json`)."
                  + (f" {doc['note']}" if doc.get("note") else ""), ""]
    for i, e in enumerate(doc.get("invocations", []), 1):
        lines.append(f"{i}. `{e.get('command', NOT_RECORDED)}`")
        dirty = e.get("git_dirty")
        commit = _fmt(e.get("git_commit", NOT_RECORDED))
        if dirty is True:
            files = e.get("git_dirty_files", [])
            commit += " (with uncommitted changes: " + (
                files if isinstance(files, str) else ", ".join(files)) + ")"
        elif dirty is False:
            commit += " (clean)"
        lines.append(f"   - commit: {commit}")
        lines.append(f"   - start: {_fmt(e.get('start', NOT_RECORDED))}; end: "
                     f"{_fmt(e.get('end', NOT_RECORDED))}"
                     + (f" ({e['wall_s'] / 60:.1f} min)" if isinstance(e.get("wall_s"),
                                                                    (int, float)) else ""))
        load = ("   - load average (1/5/15 min) at start: "
                f"{_fmt(e.get('loadavg_start', NOT_RECORDED))}; at end: "
                f"{_fmt(e.get('loadavg_end', NOT_RECORDED))}")
        if isinstance(e.get("load1_max"), (int, float)):
            load += (f"; 1-min load during the run: max {e['load1_max']:.2f}, mean "
                     f"{e['load1_mean']:.2f} ({e['load_samples']} samples)")
        lines.append(load)
        lines.append(f"   - CPUs: {_fmt(e.get('cpu_count', NOT_RECORDED))}"
                     + (f" ({e['cpus_usable']} usable by the process)"
                        if e.get("cpus_usable") not in (None, e.get("cpu_count")) else ""))
        if e.get("status"):
            lines.append(f"   - status: {e['status']}")
        extra = [f"{k}: {e[k]}" for k in ("trained_runs", "train_wall_s") if k in e]
        if extra:
            lines.append("   - " + "; ".join(extra))
        for key in ("source", "notes"):
            if e.get(key):
                lines.append(f"   - {key}: {e[key]}")
    return "\n".join(lines) + "\n"


def _write(folder: Path, prefix: str, doc: dict[str, Any]) -> None:
    p = folder / (prefix + FILE)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(p)
    (folder / (prefix + COMMANDS)).write_text(render(doc))


class Recorder:
    """One invocation's entry; completed at interpreter exit (or by ``finish``)."""

    def __init__(self, folder: Path, prefix: str, entry: dict[str, Any]) -> None:
        self.folder, self.prefix, self.entry = folder, prefix, entry
        self.pid = os.getpid()
        self._t0 = time.monotonic()
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._exc: Optional[BaseException] = None
        self._done = False
        self._thread = threading.Thread(target=self._sample, daemon=True,
                                        name="provenance-load")
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._samples.append(os.getloadavg()[0])

    def _update(self, fields: dict[str, Any]) -> None:
        with _locked(self.folder):
            doc = read(self.folder, self.prefix)
            for e in doc["invocations"]:
                if e.get("id") == self.entry["id"]:
                    e.update(fields)
                    break
            else:  # the file was replaced meanwhile: keep this run's entry anyway
                doc["invocations"].append({**self.entry, **fields})
            _write(self.folder, self.prefix, doc)

    def note(self, **fields: Any) -> None:
        """Add fields to this invocation's entry now (e.g. ``trained_runs``, ``train_wall_s``:
        what the script itself knows about its run)."""
        if os.getpid() != self.pid:
            return
        self.entry.update(fields)
        self._update(fields)

    def finish(self, status: Optional[str] = None) -> None:
        if self._done or os.getpid() != self.pid:
            return
        self._done = True
        self._stop.set()
        samples = self._samples + [os.getloadavg()[0]]
        if status is None:
            status = ("ended without an exception" if self._exc is None
                      else f"exception: {type(self._exc).__name__}: {self._exc}"[:300])
        self._update({"end": _now(), "wall_s": round(time.monotonic() - self._t0, 1),
                      "loadavg_end": _load(), "load1_max": round(max(samples), 2),
                      "load1_mean": round(sum(samples) / len(samples), 2),
                      "load_samples": len(samples), "status": status})


class RunClock:
    """One stored run's own provenance (a campaign stores runs one by one, so each carries
    what its folder's invocation entry would say of it): the commit, when it started and
    ended, and the 1-min load average at both ends and sampled every ``SAMPLE_S`` seconds in
    between, so a run made beside other work shows it. Used by rank 0 around each run."""

    def __init__(self) -> None:
        self.start, self.load_start = _now(), _load()
        self._t0 = time.monotonic()
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="run-load")
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._samples.append(os.getloadavg()[0])

    def done(self) -> dict[str, Any]:
        self._stop.set()
        samples = self._samples + [os.getloadavg()[0]]
        return {**git_state(), "host": platform.node(), "start": self.start, "end": _now(),
                "wall_s": round(time.monotonic() - self._t0, 1),
                "loadavg_start": self.load_start, "loadavg_end": _load(),
                "load1_max": round(max(samples), 2),
                "load1_mean": round(sum(samples) / len(samples), 2),
                "cpu_count": os.cpu_count()}


def record(folder: str | Path, *, prefix: str = "", argv: Optional[Sequence[str]] = None,
           notes: str = "", extra: Optional[dict[str, Any]] = None) -> Recorder:
    """Append this invocation to ``<folder>/<prefix>provenance.json`` (and ``COMMANDS.md``);
    the entry is completed when the interpreter exits."""
    folder = Path(folder)
    argv = list(sys.argv if argv is None else argv)
    entry: dict[str, Any] = {
        "id": f"{_now()}-{os.getpid()}",
        "command": command_line(argv),
        "argv": argv, "cwd": os.getcwd(),
        "python": f"{sys.executable} {platform.python_version()}",
        **git_state(),
        "host": platform.node(),
        "start": _now(), "loadavg_start": _load(),
        "end": RUNNING, "loadavg_end": RUNNING,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "status": "running",
    }
    if notes:
        entry["notes"] = notes
    entry.update(extra or {})
    with _locked(folder):
        doc = read(folder, prefix)
        doc["invocations"].append(entry)
        _write(folder, prefix, doc)
    rec = Recorder(folder, prefix, entry)
    previous = sys.excepthook

    def hook(kind, value, tb):  # an uncaught exception ends the run: say so in the entry
        rec._exc = value
        previous(kind, value, tb)

    sys.excepthook = hook
    atexit.register(rec.finish)
    return rec


class _Tee:
    def __init__(self, stream, log) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def tee_stdout(path: str | Path) -> None:
    """From now on, also write what this process prints to ``path`` (a script's
    ``output.txt``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "w")
    original = sys.stdout
    sys.stdout = _Tee(original, log)

    def close() -> None:
        sys.stdout.flush()
        sys.stdout = original
        log.close()

    atexit.register(close)


def under_results(path: str | Path) -> bool:
    """Whether ``path`` lies in this repository's ``results/`` folder."""
    try:
        Path(path).resolve().relative_to(REPO / "results")
        return True
    except ValueError:
        return False


def _main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python benchmarks/_provenance.py --out DIR [--notes TEXT] -- COMMAND ...",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description="run COMMAND, tee its output to DIR/output.txt "
                                             "and record it in DIR/provenance.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--notes", default="")
    a = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd:
        ap.error("no command after --")
    out = Path(a.out)
    entry_argv = [_rel(__file__), "--out", a.out] + (["--notes", a.notes] if a.notes else []) \
        + ["--", *cmd]
    rec = record(out, argv=entry_argv, notes=a.notes,
                 extra={"wrapped_command": command_line(cmd, python=False)})
    with open(out / "output.txt", "w") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert p.stdout is not None
        for line in p.stdout:
            sys.stdout.write(line)
            log.write(line)
        rc = p.wait()
    rec.finish(f"exit status {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(_main())
