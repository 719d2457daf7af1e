"""Two tiers, one runner: ``pytest`` runs every module on its quickest tests that still mean
something; ``pytest --all`` (``bash scripts/test.sh --all``) adds the tests marked ``long``:
long trainings, batteries and the torchtitan runs that repeat what a shorter test of the same
module already asserts on a smaller case.

Every module must keep at least one test in the quick tier: a module whose every collected
test is ``long`` fails the collection, so the quick tier never silently stops running a file.
"""

from __future__ import annotations

import os

import pytest

ALL_ENV = "FSDP_QCOMM_TEST_ALL"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all", action="store_true", default=False,
        help=f"also run the long tier (tests marked 'long'); {ALL_ENV}=1 does the same",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "long: a long training or battery, run by 'bash scripts/test.sh --all' only",
    )


def _run_all(config: pytest.Config) -> bool:
    """--all, the environment variable, or tests named by node id (``file::test``): a test
    asked for by name runs whatever its tier."""
    return (bool(config.getoption("--all")) or os.environ.get(ALL_ENV) == "1"
            or any("::" in str(a) for a in config.args))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _run_all(config):
        return
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    only_long = sorted(m for m, its in by_module.items()
                       if all(it.get_closest_marker("long") for it in its))
    # under -k or -m the selection may hold long tests alone: only a whole collection must keep
    # a quick test per module
    if only_long and not config.getoption("keyword") and not config.getoption("markexpr"):
        raise pytest.UsageError(
            f"{', '.join(only_long)}: every test is marked 'long', so the quick tier would not "
            "run this module at all; leave one quick test unmarked (or run with --all)")
    deselected = [it for it in items if it.get_closest_marker("long")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [it for it in items if not it.get_closest_marker("long")]
        config._fsdp_qcomm_long = len(deselected)  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    n = getattr(config, "_fsdp_qcomm_long", 0)
    if n:
        terminalreporter.write_line(
            f"quick tier: {n} long test(s) not run; 'bash scripts/test.sh --all' runs them")
