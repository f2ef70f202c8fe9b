"""A test run leaves nothing behind: every pytest process (with pytest-xdist, the controller and
each worker) makes its own Flower home in the temp folder (``tests/conftest.py``) and removes it
when it ends."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "fedpac-tests-flwr-home-"


def test_the_session_s_flwr_home_is_its_own_temporary_folder():
    """Flower's home in a test is a fresh folder in the temp folder, not the user's (the in-process
    sites keep their state there). Printed: the test below reads it from a pytest run's report."""
    home = Path(os.environ["FLWR_HOME"])
    print(f"FLWR_HOME={home}")
    assert home.is_dir() and home.name.startswith(PREFIX)
    assert home.parent == Path(tempfile.gettempdir())


def test_a_pytest_run_with_an_xdist_worker_leaves_nothing_in_the_temp_folder(tmp_path):
    """A pytest run with an xdist worker, the project's conftest in effect, in a temp folder of
    its own (TMPDIR): its two processes (the controller, which runs no test, and the worker) made
    a Flower home each there, and after it none is left, the one the test saw included."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTEST_", "FLWR_HOME"))}  # not this run's worker, nor its home
    node = f"{Path(__file__).relative_to(ROOT)}::test_the_session_s_flwr_home_is_its_own_temporary_folder"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-n", "1", node],
                         cwd=ROOT, env={**env, "TMPDIR": str(temp)}, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
    (home,) = re.findall(r"^FLWR_HOME=(.+)$", run.stdout, re.MULTILINE)
    assert Path(home).parent == temp and Path(home).name.startswith(PREFIX)  # where the run made it
    assert not Path(home).exists()
    # nor the controller's, nor anything else but pytest's own numbered base folders
    # (pytest-of-<user>/pytest-<n>, of which pytest keeps the last three), empty here
    assert [entry.name for entry in temp.iterdir() if not entry.name.startswith("pytest-of-")] == []
    assert [f for f in temp.rglob("*") if not f.is_dir() and not f.is_symlink()] == []


def test_the_flower_home_of_a_killed_pytest_process_goes_with_the_next_one(tmp_path):
    """A pytest process that is killed (CI's timeout, a closed terminal) removes nothing; the next
    one removes the homes of the processes that are gone, and none of a process still running."""
    from conftest import FLWR_HOME_PREFIX, remove_homes_of_ended_processes  # pylint: disable=import-outside-toplevel

    ended = subprocess.Popen([sys.executable, "-c", "pass"])  # pylint: disable=consider-using-with
    ended.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # pylint: disable=consider-using-with
    try:
        gone = tmp_path / f"{FLWR_HOME_PREFIX}{ended.pid}-abc"
        alive = tmp_path / f"{FLWR_HOME_PREFIX}{running.pid}-def"
        mine = tmp_path / f"{FLWR_HOME_PREFIX}{os.getpid()}-ghi"
        unrelated = tmp_path / f"{FLWR_HOME_PREFIX}notapid-jkl"
        for home in (gone, alive, mine, unrelated):
            (home / "fedpac-site-state").mkdir(parents=True)
        assert remove_homes_of_ended_processes(tmp_path) == [gone]
        assert not gone.exists() and alive.is_dir() and mine.is_dir() and unrelated.is_dir()
    finally:
        running.kill()
        running.wait()
    assert remove_homes_of_ended_processes(tmp_path) == [alive]


@pytest.mark.xdist_group("hygiene-check")
@pytest.mark.parametrize("index", range(4))
def test_one_of_a_group_of_four_says_where_it_ran(index):
    """What the next test runs: each of four tests of one group prints its worker."""
    print(f"GROUPED {index} ON {os.environ.get('PYTEST_XDIST_WORKER', 'no worker')}")


def test_the_tests_of_one_xdist_group_run_on_one_worker():
    """make test's e2e tier runs on two workers with --dist loadgroup, and the tests that share
    Flower's one local SuperLink must never run at once: the four tests of a group, under the
    project's conftest, all run on one of two workers (pytest 9.2 lost xdist's grouping,
    pytest-dev/pytest-xdist#1386; tests/conftest.py puts it back)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "FLWR_HOME"))}
    node = f"{Path(__file__).relative_to(ROOT)}::test_one_of_a_group_of_four_says_where_it_ran"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-n", "2",
                          "--dist", "loadgroup", node], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    placed = dict(re.findall(r"GROUPED (\d) ON (\w+)", run.stdout))
    assert sorted(placed) == ["0", "1", "2", "3"], run.stdout
    assert len(set(placed.values())) == 1, placed


# ---------------------------------------------------------------------- security properties, quickly

E2E_MARKS = {"e2e", "slow"}


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The pytest.mark.<name> of a test's decorators."""
    names = set()
    for decorator in decorators:
        node = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
            names.add(node.attr)
    return names


def quick_tests(module: Path) -> list[str]:
    """The tests of ``module`` in the quick tier (``-m "not e2e and not slow"``): neither the
    module's ``pytestmark`` nor the test's own decorators mark it e2e or slow."""
    tree = ast.parse(module.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if _marks(values) & E2E_MARKS:
                return []
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
            and not _marks(node.decorator_list) & E2E_MARKS]


def test_every_protection_security_md_claims_has_a_quick_test_that_attacks_it():
    """Each row of SECURITY.md's table of protections names, among its tests, a test module with
    tests in the quick tier: a broken protection fails in the tier run while changing code, not
    only in a deployment test at the end of the suite."""
    text = (ROOT / "docs" / "SECURITY.md").read_text()
    table = text.split("## What is protected, by what, and the test that attacks it", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|") and not line.startswith(("| property", "|---"))]
    assert len(rows) >= 15
    without = []
    for row in rows:
        cells = row.strip("|").split(" | ")
        modules = set(re.findall(r"tests/(test_\w+)\.py", cells[-1]))
        if not any(quick_tests(ROOT / "tests" / f"{name}.py") for name in modules):
            without.append(f"{cells[0][:70]} ({', '.join(sorted(modules)) or 'no test named'})")
    assert not without, "protections with no quick test:\n  " + "\n  ".join(without)
