"""Every site ends the run with its personalized model, whatever ``fraction-evaluate`` is.

The last round evaluates a sample of the sites; a deployed site saves the model it evaluates
(``client_app.app``). After the loop the server sends the final model, in an evaluate message of
the last round, to every bound site that evaluation did not reach, asking an offline site again
until the round timeout (``PersonalizedStrategy.deliver``). Runs go through the real ServerApp and ClientApp
in process (``federation.InProcessGrid``), each node with a ``model-dir`` of its own.
"""

import json
import logging
import time
from uuid import uuid4

import numpy as np
import pytest
import torch
from flwr.app import MessageType
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

from client_app.app import client_tensors
from client_app.site_model import INFO_FILE, MODEL_FILE, load_site_model, predict
from common import protocol as p
from common.config import parse_run_config
from common.methods import METHODS
from common.methods.baselines import Baseline
from common.methods.client import SITE_PARTS
from common.model import FedPACNet
from common.site_state import SiteStore
from common.training import evaluate as evaluate_model
from federation import InProcessGrid
from server_app.app import run_fedpac

SITES = 4
BASE = {
    "samples-per-client": 60,
    "test-samples-per-client": 30,
    "local-epochs": 1,
    "batch-size": 20,
    "num-server-rounds": 2,
    "fraction-evaluate": 0.4,  # the last round evaluates 2 of the 4 sites
}
# One configuration per way a method personalizes: mixed heads with a shared extractor, a whole
# local model, one averaged model, a head fine-tuned before evaluation, clustered heads, posteriors.
METHOD_CONFIGS = {
    "fedpac": {},
    "local": {"strategy": "local"},
    "fedavg": {"strategy": "fedavg"},
    "fedavg-ft": {"strategy": "fedavg-ft"},
    "fedccfa": {"strategy": "fedccfa", "balanced-epochs": 1},
    "pfedvem": {"strategy": "pfedvem", "vem-sampling-rate": 0.5},
}


class SiteGrid(InProcessGrid):
    """Nodes with a ``model-dir`` each, which can go offline from the last round's training on.

    ``outages[pid]`` is how many exchanges (``send_and_receive`` calls), counted from the one
    that carries the last round's training, partition ``pid`` misses: a message to it is then
    answered by the SuperLink in its place (NODE_UNAVAILABLE, as Flower does). ``None``: it never
    comes back, and once it missed a message it is no longer listed (its heartbeat expired).
    ``reached`` lists (message type, server round, partition-id) of every message a ClientApp ran.
    """

    def __init__(self, config: dict, models, outages: dict[int, int | None] | None = None, **options) -> None:
        super().__init__(config, SITES, seed=1, **options)
        for node, pid in self.partition_of_node.items():
            self.contexts[node].node_config["model-dir"] = str(models / f"site-{pid}")
        self.last_round = config["num-server-rounds"]
        self.outages = outages or {}
        self.exchanges = 0  # from the last round's training on
        self.gone: set[int] = set()
        self.reached: list[tuple[str, int, int]] = []

    def get_node_ids(self):
        return [n for n in self.contexts if n not in self.gone]

    def _down(self, node: int) -> bool:
        pid = self.partition_of_node[node]
        if not self.exchanges or pid not in self.outages:
            return False
        missed = self.outages[pid]
        return missed is None or self.exchanges <= missed

    def _deliver(self, msg):
        config = msg.content.config_records[p.CONFIG]
        self.reached.append((msg.metadata.message_type, config[p.SERVER_ROUND],
                             self.partition_of_node[msg.metadata.dst_node_id]))
        return super()._deliver(msg)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for msg in messages:  # ids as a deployment's grid gives them: the SuperLink's errors name them
            msg.metadata.__dict__["_message_id"] = uuid4().hex
        if any(m.metadata.message_type == MessageType.TRAIN
               and m.content.config_records[p.CONFIG][p.SERVER_ROUND] == self.last_round for m in messages):
            self.exchanges = 0
            self.exchanges += 1
        elif self.exchanges and messages:
            self.exchanges += 1
        down = [m for m in messages if self._down(m.metadata.dst_node_id)]
        replies = super().send_and_receive([m for m in messages if m not in down], timeout=timeout)
        self.sent.extend(down)
        for msg in down:
            if self.outages[self.partition_of_node[msg.metadata.dst_node_id]] is None:
                self.gone.add(msg.metadata.dst_node_id)
        return [*replies, *(create_message_error_unavailable_res_message(m.metadata, "node_unavail") for m in down)]

    def final_evaluations(self) -> list[int]:
        """The partitions whose ClientApp evaluated a model of the last round, one entry each time."""
        return sorted(pid for kind, rnd, pid in self.reached if kind == MessageType.EVALUATE and rnd == self.last_round)


def _run(config: dict, tmp_path, **grid_options):
    config = {**config, "output-dir": str(tmp_path / "out")}
    grid = SiteGrid(config, tmp_path / "models", **grid_options)
    strategy, report = run_fedpac(grid, parse_run_config(config), 1)
    (run,) = (tmp_path / "out").iterdir()
    return strategy, report, grid, json.loads((run / "status.json").read_text()), run


def server_model(final: dict[str, np.ndarray], pid: int, cfg, kept: dict[str, np.ndarray]) -> FedPACNet:
    """The model the run gives partition ``pid``: the parts its site kept at home (``kept``), its
    own part where the server keeps one (``client-<pid>/<section>/...``), the global one otherwise
    (``<section>/...``)."""
    model = FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes)
    state = {}
    for key in model.state_dict():
        section = key.split(".")[0]  # extractor (extractor.*) or head (head.*)
        shared = f"{section}/{key}"
        value = kept[key] if key in kept else final.get(f"client-{pid}/{section}/{key}", final.get(shared))
        state[key] = torch.from_numpy(value)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("name", sorted(METHOD_CONFIGS))
def test_every_site_saves_the_final_model_when_the_last_round_evaluates_a_sample(name, tmp_path):
    config = {**BASE, **METHOD_CONFIGS[name], "num-server-rounds": 1}  # one round is a last round
    cfg = parse_run_config(config)
    strategy, report, grid, status, run = _run(config, tmp_path)

    sampled = sorted(report.rounds[-1].accuracy)
    assert len(sampled) == 2  # the last round's evaluation reached 2 sites; the delivery the others
    assert grid.final_evaluations() == list(range(SITES))  # every site once: none evaluated twice
    assert status["state"] == "finished"
    assert status["delivery"]["delivered"] == list(range(SITES)) and status["delivery"]["undelivered"] == []
    assert status["delivery"]["round"] == 1

    with np.load(run / "final_state.npz") as npz:
        final = {key: npz[key] for key in npz.files}
    for pid in range(SITES):
        model, info = load_site_model(tmp_path / "models" / f"site-{pid}")
        assert info.round == 1 and info.partition_id == pid and info.method == cfg.strategy
        # model.json's accuracy is the one the run reports, and the saved model's own on the site's split
        assert info.accuracy == status["delivery"]["accuracy"][str(pid)]
        if pid in sampled:
            assert info.accuracy == report.rounds[-1].accuracy[pid]
        _, _, x_test, y_test = client_tensors(cfg, pid, SITES, torch.device("cpu"))
        assert evaluate_model(model, x_test, y_test)[1] == pytest.approx(info.accuracy, abs=1e-12)
        method = METHODS[cfg.strategy]
        if isinstance(method, Baseline) and method.finetune_before_evaluation:
            continue  # the site keeps the head it fine-tuned on its own data, which the server never sees
        # the site's model is the server's final state for it: the same weights, the same predictions
        site_root = tmp_path / "models" / f"site-{pid}" / "site-state"  # under the node's model-dir
        kept = SiteStore(site_root, pid, strategy.lineage).load(1).get(SITE_PARTS, {})
        assert bool(kept) == bool(method.site_parts)
        expected = server_model(final, pid, cfg, kept)
        for key, value in expected.state_dict().items():
            assert torch.equal(model.state_dict()[key], value), key
        images = np.random.default_rng(pid).integers(0, 256, (16, cfg.image_size, cfg.image_size), dtype=np.uint8)
        labels, probabilities = predict(model, info, images)
        server_labels, server_probabilities = predict(expected, info, images)
        assert np.array_equal(labels, server_labels)
        np.testing.assert_array_equal(probabilities, server_probabilities)


def test_every_site_evaluated_in_the_last_round_is_sent_nothing_more(tmp_path):
    _, report, grid, status, _ = _run({**BASE, "fraction-evaluate": 1.0, "num-server-rounds": 1}, tmp_path)
    assert sorted(report.rounds[-1].accuracy) == list(range(SITES))
    assert grid.final_evaluations() == list(range(SITES))
    last = [m for m in grid.sent if m.metadata.message_type == MessageType.EVALUATE
            and m.content.config_records[p.CONFIG][p.SERVER_ROUND] == 1]
    assert len(last) == SITES  # no delivery message at all
    assert status["delivery"]["delivered"] == list(range(SITES))
    assert status["delivery"]["accuracy"] == {str(pid): acc for pid, acc in report.rounds[-1].accuracy.items()}


RETURNS, NEVER = 1, 3


def test_a_site_back_before_the_timeout_gets_its_model_and_one_never_back_is_named(tmp_path, caplog):
    """Partition 1 is offline through the last round and the first delivery attempt, then back;
    partition 3 dies in the last round and never returns. The run finishes, with partition 1's
    model saved and partition 3 named as undelivered in a warning and in status.json."""
    config = {**BASE, "round-timeout": 3.0}
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        strategy, report, grid, status, run = _run(config, tmp_path, outages={RETURNS: 3, NEVER: None})
    assert time.monotonic() - started < 60
    assert status["state"] == "finished" and status["completed_rounds"] == 2
    assert status["delivery"]["delivered"] == [0, 1, 2] and status["delivery"]["undelivered"] == [NEVER]
    assert grid.final_evaluations() == [0, 1, 2]  # every site reached once, partition 1 on a retry
    asked = [m for m in grid.sent if m.metadata.message_type == MessageType.EVALUATE
             and grid.partition_of_node[m.metadata.dst_node_id] == RETURNS
             and m.content.config_records[p.CONFIG][p.SERVER_ROUND] == 2]
    assert len(asked) >= 2  # asked again once back

    info = json.loads((tmp_path / "models" / f"site-{RETURNS}" / INFO_FILE).read_text())
    assert info["round"] == 2 and info["accuracy"] == status["delivery"]["accuracy"][str(RETURNS)]
    never = tmp_path / "models" / f"site-{NEVER}"
    assert not (never / MODEL_FILE).exists() and not (never / INFO_FILE).exists()
    warnings = [r.getMessage() for r in caplog.records if "Final model not delivered" in r.getMessage()]
    assert len(warnings) == 1 and f"partitions [{NEVER}]" in warnings[0]
    # its head (trained in round 1, before it died) is in the final state, as is everyone's
    with np.load(run / "final_state.npz") as final:
        assert {f"client-{pid}/head/head.weight" for pid in range(SITES)} <= set(final.files)
    assert NEVER not in report.rounds[-1].train


def test_a_site_that_answers_with_an_error_is_named_at_once_not_waited_for(tmp_path, caplog):
    """A site whose ClientApp fails on the final model (its model-dir is a file) answered: it
    is not asked again until the round timeout; the run finishes at once with it named."""
    config = {**BASE, "fraction-evaluate": 1.0, "num-server-rounds": 1, "round-timeout": 600.0}
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "site-2").write_text("not a folder")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        _, _, grid, status, _ = _run(config, tmp_path)
    assert time.monotonic() - started < 120
    assert status["state"] == "finished"
    assert status["delivery"]["undelivered"] == [2] and status["delivery"]["delivered"] == [0, 1, 3]
    assert grid.final_evaluations().count(2) == 2  # the last round's evaluation, and one delivery
    assert "FileExistsError" in caplog.text and "Final model not delivered to partitions [2]" in caplog.text
