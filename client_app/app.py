"""FedPAC ClientApp (and its baselines'): one local data partition, trained on the GPU when there is one."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import time
from logging import INFO
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from flwr.common.logger import log
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.supercore.utils import get_flwr_home

from common import protocol as p
from common.config import FedPACConfig, configured_method, parse_run_config, privacy_settings, sites_keep_state
from common.cpu import keep_freed_memory
from common.data import check_shape, load_client_directory, load_dataset, run_normalization, to_tensors
from common.drift import Drift, label_map
from common.methods.base import Method
from common.methods.client import (SITE_PARTS, ClientResult, LocalData, Received, SiteState, client_routine,
                                   only_parts, site_model_state)
from common.model import FedPACNet, initial_model, model_inputs, weights_digest
from common.privacy import Ledger, PrivacyBudgetSpent, PrivacySettings, calibrate, private_site
from common.site_privacy import (Entry, SiteLedger, SitePolicy, digest_arrays, noise_seed, parse_secret, privacy_folder,
                                 release_id, site_secret)
from common.site_state import SiteStore, check_lineage
from common.training import evaluate_head, extract_features
from common.training import evaluate as evaluate_model
from client_app.site_model import SiteModel, save_site_model


def sealed_replies(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Open a sealed message (``common.protocol.seal``: a deployed ServerApp sends its records
    as one object) and seal the reply to it the same way; other messages pass unchanged."""
    if not p.is_sealed(msg.content):
        return call_next(msg, context)
    msg.content = p.unseal(msg.content)
    reply = call_next(msg, context)
    if reply.has_content():
        reply.content = p.seal(reply.content)
    return reply


app = ClientApp(mods=[sealed_replies])


def select_device(requested: str) -> torch.device:
    """``auto`` picks CUDA when available; asking for ``cuda`` without one is an error."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run config device = 'cuda' but no CUDA device is available")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def partition_of(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config (set by simulation or --node-config)."""
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as err:
        raise RuntimeError(
            f"node config lacks {err}: start the SuperNode with "
            "--node-config 'partition-id=I num-partitions=N'"
        ) from err


def data_path_of(context: Context) -> str:
    """The node's own data directory (node config ``data-path``); empty for a dataset slice."""
    return str(context.node_config.get("data-path", ""))


@lru_cache(maxsize=64)
def client_tensors(
    cfg: FedPACConfig, partition_id: int, num_partitions: int, device: torch.device, data_path: str = ""
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test) on ``device``, built once per process and client, as
    the model reads them (``common.model.model_inputs``: the normalized images, or their
    scattering).

    A deployed SuperNode names its own data directory in ``data-path`` and trains on all of it;
    otherwise (simulation, demos) the client takes partition ``partition_id`` of the run's dataset.
    """
    if data_path:
        data = check_shape(load_client_directory(data_path, cfg.num_classes), cfg)
        train = data.train_images, data.train_labels
        test = data.test_images, data.test_labels
        mean, std = run_normalization(cfg)  # the run's, never this site's own statistics
    else:
        # Imported here: a deployed site never partitions, and the partitioning libraries
        # (Hugging Face datasets, flwr-datasets, and with them pandas, pyarrow, matplotlib and
        # scipy) would add 190 MB resident, 68 MB of it private, to its worker (docs/PERFORMANCE.md).
        from common.partition import client_split  # pylint: disable=import-outside-toplevel

        data = load_dataset(cfg)
        split = client_split(cfg, partition_id, num_partitions)
        train = data.train_images[split.train_indices], split.train_labels
        test = data.test_images[split.test_indices], split.test_labels
        mean, std = run_normalization(cfg, data)
    x, y = to_tensors(*train, mean, std, device)
    x_test, y_test = to_tensors(*test, mean, std, device)
    return model_inputs(x, cfg.extractor_front_end), y, model_inputs(x_test, cfg.extractor_front_end), y_test


@lru_cache(maxsize=4)
def full_test_tensors(cfg: FedPACConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset's whole test set on ``device``, for the generalized accuracy (once per process)."""
    data = load_dataset(cfg)
    x, y = to_tensors(data.test_images, data.test_labels, *run_normalization(cfg, data), device)
    return model_inputs(x, cfg.extractor_front_end), y


_FULL_TEST_FEATURES: dict[tuple[bytes, FedPACConfig, torch.device], torch.Tensor] = {}


def full_test_features(model: FedPACNet, cfg: FedPACConfig, device: torch.device) -> torch.Tensor:
    """f_theta of the whole test set under ``model``'s extractor, extracted once per extractor
    and process. In a round that measures the generalized accuracy every client received the
    same global extractor and only the heads differ, so the clients a simulation worker serves
    share one pass over the test set (it was a 10k-image forward pass per client: 11-17 s of a
    client's evaluation, 415 s of a 100-client round on 2 cores). One entry is kept: a new
    extractor (the next measuring round, Local-only's own models) replaces it."""
    key = (weights_digest(model.extractor), cfg, device)
    features = _FULL_TEST_FEATURES.get(key)
    if features is None:
        _FULL_TEST_FEATURES.clear()
        features = extract_features(model.extractor, full_test_tensors(cfg, device)[0])
        _FULL_TEST_FEATURES[key] = features
    return features


def current_concept(y: torch.Tensor, cfg: FedPACConfig, partition_id: int, server_round: int) -> torch.Tensor:
    """Labels in the client's concept of this round (``common.drift``): derived from the
    partition-id and the round alone, so a restarted node or a resumed run sees the same."""
    drift = Drift.from_config(cfg)
    if drift.pattern == "none":
        return y
    mapping = torch.as_tensor(label_map(partition_id, server_round, drift, cfg.num_classes), device=y.device)
    return mapping[y]


def generalized_due(cfg: FedPACConfig, server_round: int) -> bool:
    """Whether this round measures the generalized accuracy: every ``generalized-every`` rounds
    and at the last one, or, with ``generalized-every = 0``, at the last round of a run with
    drift only (every client on the whole test set: 20 s of a 20-client simulation on 2 cores,
    for a number a run without drift does not need)."""
    every = cfg.generalized_every
    if every:
        return server_round == cfg.num_server_rounds or server_round % every == 0
    return server_round == cfg.num_server_rounds and Drift.from_config(cfg).pattern != "none"


@lru_cache(maxsize=4)
def initial_state(cfg: FedPACConfig) -> p.NDArrays:
    """The run's round-0 model, as the server builds it: a site's start for the parts it keeps."""
    model = initial_model(cfg.image_channels, cfg.image_size, cfg.num_classes, cfg.seed, cfg.extractor_front_end)
    return {key: value.numpy() for key, value in model.state_dict().items()}


def _model_from(sections: p.Sections, kept: dict[str, p.NDArrays], method: Method, cfg: FedPACConfig,
                device: torch.device) -> FedPACNet:
    """The site's model: the parts its method shares as the server sent them, the others as the
    site kept them (``common.methods.client.site_model_state``)."""
    state = site_model_state(method, sections.get(p.MODEL, {}), kept.get(SITE_PARTS), lambda: initial_state(cfg))
    model = FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes, cfg.extractor_front_end)
    model.load_state_dict({key: torch.from_numpy(np.array(value)) for key, value in state.items()}, strict=True)
    return model.to(device)


def site_state_root(context: Context) -> Path:
    """Where a site keeps what it never sends: its node config's ``state-dir``, else under its
    ``model-dir`` (a deployed site's own folder), else under Flower's home on its machine (a
    simulation). Never a path the run config or the server names."""
    state_dir = str(context.node_config.get("state-dir", ""))
    if state_dir:
        return Path(state_dir)
    model_dir = str(context.node_config.get("model-dir", ""))
    return Path(model_dir) / "site-state" if model_dir else get_flwr_home() / "fedpac-site-state"


def site_store(msg: Message, context: Context, cfg: FedPACConfig) -> SiteStore | None:
    """The site's store for this run's lineage (``common.site_state``), when the site keeps
    anything between rounds (``common.config.sites_keep_state``)."""
    if not sites_keep_state(cfg):
        return None
    config = msg.content.config_records[p.CONFIG]
    if p.LINEAGE_RUNS not in config or p.LINEAGE_STARTS not in config:
        raise ValueError(f"the server sent no run lineage; the sites of this {cfg.strategy} run keep "
                         "state between rounds")
    lineage = check_lineage(list(config[p.LINEAGE_RUNS]), list(config[p.LINEAGE_STARTS]))  # type: ignore[arg-type]
    return SiteStore(site_state_root(context), partition_of(context)[0], lineage, owner=f"flower-run-{context.run_id}")


def server_round_of(msg: Message, cfg: FedPACConfig) -> int:
    """The run's absolute round number the server sent, one of the run's rounds: the run config
    (which the server cannot change once the run started) bounds it, so no message can push a
    site's kept rounds far ahead and make it drop the ones it trained."""
    value = msg.content.config_records[p.CONFIG][p.SERVER_ROUND]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"the server sent {p.SERVER_ROUND} = {value!r}, expected an integer")
    if not 1 <= value <= cfg.num_server_rounds:
        raise ValueError(f"the server sent {p.SERVER_ROUND} = {value}, not a round of this run "
                         f"(num-server-rounds = {cfg.num_server_rounds})")
    return value


def evaluate_round_of(msg: Message, server_round: int) -> int | None:
    """Fused evaluation: the earlier round whose model this train message carries, to be
    evaluated before training (``None``: the server did not ask)."""
    value = msg.content.config_records[p.CONFIG].get(p.EVALUATE_ROUND)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < server_round:
        raise ValueError(f"the server sent {p.EVALUATE_ROUND} = {value!r} in round {server_round}, "
                         "expected an earlier round")
    return value


def _setup(msg: Message, context: Context):
    keep_freed_memory()  # once per process: no page faults for every batch's tensors
    cfg = parse_run_config(context.run_config)
    partition_id, _ = partition_of(context)
    device = select_device(cfg.device)
    return cfg, partition_id, device, p.sections_of(msg.content)


def _seed(cfg: FedPACConfig, server_round: int, partition_id: int, purpose: int = 0) -> int:
    """A seed of (seed, round, partition-id), so a resumed run repeats what it seeds exactly;
    ``purpose`` separates streams (training 0, FedAvg-FT's fine-tuning 1). Never for a private
    release: the server knows all three (:func:`_private_update` draws from the site's secret)."""
    return cfg.seed * 1_000_003 + server_round * 1_009 + partition_id + purpose * 7_919_011


def _generator(cfg: FedPACConfig, server_round: int, partition_id: int, purpose: int = 0) -> torch.Generator:
    """Shuffling seeded by :func:`_seed`."""
    return torch.Generator().manual_seed(_seed(cfg, server_round, partition_id, purpose))


# What a site keeps of its differential privacy with a run's state (``common.site_state``): the
# factor its noise multipliers were calibrated with (dp-target-epsilon). Its secret and its
# ledger are its own, across runs (``common.site_privacy``).
PRIVACY, FACTOR = "privacy", "noise-factor"
# Run-config keys that shape only what the server does (sampling, timeouts, outputs) or that
# reach the site's computation only through the privacy settings in force: a release's identity
# leaves them out, so a resumed run (another resume-from and output-dir, more rounds) asks the
# same release again and gets it, bit for bit and free. Every other key is part of it.
SERVER_ONLY_KEYS = frozenset({
    "num_server_rounds", "fraction_train", "full_last_round", "min_available_clients", "min_train_replies",
    "max_failed_rounds", "max_samples_per_client", "max_weight_ratio", "fraction_evaluate", "fused_evaluation",
    "round_timeout", "partition_map", "dp_epsilon_budget", "dp_target_epsilon", "output_dir", "resume_from",
    "save_model_every", "generalized_every", "max_norm_ratio", "shared_aggregation", "trim_fraction",
    "checkpoints_kept",
})
# The run-config keys that decide which records a simulated site holds.
DATA_KEYS = ("dataset", "data_dir", "hf_repo", "num_classes", "image_size", "image_channels", "partition",
             "uniform_share", "samples_per_client", "test_samples_per_client", "dirichlet_alpha",
             "pathological_classes", "min_train_per_class", "min_test_per_class", "class_train_samples",
             "class_test_samples", "seed")


@dataclasses.dataclass(frozen=True)
class SitePrivacy:
    """A private site's secret, its ledger for the data it trains on and its own policy
    (``common.site_privacy``)."""

    secret: bytes
    ledger: SiteLedger
    policy: SitePolicy = SitePolicy()


def site_privacy(context: Context, cfg: FedPACConfig) -> SitePrivacy:
    """The site's secret (node config ``dp-noise-secret``, 64 hex digits, else the one kept in its
    folder, made from OS entropy the first time) and its ledger for this dataset: a deployed
    site's data-path, a simulated site's partition of the run's dataset."""
    partition_id, num_partitions = partition_of(context)
    folder = privacy_folder(site_state_root(context), partition_id)
    given = str(context.node_config.get("dp-noise-secret", ""))
    secret = parse_secret(given) if given else site_secret(folder)
    data_path = data_path_of(context)
    identity = (f"data-path:{Path(data_path).resolve()}" if data_path else
                repr([(key, getattr(cfg, key)) for key in DATA_KEYS] + [("partition", partition_id, num_partitions)]))
    dataset = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return SitePrivacy(secret, SiteLedger(folder / f"ledger-{dataset}.jsonl"),
                       SitePolicy.from_node_config(context.node_config))


def _release_of(cfg: FedPACConfig, settings: PrivacySettings, partition_id: int, received: Received,
                sections: p.Sections, kept: dict[str, p.NDArrays]) -> str:
    """The identity of the release a train message asks for (``common.site_privacy.release_id``):
    what the site received, what it kept, and the settings that shape its computation."""
    arrays = hashlib.sha256()
    digest_arrays(sections, arrays)
    digest_arrays(kept, arrays)
    config = {key: value for key, value in received.config.items()
              if key not in (p.LINEAGE_RUNS, p.LINEAGE_STARTS, p.EVALUATE_ROUND)}
    run = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in SERVER_ONLY_KEYS}
    return release_id(partition_id, received.server_round, [
        arrays.digest(), repr(sorted(config.items())).encode(), repr(sorted(run.items())).encode(),
        repr(dataclasses.replace(settings, epsilon_budget=0.0, target_epsilon=0.0, rounds=0)).encode()])


def _local_update_privately(  # pylint: disable=too-many-arguments
    method: Method, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
    settings: PrivacySettings, secret: bytes, release: str,
) -> tuple[ClientResult, Ledger]:
    """The method's local update with every release private, and what it released; its noise
    and its samples are drawn from the site's secret, keyed by the release."""
    with private_site(settings, noise_seed(secret, release, "noise")) as site:
        result = client_routine(method).local_update(
            model, data, received, cfg, torch.Generator().manual_seed(noise_seed(secret, release, "sampling")))
    return result, site.ledger


def _noise_factor(  # pylint: disable=too-many-arguments
    method: Method, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
    settings: PrivacySettings, partition_id: int, spent: Ledger, secret: bytes,
) -> float:
    """The factor on both noise multipliers with which the site's ledger, after the run's
    remaining rounds, reaches dp-target-epsilon: a trial of this round's local update on copies
    counts one round's releases (nothing of the trial leaves the site or stays; only n, which is
    public, shapes what it counts), and what the site spent before (other runs included) is
    spent."""
    trial = dataclasses.replace(data, state=SiteState(copy.deepcopy(data.state.kept)))
    _, released = _local_update_privately(method, copy.deepcopy(model), trial, received, cfg, settings, secret,
                                          "calibration-trial")
    rounds = max(1, settings.rounds - received.server_round + 1)
    factor = calibrate(released, rounds, settings.target_epsilon, settings.delta, spent, settings.accountant)
    log(INFO, "partition %d: noise multipliers %.4g (gradients) and %.4g (statistics) reach epsilon = %g at "
        "delta = %g in %d rounds", partition_id, settings.noise_multiplier * factor,
        settings.statistics_noise_multiplier * factor, settings.target_epsilon, settings.delta, rounds)
    return factor


def _private_update(  # pylint: disable=too-many-arguments,too-many-locals
    method: Method, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
    settings: PrivacySettings, partition_id: int, privacy: SitePrivacy, run: str, sections: p.Sections,
) -> ClientResult:
    """The method's local update with every release private (``common.privacy.private_site``),
    charged to the site's own ledger before anything of it leaves, and the site's epsilon (over
    everything it released from this data, every run) in its log and reply metrics.

    With a budget the site stops before its epsilon would pass it: when its last round's releases
    would take it over, without training; otherwise when this round's did, before anything of
    it leaves the site. Nothing is charged then, and the run goes on without the site. A request
    the site answered before, with the same inputs, gets the same release again (drawn from the
    same noise: nothing new), and is not charged twice.
    """
    server_round = received.server_round
    entries = privacy.ledger.entries()
    spent = privacy.ledger.spent(entries)
    kept = data.state.get(PRIVACY) or {}
    if settings.target_epsilon:
        factor = float(kept[FACTOR][0]) if FACTOR in kept else _noise_factor(
            method, model, data, received, cfg, settings, partition_id, spent, privacy.secret)
        kept = {**kept, FACTOR: np.array([factor])}
        settings = settings.scaled(factor)
    privacy.policy.check(settings)  # the noise in force, calibrated or not
    settings = dataclasses.replace(settings, epsilon_budget=privacy.policy.budget(settings.epsilon_budget))
    release = _release_of(cfg, settings, partition_id, received, sections, data.state.kept)
    repeat = privacy.ledger.find(release, entries) is not None
    if settings.epsilon_budget and entries and not repeat:
        _check_budget(spent, spent.then(entries[-1].released), settings, partition_id, server_round)
    result, released = _local_update_privately(method, model, data, received, cfg, settings, privacy.secret,
                                               release)
    entry = Entry(release, run, server_round, released)
    try:
        total = _charge(privacy, entry, settings, partition_id)
    except PrivacyBudgetSpent:  # the next round refuses without training
        privacy.ledger.append(dataclasses.replace(entry, refused=True))
        raise
    epsilon = settings.epsilon(total)
    budget = settings.epsilon_budget
    log(INFO, "partition %d, round %d: differential privacy epsilon = %.4g at delta = %g%s", partition_id,
        server_round, epsilon, settings.delta, f" (budget {budget:g})" if budget else "")
    data.state.put(PRIVACY, kept)
    return dataclasses.replace(result, metrics={**result.metrics, p.DP_EPSILON: epsilon})


def _check_budget(spent: Ledger, after: Ledger, settings: PrivacySettings, partition_id: int,
                  server_round: int) -> None:
    """Raise :class:`PrivacyBudgetSpent` when ``after`` passes the site's budget."""
    epsilon = settings.epsilon(after)
    if epsilon > settings.epsilon_budget:
        raise PrivacyBudgetSpent(
            f"partition {partition_id} stops training at round {server_round}: its epsilon would go from "
            f"{settings.epsilon(spent):.4g} to {epsilon:.4g} at delta = {settings.delta:g}, over its "
            f"budget dp-epsilon-budget = {settings.epsilon_budget:g}")


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run the method's local update and reply with the model and what the server step needs.

    With fused evaluation the message's model is also the previous round's personalized model:
    it is evaluated first, exactly as an evaluate message would, and the evaluation travels back
    in the reply's ``evaluation`` record.
    """
    started = time.perf_counter()
    cfg, partition_id, device, sections = _setup(msg, context)
    method = configured_method(cfg)
    server_round = server_round_of(msg, cfg)
    evaluate_round = evaluate_round_of(msg, server_round)
    store = site_store(msg, context, cfg)
    if store is not None:
        store.check_round(server_round)
    kept = store.load(server_round - 1) if store is not None else {}
    model = _model_from(sections, kept, method, cfg, device)
    evaluation = None
    if evaluate_round is not None:
        evaluation = _evaluation(model, cfg, context, evaluate_round, kept)
        started = time.perf_counter()
    data = _local_data(cfg, context, device, server_round, kept)
    received = Received(server_round=server_round, sections={k: v for k, v in sections.items() if k != p.MODEL},
                        config=dict(msg.content.config_records[p.CONFIG]))
    settings = privacy_settings(cfg)
    if settings is None:
        SitePolicy.from_node_config(context.node_config).check(None)  # a site that requires DP refuses
        result = client_routine(method).local_update(model, data, received, cfg,
                                                     _generator(cfg, server_round, partition_id))
    else:
        run = store.lineage[-1][0] if store is not None else ""
        result = _private_update(method, model, data, received, cfg, settings, partition_id,
                                 site_privacy(context, cfg), run, sections)

    metrics = MetricRecord({p.PARTITION_ID: partition_id, p.NUM_EXAMPLES: result.num_examples,
                            **_released_metrics(result, settings is not None, time.perf_counter() - started)})
    state = {key: value.detach().cpu().numpy() for key, value in model.state_dict().items()}
    if store is not None:
        store.save(server_round, {**data.state.kept, SITE_PARTS: only_parts(state, method.site_parts)})
    shared = only_parts(state, method.shared_parts)
    content = RecordDict({p.ARRAYS: p.pack({p.MODEL: shared, p.STATISTICS: result.statistics}),
                          p.METRICS: metrics})
    if evaluation is not None:
        content[p.EVALUATION] = evaluation
    return Message(content=content, reply_to=msg)


def _released_metrics(result: ClientResult, private: bool, seconds: float) -> dict[str, float]:
    """The training metrics a reply carries. Without DP: the losses, the method's metrics and
    the time. With DP, the losses and the time depend on the training records and are outside
    the ledger: they are withheld, and the reply carries only what the server step reads
    (``ClientResult.for_server``) and the site's epsilon."""
    if not private:
        return {p.TRAIN_LOSS: result.train_loss, **result.metrics, "train-seconds": seconds}
    return {key: result.metrics[key] for key in (*result.for_server, p.DP_EPSILON)}


def _local_data(cfg: FedPACConfig, context: Context, device: torch.device, server_round: int,
                kept: dict[str, p.NDArrays]) -> LocalData:
    """The client's data on ``device``, labels in its concept of ``server_round``, and what it
    kept at the site."""
    partition_id, num_partitions = partition_of(context)
    x, y, x_test, y_test = client_tensors(cfg, partition_id, num_partitions, device, data_path_of(context))
    return LocalData(x, current_concept(y, cfg, partition_id, server_round),
                     x_test, current_concept(y_test, cfg, partition_id, server_round), SiteState(kept))


def _keep_site_model(model: FedPACNet, cfg: FedPACConfig, context: Context, server_round: int,
                     accuracy: float) -> None:
    """A deployed site (node config ``model-dir``) keeps the model it just evaluated, its
    personalized model, after the last round and every ``save-model-every`` rounds. A site the
    last round's evaluation did not reach is sent that round's model after the loop, in an
    evaluate message like any other, so it saves it here too (``PersonalizedStrategy.deliver``).

    The model goes into the run's own folder, named by Flower's run id (never by anything a
    message says); only the last round's save makes it the site's current model, so that an
    unfinished run, or one still under way, never replaces the model the site works with."""
    model_dir = str(context.node_config.get("model-dir", ""))
    every = cfg.save_model_every
    last_round = server_round == cfg.num_server_rounds
    if model_dir and (last_round or (every and server_round % every == 0)):
        partition_id, _ = partition_of(context)
        mean, std = run_normalization(cfg, None if data_path_of(context) else load_dataset(cfg))
        folder = save_site_model(model_dir, model, SiteModel(
            method=cfg.strategy, run_id=context.run_id, round=server_round, partition_id=partition_id,
            accuracy=accuracy, num_classes=cfg.num_classes, image_size=cfg.image_size,
            image_channels=cfg.image_channels, mean=[float(v) for v in mean], std=[float(v) for v in std],
            front_end=cfg.extractor_front_end, branches=model.branches,
        ), run_complete=last_round)
        log(INFO, "partition %d, round %d: personalized model saved in %s%s", partition_id, server_round, folder,
            " (now the site's current model)" if last_round else "")


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Personalized accuracy of the model the server sent for this client (:func:`_evaluation`)."""
    cfg, _, device, sections = _setup(msg, context)
    method = configured_method(cfg)
    server_round = server_round_of(msg, cfg)
    store = site_store(msg, context, cfg)
    kept = store.load(server_round) if store is not None else {}
    metrics = _evaluation(_model_from(sections, kept, method, cfg, device), cfg, context, server_round, kept)
    return Message(content=RecordDict({p.METRICS: metrics}), reply_to=msg)


def _evaluation(model: FedPACNet, cfg: FedPACConfig, context: Context, server_round: int,
                kept: dict[str, p.NDArrays]) -> MetricRecord:
    """Personalized accuracy after ``server_round``: ``model`` on the client's own test split
    (``kept``: what the site kept after that round).

    ``model`` is the global extractor with the client's combined head (FedPAC), its own head
    (FedPer, FedRep, alignment-only), the global model (FedAvg), or its own model (Local-only).
    FedAvg-FT first fine-tunes the head of a copy on the local training data; nothing of that
    goes back. Labels are the client's concept of that round. In the rounds ``generalized_due``
    names, a client that trains on a slice of the run's dataset also reports the generalized
    accuracy: the whole test set relabelled with its concept (a deployed site with its own data
    folder has no such test set and reports none). A site whose node config says
    ``withhold-metrics`` evaluates and keeps its model all the same, and reports only that it did.
    """
    started = time.perf_counter()
    partition_id, _ = partition_of(context)
    device = next(model.parameters()).device
    data = _local_data(cfg, context, device, server_round, kept)
    model = _before_evaluation(model, data, cfg, context, server_round)
    loss, accuracy = evaluate_model(model, data.x_test, data.y_test)
    _keep_site_model(model, cfg, context, server_round, accuracy)
    if SitePolicy.from_node_config(context.node_config).withhold_metrics:
        return MetricRecord({p.PARTITION_ID: partition_id, p.NUM_EXAMPLES: len(data.y_test), p.METRICS_WITHHELD: 1})
    metrics = MetricRecord(
        {
            p.PARTITION_ID: partition_id,
            p.NUM_EXAMPLES: len(data.y_test),
            "accuracy": accuracy,
            "loss": loss,
        }
    )
    if generalized_due(cfg, server_round) and not data_path_of(context):
        y_all = full_test_tensors(cfg, device)[1]
        _, metrics[p.GENERALIZED_ACCURACY] = evaluate_head(
            model.head, full_test_features(model, cfg, device), current_concept(y_all, cfg, partition_id, server_round))
    metrics[p.EVAL_SECONDS] = time.perf_counter() - started
    return metrics


def _before_evaluation(model: FedPACNet, data: LocalData, cfg: FedPACConfig, context: Context,
                       server_round: int) -> FedPACNet:
    """The method's preparation of the model it evaluates (FedAvg-FT's and FedBABU's fine-tuning
    of a copy). Its result reaches the server through the accuracy the site reports, and stays
    as the site's model: with DP on, the fine-tuning is DP-SGD drawn from the site's secret, and
    charged to the site's ledger like any release (refused past its budget)."""
    partition_id, _ = partition_of(context)
    routine = client_routine(configured_method(cfg))
    settings = privacy_settings(cfg)
    if settings is None:
        return routine.before_evaluation(model, data, cfg, _generator(cfg, server_round, partition_id, purpose=1))
    privacy = site_privacy(context, cfg)
    factor = (data.state.get(PRIVACY) or {}).get(FACTOR)
    if factor is not None:
        settings = settings.scaled(float(factor[0]))
    privacy.policy.check(settings)
    settings = dataclasses.replace(settings, epsilon_budget=privacy.policy.budget(settings.epsilon_budget))
    evaluated = {"evaluated-model": {key: value.detach().cpu().numpy() for key, value in model.state_dict().items()}}
    release = _release_of(cfg, settings, partition_id, Received(server_round=server_round,
                                                                config={"before-evaluation": 1}),
                          evaluated, data.state.kept)
    with private_site(settings, noise_seed(privacy.secret, release, "noise")) as site:
        model = routine.before_evaluation(
            model, data, cfg, torch.Generator().manual_seed(noise_seed(privacy.secret, release, "sampling")))
    if site.ledger.history:
        _charge(privacy, Entry(release, "", server_round, site.ledger), settings, partition_id)
    return model


def _charge(privacy: SitePrivacy, entry: Entry, settings: PrivacySettings, partition_id: int) -> Ledger:
    """Charge ``entry``'s release to the site's ledger before it leaves (once: a release the
    site made before is the same bits again), or raise :class:`PrivacyBudgetSpent` when it
    would take the site past its budget; returns everything spent after it."""
    entries = privacy.ledger.entries()
    spent = privacy.ledger.spent(entries)
    if privacy.ledger.find(entry.release, entries) is not None:
        return spent
    total = spent.then(entry.released)
    if settings.epsilon_budget:
        _check_budget(spent, total, settings, partition_id, entry.round)
    privacy.ledger.append(entry)
    return total


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Pre-flight: load this client's data and report its partition and sizes.

    The server asks every node this before round 1, so a bad data path, too few samples or a
    missing partition-id stops the run with the client's own message before any training.
    """
    cfg = parse_run_config(context.run_config)
    partition_id, num_partitions = partition_of(context)
    x, y, x_test, _ = client_tensors(
        cfg, partition_id, num_partitions, select_device(cfg.device), data_path_of(context)
    )
    metrics = MetricRecord(
        {
            p.PARTITION_ID: partition_id,
            "num-partitions": num_partitions,
            p.NUM_EXAMPLES: len(y),
            "test-examples": len(x_test),
        }
    )
    return Message(content=RecordDict({p.METRICS: metrics}), reply_to=msg)
