"""What every method's server part is: the state it keeps between rounds, what it sends each
client, what a client's reply must carry, and its step after a round. Pure numpy (and the
method's math): the Flower glue (``server_app.strategy``) calls it and names no method.

A method's package (``common/methods/<family>/``) holds its server part in ``server.py``, a
:class:`ServerPart` named ``Server``; :func:`server_part` finds it for any method. The state is a
:class:`ServerState`: arrays by section, one global entry or one per partition-id, so the glue
can checkpoint and save any method's state without knowing what it holds. What it adds to the
run's outputs (its columns, tables, charts and log) it declares as :attr:`ServerPart.outputs`
(``common.methods.outputs``).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.supercore import log

from common import protocol as p
from common.config import FedPACConfig
from common.methods import METHODS
from common.methods.base import Method, Rule
from common.methods.outputs import Outputs, RoundColumn, RoundData, reply_metric
from common.robust import aggregate, bound_rows, bound_updates
from common.validation import InvalidReply

# Sections of the state every method with a shared or a personal model part keeps.
EXTRACTOR = "extractor"
HEAD = "head"


@dataclass
class ServerState:
    """What the server keeps between rounds: ``shared[section]`` one set of arrays for the whole
    federation (the global extractor, FedAvg's head, the global centroids, ...), and
    ``personal[section][partition_id]`` one per client (personalized heads, Local-only's
    extractors, FedCCFA's anchors, pFedVEM's posterior scales). Keyed by partition-id: node ids
    change between runs."""

    shared: dict[str, p.NDArrays] = field(default_factory=dict)
    personal: dict[str, dict[int, p.NDArrays]] = field(default_factory=dict)

    def personal_part(self, section: str, partition_id: int | None, default: p.NDArrays) -> p.NDArrays:
        """A client's arrays of ``section``: ``default`` before it has any (or for no partition)."""
        if partition_id is None:
            return default
        return self.personal.get(section, {}).get(partition_id, default)

    def keep(self, section: str, partition_id: int, arrays: p.NDArrays) -> None:
        self.personal.setdefault(section, {})[partition_id] = arrays


@dataclass(frozen=True)
class Update:
    """One client's training reply, its model (the parts its method shares; a part kept at the
    site is empty here) and metrics checked by the glue, its
    ``statistics`` by shape and finiteness against :meth:`ServerPart.statistics_shapes`, and
    whatever the method derives from them in :meth:`ServerPart.check` (``parsed``)."""

    partition_id: int
    extractor: p.NDArrays
    head: p.NDArrays
    num_examples: int
    metrics: dict[str, float]
    statistics: p.NDArrays = field(default_factory=dict)
    parsed: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scaled:
    """A reply whose update of one model part was over its bound (:meth:`ServerPart.bound`) and
    was scaled down to it: the norm it had and the one it has now."""

    partition_id: int
    part: str
    norm: float
    bound: float


@dataclass
class StepResult:
    """What a round's server step says beyond the new state: what the round record keeps for the
    method (``server_app.report.RoundRecord.method``: alpha, clusters, the sample S_t, ...) by
    name, for its outputs (:attr:`ServerPart.outputs`) and metrics.json."""

    record: dict[str, Any] = field(default_factory=dict)


class ServerPart:
    """A method's server part; this base is FedAvg's and the other baselines': each part of the
    model is averaged over the replies by sample count (eq. 18) or kept per client
    (:class:`Rule`), and nothing but the model travels.

    ``outputs`` declares what the method adds to the run's outputs (``common.methods.outputs``):
    a class attribute, so that the report knows every registered method's columns without a run
    of it; the base adds nothing."""

    outputs: ClassVar[Outputs] = Outputs()
    # Personal sections that older checkpoints hold and the sites keep now (pFedVEM's posterior
    # scales): a run resumed from such a checkpoint drops them (the model's parts kept at the
    # site, ``Method.site_parts``, likewise).
    moved_to_sites: ClassVar[tuple[str, ...]] = ()

    def __init__(self, method: Method, cfg: FedPACConfig, extractor: p.NDArrays, head: p.NDArrays) -> None:
        self.method = method
        self.cfg = cfg
        self.extractor_template = extractor
        self.head_template = head
        self.initial_head = head  # what a client that never trained gets

    # ------------------------------------------------------------------ state

    def initial_state(self) -> ServerState:
        state = ServerState(shared={EXTRACTOR: dict(self.extractor_template)})
        if not self.personal_heads:
            state.shared[HEAD] = dict(self.initial_head)
        return state

    @property
    def personal_heads(self) -> bool:
        return self.method.head is not Rule.AVERAGE

    def summary(self) -> list[str]:
        """Lines for the log: how this method's server works."""
        return [f"Method {self.method.name}: extractor {self.method.extractor.value}, head {self.method.head.value}, "
                f"feature alignment {self.method.alignment.value}"]

    # ------------------------------------------------------------------ what travels

    def model_for(self, state: ServerState, partition_id: int | None) -> p.NDArrays:
        """The parts of the model a client gets (``Method.shared_parts``; a part kept at the site
        never travels): the global extractor and its personalized head (the global one when heads
        are averaged; the initial one before it first trains)."""
        model: p.NDArrays = {}
        if EXTRACTOR in self.method.shared_parts:
            model.update(state.shared[EXTRACTOR])
        if HEAD in self.method.shared_parts:
            model.update(state.personal_part(HEAD, partition_id, self.initial_head) if self.personal_heads
                         else state.shared[HEAD])
        return model

    def part_template(self, part: str) -> p.NDArrays:
        """The arrays of one model part (``extractor`` or ``head``) as the model has them."""
        return self.extractor_template if part == EXTRACTOR else self.head_template

    def reply_template(self) -> p.NDArrays:
        """The model arrays a training reply carries: those of the parts the method shares."""
        return {key: value for part in self.method.shared_parts for key, value in self.part_template(part).items()}

    def train_sections(self, state: ServerState, partition_id: int | None) -> tuple[p.Sections, dict[str, Any]]:
        """What a train message carries besides the model: sections and config entries."""
        del state, partition_id
        return {}, {}

    def statistics_shapes(self) -> dict[str, tuple[int, ...]]:
        """The arrays a training reply's ``statistics`` section holds, with their shapes (none:
        the reply has no such section)."""
        return {}

    def check(self, update: Update) -> Update:
        """The reply's method-specific checks (raise :class:`InvalidReply`); returns the update
        with what the step needs derived from its statistics (``parsed``)."""
        return update

    # ------------------------------------------------------------------ the round

    def bound(self, state: ServerState, updates: list[Update]) -> tuple[list[Update], list[Scaled]]:
        """The replies with each one's update of every model part it carries (``extractor``,
        ``head``: its arrays minus those :meth:`model_for` sent its partition this round) scaled
        down to at most ``max-norm-ratio`` times the median norm of the other replies' updates
        of that part (``common.robust.bound_updates``); and those that were.

        The glue calls it on every round's valid replies before :meth:`step`, whatever the
        method: every rule that combines the replies' parts (the average, FedPAC's mixes,
        FedCCFA's clusters, pFedVEM's confidence-weighted prior) then takes bounded updates. Each
        part is bounded on its own, the extractor's and the head's norms being of other scales.
        """
        ratio = self.cfg.max_norm_ratio
        if ratio <= 0 or len(updates) < 2:
            return updates, []
        sent = [self.model_for(state, u.partition_id) for u in updates]
        parts = {part: [getattr(u, part) for u in updates] for part in (EXTRACTOR, HEAD)}
        scaled = []
        for part in self.method.shared_parts:
            received = parts[part]
            origins = [{key: model[key] for key in mine} for mine, model in zip(received, sent)]
            bounded = bound_updates(received, origins, ratio)
            parts[part] = bounded.arrays  # the same objects where within the bound
            scaled += [Scaled(updates[i].partition_id, part, float(bounded.norms[i]), float(bounded.bounds[i]))
                       for i in bounded.scaled]
        if not scaled:
            return updates, []
        return [dataclasses.replace(u, extractor=extractor, head=head)
                for u, extractor, head in zip(updates, parts[EXTRACTOR], parts[HEAD])], scaled

    def average(self, parts: list[p.NDArrays], weights: np.ndarray) -> p.NDArrays:
        """One shared part (the extractor, an averaged head) of the replies, combined by
        ``shared-aggregation``: the sample-weighted mean (eq. 18), or the unweighted
        coordinate-wise median or trimmed mean (``common.robust``). Every method's server step
        averages its shared parts here."""
        return aggregate(parts, weights, self.cfg.shared_aggregation, self.cfg.trim_fraction)

    def class_means(self, updates: list[Update], server_round: int) -> np.ndarray:
        """The replies' class means (``parsed["centroids"]``: FedPAC's local centroids, FedCCFA's
        local anchors) as one (m, K, d) array, every row at most ``max-norm-ratio`` times the
        median norm of the other replies' rows of its class (among those holding the class).

        They are averaged into targets that every client's features are pulled to next round: a
        row of 1e30 would make every client's alignment loss, and so its training, diverge.
        """
        means = np.stack([u.parsed["centroids"] for u in updates])
        present = np.stack([u.parsed["class_counts"] for u in updates]) > 0
        bounded, factors = bound_rows(means, present, self.cfg.max_norm_ratio)
        over = sorted({updates[i].partition_id for i in np.flatnonzero((factors < 1.0).any(axis=1))})
        if over:
            log(WARNING, "Round %d: partitions %s report class means over max-norm-ratio = %g times the other "
                "replies' median norm of the class; scaled down to it", server_round, over, self.cfg.max_norm_ratio)
        return bounded

    def select(self, partitions: list[int], population: int, server_round: int, full: bool) -> list[int] | None:
        """The partitions that train this round, where the method draws them itself (pFedVEM's
        sample S_t); ``None``: the glue samples ``fraction-train`` of the nodes."""
        del partitions, population, server_round, full
        return None

    def trains_every_client(self, fraction_train: float) -> bool:
        """Whether every client trains every round (the condition of fused evaluation)."""
        return fraction_train >= 1.0

    def step(self, state: ServerState, updates: list[Update], weights: np.ndarray, server_round: int) -> StepResult:
        """The server step after a round with valid replies ``updates`` (in partition order) and
        their sample weights n_i (capped: ``common.averaging.capped_sample_weights``)."""
        del server_round
        for part, section in ((self.method.extractor, EXTRACTOR), (self.method.head, HEAD)):
            # the base knows two rules: a part kept at the site (LOCAL) never reaches the server
            if part is Rule.AVERAGE:
                state.shared[section] = self.average([getattr(u, section) for u in updates], weights)
        return StepResult()

    def closing_record(self, state: ServerState) -> dict[str, Any]:
        """What the round record keeps for the method, taken from the state when the record
        closes (after the round's evaluation; ``RoundRecord.method``)."""
        del state
        return {}

    # ------------------------------------------------------------------ saving

    def final_arrays(self, state: ServerState) -> p.NDArrays:
        """``final_state.npz``: the shared sections as ``<section>/<array>``, every client's as
        ``client-<pid>/<section>/<array>``."""
        arrays = {f"{section}/{key}": value for section, part in state.shared.items() for key, value in part.items()}
        for section, by_partition in state.personal.items():
            for pid, part in sorted(by_partition.items()):
                arrays.update({f"client-{pid}/{section}/{key}": value for key, value in part.items()})
        return arrays


def weighted_class_counts(updates: list[Update], weights: np.ndarray) -> np.ndarray:
    """The replies' class counts n_ik (``parsed["class_counts"]``), each client's scaled by its
    sample weight over its n_i: a client whose weight was capped counts for that much less in the
    class-count-weighted means too."""
    counts = np.stack([u.parsed["class_counts"] for u in updates])
    return counts * (weights / np.array([u.num_examples for u in updates], dtype=np.float64))[:, None]


def mean_local_accuracy(record: RoundData) -> object:
    """Unweighted mean of the accuracies the clients report for the model they trained this
    round, before the server's step (``p.LOCAL_ACCURACY``); "" where no reply has one."""
    local = [m[p.LOCAL_ACCURACY] for m in record.train.values() if p.LOCAL_ACCURACY in m]
    return float(np.mean(local)) if local else ""


# The outputs' columns of a method whose clients report that accuracy (pFedVEM, pFedHN)
LOCAL_ACCURACY_ROUND_COLUMN = RoundColumn("mean_local_accuracy", mean_local_accuracy, in_metrics=True)
LOCAL_ACCURACY_CLIENT_COLUMN = reply_metric("local_accuracy", p.LOCAL_ACCURACY)


def server_class(method: Method) -> type[ServerPart]:
    """The class of ``method``'s server part: ``Server`` in ``server.py`` next to its class's module."""
    server: type[ServerPart] = importlib.import_module(f"{type(method).__module__}.server").Server
    return server


def server_part(method: Method, cfg: FedPACConfig, extractor: p.NDArrays, head: p.NDArrays) -> ServerPart:
    """The server part of ``method``."""
    return server_class(method)(method, cfg, extractor, head)


def registered_outputs() -> list[Outputs]:
    """What every registered method (``common.methods.METHODS``) adds to the outputs, in the
    registry's order: the columns of the one schema every run's tables share."""
    return [server_class(method).outputs for method in METHODS.values()]


__all__ = ["EXTRACTOR", "HEAD", "LOCAL_ACCURACY_CLIENT_COLUMN", "LOCAL_ACCURACY_ROUND_COLUMN", "InvalidReply",
           "Scaled", "ServerPart", "ServerState", "StepResult", "Update", "registered_outputs", "server_class",
           "server_part", "weighted_class_counts"]
