"""The FedPAC Strategy on Flower's Message API, and through it the paper's baselines.

Per round: every selected node gets its own message (global extractor, global centroids, and
*its* personalized head); ``aggregate_train`` averages extractors by samples (eq. 18),
centroids by class counts (eq. 19), solves each replying client's collaboration QP and stores
the mixed heads by partition-id; ``configure_evaluate`` sends every node its new head.
After the last round, :meth:`FedPAC.deliver` sends the final model to every bound site that no
evaluation of that round reached, so every site ends the run with its personalized model.

The baselines and ablations (``common.methods``) run through the same class: a method only
says what happens to each model part (averaged, mixed, or kept per client by partition-id)
and whether centroids travel, so sampling, discovery, reply validation, the partition-id
bookkeeping and checkpoints are shared. A method that keeps posteriors (pFedVEM) has every
client's posterior kept here by partition-id, sent down with the prior mean and returned
trained; a method that aggregates a sample has the server draw the round's S_t itself. The math
lives in ``common.aggregation``, ``common.collaboration`` and ``common.variational``; this file
is the glue.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from common import protocol as p
from common.aggregation import Clustering, RoundAggregate, aggregate_round
from common.averaging import capped_sample_weights
from common.methods import FEDPAC, Alignment, Method, Rule
from common.simplex_qp import FAR_DIAGONAL
from common.sites import Identity, SiteRegistry, fingerprint
from common.variational import VEMProtocol, draw_sample, softplus_inverse
from server_app.replies import (
    ClientEvaluation,
    ClientInfo,
    ClientUpdate,
    InvalidReply,
    destinations,
    node_unavailable,
    parse_evaluate_reply,
    parse_query_reply,
    parse_train_reply,
    reply_source,
)
from server_app.checkpoint import Checkpoint
from server_app.report import FinalDelivery, RoundRecord


# Seconds before the pre-flight asks a silent node again (a first message may import torch and
# load a dataset: minutes on a crowded host, but not ten).
DISCOVERY_ATTEMPT = 120.0


# Seconds between two looks for a site that the final delivery has not reached (offline).
DELIVERY_POLL = 1.0


# The anchors key of the one global anchor set (``clustered-anchors = false``): not a partition-id.
GLOBAL_ANCHORS = -1


class FederationStalled(RuntimeError):
    """Too many rounds in a row without enough valid replies: the run stops."""


def _stacked(values: list) -> np.ndarray | None:
    """One array over the round's replies, or None for a statistic the method does not use
    (reply validation guarantees it is then absent from every reply)."""
    return None if values[0] is None else np.stack(values)



def _most_common(values: list[int]) -> int:
    """The value most of ``values`` share (the larger one on a tie, so the choice does not
    depend on the order replies arrived in)."""
    return max(set(values), key=lambda v: (values.count(v), v))


class FedPAC(Strategy):  # pylint: disable=too-many-instance-attributes
    """FedPAC: feature alignment + classifier collaboration (Xu et al., ICLR 2023).

    Parameters
    ----------
    initial_head : dict[str, np.ndarray]
        The initial classifier head: what a client that never trained gets.
    method : Method
        FedPAC (default) or one of its baselines/ablations from ``common.methods.METHODS``.
    num_rounds : int
        Total rounds, so that the last one can include every client.
    fraction_train, fraction_evaluate : float
        Fraction of connected nodes sampled for training / evaluation.
    fused_evaluation : bool
        When every node trains and is evaluated every round (both fractions 1), evaluate a
        round's model at the start of the next round's train message instead of with an
        evaluate message of its own: the model and the numbers are the same, a round is one
        message per node. The last round is evaluated by its own message. Ignored with sampling.
    full_last_round : bool
        Train every connected node in the last round (the paper's protocol).
    min_available_nodes : int
        Wait until at least this many nodes are connected before sampling.
    alpha_threshold : float
        Combination weights below this are zeroed (then rows renormalized).
    min_train_replies : int
        A round aggregates only with at least this many valid training replies; otherwise the
        global state stays as it is and the next round tries again.
    max_failed_rounds : int
        How many such rounds in a row are tolerated: the next one stops the run with a clear
        message (0: the first one does).
    qp_solver : str
        ``vectorized`` (all clients' QPs at once, cvxpy for rows it cannot certify) or
        ``cvxpy`` (one cvxpy solve per client, the reference).
    max_samples_per_client : int
        Replies claiming more training samples are rejected (0: no bound).
    max_weight_ratio : float
        A client's aggregation weight is at most this times the round's median (0: no cap).
    clustering : Clustering
        Clustered heads only (FedCCFA): the DBSCAN radius, member weights and anchor mode.
    vem : VEMProtocol
        Methods that aggregate a sample (pFedVEM) only: who trains (every client or S_t), the
        sampling rate r of S_t, and the scale every client's posterior starts from.
    seed : int
        Seeds node sampling and the sample S_t.
    sites : SiteRegistry, optional
        Who may serve which partition (``common.sites``); by default every node's own claim
        is believed, as in the simulation.
    on_round_end : callable, optional
        Called with each finished round's :class:`RoundRecord` (used to write outputs).
    """

    def __init__(  # pylint: disable=too-many-arguments
        self,
        *,
        initial_head: p.NDArrays,
        num_rounds: int,
        method: Method = FEDPAC,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        fused_evaluation: bool = False,
        full_last_round: bool = True,
        min_available_nodes: int = 2,
        alpha_threshold: float = 1e-3,
        qp_solver: str = "vectorized",
        min_train_replies: int = 1,
        max_failed_rounds: int = 3,
        max_samples_per_client: int = 0,
        max_weight_ratio: float = 10.0,
        clustering: Clustering | None = None,
        vem: VEMProtocol | None = None,
        seed: int = 0,
        sites: SiteRegistry | None = None,
        on_round_end: Callable[[RoundRecord], None] | None = None,
    ) -> None:
        self.initial_head = initial_head
        self.method = method
        self.num_rounds = num_rounds
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.vem = vem or VEMProtocol()
        # with a sample S_t that alone trains, fraction-train = 1 no longer means everyone trains
        self.trains_every_client = fraction_train >= 1.0 and not (
            method.aggregates_a_sample and not self.vem.all_train)
        self.fused_evaluation = fused_evaluation and self.trains_every_client and fraction_evaluate >= 1.0
        self.fused_evaluation_requested = fused_evaluation
        self.full_last_round = full_last_round
        self.min_available_nodes = min_available_nodes
        self.alpha_threshold = alpha_threshold
        self.qp_solver = qp_solver
        self.min_train_replies = min_train_replies
        self.max_failed_rounds = max_failed_rounds
        self.failed_rounds = 0  # consecutive rounds without enough valid replies
        self.clustering = clustering or Clustering()
        self.max_samples_per_client = max_samples_per_client
        self.max_weight_ratio = max_weight_ratio
        self.seed = seed
        self.on_round_end = on_round_end
        # State, every per-client entry keyed by partition-id (node ids change between runs).
        self.heads: dict[int, p.NDArrays] = {}  # personal heads (mixed or local)
        self.global_head: p.NDArrays = dict(initial_head)  # the one head when heads are averaged
        self.local_extractors: dict[int, p.NDArrays] = {}  # when extractors are not shared
        # Posteriors (pFedVEM): the mean is the client's entry in ``heads`` (its head in the
        # model), the pre-softplus scales s are here under the head's keys; ``global_head`` is the
        # prior mean w. A client that never trained has mu = w^0 (``initial_head``) and s = s^0.
        self.posterior_scales: dict[int, p.NDArrays] = {}
        initial_s = softplus_inverse(self.vem.initial_sigma)
        self.initial_scale = {key: np.full_like(value, initial_s) for key, value in initial_head.items()}
        self.aggregation_sample: list[int] | None = None  # S_t (partition-ids), drawn by configure_train
        num_classes, dim = initial_head[p.HEAD_WEIGHT].shape
        self.centroids = np.zeros((num_classes, dim), dtype=np.float32)
        self.centroid_mask = np.zeros(num_classes, dtype=bool)
        # Per-client alignment targets (FedCCFA's cluster anchors): (K, d) values, (K,) mask.
        self.anchors: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.sites = sites or SiteRegistry(trusted_claims=True)
        self.num_partitions: int | None = None  # as the clients report it at discovery
        self.discovery_timeout: float | None = None  # set once discover() has run
        self.extractor_template: p.NDArrays | None = None
        self.extractor: p.NDArrays | None = None  # the latest aggregated extractor
        # Rounds finished before this strategy started (a resumed run): Flower's loop counts
        # from 1, sampling and seeds use the run's absolute round number.
        self.round_offset = 0
        self._record: RoundRecord | None = None
        # Fused evaluation: the last round, trained and aggregated, whose evaluation comes back
        # with the next round's training replies.
        self._pending: RoundRecord | None = None
        # Payload bytes per node this round, both phases (train + evaluate).
        self._bytes_sent: dict[int, int] = {}
        # The last messages configured, whose replies come next: an error the SuperLink writes in
        # an offline node's place is attributed through them.
        self._sent: list[Message] = []
        self._bytes_received: dict[int, int] = {}
        # The last round's valid evaluations, by partition-id: those sites evaluated, and so saved,
        # the final model; the final delivery skips them.
        self.final_accuracy: dict[int, float] = {}

    @property
    def node_partition(self) -> dict[int, int]:
        """The nodes bound to a partition, and their partition-ids."""
        return self.sites.node_partition

    def summary(self) -> None:
        """Log the strategy's configuration."""
        method = self.method
        log(INFO, "\t├──> Sites: partitions bound by %s", self.sites.describe())
        log(INFO, "\t├──> Method %s: extractor %s, head %s, feature alignment %s", method.name,
            method.extractor.value, method.head.value, method.alignment.value)
        log(INFO, "\t├──> Sampling: fraction train %.2f (every client in the last round: %s), "
            "fraction evaluate %.2f, at least %d nodes", self.fraction_train, self.full_last_round,
            self.fraction_evaluate, self.min_available_nodes)
        if self.fused_evaluation:
            log(INFO, "\t├──> Evaluation: each round's model is evaluated by the next round's train "
                "message (fused), the last round's by an evaluate message")
        elif self.fused_evaluation_requested:
            log(INFO, "\t├──> Evaluation: an evaluate message per round (fused evaluation needs "
                "fraction-train = fraction-evaluate = 1)")
        if method.head is Rule.MIX:
            log(INFO, "\t└──> Collaboration: %s QP solver, weights below %g dropped",
                self.qp_solver, self.alpha_threshold)
        if method.aggregates_a_sample:
            log(INFO, "\t└──> Protocol %s: %s train every round; the sample S_t (each client with "
                "probability %g, at least 2, seeded by (seed %d, round)) is aggregated", self.vem.protocol,
                "all clients" if self.vem.all_train else "only the clients in S_t", self.vem.sampling_rate,
                self.seed)
        if method.head is Rule.CLUSTER:
            log(INFO, "\t└──> Class-level clustering: MADD radius %g, %s member weights, %s anchors",
                self.clustering.eps, self.clustering.weights,
                "clustered" if self.clustering.clustered_anchors else "global")

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue from a checkpoint: its heads, extractors, centroids, posteriors and round count."""
        self.heads = {pid: dict(head) for pid, head in checkpoint.heads.items()}
        if checkpoint.global_head is not None:
            self.global_head = dict(checkpoint.global_head)
        self.local_extractors = {pid: dict(ex) for pid, ex in checkpoint.client_extractors.items()}
        self.posterior_scales = {pid: dict(scale) for pid, scale in checkpoint.posterior_scales.items()}
        self.centroids = checkpoint.centroids.astype(np.float32)
        self.centroid_mask = checkpoint.centroid_mask.astype(bool)
        self.anchors = {pid: (values.astype(np.float32), mask.astype(bool))
                        for pid, (values, mask) in checkpoint.anchors.items()}
        self.extractor = dict(checkpoint.extractor)
        self.round_offset = checkpoint.completed_rounds

    # ------------------------------------------------------------------ sampling / messages

    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes that are not refused, once ``min_available_nodes`` of them are.

        A node that died may never come back: after one round timeout the round goes on with
        the nodes that are there, and its minimum of replies decides whether it counts.
        """
        started = time.monotonic()
        patience = self.discovery_timeout if self.discovery_timeout is not None else float("inf")
        while len(nodes := self._candidates(grid)) < self.min_available_nodes:
            waited = time.monotonic() - started
            if waited >= patience:
                log(WARNING, "only %d of the %d required nodes connected after %.0fs: going on with them",
                    len(nodes), self.min_available_nodes, waited)
                break
            if int(waited) % 10 == 0:
                log(INFO, "Waiting for nodes: %d connected, %d required", len(nodes), self.min_available_nodes)
            time.sleep(1)
        # Ordered by partition-id where known: node ids are random per run, partition-ids are
        # not, so the same seed samples the same clients in every run (and after a resume).
        return sorted(nodes, key=lambda n: (n not in self.node_partition, self.node_partition.get(n, 0), n))

    def _candidates(self, grid: Grid) -> list[int]:
        """The connected nodes, less those refused for the whole run."""
        refused = self.sites.refused
        return [n for n in grid.get_node_ids() if n not in refused or not refused[n].final]

    def _bound_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes bound to a partition (the only ones ever sent a model), in
        partition order."""
        return [n for n in self._wait_for_nodes(grid) if n in self.node_partition]

    def _identities(self, grid: Grid) -> dict[int, Identity]:
        """What the SuperLink vouches for about each connected node (nothing when claims are
        believed: the simulation's nodes have neither names nor keys)."""
        if self.sites.trusted_claims:
            return {}
        return {node.node_id: Identity(node.name, fingerprint(node.public_key)) for node in grid.get_nodes()}

    def _refuse(self, node_id: int, reason: str) -> None:
        log(WARNING, "Refused node %d: %s. It is sent nothing.", node_id, reason)

    def discover(self, grid: Grid, timeout: float, strict: bool = True) -> dict[int, int]:
        """Bind connected nodes of unknown partition to one: screen each by its registered
        identity (``common.sites``), then ask the others for their partition (a query message).

        Before round 1 (``strict``): every node is screened and asked, and a client that cannot
        load its data becomes a clear error before any training; a node that is refused (its
        identity serves no partition, or another than it claims) is logged and left out, and
        the pre-flight waits for ``min_available_nodes`` nodes that are not refused. During
        the run: a node that joined late or restarted is bound before it is sent anything, so
        it gets its own personalized head back; problems are only logged.
        """
        self.discovery_timeout = timeout
        while True:
            screened, identities, refused = self._screen(grid)
            nodes = [n for n in screened if n not in self.node_partition]
            if not nodes:
                if strict and refused:  # the refused counted towards min_available_nodes
                    continue
                return dict(self.node_partition)
            replies, gone = self._query(grid, nodes, timeout)
            problems, refused_answers = self._bind_answers(grid, replies, identities, strict)
            refused = refused or refused_answers
            for node in gone:  # not a client problem: the federation goes on with the nodes it has
                log(WARNING, "discovery: node %d went offline before it answered; left out", node)
            missing = len(nodes) - len(replies) - len(gone)
            if missing:
                problems.append(f"{missing} node(s) did not answer within {timeout:.0f}s")
            if problems and strict:
                raise RuntimeError("clients are not ready to train:\n  " + "\n  ".join(problems))
            for problem in problems:
                log(WARNING, "discovery: %s", problem)
            # a refused node counted towards min_available_nodes: wait for the ones that remain
            if not (strict and refused):
                return dict(self.node_partition)

    def _screen(self, grid: Grid) -> tuple[list[int], dict[int, Identity], bool]:
        """The connected nodes whose identity may serve a partition, the identities read, and
        whether a node was refused: the others are refused here, before they are sent anything
        at all (the query included)."""
        nodes = self._wait_for_nodes(grid)
        identities = self._identities(grid)
        kept, refused = [], False
        for node in nodes:
            if node not in self.node_partition and not self.sites.trusted_claims:
                if node not in identities:  # connected after the list was read: next time
                    continue
                refusal = self.sites.screen(node, identities[node], self.num_partitions)
                if refusal is not None:
                    self._refuse(node, refusal.reason)
                    refused = True
                    continue
            kept.append(node)
        return kept, identities, refused

    def _bind_answers(self, grid: Grid, replies: list[tuple[int, Message]], identities: dict[int, Identity],
                      strict: bool) -> tuple[list[str], bool]:
        """Bind each answering node to the partition it claims, where its identity (as
        :meth:`_screen` read it) agrees; returns the problems (misconfigured clients) and
        whether a node was refused."""
        problems: list[str] = []
        answers: list[tuple[int, ClientInfo]] = []
        for node, reply in replies:
            try:
                answers.append((node, parse_query_reply(reply, self.max_samples_per_client)))
            except InvalidReply as err:
                problems.append(f"node {node}: {err}")
        if self.num_partitions is None and answers:
            # Every node partitions the same dataset into the same J parts; the most common
            # answer among the nodes whose identity backs their claim is the federation's, a
            # node that disagrees is misconfigured.
            backed = [info.num_partitions for node, info in answers
                      if self.sites.backs(identities.get(node), info.partition_id)]
            if backed:
                self.num_partitions = _most_common(backed)
        connected = set(grid.get_node_ids())
        refused = False
        for node, info in sorted(answers):
            identity = identities.get(node, Identity())  # every asked node's, unless claims are believed
            # screened again: the federation's size may only now be known. Who a node is comes
            # first: an answer its identity does not back is refused, and nothing else in it
            # (its num-partitions) can stop the pre-flight
            refusal = self.sites.screen(node, identity, self.num_partitions)
            if refusal is None and self.sites.backs(identity, info.partition_id):
                if info.num_partitions != self.num_partitions:
                    problems.append(f"node {node}: num-partitions {info.num_partitions}, the federation's "
                                    f"is {self.num_partitions}")
                    continue
            refusal = refusal or self.sites.bind(node, info.partition_id, identity, connected)
            if refusal is not None:
                if self.sites.trusted_claims and strict:  # no identity to tell who is right: stop
                    problems.append(f"node {node}: {refusal.reason}")
                else:
                    self._refuse(node, refusal.reason)
                refused = True
                continue
            log(INFO, "node %d: partition %d/%d, %d training and %d test samples", node, info.partition_id,
                info.num_partitions, info.num_examples, info.test_examples)
        return problems, refused

    @staticmethod
    def _query(grid: Grid, nodes: list[int], timeout: float) -> tuple[list[tuple[int, Message]], list[int]]:
        """(node, query reply) of ``nodes`` within ``timeout`` seconds, and the nodes that went
        offline before answering. A node that has not answered is asked again every
        DISCOVERY_ATTEMPT seconds (a SuperNode whose pull of the message failed, on an
        overloaded SuperLink, drops it and would otherwise be waited for until the timeout);
        one the SuperLink reported offline is asked again as soon as it is back (a restarted
        SuperNode), and left out if it is not connected when asked."""
        deadline = time.monotonic() + timeout
        replies: list[tuple[int, Message]] = []
        pending, gone = list(nodes), []
        while pending:
            messages = [Message(content=RecordDict({p.CONFIG: ConfigRecord({p.SERVER_ROUND: 0})}),
                                message_type=MessageType.QUERY, dst_node_id=node) for node in pending]
            attempt_started = time.monotonic()
            wait = min(DISCOVERY_ATTEMPT, deadline - attempt_started)
            arrived = list(grid.send_and_receive(messages, timeout=wait))
            sent = destinations(messages)
            offline = {reply_source(reply, sent) for reply in arrived if node_unavailable(reply)}
            replies.extend((reply_source(reply, sent), reply) for reply in arrived if not node_unavailable(reply))
            answered = {node for node, _ in replies}
            pending = [node for node in pending if node not in answered]
            if not pending or time.monotonic() >= deadline:
                break
            # A push the SuperLink refuses returns at once: never ask faster than once an attempt,
            # unless every node still to answer was offline and is connected again.
            while (remaining := wait - (time.monotonic() - attempt_started)) > 0:
                if set(pending) <= offline and offline <= set(grid.get_node_ids()):
                    break
                time.sleep(min(1.0, remaining))
            connected = set(grid.get_node_ids())
            gone += [node for node in pending if node not in connected]
            pending = [node for node in pending if node in connected]
            if pending:
                log(WARNING, "discovery: %d node(s) did not answer within %.0fs; asking them again",
                    len(pending), wait)
        return replies, gone

    def _sample(self, grid: Grid, fraction: float, server_round: int, full: bool) -> list[int]:
        nodes = self._bound_nodes(grid)
        if full or not nodes:  # no node at all: a round without replies, counted as failed
            return nodes
        size = max(1, int(round(fraction * len(nodes))))
        rng = np.random.default_rng([self.seed, server_round])
        # Choose positions, not ids: node ids are uint64 and numpy would turn them into floats.
        return [nodes[i] for i in sorted(rng.choice(len(nodes), size=size, replace=False))]

    def _sample_for_aggregation(self, grid: Grid, server_round: int, full: bool) -> list[int]:
        """Draw S_t (partition-ids) for ``aggregate_train``; return the nodes that train: every
        connected node (``all-train``, or the last round with ``full-last-round``) or S_t's.

        S_t is drawn over the partitions 0..J-1 (J as the clients report it), so it depends on
        (seed, round) alone, not on node ids or on who happens to be connected.
        """
        nodes = self._bound_nodes(grid)
        population = self.num_partitions if self.num_partitions is not None else len(nodes)
        self.aggregation_sample = draw_sample(population, self.vem.sampling_rate, self.seed, server_round)
        log(INFO, "round %d: sample S_t = partitions %s", server_round, self.aggregation_sample)
        if self.vem.all_train or full:
            return nodes
        sample = set(self.aggregation_sample)
        chosen = [n for n in nodes if self.node_partition.get(n) in sample]
        missing = sample - {self.node_partition[n] for n in chosen}
        if missing:
            log(WARNING, "round %d: partitions %s of S_t have no connected node", server_round, sorted(missing))
        return chosen

    def head_of(self, node_id: int) -> p.NDArrays:
        """The head for the client on ``node_id``: its personalized head phi^_i (initial if it
        never trained), or the global head when the method averages heads (FedAvg)."""
        pid = self.node_partition.get(node_id)
        if not self.method.personal_heads:
            return self.global_head
        return self.initial_head if pid is None else self.heads.get(pid, self.initial_head)

    def alignment_targets(self, node_id: int) -> p.NDArrays:
        """What the client on ``node_id`` aligns its features to: the global centroids
        (FedPAC), or its own cluster anchors (FedCCFA; none before its first reply)."""
        if self.method.alignment is Alignment.ANCHORS:
            num_classes, dim = self.initial_head[p.HEAD_WEIGHT].shape
            no_anchors = (np.zeros((num_classes, dim), np.float32), np.zeros(num_classes, bool))
            owner = self.node_partition.get(node_id) if self.clustering.clustered_anchors else GLOBAL_ANCHORS
            values, mask = no_anchors if owner is None else self.anchors.get(owner, no_anchors)
        else:
            values, mask = self.centroids, self.centroid_mask
        return {p.CENTROID_VALUES: values, p.CENTROID_MASK: mask.astype(np.uint8)}

    def posterior_of(self, node_id: int) -> p.NDArrays:
        """What a method that keeps posteriors sends beside the client's posterior mean (its
        head): the prior mean w and the client's scales s (s^0 before its first reply)."""
        pid = self.node_partition.get(node_id)
        scale = self.initial_scale if pid is None else self.posterior_scales.get(pid, self.initial_scale)
        return {p.PRIOR_WEIGHT: self.global_head[p.HEAD_WEIGHT], p.PRIOR_BIAS: self.global_head[p.HEAD_BIAS],
                p.SCALE_WEIGHT: scale[p.HEAD_WEIGHT], p.SCALE_BIAS: scale[p.HEAD_BIAS]}

    def extractor_of(self, node_id: int, extractor: p.NDArrays) -> p.NDArrays:
        """The extractor for the client on ``node_id``: the global one, or, when extractors stay
        local (Local-only), the client's own (the initial one before it first trains)."""
        pid = self.node_partition.get(node_id)
        if self.method.extractor is Rule.LOCAL and pid is not None:
            return self.local_extractors.get(pid, extractor)
        return extractor

    def _messages(
        self, node_ids: list[int], extractor: p.NDArrays, message_type: str, server_round: int,
        evaluate_round: int | None = None,
    ) -> list[Message]:
        messages = []
        for node_id in node_ids:
            # A fresh record per node: nothing mutable is shared between messages.
            config = ConfigRecord({p.SERVER_ROUND: server_round})
            if evaluate_round is not None:
                config[p.EVALUATE_ROUND] = evaluate_round
            sections = {p.MODEL: {**self.extractor_of(node_id, extractor), **self.head_of(node_id)}}
            if message_type == MessageType.TRAIN and self.method.needs_centroids:
                sections[p.CENTROIDS] = self.alignment_targets(node_id)
            if message_type == MessageType.TRAIN and self.method.needs_initial_head:
                sections[p.INITIAL_HEAD] = self.initial_head
                config[p.HAS_PERSONAL_HEAD] = self.node_partition.get(node_id) in self.heads
            if message_type == MessageType.TRAIN and self.method.keeps_posteriors:
                sections[p.POSTERIOR] = self.posterior_of(node_id)
            content = RecordDict({p.ARRAYS: p.pack(sections), p.CONFIG: config})
            self._bytes_sent[node_id] = self._bytes_sent.get(node_id, 0) + p.payload_bytes(content)
            messages.append(Message(content=content, message_type=message_type, dst_node_id=node_id))
        self._sent = messages
        return messages

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send each sampled node the global extractor, the centroids and its own head (and,
        with fused evaluation, the round whose model that is, to evaluate first)."""
        server_round += self.round_offset
        full = self.full_last_round and server_round == self.num_rounds
        # bind the nodes that joined since (or all of them, without a pre-flight): a node is sent
        # a model only once it is bound to its partition
        self.discover(grid, self.discovery_timeout or DISCOVERY_ATTEMPT, strict=False)
        if self.method.aggregates_a_sample:
            node_ids = self._sample_for_aggregation(grid, server_round, full)
        else:
            node_ids = self._sample(grid, self.fraction_train, server_round, full)
        log(INFO, "configure_train: %d nodes%s", len(node_ids), " (all: last round)" if full else "")
        extractor = p.from_record(arrays)
        self.extractor_template = extractor
        if self.extractor is None:
            self.extractor = extractor
        self._record = RoundRecord(round=server_round, started=time.time())
        self._bytes_sent, self._bytes_received = {}, {}
        evaluate_round = None
        if self._pending is not None:
            # a round lasts from its train message to the next one, which carries its evaluation
            self._pending.seconds = self._record.started - self._pending.started
            evaluate_round = self._pending.round
        return self._messages(node_ids, extractor, MessageType.TRAIN, server_round, evaluate_round)

    # ------------------------------------------------------------------ aggregation

    def max_reply_bytes(self) -> int:
        """The most a valid reply can hold: one model (extractor + head) and statistics that are
        smaller than a second one (class means, h, a balanced head), plus 64 KiB for metrics and
        the .npz framing. Larger replies are refused before they are decoded."""
        model = sum(a.nbytes for a in (self.extractor_template or {}).values())
        model += sum(a.nbytes for a in self.initial_head.values())
        return 2 * model + 65536

    def _accept(self, msg: Message, parse: Callable[[Message], ClientUpdate | ClientEvaluation]):
        """Parse a reply; log and drop it when invalid, when its node is bound to no partition,
        or when it claims another partition than its node's."""
        node_id = reply_source(msg, destinations(self._sent)) if msg.has_error() else msg.metadata.src_node_id
        size = p.payload_bytes(msg.content) if msg.has_content() else 0
        self._bytes_received[node_id] = self._bytes_received.get(node_id, 0) + size
        bound = self.node_partition.get(node_id)
        try:
            if bound is None:  # the strategy sends only bound nodes anything: this was not asked for
                raise InvalidReply("its node is bound to no partition")
            limit = self.max_reply_bytes()
            if size > limit:  # refused before any of it is decoded
                raise InvalidReply(f"{size:,} bytes, more than the {limit:,} a reply of this "
                                   "model can need")
            parsed = parse(msg)
        except InvalidReply as err:
            log(WARNING, "Rejected reply from node %d (partition %s): %s", node_id,
                "unknown" if bound is None else bound, err)
            return None
        if bound != parsed.partition_id:
            log(WARNING, "Rejected reply from node %d (partition %d): it claims partition %d",
                node_id, bound, parsed.partition_id)
            return None
        return parsed

    @staticmethod
    def _unique(parsed: list) -> list:
        """The replies in partition order, those whose partition-id appears twice in one round
        dropped (keep neither: a node answered twice)."""
        ids = [item.partition_id for item in parsed]
        duplicates = {pid for pid in ids if ids.count(pid) > 1}
        for pid in duplicates:
            log(WARNING, "Rejected all replies claiming partition-id %d: claimed twice this round", pid)
        return sorted((item for item in parsed if item.partition_id not in duplicates),
                      key=lambda item: item.partition_id)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The method's server step; for FedPAC: extractor average, centroid update,
        collaboration QPs and head mixing."""
        server_round += self.round_offset
        replies = list(replies)
        assert self.extractor_template is not None and self._record is not None
        template = self.extractor_template

        def parse(msg: Message) -> ClientUpdate:
            return parse_train_reply(msg, template, self.initial_head, self.num_partitions, self.method,
                                     self.max_samples_per_client)

        accepted = (self._accept(msg, parse) for msg in replies)
        updates: list[ClientUpdate] = self._unique([u for u in accepted if u is not None])
        log(INFO, "aggregate_train: %d valid replies of %d", len(updates), len(replies))
        if self._pending is not None:  # before this round changes the state its checkpoint saves
            pending, self._pending = self._pending, None
            self._close_round(pending, [u.evaluation for u in updates if u.evaluation is not None])
        record = self._record
        record.rejected = len(replies) - len(updates)
        record.train = {
            u.partition_id: {k: v for k, v in u.metrics.items() if k != p.PARTITION_ID} for u in updates
        }
        if len(updates) < self.min_train_replies:
            self.failed_rounds += 1
            message = (f"Round {server_round}: {len(updates)} valid training replies, fewer than "
                       f"min-train-replies = {self.min_train_replies}")
            if self.failed_rounds > self.max_failed_rounds:
                raise FederationStalled(
                    f"{message}; {self.failed_rounds} rounds in a row without enough replies "
                    f"(max-failed-rounds = {self.max_failed_rounds}): stopping. The outputs and the "
                    "checkpoint of the last complete round are kept; resume with resume-from."
                )
            log(WARNING, "%s; global state unchanged, the next round tries again (%d/%d)",
                message, self.failed_rounds, self.max_failed_rounds)
            return None, None
        self.failed_rounds = 0

        # Every input below is listed in the order of `updates` (sorted by partition-id), so
        # row i of alpha, h_i, V_i, n_i and head i all belong to the same client.
        weights = self._sample_weights(updates)
        in_sample = None
        if self.method.aggregates_a_sample:
            sample = set(self.aggregation_sample or [])
            in_sample = [u.partition_id in sample for u in updates]
            record.sampled = sorted(sample)
        counts = _stacked([u.class_counts for u in updates])
        if counts is not None:  # a capped client's class counts shrink with its weight
            counts = counts * (weights / np.array([u.num_examples for u in updates], dtype=np.float64))[:, None]
        result = aggregate_round(
            extractors=[u.extractor for u in updates],
            heads=[u.head for u in updates],
            local_centroids=_stacked([u.centroids for u in updates]),
            class_counts=counts,
            h=_stacked([u.h for u in updates]),
            v=_stacked([u.v for u in updates]),
            num_examples=weights,
            previous_centroids=self.centroids,
            previous_mask=self.centroid_mask,
            alpha_threshold=self.alpha_threshold,
            solver=self.qp_solver,
            method=self.method,
            balanced_heads=[u.balanced_head for u in updates if u.balanced_head is not None] or None,
            clustering=self.clustering,
            # reply validation guarantees a rho in every reply of a method that keeps posteriors
            rhos=[u.rho for u in updates if u.rho is not None] if self.method.keeps_posteriors else None,
            in_sample=in_sample,
            previous_extractor=self.extractor,
            previous_head=self.global_head,
        )
        self._store(server_round, updates, result)
        if result.aggregated is not None:
            record.aggregated = [updates[i].partition_id for i in result.aggregated]
            log(INFO, "Round %d: base and global head aggregated over partitions %s of S_t %s",
                server_round, record.aggregated, record.sampled)
            if not record.aggregated:
                log(WARNING, "Round %d: no valid reply from S_t; the base and the global head stay as they "
                    "were, the replying clients' posteriors are kept", server_round)
        if result.collaboration is not None:
            record.alpha_partitions = [u.partition_id for u in updates]
            record.alpha = result.collaboration.alpha.tolist()
            record.solver_status = result.collaboration.status
            if result.collaboration.far_off:
                log(WARNING, "Round %d: partitions %s report feature statistics (||h||^2 + V/n) over %g times a "
                    "typical client's; no other client mixes their heads. Diverged, or not honest?", server_round,
                    [updates[i].partition_id for i in result.collaboration.far_off], FAR_DIAGONAL)
        if result.clusters is not None:
            record.cluster_partitions = [u.partition_id for u in updates]
            record.clusters = result.clusters.labels.tolist()
        metrics = MetricRecord(
            {
                p.TRAIN_LOSS: record.mean_train_loss,
                "num-replies": len(updates),
                "num-rejected": record.rejected,
                "qp-fallbacks": record.qp_fallbacks,
            }
        )
        # Flower carries the global extractor to the next phase; Local-only has none to carry
        # and passes the initial one on unchanged (each client's own is in local_extractors).
        assert self.extractor is not None  # set by configure_train
        return p.to_record(self.extractor), metrics

    def _sample_weights(self, updates: list[ClientUpdate]) -> np.ndarray:
        """n_i for the averages, capped at ``max_weight_ratio`` times the others' median (logged)."""
        claimed = np.array([u.num_examples for u in updates], dtype=np.float64)
        weights = capped_sample_weights(claimed, self.max_weight_ratio)
        for update, n, w in zip(updates, claimed, weights):
            if w < n:
                log(WARNING, "partition %d reports %d training samples, more than max-weight-ratio = %g "
                    "times the other replies' median: weighted as %g", update.partition_id, n,
                    self.max_weight_ratio, w)
        return weights

    def _store(self, server_round: int, updates: list[ClientUpdate], result: RoundAggregate) -> None:
        """Keep the round's outcome: the global parts, and the per-client parts by partition-id.

        Alignment targets that are not all finite are not kept: every client would align to them
        next round (and the checkpoint would keep them). Reply validation lets none through;
        this is the second guard, should an average overflow the model's dtype after all."""
        if result.centroids is not None and result.centroid_mask is not None:
            if np.isfinite(result.centroids).all():
                self.centroids, self.centroid_mask = result.centroids, result.centroid_mask
            else:
                log(WARNING, "Round %d: the aggregated centroids are not all finite; the previous ones are kept",
                    server_round)
        if result.extractor is not None:
            self.extractor = result.extractor
        else:
            for update in updates:
                self.local_extractors[update.partition_id] = update.extractor
        if not self.method.personal_heads:
            self.global_head = result.heads[0]
        else:
            for update, head in zip(updates, result.heads):
                self.heads[update.partition_id] = head
        if result.global_head is not None:
            self.global_head = result.global_head
        for update in updates:
            if update.scale is not None:
                self.posterior_scales[update.partition_id] = update.scale
        if result.clusters is not None:
            anchors, mask = result.clusters.anchors, result.clusters.anchor_mask
            finite = np.isfinite(anchors).all(axis=(1, 2))
            if not finite.all():
                log(WARNING, "Round %d: the merged anchors of partitions %s are not all finite; their previous "
                    "ones are kept", server_round, [updates[i].partition_id for i in np.flatnonzero(~finite)])
            for i, update in enumerate(updates):
                if finite[i]:
                    self.anchors[update.partition_id] = (anchors[i], mask[i])
            if not self.clustering.clustered_anchors and finite[0]:  # the round's mean, for every client
                self.anchors[GLOBAL_ANCHORS] = (anchors[0], mask[0])

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send every sampled node the new global extractor and its own combined head (with
        fused evaluation, only in the last round: the next train message evaluates the others)."""
        server_round += self.round_offset
        if self._evaluated_with_next_train(server_round):
            return []
        node_ids = self._sample(grid, self.fraction_evaluate, server_round, self.fraction_evaluate >= 1.0)
        return self._messages(node_ids, p.from_record(arrays), MessageType.EVALUATE, server_round)

    def _evaluated_with_next_train(self, server_round: int) -> bool:
        return self.fused_evaluation and server_round < self.num_rounds

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Unweighted mean of the clients' personalized accuracies; closes the round's record
        (with fused evaluation, the next round's training replies close it)."""
        server_round += self.round_offset
        record = self._record
        if record is None:
            return None
        for node_id, pid in self.node_partition.items():
            if node_id in self._bytes_sent:
                record.bytes_sent[pid] = self._bytes_sent[node_id]
                record.bytes_received[pid] = self._bytes_received.get(node_id, 0)
        if self._evaluated_with_next_train(server_round):
            self._pending = record
            return None
        accepted = (
            self._accept(msg, lambda m: parse_evaluate_reply(m, self.num_partitions)) for msg in replies
        )
        evaluations: list[ClientEvaluation] = self._unique([e for e in accepted if e is not None])
        if server_round == self.num_rounds:
            self.final_accuracy = {e.partition_id: e.accuracy for e in evaluations}
        record.seconds = time.time() - record.started
        self._close_round(record, evaluations)
        if not evaluations:
            return None
        return MetricRecord(
            {
                "accuracy": float(np.mean([e.accuracy for e in evaluations])),
                "num-clients": len(evaluations),
            }
        )

    def _close_round(self, record: RoundRecord, evaluations: list[ClientEvaluation]) -> None:
        """Complete ``record`` with its evaluations and hand it to ``on_round_end`` (outputs and
        the checkpoint of the state this round left)."""
        record.accuracy = {e.partition_id: e.accuracy for e in evaluations}
        record.test_loss = {e.partition_id: e.loss for e in evaluations}
        record.eval_seconds = {e.partition_id: e.seconds for e in evaluations}
        record.generalized = {e.partition_id: e.generalized_accuracy for e in evaluations
                              if e.generalized_accuracy is not None}
        record.centroid_classes = int(self.centroid_mask.sum())
        if evaluations:
            log(INFO, "Round %d: mean personalized accuracy %.2f%% over %d clients", record.round,
                100 * record.mean_accuracy, len(evaluations))
        else:
            log(WARNING, "Round %d: no valid evaluation replies", record.round)
        if self.on_round_end is not None:
            self.on_round_end(record)

    # ------------------------------------------------------------------ final delivery

    def deliver(self, grid: Grid, timeout: float) -> FinalDelivery:
        """After the last round: send the final model to every bound site that the last round's
        evaluation did not reach (not sampled, offline, or its reply lost), and say who has it.

        The model travels in an ordinary evaluate message of the last round: the client
        evaluates it on its own test split and a deployed site saves it with that accuracy
        (``client_app.app``), exactly what an evaluated site did. A site that is not connected,
        or does not answer, is asked again until ``timeout`` seconds have passed; one that
        answers with an error is not (its reply is logged). The sites that never got the model
        are named in one warning; their heads stay in final_state.npz.
        """
        delivery = FinalDelivery(round=self.num_rounds, accuracy=dict(self.final_accuracy))
        pending = set(self.node_partition.values()) - set(delivery.accuracy)
        if pending:
            log(INFO, "Final delivery: sending the round-%d model to partitions %s, which its "
                "evaluation did not reach", self.num_rounds, sorted(pending))
        deadline = time.monotonic() + timeout
        failed: set[int] = set()  # answered with an error or an invalid reply: not asked again
        asked: dict[int, float] = {}  # unbound nodes, when discovery last asked them
        while pending - failed:
            self._bind_newcomers(grid, deadline, asked)
            nodes = self._nodes_of(grid, pending - failed)
            if nodes:
                wait = max(0.0, min(DISCOVERY_ATTEMPT, deadline - time.monotonic()))
                delivered, answered = self._send_final_model(grid, nodes, wait)
                delivery.accuracy.update(delivered)
                pending -= set(delivered)
                failed |= answered - set(delivered)
            remaining = deadline - time.monotonic()
            if not pending - failed or remaining <= 0:
                break
            time.sleep(min(DELIVERY_POLL, remaining))  # an offline site is asked once it is back
        delivery.undelivered = sorted(pending)
        if pending:
            offline, erred = sorted(pending - failed), sorted(pending & failed)
            reasons = [f"{offline} offline until the {timeout:.0f}s timeout"] if offline else []
            reasons += [f"{erred} answered with an error (logged above)"] if erred else []
            log(WARNING, "Final model not delivered to partitions %s (%s): those sites keep no model of "
                "this run; their heads are in final_state.npz", delivery.undelivered, "; ".join(reasons))
        log(INFO, "Final model of round %d held by %d of %d sites", self.num_rounds, len(delivery.accuracy),
            len(delivery.accuracy) + len(pending))
        return delivery

    def _bind_newcomers(self, grid: Grid, deadline: float, asked: dict[int, float]) -> None:
        """Bind connected nodes that are not yet (a SuperNode restarted without authentication
        comes back under a new node id), as a round does before it sends anything. A node is
        asked at most once per DISCOVERY_ATTEMPT: one refused for now (its partition's node was
        still connected) is not queried at every look of the delivery."""
        now = time.monotonic()
        unbound = [n for n in self._candidates(grid) if n not in self.node_partition]
        if not any(now - asked.get(n, -float("inf")) >= DISCOVERY_ATTEMPT for n in unbound):
            return
        asked.update(dict.fromkeys(unbound, now))
        patience = self.discovery_timeout
        self.discover(grid, max(1.0, min(DISCOVERY_ATTEMPT, deadline - now)), strict=False)
        self.discovery_timeout = patience  # the run's patience, not this attempt's

    def _nodes_of(self, grid: Grid, partitions: set[int]) -> list[int]:
        """The connected nodes bound to ``partitions``, in partition order (not waiting for
        ``min_available_nodes``: the delivery serves whoever is there)."""
        nodes = [n for n in self._candidates(grid) if self.node_partition.get(n) in partitions]
        return sorted(nodes, key=lambda n: self.node_partition[n])

    def _send_final_model(self, grid: Grid, nodes: list[int], timeout: float) -> tuple[dict[int, float], set[int]]:
        """Send ``nodes`` the final model as an evaluate message; returns the accuracy of each
        partition whose valid evaluation came back, and every partition whose node answered at
        all (the SuperLink's word that a node is offline is no answer)."""
        assert self.extractor is not None  # set by the rounds, or by restore()
        messages = self._messages(nodes, self.extractor, MessageType.EVALUATE, self.num_rounds)
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        sent = destinations(self._sent)
        answered = set()
        for reply in replies:
            node = reply_source(reply, sent)
            if node in self.node_partition and not node_unavailable(reply):
                answered.add(self.node_partition[node])
        parsed = (self._accept(msg, lambda m: parse_evaluate_reply(m, self.num_partitions)) for msg in replies)
        return {e.partition_id: e.accuracy for e in parsed if e is not None}, answered
