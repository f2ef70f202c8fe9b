"""A site keeps its personalized models by run (``client_app.site_model``): a run's saves go to
its own folder, the site's current model changes only when a run completes, the latest runs stay
loadable by run id (``load_site_model(run=...)``, ``fedpac-predict --run``), older ones are
pruned but never the current one, a model-dir of the layout before runs were kept still loads,
and a crash while a model becomes current leaves the previous one in force."""

from __future__ import annotations

import csv
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from client_app import site_model
from client_app.site_model import KEPT_RUNS, SiteModel, current_run, kept_runs, load_site_model, save_site_model
from common.model import FedPACNet


def _model(seed: int) -> FedPACNet:
    """A small model whose weights ``seed`` tells apart from any other seed's."""
    torch.manual_seed(seed)
    return FedPACNet(1, 28, 10)


def _info(run_id: int, round_: int) -> SiteModel:
    return SiteModel(method="fedpac", run_id=run_id, round=round_, partition_id=0, accuracy=round_ / 10,
                     num_classes=10, image_size=28, image_channels=1, mean=[0.13], std=[0.31])


def _save(directory: Path, run_id: int, round_: int, num_rounds: int) -> FedPACNet:
    """What ``_keep_site_model`` does at ``round_`` of a run of ``num_rounds``: the model saved,
    current only at the run's last round. Returns the saved model."""
    model = _model(run_id * 100 + round_)
    save_site_model(directory, model, _info(run_id, round_), run_complete=round_ == num_rounds)
    return model


def _same_weights(a: FedPACNet, b: FedPACNet) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_run_s_intermediate_save_leaves_the_current_model_and_its_final_save_replaces_it(tmp_path):
    first = _save(tmp_path, run_id=11, round_=5, num_rounds=5)
    second_midway = _save(tmp_path, run_id=22, round_=2, num_rounds=4)  # save-model-every = 2

    model, info = load_site_model(tmp_path)
    assert (info.run_id, info.round) == (11, 5) and _same_weights(model, first)
    assert json.loads((tmp_path / "model.json").read_text())["run_id"] == 11  # the copy at the top too
    assert current_run(tmp_path) == 11
    model, info = load_site_model(tmp_path, run=22)  # the unfinished run's save, in its own folder
    assert (info.run_id, info.round) == (22, 2) and _same_weights(model, second_midway)

    second = _save(tmp_path, run_id=22, round_=4, num_rounds=4)
    model, info = load_site_model(tmp_path)
    assert (info.run_id, info.round) == (22, 4) and _same_weights(model, second)
    assert json.loads((tmp_path / "model.json").read_text())["round"] == 4 and current_run(tmp_path) == 22
    assert kept_runs(tmp_path) == [22, 11]


def test_a_one_round_run_after_a_five_round_run_becomes_current_and_the_five_round_one_stays_loadable(tmp_path):
    five = _save(tmp_path, run_id=7, round_=5, num_rounds=5)
    smoke = _save(tmp_path, run_id=8, round_=1, num_rounds=1)  # a smoke test
    model, info = load_site_model(tmp_path)
    assert info.run_id == 8 and _same_weights(model, smoke)
    model, info = load_site_model(tmp_path, run=7)
    assert (info.run_id, info.round) == (7, 5) and _same_weights(model, five)
    _, info = load_site_model(tmp_path, run="7")  # as fedpac-predict --run passes it
    assert info.run_id == 7


def test_pruning_keeps_the_latest_runs_and_the_current_one(tmp_path):
    _save(tmp_path, run_id=1, round_=3, num_rounds=3)  # completed: the current model from here on
    unfinished = list(range(100, 100 + KEPT_RUNS + 2))
    for run_id in unfinished:  # runs stopped after an intermediate save
        _save(tmp_path, run_id=run_id, round_=2, num_rounds=3)
    latest = unfinished[::-1][:KEPT_RUNS]
    assert kept_runs(tmp_path) == [*latest, 1]  # the two oldest unfinished runs are gone, not the current
    assert sorted(int(f.name) for f in (tmp_path / "runs").iterdir()) == sorted([1, *latest])
    assert load_site_model(tmp_path)[1].run_id == 1

    _save(tmp_path, run_id=200, round_=3, num_rounds=3)  # a run completes: run 1 is no longer current
    assert current_run(tmp_path) == 200
    assert kept_runs(tmp_path) == [200, *latest[:KEPT_RUNS - 1]]
    with pytest.raises(FileNotFoundError, match="keeps no model of run 1;"):
        load_site_model(tmp_path, run=1)


def test_a_model_dir_of_the_layout_before_runs_were_kept_loads_and_stays_loadable_by_run(tmp_path):
    """model.pt and model.json at the top, no ``current``, no ``runs/``: what a site saved before."""
    old = _model(3)
    torch.save(old.state_dict(), tmp_path / "model.pt")
    written = {key: value for key, value in _info(42, 10).__dict__.items() if key != "saved_at"}
    (tmp_path / "model.json").write_text(json.dumps(written))
    model, info = load_site_model(tmp_path)
    assert (info.run_id, info.round, info.saved_at) == (42, 10, 0.0) and _same_weights(model, old)

    _save(tmp_path, run_id=43, round_=2, num_rounds=3)  # an intermediate save changes nothing current
    assert load_site_model(tmp_path)[1].run_id == 42 and current_run(tmp_path) is None
    new = _save(tmp_path, run_id=43, round_=3, num_rounds=3)
    model, info = load_site_model(tmp_path)
    assert info.run_id == 43 and _same_weights(model, new)
    model, info = load_site_model(tmp_path, run=42)  # the old model moved into its run's folder
    assert (info.run_id, info.round) == (42, 10) and _same_weights(model, old)
    assert kept_runs(tmp_path) == [43, 42]


def test_a_crash_while_a_model_becomes_current_leaves_the_previous_one_in_force(tmp_path, monkeypatch):
    first = _save(tmp_path, run_id=5, round_=2, num_rounds=2)
    real_write = site_model.atomic_write

    def crash_at_the_top_model_json(path: Path, data: bytes) -> None:
        if path == tmp_path / "model.json":  # the top model.pt is already the new run's
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(site_model, "atomic_write", crash_at_the_top_model_json)
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, run_id=6, round_=2, num_rounds=2)
    monkeypatch.undo()
    model, info = load_site_model(tmp_path)  # run 5's weights with run 5's description
    assert info.run_id == 5 and _same_weights(model, first)
    assert load_site_model(tmp_path, run=6)[1].run_id == 6  # the new run's own save is whole


def test_a_missing_run_is_a_clear_error_listing_the_kept_runs(tmp_path, capsys):
    _save(tmp_path, run_id=31, round_=1, num_rounds=1)
    _save(tmp_path, run_id=32, round_=1, num_rounds=2)
    with pytest.raises(FileNotFoundError, match=r"keeps no model of run 99; kept runs, the latest first: 32, 31 "
                                                r"\(current: 31\)"):
        load_site_model(tmp_path, run=99)
    for bad in ("../31", "-1", "31/..", "", "³"):  # never a path, never outside runs/
        with pytest.raises(ValueError, match="is not a run id"):
            load_site_model(tmp_path, run=bad)

    images = tmp_path / "images.npz"
    import numpy as np  # pylint: disable=import-outside-toplevel

    np.savez(images, x=np.zeros((2, 28, 28), dtype=np.uint8))
    assert site_model.main([str(tmp_path), str(images), "--run", "99"]) == 2
    assert "kept runs, the latest first: 32, 31" in capsys.readouterr().err
    assert site_model.main([str(tmp_path), str(images), "--run", "32"]) == 0
    assert "model of run 32, round 1" in capsys.readouterr().err
    assert site_model.main([str(tmp_path), str(images)]) == 0
    assert "model of run 31, round 1" in capsys.readouterr().err


def test_a_current_run_folder_deleted_by_hand_falls_back_to_the_copy_at_the_top(tmp_path):
    kept = _save(tmp_path, run_id=12, round_=1, num_rounds=1)
    shutil.rmtree(tmp_path / "runs" / "12")
    model, info = load_site_model(tmp_path)
    assert info.run_id == 12 and _same_weights(model, kept)


class _Opens:
    """Unpickled, opens (creates) a file: what a hostile model file could run instead."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.path), "w"))


def test_a_model_file_that_runs_code_when_loaded_is_refused_whatever_the_environment(tmp_path, monkeypatch):
    """The site loads only tensors from model.pt, even where the environment tells torch to
    unpickle anything by default (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD, a setting some tools ask for)."""
    _save(tmp_path / "site", 1, 1, 1)
    marker = tmp_path / "ran"
    torch.save({"head.weight": _Opens(marker)}, site_model.model_folder(tmp_path / "site") / site_model.MODEL_FILE)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError):
        load_site_model(tmp_path / "site")
    assert not marker.exists()


def test_a_model_file_missing_a_weight_or_holding_another_is_refused(tmp_path):
    """A model.pt that does not fit the model its model.json describes is an error, never a model
    left partly at its random initialization."""
    _save(tmp_path / "site", 1, 1, 1)
    path = site_model.model_folder(tmp_path / "site") / site_model.MODEL_FILE
    state = torch.load(path, weights_only=True)
    for changed in ({k: v for k, v in state.items() if k != "head.bias"}, {**state, "head.extra": torch.zeros(1)}):
        torch.save(changed, path)
        with pytest.raises(RuntimeError, match="state_dict"):
            load_site_model(tmp_path / "site")


def test_fedpac_predict_writes_one_row_per_image_to_the_csv_it_is_given(tmp_path, capsys):
    model = _save(tmp_path / "site", 1, 1, 1)
    images = (np.arange(3 * 28 * 28) % 251).astype(np.uint8).reshape(3, 28, 28)
    np.savez(tmp_path / "images.npz", x=images)
    out = tmp_path / "predictions.csv"
    assert site_model.main([str(tmp_path / "site"), str(tmp_path / "images.npz"), "--out", str(out)]) == 0
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["image", "class", "confidence"] and len(rows) == 4
    labels, _ = site_model.predict(model.eval(), _info(1, 1), images)
    assert [int(r[1]) for r in rows[1:]] == labels.tolist()
    assert "3 images, model of run 1" in capsys.readouterr().err
