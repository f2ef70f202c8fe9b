"""Checkpoints after every round; a crashed run resumes to the same final model."""

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest

from common import protocol as p
from common.config import ConfigError, parse_run_config
from common.model import EMBEDDING_DIM
from common.site_privacy import SiteLedger, privacy_folder
from common.site_state import SiteStore
from federation import InProcessGrid
from server_app.app import run_fedpac
from server_app.checkpoint import FILE_NAME, CheckpointError, load_checkpoint

BASE = {
    "samples-per-client": 60,
    "test-samples-per-client": 30,
    "local-epochs": 1,
    "batch-size": 20,
    "num-server-rounds": 4,
    "fraction-train": 0.5,  # partial participation: sampling must also resume exactly
}


def _run(run_config, grid_seed, crash_at_round=None, run_id=1, node_config=None):
    cfg = parse_run_config(run_config)
    grid = InProcessGrid(run_config, 6, seed=grid_seed, crash_at_round=crash_at_round, node_config=node_config)
    return run_fedpac(grid, cfg, run_id)


@pytest.mark.slow
def test_resumed_run_gives_the_same_final_model_as_an_uninterrupted_one(tmp_path):
    full, full_report = _run({**BASE, "output-dir": str(tmp_path / "full")}, grid_seed=1, run_id=1)

    crashed_config = {**BASE, "output-dir": str(tmp_path / "crashed")}
    with pytest.raises(RuntimeError, match="simulated server crash in round 3"):
        _run(crashed_config, grid_seed=2, crash_at_round=3, run_id=2)  # other node ids, too
    (crashed_dir,) = (tmp_path / "crashed").iterdir()
    checkpoint = load_checkpoint(crashed_dir)
    assert checkpoint.completed_rounds == 2 and len(checkpoint.rounds) == 2
    assert len(json.loads((crashed_dir / "metrics.json").read_text())["rounds"]) == 2

    resumed, report = _run(
        {**BASE, "output-dir": str(tmp_path / "resumed"), "resume-from": str(crashed_dir)}, grid_seed=3, run_id=3
    )
    assert [r.round for r in report.rounds] == [1, 2, 3, 4]
    assert [r.accuracy for r in report.rounds] == [r.accuracy for r in full_report.rounds]
    for key, value in full.extractor.items():
        np.testing.assert_array_equal(resumed.extractor[key], value)
    full_heads, resumed_heads = full.state.personal["head"], resumed.state.personal["head"]
    assert sorted(resumed_heads) == sorted(full_heads)
    for pid, head in full_heads.items():
        for key, value in head.items():
            np.testing.assert_array_equal(resumed_heads[pid][key], value)
    np.testing.assert_array_equal(resumed.state.shared["centroids"][p.CENTROID_VALUES],
                                  full.state.shared["centroids"][p.CENTROID_VALUES])
    assert (crashed_dir / "checkpoint.npz").exists()  # the earlier run's files are untouched


def test_resume_refuses_a_missing_or_incompatible_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        _run({**BASE, "output-dir": str(tmp_path), "resume-from": str(tmp_path / "nothing")}, grid_seed=1)
    _run({**BASE, "num-server-rounds": 1, "output-dir": str(tmp_path / "a")}, grid_seed=1)
    (run_dir,) = (tmp_path / "a").iterdir()
    with pytest.raises(ConfigError, match="seed"):
        _run({**BASE, "seed": 5, "output-dir": str(tmp_path / "b"), "resume-from": str(run_dir)}, grid_seed=1)
    (run_dir / "checkpoint.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        _run({**BASE, "output-dir": str(tmp_path / "c"), "resume-from": str(run_dir)}, grid_seed=1)


def test_clients_that_cannot_load_their_data_stop_the_run_before_training(tmp_path):
    config = {**BASE, "dataset": "mnist", "data-dir": str(tmp_path / "missing"), "output-dir": str(tmp_path)}
    cfg = parse_run_config(config)
    grid = InProcessGrid(config, 3)
    with pytest.raises(RuntimeError, match="not ready to train(.|\n)*does not exist"):
        run_fedpac(grid, cfg, 1)
    assert not any(m.metadata.message_type == "train" for m in grid.sent)


def test_the_run_folder_says_where_it_stands_and_how_to_resume(tmp_path):
    config = {**BASE, "output-dir": str(tmp_path / "crashed"), "strategy": "fedper"}
    with pytest.raises(RuntimeError, match="simulated server crash in round 3"):
        _run(config, grid_seed=2, crash_at_round=3)
    (run_dir,) = (tmp_path / "crashed").iterdir()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["completed_rounds"] == 2 and status["num_rounds"] == 4
    assert "simulated server crash in round 3" in status["error"]
    # the command names every non-default key of the run and the folder; run as printed, it resumes
    command = status["resume"]
    assert command.startswith("flwr run . <federation> --run-config ")
    overrides = command.split('--run-config "', 1)[1].rstrip('"')
    assert "strategy='fedper'" in overrides and "fraction-train=0.5" in overrides
    assert f"resume-from='{run_dir}'" in overrides
    resumed_config = {**config, "output-dir": str(tmp_path / "resumed"), "resume-from": str(run_dir)}
    _, report = _run(resumed_config, grid_seed=3)
    (resumed_dir,) = (tmp_path / "resumed").iterdir()
    finished = json.loads((resumed_dir / "status.json").read_text())
    assert finished["state"] == "finished" and finished["completed_rounds"] == 4 and not finished["error"]
    assert [r.round for r in report.rounds] == [1, 2, 3, 4]


def test_resume_command_round_trips_through_the_run_config_parser(tmp_path):
    import tomllib

    from server_app.app import resume_command

    cfg = parse_run_config({"strategy": "fedccfa", "drift": "sudden", "cluster-eps": 0.2,
                            "clustered-anchors": False, "num-server-rounds": 7})
    overrides = resume_command(cfg, tmp_path / "run 1").split('--run-config "', 1)[1].rstrip('"')
    # flwr parses each key=value as TOML
    parsed = {}
    for pair in overrides.split(" resume-from=")[0].split(" "):
        parsed.update(tomllib.loads(pair))
    again = parse_run_config({**parsed, "resume-from": str(tmp_path / "run 1")})
    assert again.strategy == "fedccfa" and again.cluster_eps == 0.2 and again.clustered_anchors is False
    assert again.num_server_rounds == 7 and again.drift == "sudden"


def test_resume_refuses_a_config_that_changes_the_computation_and_lists_the_differences(tmp_path):
    _run({**BASE, "num-server-rounds": 1, "output-dir": str(tmp_path / "a")}, grid_seed=1)
    (run_dir,) = (tmp_path / "a").iterdir()
    changed = {**BASE, "lambda-align": 0.5, "extractor-lr": 0.02, "output-dir": str(tmp_path / "b"),
               "resume-from": str(run_dir)}
    with pytest.raises(ConfigError, match=r"extractor-lr: 0\.01 -> 0\.02; lambda-align: 1\.0 -> 0\.5"):
        _run(changed, grid_seed=1)
    with pytest.raises(ConfigError, match=r"dp: False -> True"):
        _run({**BASE, "dp": True, "output-dir": str(tmp_path / "b"), "resume-from": str(run_dir)}, grid_seed=1)
    # where and how long it runs may change: more rounds, another timeout; and without DP the DP
    # settings, which compute nothing there (a checkpoint from before the DP recipe's defaults)
    _, report = _run({**BASE, "num-server-rounds": 2, "round-timeout": 60.0, "dp-batch-size": 0, "dp-step-size": 0.0,
                      "dp-momentum": 0.0, "output-dir": str(tmp_path / "c"), "resume-from": str(run_dir)}, grid_seed=1)
    assert [r.round for r in report.rounds] == [1, 2]


def test_a_truncated_checkpoint_is_a_clear_error(tmp_path):
    _run({**BASE, "num-server-rounds": 1, "output-dir": str(tmp_path / "a")}, grid_seed=1)
    (run_dir,) = (tmp_path / "a").iterdir()
    data = (run_dir / "checkpoint.npz").read_bytes()
    (run_dir / "checkpoint.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or not a checkpoint"):
        load_checkpoint(run_dir)


def _archive(run_dir: Path) -> tuple[dict[str, np.ndarray], dict]:
    """A checkpoint file's arrays and its meta record, as stored."""
    with np.load(run_dir / FILE_NAME) as archive:
        arrays = {name: archive[name] for name in archive.files}
    return arrays, json.loads(str(arrays.pop("meta")))


def _write_archive(directory: Path, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / FILE_NAME, meta=np.array(json.dumps(meta)), **arrays)
    return directory


# Format 2's personal sections, and the per-partition groups format 1 kept them in.
_FORMAT_1_GROUPS = {"head": "head", "extractor": "client-extractor", "scale": "posterior-scale"}
# The names of the centroids' and anchors' values and mask in format 1 (FedPAC's; FedCCFA's).
_FORMAT_1_CENTROIDS = {p.CENTROID_VALUES: "centroids", p.CENTROID_MASK: "centroid_mask"}
_FORMAT_1_ANCHORS = {p.CENTROID_VALUES: "values", p.CENTROID_MASK: "mask"}


def format_1_arrays(arrays: dict[str, np.ndarray], meta: dict) -> tuple[dict[str, np.ndarray], dict]:
    """A format-2 checkpoint's arrays and meta as format 1 wrote the same state: the global
    extractor ``extractor/<k>``; the centroids and their mask ``centroids``, ``centroid_mask``
    (every method had them, zeros where it keeps none); the shared head ``global-head/<k>``;
    per partition ``head/<pid>/<k>``, ``client-extractor/<pid>/<k>``, ``anchors/<pid>/values``
    and ``anchors/<pid>/mask``, ``posterior-scale/<pid>/<k>``."""
    num_classes = meta["model_shape"][0]
    old = {"centroids": np.zeros((num_classes, EMBEDDING_DIM), np.float32),
           "centroid_mask": np.zeros(num_classes, bool)}
    for name, value in arrays.items():
        kind, _, rest = name.partition("/")
        if kind == "shared":
            section, key = rest.split("/", 1)
            if section == "extractor":
                old[f"extractor/{key}"] = value
            elif section == "head":
                old[f"global-head/{key}"] = value
            elif section == "centroids":
                old[_FORMAT_1_CENTROIDS[key]] = value
            else:
                raise AssertionError(f"no format-1 name for shared section {section!r} ({name})")
        else:
            assert kind == "personal", name
            section, pid, key = rest.split("/", 2)
            if section == "anchors":
                old[f"anchors/{pid}/{_FORMAT_1_ANCHORS[key]}"] = value
            elif section in _FORMAT_1_GROUPS:
                old[f"{_FORMAT_1_GROUPS[section]}/{pid}/{key}"] = value
            else:
                raise AssertionError(f"no format-1 name for personal section {section!r} ({name})")
    assert meta["format"] == 2
    return old, {**meta, "format": 1}


def as_format_1(run_dir: Path, directory: Path) -> Path:
    """``run_dir``'s checkpoint rewritten in format 1, in ``directory``."""
    return _write_archive(directory, *format_1_arrays(*_archive(run_dir)))


# The format-1 groups each method's checkpoint holds (the converter's every branch is used).
FORMAT_1_RUNS = {
    "fedpac": ({}, {"extractor", "centroids", "centroid_mask", "head"}),  # BASE: a sample trains
    "fedccfa": ({"strategy": "fedccfa", "fraction-train": 1.0, "balanced-epochs": 1},
                {"extractor", "centroids", "centroid_mask", "head", "anchors"}),
    "pfedvem": ({"strategy": "pfedvem", "fraction-train": 1.0, "vem-sampling-rate": 0.5},
                {"extractor", "centroids", "centroid_mask", "global-head", "head"}),
    "fedavg": ({"strategy": "fedavg"}, {"extractor", "centroids", "centroid_mask", "global-head"}),
}
BYTES = ("bytes_sent", "bytes_received")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FORMAT_1_RUNS))
def test_a_run_resumes_exactly_from_a_checkpoint_of_format_1(name, tmp_path):
    """Checkpoints written before the methods kept their state by section still continue their
    run: every round after the checkpoint's, every rounds.csv column but the time, and the final
    state are those of the uninterrupted run."""
    extra, groups = FORMAT_1_RUNS[name]
    config = {**BASE, **extra, "num-server-rounds": 3}
    full, full_report = _run({**config, "output-dir": str(tmp_path / "full")}, grid_seed=1, run_id=1)
    with pytest.raises(RuntimeError, match="simulated server crash in round 3"):
        _run({**config, "output-dir": str(tmp_path / "crashed")}, grid_seed=2, crash_at_round=3, run_id=2)
    (crashed,) = (tmp_path / "crashed").iterdir()
    k = load_checkpoint(crashed).completed_rounds
    assert k == (1 if full.fused_evaluation else 2)  # fused: round 2's evaluation was to come in round 3

    old = as_format_1(crashed, tmp_path / "format-1")
    arrays, meta = _archive(old)
    assert meta["format"] == 1 and {key.split("/")[0] for key in arrays} == groups
    checkpoint = load_checkpoint(old)
    assert checkpoint.completed_rounds == k and [r.round for r in checkpoint.rounds] == list(range(1, k + 1))

    resumed, report = _run({**config, "output-dir": str(tmp_path / "resumed"), "resume-from": str(old)},
                           grid_seed=3, run_id=3)
    assert resumed.fused_evaluation == full.fused_evaluation
    assert [r.round for r in report.rounds] == [1, 2, 3]
    assert [r.accuracy for r in report.rounds] == [r.accuracy for r in full_report.rounds]
    assert [r.test_loss for r in report.rounds] == [r.test_loss for r in full_report.rounds]
    (full_dir,) = (tmp_path / "full").iterdir()
    (resumed_dir,) = (tmp_path / "resumed").iterdir()
    full_rows = list(csv.DictReader((full_dir / "rounds.csv").open()))
    resumed_rows = list(csv.DictReader((resumed_dir / "rounds.csv").open()))
    assert [row["round"] for row in resumed_rows] == ["1", "2", "3"]
    for row, expected in zip(resumed_rows, full_rows):
        # the first round after a resume sends no evaluation of the round before (fused: it is in
        # the checkpoint already), so its messages are smaller; every other number is the same
        first_resumed = full.fused_evaluation and int(row["round"]) == k + 1
        # a method whose sites keep state names the runs it continues in each message: a few bytes more
        longer_lineage = resumed.server.method.keeps_anything_at_site and int(row["round"]) > k
        ignored = {"seconds", *(BYTES if first_resumed or longer_lineage else ())}
        assert {c: v for c, v in row.items() if c not in ignored} == \
            {c: v for c, v in expected.items() if c not in ignored}, row["round"]
    with np.load(full_dir / "final_state.npz") as a, np.load(resumed_dir / "final_state.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for key in a.files:
            np.testing.assert_array_equal(b[key], a[key], err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "extra"), [
    ("fedper", {}), ("local", {}), ("ditto", {}),
    # differential privacy: each site's ledger (and its calibrated noise) kept at the site, the
    # noise drawn from the site's secret
    ("fedpac", {"dp": True}), ("ditto", {"dp": True, "dp-target-epsilon": 6.0}),
])
def test_a_run_whose_sites_keep_parts_of_it_resumes_exactly(name, extra, tmp_path):
    """FedPer's heads, Local-only's models and Ditto's personal models stay at the sites, on their
    disk, as does every site's privacy ledger with dp on: a crashed server resumed (with every
    node restarted: new contexts, new node ids) computes the uninterrupted run's rounds, and its
    sites end with the same kept state and report the same epsilon."""
    config = {**BASE, "strategy": name, "num-server-rounds": 3, **extra}
    # The uninterrupted run's sites and the interrupted ones are other sites (their own folders,
    # their own ledgers) with the same secret: with it, the same requests give the same releases.
    secret = "5e" * 32
    sites = {"full": tmp_path / "full-sites", "crashed": tmp_path / "sites"}
    full, full_report = _run({**config, "output-dir": str(tmp_path / "full")}, grid_seed=1, run_id=1,
                             node_config={"state-dir": str(sites["full"]), "dp-noise-secret": secret})
    own = {"state-dir": str(sites["crashed"]), "dp-noise-secret": secret}
    with pytest.raises(RuntimeError, match="simulated server crash in round 3"):
        _run({**config, "output-dir": str(tmp_path / "crashed")}, grid_seed=2, crash_at_round=3, run_id=2,
             node_config=own)
    (crashed,) = (tmp_path / "crashed").iterdir()
    checkpoint = load_checkpoint(crashed)
    resumed, report = _run({**config, "output-dir": str(tmp_path / "resumed"), "resume-from": str(crashed)},
                           grid_seed=3, run_id=3, node_config=own)
    assert [run for run, _ in resumed.lineage] == [checkpoint.lineage[0][0], resumed.lineage[-1][0]]
    assert resumed.lineage[-1][1] == checkpoint.completed_rounds + 1
    assert [r.accuracy for r in report.rounds] == [r.accuracy for r in full_report.rounds]
    assert [r.test_loss for r in report.rounds] == [r.test_loss for r in full_report.rounds]
    epsilons = [{pid: m.get(p.DP_EPSILON) for pid, m in r.train.items()} for r in report.rounds]
    assert epsilons == [{pid: m.get(p.DP_EPSILON) for pid, m in r.train.items()} for r in full_report.rounds]
    assert all(e is not None for r in epsilons for e in r.values()) == bool(extra)
    trained = 0
    for pid in range(6):
        expected = SiteStore(sites["full"], pid, full.lineage).load(3)
        kept = SiteStore(sites["crashed"], pid, resumed.lineage).load(3)
        assert sorted(kept) == sorted(expected), pid
        for name_, arrays in expected.items():
            for key, value in arrays.items():
                np.testing.assert_array_equal(kept[name_][key], value, err_msg=f"{pid} {name_} {key}")
        trained += bool(expected)
        if extra.get("dp"):  # the same releases charged, each once, in both sites' own ledgers
            charged = [{e.release for f in privacy_folder(sites[run], pid).glob("ledger-*.jsonl")
                        for e in SiteLedger(f).entries() if not e.refused} for run in ("full", "crashed")]
            assert charged[0] == charged[1], pid
            trained += bool(charged[0])
    assert trained >= 3  # half the sites train each round


def test_an_older_checkpoint_that_holds_parts_now_kept_at_the_sites_drops_them_and_says_so(tmp_path, caplog):
    """Before the sites kept FedPer's heads, the server did, in its checkpoint: a run resumed from
    one says that the sites start their heads over, and keeps none on the server."""
    config = {**BASE, "strategy": "fedper", "num-server-rounds": 2, "output-dir": str(tmp_path / "first")}
    _run({**config, "num-server-rounds": 1}, grid_seed=1)
    (first,) = (tmp_path / "first").iterdir()
    arrays, meta = _archive(first)
    meta.pop("lineage")  # written before lineages, too
    arrays.update({f"personal/head/{pid}/{key}": value for pid in range(6)
                   for key, value in (("head.weight", np.zeros((10, EMBEDDING_DIM), np.float32)),
                                      ("head.bias", np.zeros(10, np.float32)))})
    old = _write_archive(tmp_path / "old", arrays, meta)
    with caplog.at_level("WARNING"):
        strategy, report = _run({**config, "output-dir": str(tmp_path / "resumed"), "resume-from": str(old)},
                                grid_seed=2, run_id=2)
    assert "now keeps at the site" in caplog.text
    assert not strategy.state.personal.get("head") and [r.round for r in report.rounds] == [1, 2]


def test_a_checkpoint_of_an_unknown_format_is_refused_before_any_training(tmp_path):
    _run({**BASE, "num-server-rounds": 1, "output-dir": str(tmp_path / "a")}, grid_seed=1)
    (run_dir,) = (tmp_path / "a").iterdir()
    arrays, meta = _archive(run_dir)
    future = _write_archive(tmp_path / "future", arrays, {**meta, "format": 3})
    with pytest.raises(CheckpointError, match=r"has format 3, expected one of 1, 2$"):
        load_checkpoint(future)
    config = {**BASE, "num-server-rounds": 2, "output-dir": str(tmp_path / "b"), "resume-from": str(future)}
    grid = InProcessGrid(config, 6, seed=1)
    with pytest.raises(CheckpointError, match="has format 3, expected one of 1, 2"):
        run_fedpac(grid, parse_run_config(config), 2)
    assert not grid.sent


@pytest.mark.parametrize(
    ("version", "edit", "problem"),
    [
        (1, lambda arrays, meta: arrays.pop("centroids"), "KeyError: 'centroids'"),
        (1, lambda arrays, meta: arrays.update({"head/first/head.weight": np.zeros(2)}), "ValueError"),
        (2, lambda arrays, meta: meta.pop("completed_rounds"), "KeyError: 'completed_rounds'"),
        (2, lambda arrays, meta: meta.update(rounds=5), "TypeError"),
        (2, lambda arrays, meta: arrays.update({"personal/head/first/head.weight": np.zeros(2)}), "ValueError"),
        (2, lambda arrays, meta: arrays.update({"head/0/head.weight": np.zeros(2)}), "ValueError"),
        (2, lambda arrays, meta: meta.update(rounds=[{"round": 1, "unknown": 2}]), "TypeError"),
    ],
)
def test_a_checkpoint_with_missing_or_foreign_parts_is_a_clear_error(tmp_path, version, edit, problem):
    _run({**BASE, "num-server-rounds": 1, "output-dir": str(tmp_path / "a")}, grid_seed=1)
    (run_dir,) = (tmp_path / "a").iterdir()
    arrays, meta = _archive(run_dir)
    if version == 1:
        arrays, meta = format_1_arrays(arrays, meta)
    edit(arrays, meta)
    _write_archive(run_dir, arrays, meta)
    with pytest.raises(CheckpointError, match=f"is malformed \\({re.escape(problem)}"):
        load_checkpoint(run_dir)


def test_a_checkpoint_without_a_section_its_method_keeps_is_a_clear_error_before_any_training(tmp_path):
    """Format 2's counterpart of format 1's missing ``centroids``: FedPAC's checkpoint without its
    centroids section."""
    _run({**BASE, "num-server-rounds": 1, "output-dir": str(tmp_path / "a")}, grid_seed=1)
    (run_dir,) = (tmp_path / "a").iterdir()
    arrays, meta = _archive(run_dir)
    del arrays[f"shared/centroids/{p.CENTROID_VALUES}"]
    _write_archive(run_dir, arrays, meta)
    config = {**BASE, "num-server-rounds": 2, "output-dir": str(tmp_path / "b"), "resume-from": str(run_dir)}
    grid = InProcessGrid(config, 6, seed=1)
    with pytest.raises(CheckpointError, match=r"is malformed \(.*centroids"):
        run_fedpac(grid, parse_run_config(config), 2)
    assert not any(m.metadata.message_type == "train" for m in grid.sent)


@pytest.mark.slow
def test_a_run_continues_another_drifts_rounds_while_no_label_has_changed(tmp_path):
    """The recurrent and incremental drifts share their first rounds with the sudden one: a run
    under one continues a run under another exactly, up to the first round whose labels differ."""
    drift = {**BASE, "num-server-rounds": 5, "full-last-round": False}  # a last round like any other
    recurrent = {**drift, "drift": "recurrent", "drift-rounds": "3,4"}  # swapped in round 4, back in 5
    full, full_report = _run({**recurrent, "output-dir": str(tmp_path / "full")}, grid_seed=1, run_id=1)

    sudden = {**drift, "drift": "sudden", "drift-rounds": "3", "num-server-rounds": 3}  # rounds 1-3: no change
    _run({**sudden, "output-dir": str(tmp_path / "sudden")}, grid_seed=2, run_id=2)
    (sudden_dir,) = (tmp_path / "sudden").iterdir()
    continued, report = _run({**recurrent, "output-dir": str(tmp_path / "continued"), "resume-from": str(sudden_dir)},
                             grid_seed=3, run_id=3)
    assert [r.accuracy for r in report.rounds] == [r.accuracy for r in full_report.rounds]
    for key, value in full.extractor.items():
        np.testing.assert_array_equal(continued.extractor[key], value)
    for pid, head in full.state.personal["head"].items():
        for key, value in head.items():
            np.testing.assert_array_equal(continued.state.personal["head"][pid][key], value)

    # one round further, the sudden run's labels have changed: not the recurrent run's rounds
    _run({**sudden, "num-server-rounds": 4, "output-dir": str(tmp_path / "later")}, grid_seed=2, run_id=4)
    (later_dir,) = (tmp_path / "later").iterdir()
    with pytest.raises(ConfigError, match="drift: 'sudden' -> 'recurrent'"):
        _run({**recurrent, "output-dir": str(tmp_path / "refused"), "resume-from": str(later_dir)}, grid_seed=1)


def test_a_resumed_run_that_stops_before_its_first_round_points_at_the_checkpoint_it_resumed_from(tmp_path):
    """Until the resumed run has saved a checkpoint of its own, its folder holds none: status.json
    and the logged command name the checkpoint it resumed from, which still holds its last state."""
    from common.model import split_state
    from server_app.app import initial_model, model_shape
    from common.methods.server import ServerState
    from server_app.checkpoint import Checkpoint, save_checkpoint

    config = {**BASE, "output-dir": str(tmp_path / "out")}
    cfg = parse_run_config(config)
    extractor, _ = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    old = tmp_path / "old"
    old.mkdir()
    state = ServerState(shared={"extractor": extractor, "centroids": {
        p.CENTROID_VALUES: np.zeros((cfg.num_classes, 128), np.float32),
        p.CENTROID_MASK: np.zeros(cfg.num_classes, bool)}})
    save_checkpoint(Checkpoint(completed_rounds=2, state=state, rounds=[], model_shape=model_shape(cfg),
                               seed=cfg.seed), old)

    class UnreachableGrid:
        def get_node_ids(self):
            raise RuntimeError("SuperLink unreachable")

    with pytest.raises(RuntimeError, match="SuperLink unreachable"):
        run_fedpac(UnreachableGrid(), parse_run_config({**config, "resume-from": str(old)}), 2)
    (run_dir,) = (tmp_path / "out").iterdir()
    assert not (run_dir / "checkpoint.npz").exists()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["completed_rounds"] == 2
    assert status["checkpoint"] == str(old / "checkpoint.npz")
    assert load_checkpoint(status["checkpoint"]).completed_rounds == 2
    assert status["resume"].endswith(f"resume-from='{old}'\"")
