"""The personalized-FL Strategy on Flower's Message API: the glue every method runs through.

Per round: every selected node gets its own message (the model its method's server part gives
its partition: for FedPAC the global extractor with *its* personalized head, and the global
centroids); ``aggregate_train`` checks the replies and hands the valid ones to the method's
server step; ``configure_evaluate`` sends every node its new model. After the last round,
:meth:`PersonalizedStrategy.deliver` sends the final model to every bound site that no evaluation
of that round reached, so every site ends the run with its personalized model.

What a method does (``common/methods/<family>/server.py``, a ``ServerPart``) and what it keeps
(a ``ServerState``: arrays by section, global or by partition-id) are its own; discovery,
sampling, reply framing and validation, the partition-id bookkeeping, failed rounds, the round
records and the checkpoints are shared here, and name no method.
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
from common.averaging import capped_sample_weights
from common.methods.server import EXTRACTOR, ServerPart, ServerState
from common.sites import Identity, SiteRegistry, fingerprint
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
from server_app.checkpoint import Checkpoint, CheckpointError
from server_app.report import FinalDelivery, RoundRecord


# Seconds before the pre-flight asks a silent node again (a first message may import torch and
# load a dataset: minutes on a crowded host, but not ten).
DISCOVERY_ATTEMPT = 120.0


# Seconds between two looks for a site that the final delivery has not reached (offline).
DELIVERY_POLL = 1.0


class FederationStalled(RuntimeError):
    """Too many rounds in a row without enough valid replies: the run stops."""


def _most_common(values: list[int]) -> int:
    """The value most of ``values`` share (the larger one on a tie, so the choice does not
    depend on the order replies arrived in)."""
    return max(set(values), key=lambda v: (values.count(v), v))


class PersonalizedStrategy(Strategy):  # pylint: disable=too-many-instance-attributes
    """A personalized-FL method (its ``ServerPart``) on Flower's Message API.

    Parameters
    ----------
    server : ServerPart
        The method's server part (``common.methods.server.server_part``): its state, what it
        sends, what a reply must carry, its step.
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
    min_train_replies : int
        A round aggregates only with at least this many valid training replies; otherwise the
        global state stays as it is and the next round tries again.
    max_failed_rounds : int
        How many such rounds in a row are tolerated: the next one stops the run with a clear
        message (0: the first one does).
    max_samples_per_client : int
        Replies claiming more training samples are rejected (0: no bound).
    max_weight_ratio : float
        A client's aggregation weight is at most this times the round's median (0: no cap).
    seed : int
        Seeds node sampling.
    sites : SiteRegistry, optional
        Who may serve which partition (``common.sites``); by default every node's own claim
        is believed, as in the simulation.
    on_round_end : callable, optional
        Called with each finished round's :class:`RoundRecord` (used to write outputs).
    """

    def __init__(  # pylint: disable=too-many-arguments
        self,
        *,
        server: ServerPart,
        num_rounds: int,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        fused_evaluation: bool = False,
        full_last_round: bool = True,
        min_available_nodes: int = 2,
        min_train_replies: int = 1,
        max_failed_rounds: int = 3,
        max_samples_per_client: int = 0,
        max_weight_ratio: float = 10.0,
        seed: int = 0,
        sites: SiteRegistry | None = None,
        on_round_end: Callable[[RoundRecord], None] | None = None,
    ) -> None:
        self.server = server
        self.state: ServerState = server.initial_state()
        self.num_rounds = num_rounds
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.trains_every_client = server.trains_every_client(fraction_train)
        self.fused_evaluation = fused_evaluation and self.trains_every_client and fraction_evaluate >= 1.0
        self.fused_evaluation_requested = fused_evaluation
        self.full_last_round = full_last_round
        self.min_available_nodes = min_available_nodes
        self.min_train_replies = min_train_replies
        self.max_failed_rounds = max_failed_rounds
        self.failed_rounds = 0  # consecutive rounds without enough valid replies
        self.max_samples_per_client = max_samples_per_client
        self.max_weight_ratio = max_weight_ratio
        self.seed = seed
        self.on_round_end = on_round_end
        self.sites = sites or SiteRegistry(trusted_claims=True)
        self.num_partitions: int | None = None  # as the clients report it at discovery
        self.discovery_timeout: float | None = None  # set once discover() has run
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

    @property
    def extractor(self) -> p.NDArrays:
        """The global extractor (Local-only: the initial one; each client's own is in the state)."""
        return self.state.shared[EXTRACTOR]

    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "\t├──> Sites: partitions bound by %s", self.sites.describe())
        for line in self.server.summary():
            log(INFO, "\t├──> %s", line)
        log(INFO, "\t├──> Sampling: fraction train %.2f (every client in the last round: %s), "
            "fraction evaluate %.2f, at least %d nodes", self.fraction_train, self.full_last_round,
            self.fraction_evaluate, self.min_available_nodes)
        if self.fused_evaluation:
            log(INFO, "\t├──> Evaluation: each round's model is evaluated by the next round's train "
                "message (fused), the last round's by an evaluate message")
        elif self.fused_evaluation_requested:
            log(INFO, "\t├──> Evaluation: an evaluate message per round (fused evaluation needs "
                "fraction-train = fraction-evaluate = 1)")

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue from a checkpoint: the method's state (the sections it keeps) and the round count."""
        kept = self.state.shared
        self.state = ServerState(
            shared={section: {k: np.array(v) for k, v in arrays.items()}
                    for section, arrays in checkpoint.state.shared.items() if section in kept},
            personal={section: {pid: {k: np.array(v) for k, v in arrays.items()} for pid, arrays in parts.items()}
                      for section, parts in checkpoint.state.personal.items()},
        )
        self.round_offset = checkpoint.completed_rounds
        problem = self._state_problem()
        if problem:
            raise CheckpointError(f"checkpoint is malformed ({problem}): it does not hold the state a "
                                  f"'{self.server.method.name}' run keeps")

    def _state_problem(self) -> str | None:
        """What keeps the restored state from being the method's: a section it keeps missing, or
        arrays that are not the model's (checked now, before any node is sent anything, rather
        than as a KeyError in round 1 or a model every client refuses)."""
        expected = self.server.initial_state()
        for section, arrays in expected.shared.items():
            found = self.state.shared.get(section)
            if found is None:
                return f"no section '{section}'"
            if {k: v.shape for k, v in found.items()} != {k: v.shape for k, v in arrays.items()}:
                return f"section '{section}' holds {sorted(found)} with other shapes than {sorted(arrays)}"
        template = {k: v.shape for k, v in {**self.server.extractor_template, **self.server.head_template}.items()}
        partitions = {pid for parts in self.state.personal.values() for pid in parts}
        for pid in sorted(partitions | {None}, key=lambda pid: -1 if pid is None else pid):
            try:
                model = self.server.model_for(self.state, pid)
                self.server.train_sections(self.state, pid)
            except KeyError as err:
                return f"partition {pid}: no {err}"
            if {k: v.shape for k, v in model.items()} != template:
                return f"partition {pid}: its model's arrays are not the model's"
        return None

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

    def _sample(self, nodes: list[int], fraction: float, server_round: int, full: bool) -> list[int]:
        """``fraction`` of ``nodes`` (all of them when ``full``), seeded by (seed, round)."""
        if full or not nodes:  # no node at all: a round without replies, counted as failed
            return nodes
        size = max(1, int(round(fraction * len(nodes))))
        rng = np.random.default_rng([self.seed, server_round])
        # Choose positions, not ids: node ids are uint64 and numpy would turn them into floats.
        return [nodes[i] for i in sorted(rng.choice(len(nodes), size=size, replace=False))]

    def _messages(
        self, node_ids: list[int], message_type: str, server_round: int, evaluate_round: int | None = None,
    ) -> list[Message]:
        messages = []
        for node_id in node_ids:
            # A fresh record per node: nothing mutable is shared between messages.
            config = ConfigRecord({p.SERVER_ROUND: server_round})
            if evaluate_round is not None:
                config[p.EVALUATE_ROUND] = evaluate_round
            pid = self.node_partition.get(node_id)
            sections = {p.MODEL: self.server.model_for(self.state, pid)}
            if message_type == MessageType.TRAIN:
                extra, entries = self.server.train_sections(self.state, pid)
                sections.update(extra)
                config.update(entries)
            content = RecordDict({p.ARRAYS: p.pack(sections), p.CONFIG: config})
            self._bytes_sent[node_id] = self._bytes_sent.get(node_id, 0) + p.payload_bytes(content)
            messages.append(Message(content=content, message_type=message_type, dst_node_id=node_id))
        self._sent = messages
        return messages

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send each sampled node its model and what its method sends with it (and, with fused
        evaluation, the round whose model that is, to evaluate first)."""
        server_round += self.round_offset
        full = self.full_last_round and server_round == self.num_rounds
        # bind the nodes that joined since (or all of them, without a pre-flight): a node is sent
        # a model only once it is bound to its partition
        self.discover(grid, self.discovery_timeout or DISCOVERY_ATTEMPT, strict=False)
        node_ids = self._trainers(grid, server_round, full)
        log(INFO, "configure_train: %d nodes%s", len(node_ids), " (all: last round)" if full else "")
        self._record = RoundRecord(round=server_round, started=time.time())
        self._bytes_sent, self._bytes_received = {}, {}
        evaluate_round = None
        if self._pending is not None:
            # a round lasts from its train message to the next one, which carries its evaluation
            self._pending.seconds = self._record.started - self._pending.started
            evaluate_round = self._pending.round
        return self._messages(node_ids, MessageType.TRAIN, server_round, evaluate_round)

    def _trainers(self, grid: Grid, server_round: int, full: bool) -> list[int]:
        """The nodes that train this round: those of the partitions the method draws itself
        (pFedVEM's S_t), or ``fraction-train`` of the bound nodes."""
        nodes = self._bound_nodes(grid)
        population = self.num_partitions if self.num_partitions is not None else len(nodes)
        chosen = self.server.select([self.node_partition[n] for n in nodes], population, server_round, full)
        if chosen is None:
            return self._sample(nodes, self.fraction_train, server_round, full)
        partitions = set(chosen)
        return [n for n in nodes if self.node_partition[n] in partitions]

    # ------------------------------------------------------------------ aggregation

    def max_reply_bytes(self) -> int:
        """The most a valid reply can hold: one model (extractor + head) and statistics that are
        smaller than a second one (class means, h, a balanced head), plus 64 KiB for metrics and
        the .npz framing. Larger replies are refused before they are decoded."""
        model = sum(a.nbytes for a in self.server.extractor_template.values())
        model += sum(a.nbytes for a in self.server.head_template.values())
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
        """Check the replies and run the method's server step on the valid ones."""
        server_round += self.round_offset
        replies = list(replies)
        assert self._record is not None

        def parse(msg: Message) -> ClientUpdate:
            return parse_train_reply(msg, self.server, self.num_partitions, self.max_samples_per_client)

        accepted = (self._accept(msg, parse) for msg in replies)
        updates: list[ClientUpdate] = self._unique([u for u in accepted if u is not None])
        log(INFO, "aggregate_train: %d valid replies of %d", len(updates), len(replies))
        if self._pending is not None:  # before this round changes the state its checkpoint saves
            pending, self._pending = self._pending, None
            self._close_round(pending, [u.evaluation for u in updates if u.evaluation is not None])
        record = self._record
        record.rejected = len(replies) - len(updates)
        record.train = {
            u.partition_id: {k: v for k, v in u.update.metrics.items() if k != p.PARTITION_ID} for u in updates
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
        step = self.server.step(self.state, [u.update for u in updates], self._sample_weights(updates), server_round)
        for name, value in step.record.items():
            setattr(record, name, value)
        metrics = MetricRecord(
            {
                p.TRAIN_LOSS: record.mean_train_loss,
                "num-replies": len(updates),
                "num-rejected": record.rejected,
                "qp-fallbacks": record.qp_fallbacks,
            }
        )
        # Flower carries the global extractor to the next phase (Local-only's is the initial one:
        # each client's own is in the state)
        return p.to_record(self.extractor), metrics

    def _sample_weights(self, updates: list[ClientUpdate]) -> np.ndarray:
        """n_i for the averages, capped at ``max_weight_ratio`` times the others' median (logged)."""
        claimed = np.array([u.update.num_examples for u in updates], dtype=np.float64)
        weights = capped_sample_weights(claimed, self.max_weight_ratio)
        for update, n, w in zip(updates, claimed, weights):
            if w < n:
                log(WARNING, "partition %d reports %d training samples, more than max-weight-ratio = %g "
                    "times the other replies' median: weighted as %g", update.partition_id, n,
                    self.max_weight_ratio, w)
        return weights

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send every sampled node the new global extractor and its own combined head (with
        fused evaluation, only in the last round: the next train message evaluates the others)."""
        server_round += self.round_offset
        if self._evaluated_with_next_train(server_round):
            return []
        node_ids = self._sample(self._bound_nodes(grid), self.fraction_evaluate, server_round,
                                self.fraction_evaluate >= 1.0)
        return self._messages(node_ids, MessageType.EVALUATE, server_round)

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
        for name, value in self.server.closing_record(self.state).items():
            setattr(record, name, value)
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
        messages = self._messages(nodes, MessageType.EVALUATE, self.num_rounds)
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        sent = destinations(self._sent)
        answered = set()
        for reply in replies:
            node = reply_source(reply, sent)
            if node in self.node_partition and not node_unavailable(reply):
                answered.add(self.node_partition[node])
        parsed = (self._accept(msg, lambda m: parse_evaluate_reply(m, self.num_partitions)) for msg in replies)
        return {e.partition_id: e.accuracy for e in parsed if e is not None}, answered
