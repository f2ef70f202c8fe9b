import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
# one thread per pytest-xdist worker (make test-fast runs one worker per core), two otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))
# What the in-process sites keep between rounds (client_app.app.site_state_root) lands in this
# session's own Flower home, not the user's; a test that starts Flower's processes gives them one.
# Every pytest process has its own (with pytest-xdist: the controller and each worker) and removes
# it when it ends (pytest_unconfigure; atexit should a process end without it): a test run leaves
# nothing in the temp folder (tests/test_test_hygiene.py). A process that is killed runs neither,
# so its folder names it, and the next pytest process removes the folders of processes gone.
FLWR_HOME_PREFIX = "fedpac-tests-flwr-home-"
_OWNER = os.getpid()


def remove_homes_of_ended_processes(temp: Path) -> list[Path]:
    """Remove the Flower homes in ``temp`` whose pytest process no longer runs; returns them."""
    removed = []
    for home in temp.glob(FLWR_HOME_PREFIX + "*-*"):
        pid = home.name.removeprefix(FLWR_HOME_PREFIX).split("-", 1)[0]
        if not pid.isdigit() or int(pid) == _OWNER:
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(home, ignore_errors=True)
            removed.append(home)
        except PermissionError:  # another user's process, alive
            pass
    return removed


remove_homes_of_ended_processes(Path(tempfile.gettempdir()))
FLWR_HOME = tempfile.mkdtemp(prefix=f"{FLWR_HOME_PREFIX}{_OWNER}-")
os.environ["FLWR_HOME"] = FLWR_HOME


def _remove_flwr_home() -> None:
    if os.getpid() == _OWNER:  # not a forked child's exit: the folder is its parent's
        shutil.rmtree(FLWR_HOME, ignore_errors=True)


atexit.register(_remove_flwr_home)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests of one ``xdist_group`` run on one worker under ``--dist loadgroup`` (make test's e2e
    tier: tests/deployment.py's LOCAL_SUPERLINK). pytest-xdist tells its scheduler a test's group
    by a suffix on the test's node id ("...::test@group"), set on the worker as ``item._nodeid``;
    pytest 9.2 reads node ids from a structured ``item._id``, so the suffix no longer takes and
    grouped tests are spread like any other (pytest-dev/pytest-xdist#1386, docs/UPSTREAM.md).
    Until xdist's fix ships, the suffix is set here where pytest reads it."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId  # pylint: disable=import-outside-toplevel

    for item in items:
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(groups)
        if groups and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)  # pylint: disable=protected-access


def pytest_unconfigure(config: pytest.Config) -> None:  # pylint: disable=unused-argument
    """This process's Flower home goes with it."""
    _remove_flwr_home()


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _unrendered(fig, path: Path, palette: bool = False) -> None:
    from server_app import report

    report.atomic_write(path, PNG_SIGNATURE)  # where the real one writes (a full disk still fails)


@pytest.fixture(autouse=True)
def _charts_built_not_rendered(request, monkeypatch):
    """Every chart of a run or a report is built from its data as always, but not rendered to
    PNG (matplotlib's rasterizing took most of the in-process runs' and the runner's report
    time): the file holds the PNG signature only. A test that asks for ``rendered_charts``
    gets real PNG files; the end-to-end runs, in processes of their own, always do."""
    if "rendered_charts" not in request.fixturenames:
        from common import figures
        from experiments import summary

        # every chart of a run, the accuracy and the methods' own (common/methods/*/charts.py),
        # is saved by common.figures.save_figure
        monkeypatch.setattr(figures, "save_figure", _unrendered)
        monkeypatch.setattr(summary, "save_figure", _unrendered)


@pytest.fixture
def rendered_charts():
    """Charts rendered to real PNG files (see ``_charts_built_not_rendered``)."""


@pytest.fixture(autouse=True)
def _task_identity():
    from federation import set_task_identity

    set_task_identity()
    yield
