"""The run folder keeps the checkpoints of its latest rounds (``checkpoint-round-<t>.npz``) beside
``checkpoint.npz``, and ``resume-from`` can name one: a run whose latest state a site spoiled
continues from a round before it."""

from __future__ import annotations

import os
from dataclasses import asdict

import numpy as np
import pytest

from common import protocol as p
from common.config import configured_method, parse_run_config
from common.methods.fedpac.server import CENTROIDS
from common.methods.server import EXTRACTOR, HEAD, ServerState, server_part
from common.model import split_state
from federation import InProcessGrid
from server_app import checkpoint as checkpoints
from server_app.app import initial_model, model_shape, run_fedpac
from server_app.checkpoint import (FILE_NAME, Checkpoint, CheckpointError, kept_rounds, load_checkpoint,
                                   save_checkpoint)
from server_app.report import RoundRecord

RUN_CONFIG = {"samples-per-client": 60, "test-samples-per-client": 30, "local-epochs": 1, "batch-size": 20}


def _state(value: float) -> ServerState:
    return ServerState(shared={EXTRACTOR: {"w": np.full(3, value, np.float32)}},
                       personal={HEAD: {0: {"b": np.full(2, value, np.float32)}}})


def _checkpoint(completed: int, state: ServerState | None = None, config: dict | None = None) -> Checkpoint:
    return Checkpoint(completed_rounds=completed, state=state or _state(float(completed)),
                      rounds=[RoundRecord(round=r, started=0.0) for r in range(1, completed + 1)],
                      model_shape=(10, 28, 1), seed=0, config=config or {})


def test_the_latest_rounds_are_kept_beside_checkpoint_npz(tmp_path):
    for completed in range(1, 6):
        save_checkpoint(_checkpoint(completed), tmp_path, kept=3)
    assert kept_rounds(tmp_path) == [3, 4, 5]
    assert {f.name for f in tmp_path.iterdir()} == {
        FILE_NAME, "checkpoint-round-3.npz", "checkpoint-round-4.npz", "checkpoint-round-5.npz"}
    # the latest round's file is checkpoint.npz itself (a hard link: no byte written twice)
    assert os.stat(tmp_path / FILE_NAME).st_ino == os.stat(tmp_path / "checkpoint-round-5.npz").st_ino
    assert load_checkpoint(tmp_path).completed_rounds == 5
    earlier = load_checkpoint(tmp_path / "checkpoint-round-3.npz")
    assert earlier.completed_rounds == 3 and len(earlier.rounds) == 3
    np.testing.assert_array_equal(earlier.state.shared[EXTRACTOR]["w"], np.full(3, 3.0, np.float32))
    save_checkpoint(_checkpoint(6), tmp_path, kept=1)
    assert kept_rounds(tmp_path) == [6] and load_checkpoint(tmp_path).completed_rounds == 6


def test_without_hard_links_the_round_is_written_again(tmp_path, monkeypatch):
    """A file system without hard links (some network or Windows shares): the same bytes."""
    def refused(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(checkpoints.os, "link", refused)
    save_checkpoint(_checkpoint(1), tmp_path)
    round_file = tmp_path / "checkpoint-round-1.npz"
    assert round_file.read_bytes() == (tmp_path / FILE_NAME).read_bytes()
    assert os.stat(round_file).st_ino != os.stat(tmp_path / FILE_NAME).st_ino
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temporary file left


def test_a_round_no_longer_kept_is_a_clear_error_naming_those_that_are(tmp_path):
    for completed in range(1, 5):
        save_checkpoint(_checkpoint(completed), tmp_path, kept=2)
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*checkpoint-round-1\.npz \(that folder keeps "
                                              r"rounds 3, 4\)"):
        load_checkpoint(tmp_path / "checkpoint-round-1.npz")


def test_a_folder_with_only_checkpoint_npz_reads_as_before(tmp_path):
    """Run folders written before the rounds were kept hold checkpoint.npz alone."""
    save_checkpoint(_checkpoint(4), tmp_path)
    (tmp_path / "checkpoint-round-4.npz").unlink()
    assert kept_rounds(tmp_path) == [] and load_checkpoint(tmp_path).completed_rounds == 4
    assert load_checkpoint(tmp_path / FILE_NAME).completed_rounds == 4


def test_a_run_resumes_from_an_earlier_round_than_its_poisoned_latest(tmp_path):
    """Round 2's checkpoint holds an extractor a hostile site made 1e30 times too large (what issue
    54's checkpoint held): resumed from the folder, every site would train on it; resumed from the
    kept round 1, the run trains round 2 again from round 1's state, every reply valid."""
    config = {**RUN_CONFIG, "num-server-rounds": 2, "output-dir": str(tmp_path / "out")}
    cfg = parse_run_config(config)
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    server = server_part(configured_method(cfg), cfg, extractor, head)
    folder = tmp_path / "poisoned"
    folder.mkdir()
    saved = asdict(parse_run_config({**config, "num-server-rounds": 5}))
    clean = server.initial_state()
    save_checkpoint(Checkpoint(1, clean, [RoundRecord(round=1, started=0.0)], model_shape(cfg), cfg.seed,
                               cfg.strategy, saved), folder)
    poisoned = ServerState(shared={**clean.shared, EXTRACTOR: {k: v * np.float32(1e30) for k, v in extractor.items()}})
    save_checkpoint(Checkpoint(2, poisoned, [RoundRecord(round=r, started=0.0) for r in (1, 2)], model_shape(cfg),
                               cfg.seed, cfg.strategy, saved), folder)
    assert load_checkpoint(folder).completed_rounds == 2  # the latest: the poisoned one

    resumed = {**config, "resume-from": str(folder / "checkpoint-round-1.npz")}
    strategy, report = run_fedpac(InProcessGrid(resumed, 3), parse_run_config(resumed), 2)
    assert [r.round for r in report.rounds] == [1, 2]
    assert len(report.rounds[1].train) == 3 and report.rounds[1].rejected == 0
    assert all(np.abs(v).max() < 10 for v in strategy.extractor.values())
    (run_dir,) = (tmp_path / "out").iterdir()
    assert kept_rounds(run_dir) == [2] and load_checkpoint(run_dir).completed_rounds == 2


@pytest.mark.slow
def test_a_run_resumed_from_a_kept_round_ends_as_the_uninterrupted_run(tmp_path):
    config = {**RUN_CONFIG, "num-server-rounds": 3, "fraction-train": 0.5}
    full, full_report = _run({**config, "output-dir": str(tmp_path / "full")}, 1)
    (full_dir,) = (tmp_path / "full").iterdir()
    assert kept_rounds(full_dir) == [1, 2, 3]
    resumed, report = _run({**config, "output-dir": str(tmp_path / "resumed"),
                            "resume-from": str(full_dir / "checkpoint-round-1.npz")}, 2)
    assert [r.accuracy for r in report.rounds] == [r.accuracy for r in full_report.rounds]
    for key, value in full.extractor.items():
        np.testing.assert_array_equal(resumed.extractor[key], value)
    for pid, head in full.state.personal[HEAD].items():
        for key, value in head.items():
            np.testing.assert_array_equal(resumed.state.personal[HEAD][pid][key], value)
    np.testing.assert_array_equal(resumed.state.shared[CENTROIDS][p.CENTROID_VALUES],
                                  full.state.shared[CENTROIDS][p.CENTROID_VALUES])


def _run(config: dict, grid_seed: int):
    return run_fedpac(InProcessGrid(config, 6, seed=grid_seed), parse_run_config(config), grid_seed)

