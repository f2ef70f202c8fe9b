"""End to end: `flwr run .` on the embedded data, through a local SuperLink and Ray simulation.

`flwr run` exits 0 even when the run fails, so these tests read the run's status from
`flwr ls` and the app's own outputs.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from common.config import FedPACConfig
from common.model import split_state
from server_app.app import initial_model
from tests.deployment import LOCAL_SUPERLINK, process_gone

ROOT = Path(__file__).resolve().parents[1]
FLWR = str(Path(sys.executable).with_name("flwr"))
pytestmark = [pytest.mark.e2e, LOCAL_SUPERLINK]


def foreign_local_superlinks() -> list[str]:
    """Command lines of running local (``--simulation``) SuperLinks that another Python
    environment started. `flwr run` hands its run to whichever SuperLink holds Flower's local
    ports (127.0.0.1:39091/39093), so a leftover one from another checkout (a deleted clone, say)
    would run this checkout's tests with its own, maybe vanished, interpreter."""
    result = subprocess.run(["pgrep", "-af", "flower-superlink.*--simulation"], capture_output=True, text=True)
    ours = str(Path(FLWR).parent)
    return [line for line in result.stdout.splitlines() if ours not in line]


@pytest.fixture(scope="module")
def flower_env(tmp_path_factory):
    """Its own FLWR_HOME, and the local SuperLink it starts stopped afterwards by PID."""
    foreign = foreign_local_superlinks()
    if foreign:
        pytest.fail("a local SuperLink of another Python environment holds Flower's local ports; stop it "
                    "(`make stop`, or kill the PID) and run again:\n" + "\n".join(foreign), pytrace=False)
    home = tmp_path_factory.mktemp("flwr-home")
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    yield env
    result = subprocess.run(["pgrep", "-f", f"flower-superlink.*{home}"], capture_output=True, text=True)
    pids = [int(pid) for pid in result.stdout.split()]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    # Gone before the next test module starts: one still shutting down holds Flower's local ports.
    deadline = time.monotonic() + 20
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if not process_gone(pid)]
        time.sleep(0.2)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def flwr_run(env, run_config: str, num_supernodes: int, timeout: float = 900) -> tuple[str, str]:
    """Submit a run, wait for it to finish; returns (run id, final status)."""
    submitted = subprocess.run(
        [FLWR, "run", str(ROOT), "--format", "json", "--run-config", run_config,
         "--federation-config", f"num-supernodes={num_supernodes} client-resources-num-cpus=1"],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )
    run_id = json.loads(submitted.stdout[submitted.stdout.index("{"):])["run-id"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = subprocess.run([FLWR, "ls", "--run-id", str(run_id), "--format", "json"],
                                env=env, capture_output=True, text=True, check=True)
        status = json.loads(listed.stdout[listed.stdout.index("{"):])["runs"][0]["status"]
        if status.startswith("finished"):
            return str(run_id), status
        time.sleep(2)
    subprocess.run([FLWR, "stop", str(run_id)], env=env, capture_output=True)
    raise AssertionError(f"run {run_id} did not finish within {timeout}s")


def run_log(env, run_id: str) -> str:
    """The run's own log (ServerApp and ClientApps), as `flwr log --show` prints it."""
    return subprocess.run([FLWR, "log", run_id, "--show"], env=env, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def finished_run(flower_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("outputs")
    run_id, status = flwr_run(
        flower_env, f"num-server-rounds=4 samples-per-client=300 test-samples-per-client=100 output-dir='{out}'",
        num_supernodes=10,
    )
    assert status == "finished:completed", run_log(flower_env, run_id)[-5000:]
    (run_dir,) = [d for d in out.iterdir() if d.name.endswith(f"run{run_id}")]
    return run_dir


def test_run_completes_and_accuracy_is_high_and_rising(finished_run):
    rounds = list(csv.DictReader((finished_run / "rounds.csv").open()))
    accuracy = [float(r["mean_accuracy"]) for r in rounds]
    assert len(accuracy) == 4
    assert accuracy[-1] > 0.7  # chance is 0.1
    assert accuracy[-1] > accuracy[0]
    assert all(int(r["num_evaluated"]) == 10 and int(r["num_trained"]) == 10 for r in rounds)
    assert all(int(r["qp_fallbacks"]) == 0 for r in rounds)


def test_alpha_rows_sum_to_one_and_favour_the_clients_group(finished_run):
    metrics = json.loads((finished_run / "metrics.json").read_text())
    last = metrics["rounds"][-1]
    alpha = np.array(last["alpha"])
    pids = last["alpha_partitions"]
    assert pids == list(range(10))
    np.testing.assert_allclose(alpha.sum(axis=1), 1.0, atol=1e-9)
    groups = np.array(pids) % 5
    same = groups[:, None] == groups[None, :]
    off_diagonal_same = same & ~np.eye(10, dtype=bool)
    assert alpha[off_diagonal_same].mean() > 5 * alpha[~same].mean()
    for i in range(10):  # every client gives its group-mate more weight than any outsider
        assert alpha[i][off_diagonal_same[i]].max() > alpha[i][~same[i]].max()


def test_outputs_are_complete(finished_run):
    for name in ("accuracy.png", "alpha.png"):
        assert (finished_run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    clients = list(csv.DictReader((finished_run / "clients.csv").open()))
    assert len(clients) == 40
    assert all(int(row["bytes_sent"]) > 400_000 and int(row["bytes_received"]) > 400_000 for row in clients)
    assert {row["solver_status"] for row in clients} == {"optimal"}
    state = np.load(finished_run / "final_state.npz")
    assert {f"client-{pid}/head/head.weight" for pid in range(10)} <= set(state.files)
    assert state["centroids/mask"].all()
    config = json.loads((finished_run / "config.json").read_text())
    assert config["num_server_rounds"] == 4 and config["samples_per_client"] == 300


def test_invalid_config_fails_the_run_before_training(flower_env, tmp_path):
    run_id, status = flwr_run(flower_env, f"uniform-share=150.0 output-dir='{tmp_path}'", num_supernodes=2)
    assert status == "finished:failed"
    assert not any(tmp_path.iterdir())  # nothing was trained or written
    log = run_log(flower_env, run_id)
    assert "'uniform-share' = 150.0 is invalid: must be in [0, 100]" in log
    assert "configure_train" not in log


def test_fedccfa_under_a_sudden_drift_through_flwr_run(flower_env, tmp_path):
    run_id, status = flwr_run(
        flower_env,
        "strategy='fedccfa' drift='sudden' drift-rounds='1' generalized-every=1 num-server-rounds=3 "
        f"samples-per-client=200 test-samples-per-client=50 align-from-round=2 output-dir='{tmp_path}'",
        num_supernodes=4,
    )
    assert status == "finished:completed", run_log(flower_env, run_id)[-5000:]
    (run_dir,) = list(tmp_path.iterdir())
    rounds = list(csv.DictReader((run_dir / "rounds.csv").open()))
    assert [int(r["round"]) for r in rounds] == [1, 2, 3]
    assert all(0.0 <= float(r["mean_generalized_accuracy"]) <= 1.0 for r in rounds)
    clusters = list(csv.DictReader((run_dir / "clusters.csv").open()))
    assert len(clusters) == 3 * 10 * 4  # rounds x classes x clients (every class present)
    assert (run_dir / "clusters.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "generalized" in run_log(flower_env, run_id)


def test_pfedvem_on_its_label_skew_through_flwr_run(flower_env, tmp_path):
    sites = Path(flower_env["FLWR_HOME"]) / "fedpac-site-state"  # the simulated sites' disks
    earlier_runs = set(sites.glob("*"))
    run_id, status = flwr_run(
        flower_env,
        "strategy='pfedvem' partition='vem-pairs' class-train-samples=100 class-test-samples=30 "
        "num-server-rounds=3 local-epochs=1 vem-head-steps=2 vem-mc-samples=2 vem-sampling-rate=0.5 "
        f"vem-protocol='sampled-train' output-dir='{tmp_path}'",
        num_supernodes=4,
    )
    assert status == "finished:completed", run_log(flower_env, run_id)[-5000:]
    (run_dir,) = list(tmp_path.iterdir())
    assert json.loads((run_dir / "config.json").read_text())["vem_protocol"] == "sampled-train"
    rounds = list(csv.DictReader((run_dir / "rounds.csv").open()))
    assert [int(r["round"]) for r in rounds] == [1, 2, 3]
    # sampled-train: only S_t (at least 2 of the 4) trains, every client is evaluated
    assert all(2 <= int(r["num_trained"]) <= 4 and int(r["num_evaluated"]) == 4 for r in rounds)
    assert all(0.0 <= float(r["mean_local_accuracy"]) <= 1.0 for r in rounds)
    trained = [row for row in csv.DictReader((run_dir / "clients.csv").open()) if row["rho"]]
    assert len(trained) == sum(int(r["num_trained"]) for r in rounds)
    assert all(float(row["rho"]) > 0 for row in trained)
    assert (run_dir / "confidence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with np.load(run_dir / "final_state.npz") as state:
        # the clients' posterior means (client-<pid>/head/head.weight, ...); their scales stay at the sites
        assert any(key.startswith("client-") and "/head/" in key for key in state.files)
        assert not [key for key in state.files if "/scale/" in key]
    (run_folder,) = set(sites.glob("*")) - earlier_runs
    # every site trained in the full last round: each kept its scales
    kept = {path.parent.name for path in run_folder.glob("partition-*/round-3.npz")}
    assert kept == {f"partition-{pid}" for pid in range(4)}


@pytest.mark.parametrize("method,own_metric", [("fedprox", None), ("ditto", "personal-loss"), ("fedbabu", None)])
def test_fedprox_ditto_and_fedbabu_through_flwr_run(flower_env, tmp_path, method, own_metric):
    """The methods added as one package and one registry line run through `flwr run .` with their
    own knob set on the command line; Ditto's sites report their personal model's loss every
    round (the model they keep in the SuperNode's state and evaluate); FedBABU's server ends
    with the initial head (its sites never train it; they fine-tune a copy to evaluate)."""
    knob = {"fedprox": "prox-mu=0.1", "ditto": "ditto-lambda=0.5", "fedbabu": "babu-finetune-epochs=2"}[method]
    run_id, status = flwr_run(
        flower_env,
        f"strategy='{method}' {knob} num-server-rounds=2 samples-per-client=200 test-samples-per-client=50 "
        f"local-epochs=1 output-dir='{tmp_path}'",
        num_supernodes=3,
    )
    assert status == "finished:completed", run_log(flower_env, run_id)[-5000:]
    (run_dir,) = list(tmp_path.iterdir())
    config = json.loads((run_dir / "config.json").read_text())
    assert config["strategy"] == method and len(config["method_settings"]) == 1
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rounds = metrics["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    for record in rounds:
        assert sorted(map(int, record["accuracy"])) == [0, 1, 2]
        assert all(0.0 <= a <= 1.0 for a in record["accuracy"].values())
        if own_metric:
            assert all(own_metric in m for m in record["train"].values()), record["train"]
    if method == "fedbabu":  # the run's round-0 model is initial_model(cfg), seeded by the run's seed
        shape = {key: config[key] for key in ("seed", "image_channels", "image_size", "num_classes")}
        initial = initial_model(FedPACConfig(**shape)).state_dict()
        _, initial_head = split_state({k: v.numpy() for k, v in initial.items()})
        with np.load(run_dir / "final_state.npz") as state:
            assert all(np.array_equal(state[f"head/{key}"], value) for key, value in initial_head.items())


def test_simulate_sh_refuses_a_local_superlink_of_another_environment(tmp_path):
    """`make run` (deploy/simulate.sh) does not hand its run to a local SuperLink that another
    checkout or user started: that one would run the app with its own interpreter, as its own
    user. It names the process and stops before submitting anything."""
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                "/opt/another-checkout/.venv/bin/flower-superlink", "--insecure", "--simulation"])
    try:
        env = {**os.environ, "PATH": f"{Path(FLWR).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "FLWR_HOME": str(tmp_path / "home"), "COLUMNS": "80"}  # a narrow terminal cuts ps's lines
        result = subprocess.run(["bash", str(ROOT / "deploy" / "simulate.sh"), "--clients", "2"], env=env,
                                capture_output=True, text=True, timeout=60)
    finally:
        foreign.kill()
        foreign.wait()
    assert result.returncode == 1
    assert "a local SuperLink of another Python environment or user" in result.stderr
    assert f"{foreign.pid} " in result.stderr and "make stop" in result.stderr
    assert "Successfully started run" not in result.stdout and not (tmp_path / "home").exists()
