"""The warm executor in a real deployment (TLS SuperLink, an authenticated SuperNode started with
deploy/supernode.sh, runs submitted with `flwr run`): each run's ClientApp has its own worker
process at the site, a site that replaced its data files between two runs with the same run
config trains the second on the new files, and `flwr stop` of a run whose task is running. In
that order: a run on the site's data, a run stopped while its message trains, the site's data
files replaced, a run with the first run's config.

The workers are seen from the executor's log lines in the SuperNode's log: 'ClientApp worker
(pid N) serves run R ...', '... of run R ... stopped: ...' and 'Standby ClientApp worker (pid N)
started'."""

from __future__ import annotations

import csv
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

from tests.deployment import FEDERATION, ROOT, SMALL, Federation, create_certificates, process_gone

sys.path.insert(0, str(ROOT / "deploy"))
from export_partitions import export  # noqa: E402  pylint: disable=wrong-import-position

pytestmark = pytest.mark.e2e

IDLE_TIMEOUT = 10  # seconds, FEDPAC_WORKER_IDLE_TIMEOUT: short, so that a run's worker goes within the test
# about 10 s of local training on 2 idle cores (100 samples): long enough to stop the run in the middle
LONG_TRAINING = SMALL.replace("local-epochs=1", "local-epochs=60")


def export_site_data(out: Path, samples: int) -> Path:
    """Partition 0 of 1 as a site's own folder (train.npz, test.npz) with ``samples`` training samples."""
    config = parse_config_args([f"samples-per-client={samples} test-samples-per-client=50"])
    (directory,) = export(config, 1, out)
    return directory


def run_folder(out: Path, run_id: str) -> Path:
    (directory,) = out.glob(f"*-run{run_id}")
    return directory


def trained_examples(out: Path, run_id: str) -> list[int]:
    with (run_folder(out, run_id) / "clients.csv").open() as table:
        return [int(row["num_examples"]) for row in csv.DictReader(table)]


def workers_of(log: str, run_id: str) -> list[int]:
    return [int(pid) for pid, run in re.findall(r"ClientApp worker \(pid (\d+)\) serves run (\d+) ", log)
            if run == run_id]


def wait_for(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.25)


def test_each_run_has_its_own_worker_reads_the_site_s_current_data_and_a_stopped_run_s_worker_goes(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FEDPAC_WORKER_IDLE_TIMEOUT", str(IDLE_TIMEOUT))  # the node's environment
    site = export_site_data(tmp_path / "data", samples=100)
    replacement = export_site_data(tmp_path / "new-data", samples=60)
    federation = Federation(tmp_path / "deployment", create_certificates(tmp_path / "certs", 1), num_nodes=1)
    out, models = tmp_path / "out", tmp_path / "models"
    config = f"num-server-rounds=1 min-available-clients=1 output-dir='{out}'"
    try:
        federation.register(0)
        federation.start_node(0, data_path=site, model_dir=models)
        node_log = lambda: federation.read_log("supernode-0")  # noqa: E731

        first = federation.submit(f"{SMALL} {config}")
        assert federation.wait(first) == "finished:completed", federation.log(first)[-3000:]
        assert trained_examples(out, first) == [100]
        (first_worker,) = workers_of(node_log(), first)  # its query, train and evaluate tasks: one process

        # A run stopped while its task trains.
        stopped = federation.submit(f"{LONG_TRAINING} {config}")
        wait_for(lambda: re.search(rf"serves run {stopped} .*Receiving: train message", node_log(), re.S),
                 timeout=120, what="the stopped run's train message")
        (stopped_worker,) = workers_of(node_log(), stopped)
        assert stopped_worker != first_worker
        federation.flwr("stop", stopped, FEDERATION)  # the CLI's own start-up takes it into the training
        dropped = f"Run ID {stopped} is not in `RUNNING` status. Ignoring reply message"
        assert dropped not in node_log()  # the task is still running
        assert federation.status(stopped) == "finished:stopped"
        # Nothing tells the node's ClientApp: the task trains to its end, and the node drops its
        # reply when it sends it (the ClientApp's push of the reply may fail then, or not).
        wait_for(lambda: dropped in node_log(), timeout=60, what="the stopped run's reply dropped")
        # Its worker goes after the idle timeout, and a standby is started for the next run.
        retired = (rf"pid {stopped_worker}\) of run {stopped} [^\n]*stopped: no task for {IDLE_TIMEOUT} s"
                   r".*Standby ClientApp worker \(pid \d+\) started")
        wait_for(lambda: re.search(retired, node_log(), re.S), timeout=IDLE_TIMEOUT + 15,
                 what="the stopped run's worker stopped")
        assert process_gone(stopped_worker)
        standby = int(re.findall(r"Standby ClientApp worker \(pid (\d+)\) started", node_log())[-1])

        # The site replaces its data files while its SuperNode runs; a run with the first run's
        # config trains on the new files, in a new process (the standby), as the node still serves.
        for name in ("train.npz", "test.npz"):
            os.replace(replacement / name, site / name)
        third = federation.submit(f"{SMALL} {config}")
        assert federation.wait(third) == "finished:completed", federation.log(third)[-3000:]
        assert trained_examples(out, third) == [60]
        assert workers_of(node_log(), third) == [standby]
        assert process_gone(first_worker)
        assert json.loads((models / "model.json").read_text())["run_id"] == int(third)
    finally:
        federation.close()
