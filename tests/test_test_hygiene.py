"""A test run leaves nothing behind: every pytest process (with pytest-xdist, the controller and
each worker) makes its own Flower home in the temp folder (``tests/conftest.py``) and removes it
when it ends."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

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
