"""Two tiers, one runner: ``pytest`` runs every module on its quickest tests that still mean
something; ``pytest --all`` (``bash scripts/test.sh --all``) adds the tests marked ``long``:
long trainings, batteries and the torchtitan runs that repeat what a shorter test of the same
module already asserts on a smaller case.

Every module must keep at least one test in the quick tier: a module whose every collected
test is ``long`` fails the collection, so the quick tier never silently stops running a file.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest

ALL_ENV = "FSDP_QCOMM_TEST_ALL"
#: "i/n": this pytest runs the i-th of n interleaved slices of what it selected (the i-th test,
#: then every n-th after it). A test that starts a single-threaded child pytest starts n of
#: them at once, one slice each, so that both cores work (``test_kernels.py``'s interpreter run).
SHARD_ENV = "FSDP_QCOMM_TEST_SHARD"


@pytest.fixture(autouse=True)
def _seed_per_test(request: pytest.FixtureRequest) -> None:
    """Seed the global RNGs from the test's node id: a test that draws from them sees the same
    numbers whatever ran before it in its process, so its outcome does not hang on the order
    or on which xdist worker it lands in."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(seed)


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


def _shard(items: list[pytest.Item]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """(kept, dropped) under ``SHARD_ENV``; everything is kept without it."""
    spec = os.environ.get(SHARD_ENV)
    if not spec:
        return items, []
    try:
        i, n = (int(x) for x in spec.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"{SHARD_ENV}={spec!r}: expected 'i/n' with 0 <= i < n") from None
    return items[i::n], [it for k, it in enumerate(items) if k % n != i]


#: test folders whose files run longest (torchrun jobs of 4 ranks, minutes per file): collected
#: first, so that pytest-xdist (``scripts/test.sh``) starts them first and the other workers run
#: the rest of the suite beside them, rather than one worker finishing them alone at the end
_LONGEST_FIRST = ("titan03", "titan", "titan_common")


def _longest_first(item: pytest.Item) -> int:
    folder = item.path.parent.name
    return _LONGEST_FIRST.index(folder) if folder in _LONGEST_FIRST else len(_LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _tier(config, items)
    items[:], dropped = _shard(items)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items.sort(key=_longest_first)  # stable: the order inside a folder stays
    if hasattr(config, "workeroutput"):  # a pytest-xdist worker: tell the controller
        config.workeroutput["fsdp_qcomm_long"] = getattr(config, "_fsdp_qcomm_long", 0)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller collects nothing itself: it takes the long tier's count from
    its workers, for the summary line."""
    n = getattr(node, "workeroutput", {}).get("fsdp_qcomm_long", 0)
    node.config._fsdp_qcomm_long = max(n, getattr(node.config, "_fsdp_qcomm_long", 0))


def _tier(config: pytest.Config, items: list[pytest.Item]) -> None:
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
