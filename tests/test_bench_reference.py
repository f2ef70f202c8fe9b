"""The server benchmark compares like with like: its naive reference computes the same round."""

import sys

import numpy as np
from benches import load_bench

from common import protocol
from common.methods.fedpac.collaboration import collaboration_matrix_direct, qp_objective
from common.methods.fedpac.server import CENTROIDS
from common.methods.server import EXTRACTOR, HEAD

bench = load_bench("server_aggregation")
naive_round, synthetic_round = bench.naive_round, bench.synthetic_round
fedpac_round, step_round = bench.fedpac_round, bench.step_round


def test_naive_reference_and_the_fedpac_server_step_agree():
    data = synthetic_round(6, 10, "clustered", seed=1)
    server, updates, weights = fedpac_round(data, threshold=0.0)
    # what the bench times is the server step the strategy runs: FedPAC's, without a threshold
    assert server.method.name == "fedpac" and server.cfg.alpha_threshold == 0.0
    for update in updates:  # the statistics as the method's own check derives them from a reply
        reply = server.check(bench.Update(
            partition_id=update.partition_id, extractor=update.extractor, head=update.head,
            num_examples=update.num_examples, metrics={protocol.V: update.parsed["v"]},
            statistics={protocol.CENTROID_VALUES: update.parsed["centroids"].astype(np.float32),
                        protocol.CLASS_COUNTS: update.parsed["class_counts"],
                        protocol.H: update.parsed["h"].astype(np.float32)}))
        assert sorted(reply.parsed) == sorted(update.parsed)
        for key, value in update.parsed.items():
            np.testing.assert_allclose(reply.parsed[key], value, rtol=1e-6, atol=1e-7)
    state, step = step_round(server, updates, weights)
    extractor, centroids, alpha, heads = naive_round(data, threshold=0.0)
    for key, value in extractor.items():
        np.testing.assert_allclose(state.shared[EXTRACTOR][key], value, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state.shared[CENTROIDS][protocol.CENTROID_VALUES], centroids, rtol=1e-5, atol=1e-6)
    ours_alpha = np.array(step.record["alpha"])
    assert step.record["alpha_partitions"] == list(range(6))
    for i in range(6):
        p = collaboration_matrix_direct(data["h"], data["v"], data["num_examples"], i)
        assert qp_objective(p, ours_alpha[i]) <= qp_objective(p, alpha[i]) * (1 + 1e-6) + 1e-12
    ours_heads = [state.personal[HEAD][pid] for pid in range(6)]
    for key in heads[0]:
        np.testing.assert_allclose(
            np.stack([h[key] for h in ours_heads]), np.stack([h[key] for h in heads]), atol=5e-3
        )


def test_deployment_bench_variants_parse_and_set_their_environment_only_while_they_run(monkeypatch):
    import argparse
    import os

    import pytest

    deployment = load_bench("deployment")
    label, overrides = deployment.parse_variant("object waits off:FEDPAC_X=0,FEDPAC_Y=")
    assert label == "object waits off" and overrides == {"FEDPAC_X": "0", "FEDPAC_Y": ""}
    for bad in ("no-colon", "label:", ":A=1", "label:A"):
        with pytest.raises(argparse.ArgumentTypeError):
            deployment.parse_variant(bad)
    monkeypatch.setenv("FEDPAC_X", "2")
    monkeypatch.delenv("FEDPAC_Y", raising=False)
    with deployment.environment(overrides):
        assert os.environ["FEDPAC_X"] == "0" and os.environ["FEDPAC_Y"] == ""
    assert os.environ["FEDPAC_X"] == "2" and "FEDPAC_Y" not in os.environ


def test_cpu_profile_sorts_processes_by_what_they_are_and_counts_a_busy_child():
    import subprocess
    import time

    from bench.cpu_profile import KINDS, ProcessCpu, kind_of

    assert kind_of("python deploy/patient_superlink.py --x", "bash") == "superlink"
    assert kind_of("python .venv/bin/flwr-serverapp --token t", "flower-superexec") == "serverapp"
    assert kind_of("python deploy/fast_supernode.py --superlink l", "bash") == "supernodes"
    assert kind_of("python deploy/warm_executor.py --runtime-api-address a", "bash") == "executors"
    assert kind_of("python -c from multiprocessing.spawn import spawn_main", "python deploy/warm_executor.py") \
        == "clientapp workers"
    assert kind_of("python -c from multiprocessing.spawn import spawn_main", "ray::worker") == "other"
    with ProcessCpu(interval=0.1) as cpu:
        # 0.6 s of its own CPU time, however busy the machine is
        spinner = subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 0.6: pass"])
        spinner.wait()
        time.sleep(0.2)
    assert set(cpu.seconds) == {*KINDS, "idle"}
    # the child's 0.6 s of spinning, read from /proc while it ran and counted as "other" (the
    # machine's other processes add to that total too, so the child is checked by its pid)
    child = str(spinner.pid)
    assert cpu._kinds[child] == "other" and cpu._last[child] >= 0.3  # pylint: disable=protected-access
    assert cpu.seconds["other"] >= cpu._last[child]  # pylint: disable=protected-access


def test_fingerprint_ignores_timing_and_sees_every_number():
    from bench.fingerprint import rounds_digest

    rounds = "round,mean_accuracy,seconds\n1,0.5,12.7\n2,0.625,9.9\n"
    assert rounds_digest(rounds) == rounds_digest(rounds.replace("12.7", "3.1"))
    assert rounds_digest(rounds) != rounds_digest(rounds.replace("0.625", "0.6250001"))
    assert rounds_digest(rounds) != rounds_digest(rounds.replace("1,0.5", "1,0.4"))
