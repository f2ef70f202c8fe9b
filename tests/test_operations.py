"""Operations the README and docs/RELIABILITY.md promise an operator, checked through what a run
leaves in its folder while it runs: status.json after every round, a crash that loses no finished
round and resumes from it, max-failed-rounds counting failed rounds in a row, the rounds at which a
site saves its model (save-model-every), and local shuffling reseeded every round.

Every run goes through the ServerApp's own loop (``run_fedpac``) on the in-process federation, and
is read back only from the files an operator reads (status.json, rounds.csv, checkpoint.npz, a
site's model.json): a strategy or a method that is rewritten keeps these promises or fails here.
"""

from __future__ import annotations

import csv
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from client_app.app import app as client_app
from common import protocol as p
from common.config import parse_run_config
from common.model import FedPACNet
from federation import InProcessGrid
from server_app.app import run_fedpac
from server_app.checkpoint import load_checkpoint

# One client with two batches of ten images: none of these promises depends on how many clients
# there are or how well they learn, and a round takes about a second on two busy cores.
SMALL = {"samples-per-client": 20, "test-samples-per-client": 10, "min-train-per-class": 1, "min-test-per-class": 1,
         "local-epochs": 1, "batch-size": 10, "min-available-clients": 1}


@dataclass(frozen=True)
class Look:
    """What the run folder says at one moment: the status, and what is saved of the rounds."""

    state: str
    completed: int
    checkpoint_rounds: int | None  # None: no checkpoint yet
    table_rounds: tuple[int, ...]  # the rounds rounds.csv lists


def run_folder(output_dir: Path) -> Path | None:
    folders = list(output_dir.iterdir()) if output_dir.is_dir() else []
    assert len(folders) <= 1, folders
    return folders[0] if folders else None


def look(folder: Path) -> Look:
    status = json.loads((folder / "status.json").read_text())
    checkpoint = folder / "checkpoint.npz"
    return Look(
        state=status["state"],
        completed=status["completed_rounds"],
        checkpoint_rounds=load_checkpoint(checkpoint).completed_rounds if checkpoint.exists() else None,
        table_rounds=tuple(int(row["round"]) for row in table(folder / "rounds.csv")),
    )


def table(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def distinct(values: Iterable) -> list:
    """``values`` without consecutive repeats: the successive states a file went through."""
    out: list = []
    for value in values:
        if not out or out[-1] != value:
            out.append(value)
    return out


class WatchedGrid(InProcessGrid):
    """The in-process federation, looking at the run folder before every exchange (what an
    operator, or a crash at that moment, would find there), and answering chosen training rounds
    with no reply at all, as if every SuperNode had missed the round timeout."""

    def __init__(self, run_config: dict, *, silent_rounds: Iterable[int] = (), **kwargs) -> None:
        super().__init__(run_config, 1, **kwargs)
        self.output_dir = Path(run_config["output-dir"])
        self.silent_rounds = set(silent_rounds)
        self.looks: list[Look] = []

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        folder = run_folder(self.output_dir)
        if folder is not None:
            self.looks.append(look(folder))
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            if self.train_rounds + 1 in self.silent_rounds:
                self.train_rounds += 1
                self.sent.extend(messages)
                return []
        return super().send_and_receive(messages, timeout=timeout)


def run(grid: InProcessGrid, config: dict, run_id: int = 1) -> None:
    """The ServerApp's run on ``grid`` (which stands in for Flower's Grid)."""
    run_fedpac(cast(Grid, grid), parse_run_config(config), run_id)


def resume_from(status: dict) -> str:
    """The run folder the status's resume command continues from, as an operator copies it."""
    match = re.search(r"resume-from='([^']*)'", status["resume"])
    assert match, status["resume"]
    return match.group(1)


def test_status_says_running_after_every_round_and_a_crash_loses_no_finished_round(tmp_path):
    """RELIABILITY.md, "Where a run stands": status.json is rewritten with ``running`` after every
    round, so a ServerApp killed with its SuperLink leaves ``running`` at the last complete round,
    whose checkpoint and table rows are there and resume to the end."""
    config = {**SMALL, "num-server-rounds": 5, "output-dir": str(tmp_path / "crashed")}
    grid = WatchedGrid(config, crash_at_round=4)
    with pytest.raises(RuntimeError, match="simulated server crash in round 4"):
        run(grid, config)

    # Before every exchange the folder was consistent: the status, the checkpoint and rounds.csv
    # all at the same round. Fused evaluation completes round t during round t + 1.
    for seen in grid.looks:
        assert seen.state == "running"
        assert seen.checkpoint_rounds == (seen.completed or None)
        assert seen.table_rounds == tuple(range(1, seen.completed + 1))
    assert distinct(seen.completed for seen in grid.looks) == [0, 1, 2]
    # what a ServerApp killed in round 4 (no `failed` written) leaves behind
    assert grid.looks[-1] == Look("running", 2, 2, (1, 2))

    crashed = run_folder(tmp_path / "crashed")
    assert crashed is not None
    status = json.loads((crashed / "status.json").read_text())
    assert status["state"] == "failed" and status["completed_rounds"] == 2 and status["num_rounds"] == 5
    assert "simulated server crash in round 4" in status["error"]
    assert status["checkpoint"] == str(crashed / "checkpoint.npz")
    assert load_checkpoint(status["checkpoint"]).completed_rounds == 2
    crashed_rows = table(crashed / "rounds.csv")
    assert [row["round"] for row in crashed_rows] == ["1", "2"]

    # the status's own command continues the run, on other node ids, in a new folder
    resumed_config = {**config, "output-dir": str(tmp_path / "resumed"), "resume-from": resume_from(status)}
    resumed_grid = WatchedGrid(resumed_config, seed=1)
    run(resumed_grid, resumed_config, 2)
    resumed = run_folder(tmp_path / "resumed")
    assert resumed is not None
    assert [seen.state for seen in resumed_grid.looks] == ["running"] * len(resumed_grid.looks)
    assert distinct(seen.completed for seen in resumed_grid.looks) == [2, 3, 4]
    assert look(resumed) == Look("finished", 5, 5, (1, 2, 3, 4, 5))
    resumed_rows = table(resumed / "rounds.csv")
    assert resumed_rows[:2] == crashed_rows  # the crashed run's rounds, not recomputed
    assert table(crashed / "rounds.csv") == crashed_rows  # and its folder untouched


def test_max_failed_rounds_counts_failed_rounds_in_a_row_not_in_total(tmp_path):
    """A round without enough training replies keeps the global state and the next round tries
    again; only ``max-failed-rounds`` + 1 of them in a row stop the run (test_strategy.py pins the
    same count), failed, its finished rounds kept."""
    config = {**SMALL, "num-server-rounds": 5, "max-failed-rounds": 1, "output-dir": str(tmp_path / "gaps")}
    grid = WatchedGrid(config, silent_rounds={2, 4})  # two failed rounds, never two in a row
    run(grid, config)
    folder = run_folder(tmp_path / "gaps")
    assert folder is not None
    assert look(folder) == Look("finished", 5, 5, (1, 2, 3, 4, 5))
    assert [int(row["num_trained"]) for row in table(folder / "rounds.csv")] == [1, 0, 1, 0, 1]

    config = {**config, "output-dir": str(tmp_path / "stalled")}
    grid = WatchedGrid(config, silent_rounds={2, 3})
    with pytest.raises(RuntimeError, match="max-failed-rounds = 1"):
        run(grid, config, 2)
    assert grid.train_rounds == 3  # the second failed round in a row stopped it: round 4 never sent
    folder = run_folder(tmp_path / "stalled")
    assert folder is not None
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "failed"
    assert status["error"].startswith("FederationStalled: Round 3: 0 valid training replies, fewer than "
                                      "min-train-replies = 1")
    assert "2 rounds in a row" in status["error"]
    # the outputs and the checkpoint of the complete rounds are kept, and named for a resume
    stalled = look(folder)
    assert stalled.completed >= 1
    assert stalled.checkpoint_rounds == stalled.completed
    assert stalled.table_rounds == tuple(range(1, stalled.completed + 1))
    assert resume_from(status) == str(folder)


class SiteGrid(WatchedGrid):
    """Sites that keep their model in their node config's ``model-dir`` (as a deployed SuperNode
    does), with the rounds at which each wrote its model.json, read after every exchange."""

    def __init__(self, run_config: dict, sites: Path) -> None:
        super().__init__(run_config)
        self.model_dirs = {}
        for context in self.contexts.values():
            pid = int(context.node_config["partition-id"])
            self.model_dirs[pid] = sites / f"site-{pid}"
            context.node_config["model-dir"] = str(self.model_dirs[pid])
        self.saved: dict[int, list[int]] = {pid: [] for pid in self.model_dirs}

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = super().send_and_receive(messages, timeout=timeout)
        for pid, directory in self.model_dirs.items():
            for info in directory.glob("runs/*/model.json"):  # the run's own saves (client_app.site_model)
                saved = json.loads(info.read_text())["round"]
                if self.saved[pid][-1:] != [saved]:
                    self.saved[pid].append(saved)
        return replies


def saved_rounds(directory: Path, num_rounds: int, **keys: object) -> dict[int, list[int]]:
    """The rounds at which each site wrote its model during a run, partition by partition."""
    config = {**SMALL, **keys, "num-server-rounds": num_rounds, "output-dir": str(directory / "outputs")}
    grid = SiteGrid(config, directory)
    run(grid, config)
    for model_dir in grid.model_dirs.values():
        assert (model_dir / "model.pt").stat().st_size > 0
    return grid.saved


def test_save_model_every_saves_a_sites_model_at_those_rounds_and_the_last(tmp_path):
    """OUTPUTS.md, "What each site keeps": after the last round, and with save-model-every = N
    also every N rounds; not at others."""
    assert saved_rounds(tmp_path / "every-2", 3, **{"save-model-every": 2}) == {0: [2, 3]}
    assert saved_rounds(tmp_path / "default", 2) == {0: [2]}  # 0 (the default): the last round only


def _train_message(model: FedPACNet, server_round: int) -> Message:
    state = {key: value.numpy() for key, value in model.state_dict().items()}
    content = RecordDict({p.ARRAYS: p.pack({p.MODEL: state}),
                          p.CONFIG: ConfigRecord({p.SERVER_ROUND: server_round})})
    return Message(content=content, message_type=MessageType.TRAIN, dst_node_id=1 << 63)


def test_local_shuffling_is_reseeded_every_round_and_repeats_with_the_same_seed(monkeypatch):
    """The same client, sent the same model in two rounds, trains on other batch orders (one order
    replayed every round passes a resume test, both runs sharing it); the same (seed, round,
    partition) repeats its order and its update bit for bit (what an exact resume relies on)."""
    orders: list[torch.Tensor] = []
    randperm = torch.randperm

    # every shuffle of the ClientApp, whatever routine draws it
    def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
        order = randperm(*args, **kwargs)
        orders.append(order.clone())
        return order

    monkeypatch.setattr(torch, "randperm", recorded)
    torch.manual_seed(0)
    model = FedPACNet(1, 28, 10)

    def train(server_round: int, partition_id: int = 0, seed: int = 0) -> tuple[list[torch.Tensor], p.NDArrays]:
        orders.clear()
        context = Context(run_id=7, node_id=1 << 63, state=RecordDict(),
                          node_config={"partition-id": partition_id, "num-partitions": 2},
                          run_config={**SMALL, "seed": seed})
        reply = client_app(_train_message(model, server_round), context)
        assert not reply.has_error(), reply.error
        assert orders, "the local update drew no batch order"
        return list(orders), p.sections_of(reply.content)[p.MODEL]

    round_1, update_1 = train(1)
    again, update_again = train(1)
    round_2, update_2 = train(2)
    assert len(round_1) == len(round_2) == len(again)
    assert all(torch.equal(a, b) for a, b in zip(round_1, again))
    assert all(np.array_equal(update_1[key], update_again[key]) for key in update_1)
    assert not any(torch.equal(a, b) for a, b in zip(round_1, round_2)), "round 2 replays round 1's batches"
    assert not all(np.array_equal(update_1[key], update_2[key]) for key in update_1)
    # the other two parts of the seed: another partition, another run seed
    other_partition, _ = train(1, partition_id=1)
    other_seed, _ = train(1, seed=1)
    assert not any(torch.equal(a, b) for a, b in zip(round_1, other_partition))
    assert not any(torch.equal(a, b) for a, b in zip(round_1, other_seed))


@pytest.mark.parametrize("fused", [True, False])
def test_every_round_records_the_seconds_it_took(tmp_path, fused):
    """rounds.csv's seconds: a round lasts from its train message to its evaluation's end (fused:
    to the next round's train message), a positive time no longer than the whole run."""
    config = {**SMALL, "num-server-rounds": 2, "fused-evaluation": fused, "output-dir": str(tmp_path)}
    started = time.time()
    run(InProcessGrid(config, 3), config)
    elapsed = time.time() - started
    (run_dir,) = tmp_path.iterdir()
    rows = list(csv.DictReader((run_dir / "rounds.csv").open()))
    assert [row["round"] for row in rows] == ["1", "2"]
    assert all(0 < float(row["seconds"]) <= elapsed for row in rows), (rows, elapsed)
