"""pFedVEM's server step: every replying client's posterior mean kept (as the client's head; its
scales stay at the site, since no server step uses them), and over the round's sample S_t the
prior mean w averaged by confidence tau_j = 1 / rho_j^2 (eq. 7) and the base by sample count
(``common.methods.pfedvem.variational.aggregate_sample``)."""

from __future__ import annotations

import dataclasses
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.supercore import log

from common import protocol as p
from common.config import FedPACConfig
from common.methods.outputs import Chart, ClientColumn, Outputs, RoundColumn, RoundData, reply_metric
from common.methods.pfedvem import PFedVEM
from common.methods.pfedvem.charts import confidence_chart, has_confidences
from common.methods.pfedvem.variational import VEMProtocol, aggregate_sample, draw_sample, initial_global_head
from common.methods.server import (
    EXTRACTOR,
    HEAD,
    LOCAL_ACCURACY_CLIENT_COLUMN,
    LOCAL_ACCURACY_ROUND_COLUMN,
    ServerPart,
    ServerState,
    StepResult,
    Update,
    mean_local_accuracy,
)
from common.model import EMBEDDING_DIM
from common.validation import InvalidReply, fraction_metric, metric

# The section where checkpoints written before the sites kept their posterior scales held them.
SCALE = "scale"


def num_aggregated(record: RoundData) -> object:
    return len(record.method.get("aggregated", [])) if record.method.get("sampled") else ""


def aggregated(record: RoundData, partition_id: int) -> object:
    """1 when the client was in S_t and its reply entered the means, 0 when it trained but did not."""
    trained = record.train.get(partition_id)
    if not (record.method.get("sampled") and trained):
        return ""
    return int(partition_id in record.method.get("aggregated", []))


def _log(record: RoundData) -> str:
    local = mean_local_accuracy(record)
    line = f" | local models before aggregation {100 * local:.2f}%" if isinstance(local, float) else ""
    if record.method.get("sampled"):
        line += f" | aggregated {record.method.get('aggregated', [])} of S_t {record.method['sampled']}"
    return line


# What pFedVEM adds to the outputs: its own evaluation (the local models before aggregation) and
# the sample S_t per round, the clients' reply metrics, and the clients' confidences chart.
OUTPUTS = Outputs(
    round_columns=(LOCAL_ACCURACY_ROUND_COLUMN, RoundColumn("num_aggregated", num_aggregated)),
    client_columns=(reply_metric("head_loss", "head-loss"), LOCAL_ACCURACY_CLIENT_COLUMN,
                    reply_metric("rho", p.RHO), ClientColumn("aggregated", aggregated)),
    charts=(Chart("confidence.png", confidence_chart, has_confidences),),
    log=_log,
)


def initial_prior_head(cfg: FedPACConfig) -> p.NDArrays:
    """pFedVEM's w^0: W_bar, b_bar ~ N(0, 1) seeded by the run's seed (the code's ``torch.randn``,
    not nn.Linear's initialization), in nn.Linear's layout: the (d, K) draw is transposed."""
    weight, bias = initial_global_head(EMBEDDING_DIM, cfg.num_classes, torch.Generator().manual_seed(cfg.seed))
    return {p.HEAD_WEIGHT: weight.T.contiguous().numpy(), p.HEAD_BIAS: bias.numpy()}


class Server(ServerPart):
    """pFedVEM's server part: the base and the prior mean w (``shared``), every client's posterior
    (``personal``: its mean as ``head``; its scales stay at the site). A client that never
    trained has mu = w^0 (and, at its site, s = s^0)."""

    method: PFedVEM
    outputs = OUTPUTS
    moved_to_sites = (SCALE,)

    def __init__(self, method: PFedVEM, cfg: FedPACConfig, extractor: p.NDArrays, head: p.NDArrays) -> None:
        super().__init__(method, cfg, extractor, head)
        self.initial_head = initial_prior_head(cfg)  # every posterior starts at the prior mean w^0
        self.vem = VEMProtocol(cfg.vem_protocol, cfg.vem_sampling_rate, cfg.vem_initial_sigma)
        self.sample: list[int] = []  # S_t (partition-ids), drawn by select()

    @property
    def personal_heads(self) -> bool:
        return True

    def initial_state(self) -> ServerState:
        state = super().initial_state()
        state.shared[HEAD] = dict(self.initial_head)  # the prior mean w
        return state

    def summary(self) -> list[str]:
        return [*super().summary(), f"Protocol {self.vem.protocol}: "
                f"{'all clients' if self.vem.all_train else 'only the clients in S_t'} train every round; the "
                f"sample S_t (each client with probability {self.vem.sampling_rate:g}, at least 2, seeded by "
                f"(seed {self.cfg.seed}, round)) is aggregated"]

    def train_sections(self, state: ServerState, partition_id: int | None) -> tuple[p.Sections, dict[str, Any]]:
        """Beside the client's posterior mean (its head): the prior mean w."""
        del partition_id
        prior = state.shared[HEAD]
        return {p.POSTERIOR: {p.PRIOR_WEIGHT: prior[p.HEAD_WEIGHT], p.PRIOR_BIAS: prior[p.HEAD_BIAS]}}, {}

    def check(self, update: Update) -> Update:
        """rho with a finite, positive confidence 1/rho^2; the local model's accuracy in [0, 1]."""
        rho = metric(update.metrics, p.RHO)
        # tau = 1 / rho^2 weighs the client in the prior mean: rho = 0 would be an infinite weight,
        # a rho whose square overflows a zero one (and an all-zero sum of weights)
        squared = rho * rho
        if not (rho > 0 and squared > 0 and 0.0 < 1.0 / squared < float("inf")):
            raise InvalidReply(f"rho = {rho} must be a positive number with a finite, positive confidence 1/rho^2")
        fraction_metric(update.metrics, p.LOCAL_ACCURACY, "local accuracy")
        return dataclasses.replace(update, parsed={"rho": rho})

    def trains_every_client(self, fraction_train: float) -> bool:
        # with a sample S_t that alone trains, fraction-train = 1 no longer means everyone trains
        return fraction_train >= 1.0 and self.vem.all_train

    def select(self, partitions: list[int], population: int, server_round: int, full: bool) -> list[int] | None:
        """Draw S_t over the partitions 0..J-1 (J as the clients report it), so it depends on
        (seed, round) alone, not on node ids or on who happens to be connected; every client
        trains (``all-train``, or the last round with ``full-last-round``) or S_t's."""
        self.sample = draw_sample(population, self.vem.sampling_rate, self.cfg.seed, server_round)
        log(INFO, "round %d: sample S_t = partitions %s", server_round, self.sample)
        if self.vem.all_train or full:
            return partitions
        missing = set(self.sample) - set(partitions)
        if missing:
            log(WARNING, "round %d: partitions %s of S_t have no connected node", server_round, sorted(missing))
        return [pid for pid in partitions if pid in set(self.sample)]

    def step(self, state: ServerState, updates: list[Update], weights: np.ndarray, server_round: int) -> StepResult:
        sample = set(self.sample)
        weight_key, bias_key = p.HEAD_WEIGHT, p.HEAD_BIAS
        prior = state.shared[HEAD]
        result = aggregate_sample(
            [u.extractor for u in updates], [u.head[weight_key] for u in updates], [u.head[bias_key] for u in updates],
            [u.parsed["rho"] for u in updates], weights, [u.partition_id in sample for u in updates],
            state.shared[EXTRACTOR], (prior[weight_key], prior[bias_key]),
        )
        # the base over the replies aggregate_sample used, combined as every method's shared
        # parts are (with shared-aggregation = mean: the same sample-weighted mean it took)
        state.shared[EXTRACTOR] = (self.average([updates[i].extractor for i in result.used], weights[result.used])
                                   if result.used else result.extractor)
        for update in updates:  # the posterior persists: never reset to w
            state.keep(HEAD, update.partition_id, dict(update.head))
        state.shared[HEAD] = {weight_key: result.weight, bias_key: result.bias}
        aggregated = [updates[i].partition_id for i in result.used]
        log(INFO, "Round %d: base and global head aggregated over partitions %s of S_t %s",
            server_round, aggregated, sorted(sample))
        if not aggregated:
            log(WARNING, "Round %d: no valid reply from S_t; the base and the global head stay as they were, "
                "the replying clients' posteriors are kept", server_round)
        return StepResult(record={"sampled": sorted(sample), "aggregated": aggregated})
