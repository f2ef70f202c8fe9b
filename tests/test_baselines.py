"""The paper's baselines and ablations: one strategy, one client, a method description each.

Every method runs end to end through the real ClientApp (in-process federation); FedAvg's
aggregate is checked against a weighted mean computed by hand; FedPer, FedRep and the
alignment-only ablation keep every head local; Local-only keeps every whole model local; and
each method sends and accepts only the records its server step uses.
"""

import copy
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from client_app.app import app as client_app
from client_app.app import client_tensors
from common import protocol as p
from common.config import ConfigError, FedPACConfig, configured_method, parse_run_config
from common.methods import METHODS, Rule
from common.methods.base import Alignment, Method
from common.methods.client import SITE_PARTS, ClientResult, LocalData, Received, client_routine
from common.methods.fedpac.server import CENTROIDS
from common.methods.pfedvem.server import SCALE
from common.methods.server import EXTRACTOR, HEAD, server_part
from common.model import HEAD_PREFIX, FedPACNet, part_of, split_state
from common.training import evaluate, train_head
from common.site_state import SiteStore
from federation import InProcessGrid, set_section
from server_app.app import initial_model, run_fedpac
from server_app.checkpoint import load_checkpoint
from server_app.strategy import PersonalizedStrategy
from method_traits import traits

RUN_CONFIG = {
    "samples-per-client": 60,
    "test-samples-per-client": 30,
    "local-epochs": 1,
    "batch-size": 20,
    "fedrep-head-epochs": 2,
}


def _config(strategy, **extra):
    return {**RUN_CONFIG, "strategy": strategy, **extra}


def _strategy(run_config):
    cfg = parse_run_config(run_config)
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    strategy = PersonalizedStrategy(server=server_part(configured_method(cfg), cfg, extractor, head),
                                    num_rounds=cfg.num_server_rounds, seed=cfg.seed)
    return strategy, extractor


class Recorder:
    """A tamper hook that keeps a copy of every training reply's records, by partition-id."""

    def __init__(self):
        self.train: dict[int, RecordDict] = {}

    def __call__(self, reply, pid):
        if reply.metadata.message_type == MessageType.TRAIN and reply.has_content():
            self.train[pid] = reply.content
        return reply


def _train_round(strategy, grid, extractor, server_round=1):
    messages = list(strategy.configure_train(server_round, p.to_record(extractor), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    return messages, strategy.aggregate_train(server_round, replies)


# ---------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_runs_two_rounds_end_to_end(name, tmp_path):
    method = METHODS[name]
    config = _config(name, **{"num-server-rounds": 2, "output-dir": str(tmp_path)})
    recorder = Recorder()
    grid = InProcessGrid(config, 3, tamper=recorder)
    strategy, report = run_fedpac(grid, parse_run_config(config), 1)

    assert [r.round for r in report.rounds] == [1, 2]
    for record in report.rounds:
        assert sorted(record.accuracy) == [0, 1, 2] and sorted(record.train) == [0, 1, 2]
        assert all(0.0 <= a <= 1.0 for a in record.accuracy.values())
        assert all(np.isfinite(m["train-loss"]) for m in record.train.values())
        # alpha exists exactly for the methods that mix heads, one row per trained client
        assert (len(record.method.get("alpha", [])) == 3) == method.has_alpha
        if method.has_alpha:
            np.testing.assert_allclose(np.sum(record.method["alpha"], axis=1), 1.0)
    # clients send statistics only when the server step uses them, and only the ones it uses
    for content in recorder.train.values():
        sections = p.sections_of(content)
        assert (p.STATISTICS in sections) == (traits(method).sends_statistics)
        if p.STATISTICS in sections:
            sent = set(sections[p.STATISTICS])
            assert (p.CENTROID_VALUES in sent) == traits(method).centroids
            assert (p.H in sent) == traits(method).statistics
        assert (p.RHO in content[p.METRICS]) == traits(method).posteriors
        assert (p.LOCAL_ACCURACY in content[p.METRICS]) == traits(method).local_evaluation
        assert (p.V in content[p.METRICS]) == traits(method).statistics
    # the server sends centroids only to methods that align features
    train_messages = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert all((p.CENTROIDS in p.sections_of(m.content)) == traits(method).centroids for m in train_messages)
    assert all((p.POSTERIOR in p.sections_of(m.content)) == traits(method).posteriors for m in train_messages)

    (run_dir,) = tmp_path.iterdir()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["config"]["strategy"] == name and len(metrics["rounds"]) == 2
    assert (run_dir / "alpha.png").exists() == method.has_alpha
    assert (run_dir / "accuracy.png").exists() and (run_dir / "final_state.npz").exists()
    checkpoint = load_checkpoint(run_dir)
    assert checkpoint.strategy == name and checkpoint.completed_rounds == 2
    # the server state that the method keeps, keyed by partition-id; what its sites keep at home
    initial_extractor, initial_head = split_state(
        {k: v.numpy() for k, v in initial_model(parse_run_config(config)).state_dict().items()})
    state = strategy.state
    assert not state.personal.get(EXTRACTOR) and not checkpoint.state.personal.get(EXTRACTOR)
    if method.extractor is not Rule.LOCAL:
        assert not np.array_equal(strategy.extractor["extractor.0.weight"], initial_extractor["extractor.0.weight"])
    if method.head is Rule.AVERAGE:
        assert not state.personal.get(HEAD) and HEAD in checkpoint.state.shared
        for key, initial in initial_head.items():  # FedBABU's head never trains: the initial one, bit for bit
            assert np.array_equal(state.shared[HEAD][key], initial) == traits(method).fixed_head, key
    elif method.head is Rule.LOCAL:
        assert not state.personal.get(HEAD) and HEAD not in checkpoint.state.shared
    else:
        assert sorted(state.personal[HEAD]) == [0, 1, 2]
        assert (HEAD in checkpoint.state.shared) == traits(method).global_head
    assert SCALE not in checkpoint.state.personal  # pFedVEM's posterior scales stay at the sites
    # a part kept at the site never travels, either way, and the site has it after the last round
    kept_at_site = traits(method).kept_at_site
    for message in [*train_messages, *recorder.train.values()]:
        content = message.content if isinstance(message, Message) else message
        travelled = {part_of(key) for key in p.sections_of(content).get(p.MODEL, {})}
        assert travelled == {"extractor", "head"} - set(kept_at_site)
    final = np.load(run_dir / "final_state.npz")
    assert not [key for key in final.files if key.split("/")[-2] in kept_at_site and key.startswith("client-")]
    for pid in range(3):
        kept = SiteStore(Path(os.environ["FLWR_HOME"]) / "fedpac-site-state", pid, strategy.lineage).load(2)
        assert set(kept) == ({SITE_PARTS} if kept_at_site else set()) | set(traits(method).site_state)
        if kept_at_site:
            assert {part_of(key) for key in kept[SITE_PARTS]} == set(kept_at_site)


# ---------------------------------------------------------------------------- FedAvg


def _reply(msg: Message, arrays: dict, num_examples: int, pid: int) -> Message:
    content = RecordDict({
        p.ARRAYS: p.pack({p.MODEL: arrays}),
        p.METRICS: MetricRecord({p.PARTITION_ID: pid, p.NUM_EXAMPLES: num_examples, "train-loss": 1.0}),
    })
    return Message(content=content, reply_to=msg)


def test_fedavg_aggregate_equals_a_hand_computed_weighted_mean():
    config = _config("fedavg")
    strategy, extractor = _strategy(config)
    grid = InProcessGrid(config, 3)
    strategy.discover(grid, timeout=60)
    messages = list(strategy.configure_train(1, p.to_record(extractor), ConfigRecord(), grid))
    pid_of = {m.metadata.dst_node_id: grid.partition_of_node[m.metadata.dst_node_id] for m in messages}
    template = {**extractor, **strategy.server.initial_head}
    # client k sends every weight equal to k + 1 and n_k = 10, 30, 60 samples
    sizes = {0: 10, 1: 30, 2: 60}
    replies = [
        _reply(m, {k: np.full_like(v, pid_of[m.metadata.dst_node_id] + 1) for k, v in template.items()},
               sizes[pid_of[m.metadata.dst_node_id]], pid_of[m.metadata.dst_node_id])
        for m in messages
    ]
    new_arrays, metrics = strategy.aggregate_train(1, reversed(replies))
    expected = (10 * 1 + 30 * 2 + 60 * 3) / 100  # = 2.5, by hand
    assert metrics["num-replies"] == 3
    for value in p.from_record(new_arrays).values():  # the extractor Flower carries on
        np.testing.assert_allclose(value, expected, rtol=1e-6)
    for value in strategy.state.shared[HEAD].values():  # and the head: FedAvg averages the whole model
        np.testing.assert_allclose(value, expected, rtol=1e-6)
    # every node, including one that never trained, evaluates the one global model
    grid.contexts[12345] = grid.contexts[next(iter(grid.contexts))]
    for msg in strategy.configure_evaluate(1, new_arrays, ConfigRecord(), grid):
        for value in p.sections_of(msg.content)[p.MODEL].values():
            np.testing.assert_allclose(value, expected, rtol=1e-6)


def test_fedavg_rejects_statistics_it_did_not_ask_for_and_fedpac_collab_requires_them(caplog):
    def add_statistics(reply, pid):
        if pid == 1 and reply.metadata.message_type == MessageType.TRAIN:
            set_section(reply, p.STATISTICS, {p.CLASS_COUNTS: np.full(10, 6, dtype=np.int64)})
        return reply

    config = _config("fedavg")
    strategy, extractor = _strategy(config)
    grid = InProcessGrid(config, 3, tamper=add_statistics)
    with caplog.at_level(logging.WARNING):
        _, (_, metrics) = _train_round(strategy, grid, extractor)
    assert metrics["num-replies"] == 2 and "unexpected section(s) ['statistics']" in caplog.text

    def drop_h(reply, pid):
        if pid == 2 and reply.metadata.message_type == MessageType.TRAIN:
            stats = p.sections_of(reply.content)[p.STATISTICS]
            del stats[p.H]
            set_section(reply, p.STATISTICS, stats)
        return reply

    config = _config("fedpac-collab")
    strategy, extractor = _strategy(config)
    grid = InProcessGrid(config, 3, tamper=drop_h)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _, (_, metrics) = _train_round(strategy, grid, extractor)
    assert metrics["num-replies"] == 2 and "statistics lack 'h'" in caplog.text
    assert sorted(strategy.state.personal[HEAD]) == [0, 1]
    assert CENTROIDS not in strategy.state.shared  # collaboration only: no centroids, ever


# ---------------------------------------------------------------------------- local heads


@pytest.mark.parametrize("name", ["fedper", "fedrep", "fedpac-none", "fedpac-align"])
def test_heads_stay_at_the_sites_and_each_site_evaluates_with_its_own(name):
    config = _config(name)
    strategy, extractor = _strategy(config)
    recorder = Recorder()
    grid = InProcessGrid(config, 4, tamper=recorder, shuffle_replies=True)
    messages, (new_arrays, _) = _train_round(strategy, grid, extractor)

    # no head travels, either way, and the server keeps none
    trained = {pid: p.sections_of(content)[p.MODEL] for pid, content in recorder.train.items()}
    assert sorted(trained) == [0, 1, 2, 3]
    for arrays in [*trained.values(), *(p.sections_of(m.content)[p.MODEL] for m in messages)]:
        assert not [key for key in arrays if key.startswith(HEAD_PREFIX)]
    assert not strategy.state.personal
    # the extractor is still shared: the sample-weighted mean of the replies' extractors
    n = {pid: content[p.METRICS][p.NUM_EXAMPLES] for pid, content in recorder.train.items()}
    for key, value in p.from_record(new_arrays).items():
        expected = sum(n[pid] * trained[pid][key].astype(np.float64) for pid in trained) / sum(n.values())
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7)
    # each site kept the head it trained, and evaluates the global extractor with it
    root = Path(os.environ["FLWR_HOME"]) / "fedpac-site-state"
    heads = {pid: SiteStore(root, pid, strategy.lineage).load(1)[SITE_PARTS] for pid in range(4)}
    assert not np.allclose(heads[0]["head.weight"], heads[1]["head.weight"])  # a real test
    cfg = parse_run_config(config)
    replies = grid.send_and_receive(strategy.configure_evaluate(1, new_arrays, ConfigRecord(), grid))
    assert len(replies) == 4
    for reply in replies:
        metrics = reply.content[p.METRICS]
        pid = int(metrics[p.PARTITION_ID])
        model = FedPACNet(1, 28, 10)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in {**p.from_record(new_arrays), **heads[pid]}.items()})
        _, _, x_test, y_test = client_tensors(cfg, pid, 4, torch.device("cpu"))
        assert metrics["accuracy"] == evaluate(model, x_test, y_test)[1]


def test_local_only_keeps_every_whole_model_at_the_site():
    config = _config("local")
    strategy, extractor = _strategy(config)
    recorder = Recorder()
    grid = InProcessGrid(config, 3, tamper=recorder)
    messages, (new_arrays, _) = _train_round(strategy, grid, extractor)
    for key, value in p.from_record(new_arrays).items():  # nothing is averaged
        np.testing.assert_array_equal(value, extractor[key])
    # no model travels, either way: the reply is its sample count and losses
    assert all(p.MODEL not in p.sections_of(m.content) for m in messages)
    assert all(not p.sections_of(content) for content in recorder.train.values()) and len(recorder.train) == 3
    root = Path(os.environ["FLWR_HOME"]) / "fedpac-site-state"
    for pid in range(3):
        kept = SiteStore(root, pid, strategy.lineage).load(1)[SITE_PARTS]
        assert set(kept) == set(extractor) | {"head.weight", "head.bias"}
        assert not np.array_equal(kept["extractor.0.weight"], extractor["extractor.0.weight"])


# ---------------------------------------------------------------------------- client side


def _data(n=40, seed=0):
    torch.manual_seed(seed)
    return FedPACNet(1, 28, 10), torch.randn(n, 1, 28, 28), torch.arange(n) % 5


def _changed(before, module):
    return [not torch.equal(b, a) for b, a in zip(before, module.parameters())]


def _local_update(model, x, y, received: Received, cfg: FedPACConfig) -> ClientResult:
    """The run's method's local update (no test split: x, y stand in for it)."""
    return client_routine(METHODS[cfg.strategy]).local_update(
        model, LocalData(x, y, x, y), received, cfg, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_each_method_trains_the_parts_it_should_and_computes_only_what_it_sends(name):
    method = METHODS[name]
    model, x, y = _data()
    cfg = FedPACConfig(strategy=name, local_epochs=1, batch_size=8, fedrep_head_epochs=2)
    extractor_before = [q.detach().clone() for q in model.extractor.parameters()]
    head_before = [q.detach().clone() for q in model.head.parameters()]
    received = Received(server_round=cfg.align_from_round, sections={
        p.CENTROIDS: {p.CENTROID_VALUES: torch.randn(10, 128).numpy(), p.CENTROID_MASK: np.ones(10, dtype=bool)},
        p.INITIAL_HEAD: {HEAD_PREFIX + k: v.detach().numpy().copy() for k, v in model.head.state_dict().items()},
        p.POSTERIOR: {p.PRIOR_WEIGHT: torch.randn(10, 128).numpy(), p.PRIOR_BIAS: torch.randn(10).numpy()},
    })
    update = _local_update(model, x, y, received, cfg)
    assert all(_changed(extractor_before, model.extractor))
    if traits(method).fixed_head:  # FedBABU: the head goes back as received
        assert not any(_changed(head_before, model.head))
    else:
        assert all(_changed(head_before, model.head))
    assert update.num_examples == len(x)
    assert (p.H in update.statistics) == (p.V in update.metrics) == traits(method).statistics
    assert (p.CENTROID_VALUES in update.statistics) == traits(method).centroids
    assert (p.CLASS_COUNTS in update.statistics) == traits(method).class_counts
    assert ("align-loss" in update.metrics) == traits(method).centroids
    if traits(method).centroids:
        assert update.metrics["align-loss"] > 0
    if p.CLASS_COUNTS in update.statistics:
        assert update.statistics[p.CLASS_COUNTS].tolist() == [8] * 5 + [0] * 5
    assert (p.BALANCED_WEIGHT in update.statistics) == traits(method).balanced_head
    assert (p.RHO in update.metrics) == traits(method).posteriors


def test_fedrep_body_epochs_keep_the_head_frozen_and_head_epochs_train_it():
    for head_epochs in (0, 3):
        model, x, y = _data()
        cfg = FedPACConfig(strategy="fedrep", fedrep_head_epochs=head_epochs, local_epochs=1, batch_size=8)
        head_before = [q.detach().clone() for q in model.head.parameters()]
        update = _local_update(model, x, y, Received(), cfg)
        changed = _changed(head_before, model.head)
        assert all(changed) if head_epochs else not any(changed)
        assert (update.metrics["head-loss"] > 0) == (head_epochs > 0)


def _arguments_of(monkeypatch, function: str, argument: str) -> list:
    """The ``argument`` keyword of every call a baseline's client part (FedRep's) makes to the
    training block ``<function>`` (``common.training``) from now on."""
    import common.methods.baselines.client as client

    seen = []
    original = getattr(client, function)

    def spy(*args, **kwargs):
        seen.append(kwargs.get(argument))
        return original(*args, **kwargs)

    monkeypatch.setattr(client, function, spy)
    return seen


def test_fedrep_trains_its_body_fedrep_body_epochs_epochs_not_local_epochs(monkeypatch):
    seen = _arguments_of(monkeypatch, "train_extractor", "epochs")
    model, x, y = _data()
    cfg = FedPACConfig(strategy="fedrep", fedrep_head_epochs=1, fedrep_body_epochs=2, local_epochs=5, batch_size=8)
    _local_update(model, x, y, Received(), cfg)
    assert seen == [2]
    assert FedPACConfig().fedrep_body_epochs == 1  # FedRep's own value
    with pytest.raises(ConfigError, match="'fedrep-body-epochs'.*>= 1"):
        parse_run_config({"fedrep-body-epochs": 0})


def test_fedrep_head_lr_sets_the_heads_step_and_defaults_to_the_baselines(monkeypatch):
    seen = _arguments_of(monkeypatch, "train_head", "lr")
    model, x, y = _data()
    for head_lr in (0.0, 0.1):
        cfg = FedPACConfig(strategy="fedrep", fedrep_head_epochs=1, fedrep_head_lr=head_lr, extractor_lr=0.02,
                           local_epochs=1, batch_size=8)
        _local_update(model, x, y, Received(), cfg)
    assert seen == [0.02, 0.1]
    assert parse_run_config({"fedrep-head-lr": 0.1}).fedrep_head_lr == 0.1
    with pytest.raises(ConfigError, match="'fedrep-head-lr'.*>= 0"):
        parse_run_config({"fedrep-head-lr": -0.1})


def _evaluate(strategy, state):
    """The real ClientApp's evaluation of ``state`` on partition 0 under ``strategy``."""
    grid = InProcessGrid(_config(strategy), 2)
    node = next(n for n, pid in grid.partition_of_node.items() if pid == 0)
    msg = Message(
        content=RecordDict({p.ARRAYS: p.pack({p.MODEL: {k: v.numpy() for k, v in state.items()}}),
                            p.CONFIG: ConfigRecord({p.SERVER_ROUND: 1})}),
        message_type=MessageType.EVALUATE, dst_node_id=node,
    )
    return client_app(msg, grid.contexts[node]).content[p.METRICS]


def test_fedavg_ft_fine_tunes_the_head_before_evaluating_and_is_deterministic():
    state = initial_model(parse_run_config(RUN_CONFIG)).state_dict()
    plain = _evaluate("fedavg", state)
    tuned = _evaluate("fedavg-ft", state)
    again = _evaluate("fedavg-ft", state)
    assert tuned["loss"] < plain["loss"]  # one epoch on the client's own labels helps at once
    assert tuned["loss"] == again["loss"] and tuned["accuracy"] == again["accuracy"]


def test_fedavg_ft_fine_tunes_at_the_baselines_step_size_not_fedpacs_head_step():
    """FedAvg-FT's fine-tuning is the authors' ``local_fine_tuning``: the classifier at the common
    step size eta (``extractor-lr``), whatever FedPAC's ``head-lr`` is."""
    model, x, y = _data()
    cfg = FedPACConfig(strategy="fedavg-ft", finetune_epochs=1, batch_size=8, extractor_lr=0.05, head_lr=0.5)
    by_routine = client_routine(METHODS["fedavg-ft"]).before_evaluation(model, LocalData(x, y, x, y), cfg,
                                                                         torch.Generator().manual_seed(4))
    by_hand = copy.deepcopy(model)
    train_head(by_hand, x, y, cfg, torch.Generator().manual_seed(4), epochs=1, lr=0.05)
    for key, value in by_hand.state_dict().items():
        torch.testing.assert_close(by_routine.state_dict()[key], value, rtol=0, atol=0)


def test_a_method_whose_parts_cannot_work_together_is_refused_saying_why():
    cases = [
        (dict(head=Rule.MIX, extractor=Rule.LOCAL), "head mix needs an averaged extractor"),
        (dict(extractor=Rule.LOCAL, alignment=Alignment.CENTROIDS), "feature alignment needs an averaged extractor"),
        (dict(alignment=Alignment.ANCHORS), "anchors come from, and only from, clustered heads"),
        (dict(head=Rule.CONFIDENCE, alignment=Alignment.CENTROIDS), "posteriors come with an averaged extractor"),
    ]
    for parts, reason in cases:
        with pytest.raises(ValueError, match=f"odd: {reason}"):
            Method("odd", **parts)


# ---------------------------------------------------------------------------- config, resume


def test_unknown_strategy_is_a_config_error_naming_the_key_and_the_choices():
    with pytest.raises(ConfigError) as err:
        parse_run_config({"strategy": "scaffold"})
    message = str(err.value)
    assert "'strategy'" in message and all(name in message for name in METHODS)
    with pytest.raises(ConfigError, match="'fedrep-head-epochs'.*>= 0"):
        parse_run_config({"fedrep-head-epochs": -1})
    with pytest.raises(ConfigError, match="'finetune-epochs'.*>= 0"):
        parse_run_config({"finetune-epochs": -1})
    assert FedPACConfig().strategy == "fedpac"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local", "fedavg"])
def test_a_baseline_resumes_to_the_same_final_model(name, tmp_path):
    base = _config(name, **{"num-server-rounds": 3, "fraction-train": 0.5})

    def run(extra, grid_seed, crash_at_round=None):
        config = {**base, **extra}
        grid = InProcessGrid(config, 4, seed=grid_seed, crash_at_round=crash_at_round)
        return run_fedpac(grid, parse_run_config(config), 1)

    full, _ = run({"output-dir": str(tmp_path / "full")}, 1)
    with pytest.raises(RuntimeError, match="simulated server crash"):
        run({"output-dir": str(tmp_path / "crashed")}, 2, crash_at_round=3)
    (crashed,) = (tmp_path / "crashed").iterdir()
    resumed, report = run({"output-dir": str(tmp_path / "resumed"), "resume-from": str(crashed)}, 3)
    assert [r.round for r in report.rounds] == [1, 2, 3]
    # the state's sections: Local-only keeps every extractor and head, FedAvg one of each
    assert sorted(resumed.state.shared) == sorted(full.state.shared)
    assert sorted(resumed.state.personal) == sorted(full.state.personal)
    for section, arrays in full.state.shared.items():  # the extractor (and FedAvg's head)
        for key, value in arrays.items():
            np.testing.assert_array_equal(resumed.state.shared[section][key], value)
    for section, parts in full.state.personal.items():  # Local-only's extractors and heads
        assert sorted(resumed.state.personal[section]) == sorted(parts)
        for pid, arrays in parts.items():
            for key, value in arrays.items():
                np.testing.assert_array_equal(resumed.state.personal[section][pid][key], value)
    # a checkpoint resumes only as the method that wrote it
    with pytest.raises(ConfigError, match="checkpoint is a '" + name):
        run({"strategy": "fedpac", "output-dir": str(tmp_path / "other"), "resume-from": str(crashed)}, 3)
