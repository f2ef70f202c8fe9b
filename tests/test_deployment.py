"""Deployment on localhost: a TLS SuperLink with SuperNode authentication and authenticated
SuperNodes as separate processes, talking Flower's gRPC Fleet API (no simulation, no Ray),
started with deploy/superlink.sh and deploy/supernode.sh and driven by `flwr run . <federation>`."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from client_app import site_model
from common.site_privacy import privacy_folder

from tests.deployment import (
    FEDERATION,
    ROOT,
    SMALL,
    Federation,
    create_certificates,
    rounds_of,
    run_dir,
    wait_for_rounds,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def certs(tmp_path_factory):
    # one key more than the federation registers: the intruder's
    return create_certificates(tmp_path_factory.mktemp("certs"), 4)


@pytest.fixture
def federation(tmp_path, certs):
    fed = Federation(tmp_path, certs, num_nodes=3)
    yield fed
    fed.close()


def _export_partitions(data, run_config: str = SMALL) -> None:
    """The simulation's partitions written as each site's own data folder, ``data/client-<i>``."""
    subprocess.run([sys.executable, str(ROOT / "deploy" / "export_partitions.py"), "--clients", "3",
                    "--out", str(data), "--run-config", run_config], check=True, capture_output=True)


@pytest.fixture
def simulate():
    """Start the same run as a 3-client simulation, outputs in ``out``, in the background:
    ``simulate(run_config, out, node_config)`` (``node_config``: every simulated site's own
    settings, ``experiments.simulation --node-config``) returns a function that waits for it and
    fails with its log if it failed. A simulation spends most of its half minute waiting for Ray
    to start, so it runs beside the deployment it is compared with; one still running when the
    test ends is killed with everything it started."""
    started: list[subprocess.Popen] = []

    def start(run_config: dict, out: Path, node_config: str = "") -> Callable[[], None]:
        log = out.parent / f"{out.name}.log"
        with log.open("wb") as stream:
            process = subprocess.Popen(
                [sys.executable, "-m", "experiments.simulation", "--clients", "3", "--run-config",
                 json.dumps({**run_config, "output-dir": str(out)}), "--node-config", node_config],
                cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
        started.append(process)

        def finished() -> None:
            assert process.wait(timeout=600) == 0, log.read_text(errors="replace")[-3000:]
        return finished

    yield start
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# One noise secret for the simulated sites and the deployed ones of a DP comparison: each site
# draws its noise from its own secret (common.site_privacy), so only sites that share it compute
# the same releases.
SHARED_SECRET = "c0ffee" * 10 + "c0ff"


def _give_secret(model_dir: Path, pid: int) -> None:
    """What a deployed site does to fix its noise secret: the file in its own site-state folder."""
    folder = privacy_folder(model_dir / "site-state", pid)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "noise-secret").write_text(SHARED_SECRET + "\n")


def _assert_same_final_state(simulated, deployed) -> list[str]:
    """The two runs' final_state.npz hold the same arrays, bit for bit; returns their names."""
    with np.load(run_dir(simulated) / "final_state.npz") as sim, np.load(run_dir(deployed) / "final_state.npz") as dep:
        assert sorted(sim.files) == sorted(dep.files)
        for key in sim.files:
            assert np.array_equal(sim[key], dep[key]), (simulated, key)
        return list(sim.files)


def test_tls_federation_with_node_auth_trains_on_local_data_and_refuses_an_unregistered_node(
    federation, tmp_path
):
    # partition 2 is a "real" deployed client: its own data directory, not a dataset slice
    data = tmp_path / "data"
    _export_partitions(data, "samples-per-client=80 test-samples-per-client=40")
    federation.register(0, 1, 2)
    intruder = federation.start_node(0, key=3, restarts=0)  # a valid key pair, but never registered
    assert intruder.wait(timeout=120) != 0
    assert "Failed to activate SuperNode" in federation.read_log("supernode-0")
    listed = federation.flwr("supernode", "ls", FEDERATION, "--format", "json")
    assert '"online"' not in listed, listed  # the intruder was refused: no node is online

    # site 0 runs only the app version it approved (this app's, as `flwr run` bundles it); site
    # 1 keeps its evaluations' metrics to itself
    digest = subprocess.run([sys.executable, str(ROOT / "deploy" / "warm_executor.py"), "--fab-digest", str(ROOT)],
                            check=True, capture_output=True, text=True).stdout.strip()
    policies = {0: ["--approved-apps", digest], 1: ["--privacy-policy", "withhold-metrics=true"]}
    for pid in range(3):
        federation.start_node(pid, data_path=data / "client-2" if pid == 2 else None, options=policies.get(pid, ()))
    out = tmp_path / "out"
    # the SuperExec crashed: the SuperLink starts a new one, or this run would stay pending
    federation.kill_superexec()
    # each round evaluates 2 of the 3 sites: the third gets the final model by the final delivery
    run_id = federation.submit(f"{SMALL} num-server-rounds=2 min-available-clients=3 fraction-evaluate=0.67 "
                               f"output-dir='{out}'")
    status = federation.wait(run_id)
    assert status == "finished:completed", federation.log(run_id)[-3000:]
    rounds = rounds_of(out)
    assert [int(r["round"]) for r in rounds] == [1, 2]
    assert all(int(r["num_trained"]) == 3 and 1 <= int(r["num_evaluated"]) <= 2 for r in rounds)
    assert (run_dir(out) / "final_state.npz").exists()
    last = [row for row in csv.DictReader((run_dir(out) / "clients.csv").open()) if row["round"] == "2"]
    examples = {row["partition_id"]: int(row["num_examples"]) for row in last}
    assert examples == {"0": 100, "1": 100, "2": 80}  # node 2 read its own directory

    # Every site kept its personalized model, evaluated in the last round or not; the one on its
    # own data reproduces its accuracy through the documented predict entry point.
    delivery = json.loads((run_dir(out) / "status.json").read_text())["delivery"]
    assert delivery["delivered"] == [0, 1, 2] and delivery["undelivered"] == []
    assert delivery["accuracy"]["1"] is None and not any(r["accuracy"] for r in last if r["partition_id"] == "1")
    for row in last:
        info = json.loads((tmp_path / "models" / f"client-{row['partition_id']}" / "model.json").read_text())
        assert info["round"] == 2 and info["partition_id"] == int(row["partition_id"])
        assert 0.0 <= info["accuracy"] <= 1.0  # site 1 too: it evaluated, and kept the figure
        if row["partition_id"] != "1":
            assert info["accuracy"] == pytest.approx(delivery["accuracy"][row["partition_id"]])
        if row["accuracy"]:
            assert info["accuracy"] == pytest.approx(float(row["accuracy"]))
    predictions = tmp_path / "predictions.csv"
    assert site_model.main([str(tmp_path / "models" / "client-2"), str(data / "client-2" / "test.npz"),
                            "--out", str(predictions)]) == 0
    with np.load(data / "client-2" / "test.npz") as test:
        labels = test["y"]
    predicted = [int(r["class"]) for r in csv.DictReader(predictions.open())]
    assert np.mean(np.asarray(predicted) == labels) == pytest.approx(delivery["accuracy"]["2"])


def test_deployed_sites_on_exported_partitions_get_the_simulations_model(tmp_path, certs, monkeypatch, simulate):
    """The simulation's partitions as each site's own data folder, two sites in warm workers and
    one with Flower's own process per message: the final model is the simulation's, bit for bit
    (one normalization for every client, the warm worker computes what a fresh process does, and
    sealed messages carry what the simulation's plain ones do)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray gives a simulated client with one CPU
    config = {"samples-per-client": 100, "test-samples-per-client": 50, "local-epochs": 1,
              "num-server-rounds": 2, "min-available-clients": 3}
    data = tmp_path / "data"
    _export_partitions(data)
    simulated = tmp_path / "simulated"
    simulation = simulate(config, simulated)
    federation = Federation(tmp_path / "deployed", certs, num_nodes=3)
    try:
        federation.register(0, 1, 2)
        for pid in range(3):
            federation.start_node(pid, data_path=data / f"client-{pid}", executor="cold" if pid == 0 else "warm")
        deployed = tmp_path / "out"
        run_id = federation.submit(" ".join(f"{k}={v}" for k, v in config.items()) + f" output-dir='{deployed}'")
        assert federation.wait(run_id) == "finished:completed", federation.log(run_id)[-3000:]
        assert "Messages sealed" in federation.log(run_id)  # the deployed path, not the simulation's
    finally:
        federation.close()
    simulation()
    _assert_same_final_state(simulated, deployed)


def _per_client(out, *columns: str) -> dict[tuple[str, str], tuple[str, ...]]:
    """clients.csv's ``columns`` by (round, partition-id), exactly as written."""
    rows = csv.DictReader((run_dir(out) / "clients.csv").open())
    return {(row["round"], row["partition_id"]): tuple(row[c] for c in columns) for row in rows}


def test_fedprox_and_dittos_personal_models_deployed_compute_what_the_simulation_does(tmp_path, certs, monkeypatch,
                                                                                     simulate):
    """FedProx and Ditto on deployed sites (one with Flower's own process per message, two in warm
    workers), one run after the other on the same federation: every site's accuracy and loss in
    every round, and the final global model, are the simulation's, bit for bit. Ditto's personal
    model lives at the site from one round to the next (the node's state, never sent), so a site
    that lost it, or mixed it up with another run's, would evaluate another model from round 2 on;
    each site saves its personal model at the end, with the accuracy the server recorded."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray gives a simulated client with one CPU
    common = {"samples-per-client": 100, "test-samples-per-client": 50, "local-epochs": 1,
              "num-server-rounds": 3, "min-available-clients": 3}
    methods = {"fedprox": {"prox-mu": 0.1}, "ditto": {"ditto-lambda": 0.5}}
    data = tmp_path / "data"
    _export_partitions(data)
    simulations = [simulate({**common, **knobs, "strategy": method}, tmp_path / f"simulated-{method}")
                   for method, knobs in methods.items()]
    federation = Federation(tmp_path / "deployed", certs, num_nodes=3)
    try:
        federation.register(0, 1, 2)
        for pid in range(3):
            federation.start_node(pid, data_path=data / f"client-{pid}", executor="cold" if pid == 0 else "warm")
        for method, knobs in methods.items():
            settings = " ".join(f"{k}={v}" for k, v in {**common, **knobs}.items())
            run_id = federation.submit(f"strategy='{method}' {settings} output-dir='{tmp_path / method}'")
            assert federation.wait(run_id) == "finished:completed", federation.log(run_id)[-3000:]
    finally:
        federation.close()
    for simulation in simulations:
        simulation()
    for method in methods:
        simulated, deployed = tmp_path / f"simulated-{method}", tmp_path / method
        measured = ("accuracy", "test_loss", "train_loss", "num_examples")
        assert _per_client(deployed, *measured) == _per_client(simulated, *measured), method
        assert len(_per_client(deployed, *measured)) == 9
        _assert_same_final_state(simulated, deployed)
    # the sites' saved models are Ditto's (the last run's) personal models, the ones evaluated
    last = _per_client(tmp_path / "ditto", "accuracy")
    for pid in range(3):
        info = json.loads((tmp_path / "deployed" / "models" / f"client-{pid}" / "model.json").read_text())
        assert info["round"] == 3 and info["accuracy"] == pytest.approx(float(last[("3", str(pid))][0]), abs=0)


def test_client_state_survives_a_killed_supernode_and_a_resumed_server(tmp_path, certs, monkeypatch, simulate):
    """Client state in a real deployment, for pFedVEM (its posterior means live on the server, by
    partition-id, their scales at the sites) and FedPer (its heads stay at the sites, on their
    disk, and never travel): two
    rounds, SuperNode 2 killed and restarted, the server stopped and resumed from its checkpoint
    for rounds 3 and 4. Every site's accuracy and loss in every round, and the final model, are
    the uninterrupted simulation's, bit for bit (a node that had started over from the prior, or
    from round 0's head, would not). Site 2 holds its own privacy policy, a floor on the noise
    that every one of these runs meets; a last run that asks for less noise is refused by site 2
    alone, with the reason in the server's log, and finishes with the other two."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray gives a simulated client with one CPU
    common = {"samples-per-client": 100, "test-samples-per-client": 50, "local-epochs": 1,
              "min-available-clients": 3}
    methods = {"pfedvem": {"vem-head-steps": 2, "vem-mc-samples": 2}, "fedper": {},
               # differential privacy at every site: each site's ledger kept on its disk, its noise
               # drawn from its secret (the simulated sites share the deployed ones')
               "fedpac": {"dp": True}}
    # each method's simulation its own sites' folders: the three run at once
    simulations = [simulate({**common, **knobs, "strategy": method, "num-server-rounds": 4},
                            tmp_path / f"simulated-{method}",
                            f"state-dir='{tmp_path / f'simulated-sites-{method}'}' dp-noise-secret='{SHARED_SECRET}'")
                   for method, knobs in methods.items()]
    federation = Federation(tmp_path / "deployed", certs, num_nodes=3)
    try:
        federation.register(0, 1, 2)
        policy = {2: ["--privacy-policy", "dp-min-noise-multiplier=0.5"]}
        for pid in range(3):
            _give_secret(tmp_path / "deployed" / "models" / f"client-{pid}", pid)
            federation.start_node(pid, options=policy.get(pid, ()))
        settings = {method: " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                     for k, v in {**common, **knobs, "strategy": f"'{method}'"}.items())
                    for method, knobs in methods.items()}
        for method in methods:
            first = tmp_path / f"first-{method}"
            run_id = federation.submit(f"{settings[method]} num-server-rounds=2 output-dir='{first}'")
            assert federation.wait(run_id) == "finished:completed", federation.log(run_id)[-3000:]
        # once for the three methods: the SuperLink keeps a killed node out for up to a minute
        federation.signal_node(2, signal.SIGKILL)
        federation.start_node(2, options=policy[2])
        for method in methods:
            first, resumed = tmp_path / f"first-{method}", tmp_path / f"resumed-{method}"
            run_id = federation.submit(
                f"{settings[method]} num-server-rounds=4 resume-from='{run_dir(first)}' output-dir='{resumed}'")
            assert federation.wait(run_id) == "finished:completed", federation.log(run_id)[-3000:]
        less_noise = tmp_path / "less-noise"
        run_id = federation.submit(f"{SMALL} dp=true dp-noise-multiplier=0.3 num-server-rounds=1 "
                                   f"min-available-clients=3 output-dir='{less_noise}'")
        assert federation.wait(run_id) == "finished:completed", federation.log(run_id)[-3000:]
        assert "below the site's dp-min-noise-multiplier = 0.5" in federation.log(run_id)
        assert int(rounds_of(less_noise)[0]["num_trained"]) == 2
    finally:
        federation.close()
    for simulation in simulations:
        simulation()
    measured = ("accuracy", "test_loss", "train_loss", "num_examples")
    for method in methods:
        simulated, resumed = tmp_path / f"simulated-{method}", tmp_path / f"resumed-{method}"
        assert [int(r["round"]) for r in rounds_of(resumed)] == [1, 2, 3, 4]
        assert all(int(r["num_trained"]) == 3 for r in rounds_of(resumed))
        assert _per_client(resumed, *measured) == _per_client(simulated, *measured), method
        arrays = _assert_same_final_state(simulated, resumed)
        on_server = {key.split("/")[1] for key in arrays if key.startswith("client-")}
        # pFedVEM's posterior means and FedPAC's mixed heads are the server's; FedPer's heads are not
        assert on_server == (set() if method == "fedper" else {"head"})
        for pid in range(3):  # what each site kept (pFedVEM's scales, FedPer's heads): in its model folder
            kept = tmp_path / "deployed" / "models" / f"client-{pid}" / "site-state"
            assert sorted(f.name for f in kept.glob(f"*/partition-{pid}/round-*.npz"))
    private = _per_client(tmp_path / "resumed-fedpac", "dp_epsilon")
    assert private == _per_client(tmp_path / "simulated-fedpac", "dp_epsilon")
    assert all(float(eps) > 0 for (eps,) in private.values())
    for pid in range(3):  # a deployed site shows its epsilon in its own log, every round it trained
        logged = re.findall(rf"partition {pid}, round (\d+): differential privacy epsilon = ([0-9.]+) at delta",
                            federation.read_log(f"supernode-{pid}"))
        assert sorted({int(t) for t, _ in logged}) == [1, 2, 3, 4], pid
        assert {int(t): float(e) for t, e in logged}[4] == pytest.approx(float(private[("4", str(pid))][0]), rel=1e-3)


def test_a_killed_supernode_rejoins_and_a_hung_one_is_timed_out(federation, tmp_path):
    federation.register(0, 1, 2)
    for pid in range(3):
        federation.start_node(pid)
    out = tmp_path / "out"
    run_id = federation.submit(
        f"{SMALL} num-server-rounds=4 min-train-replies=2 min-available-clients=3 round-timeout=45 "
        # an evaluate message per round: a round's row is written before the next round's messages
        # go out, so the signals below land between rounds (fused evaluation writes it after them)
        f"fused-evaluation=false output-dir='{out}'"
    )
    wait_for_rounds(out, 1)
    federation.signal_node(2, signal.SIGKILL)  # dies while round 2 starts, restarts at once
    federation.start_node(2)
    wait_for_rounds(out, 2)
    federation.signal_node(1, signal.SIGSTOP)  # hangs through round 3: the round times out
    wait_for_rounds(out, 3, timeout=400)
    federation.signal_node(1, signal.SIGCONT)
    status = federation.wait(run_id)
    log = federation.log(run_id)
    assert status == "finished:completed", log[-3000:]
    rounds = rounds_of(out)
    assert [int(r["round"]) for r in rounds] == [1, 2, 3, 4]
    assert int(rounds[2]["num_trained"]) == 2  # the hung node's reply never came
    assert float(rounds[2]["seconds"]) >= 45
    assert int(rounds[3]["num_trained"]) == 3  # both nodes are back, as partitions 1 and 2
    assert float(rounds[-1]["mean_accuracy"]) > float(rounds[0]["mean_accuracy"])
