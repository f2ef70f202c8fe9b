"""The personalized-FL Strategy on Flower's Message API: the glue every method runs through.

Per round: every selected node gets its own message (the model its method's server part gives
its partition: for FedPAC the global extractor with *its* personalized head, and the global
centroids); ``aggregate_train`` checks the replies and hands the valid ones to the method's
server step; ``configure_evaluate`` sends every node its new model. After the last round,
:meth:`PersonalizedStrategy.deliver` sends the final model to every bound site that no evaluation
of that round reached, so every site ends the run with its personalized model.

What a method does (``common/methods/<family>/server.py``, a ``ServerPart``) and what it keeps
(a ``ServerState``: arrays by section, global or by partition-id) are its own; sampling, reply
framing and validation, the partition-id bookkeeping, failed rounds, the round records and the
checkpoints are shared here, and name no method; which node serves which partition (the
pre-flight, the binding) is ``server_app.federation``'s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from common import protocol as p
from common.averaging import capped_sample_weights
from common.methods.server import EXTRACTOR, ServerPart, ServerState, Update
from common.site_state import Lineage
from common.sites import SiteRegistry
from server_app import federation
from server_app.federation import SiteBinding
from server_app.replies import (
    ClientEvaluation,
    ClientUpdate,
    InvalidReply,
    destinations,
    node_unavailable,
    parse_evaluate_reply,
    parse_train_reply,
    reply_source,
)
from server_app.checkpoint import Checkpoint, CheckpointError
from server_app.report import FinalDelivery, RoundRecord


# Seconds between two looks for a site that the final delivery has not reached (offline).
DELIVERY_POLL = 1.0
# Rounds in a row that ask a partition to train without a valid reply from it before the
# operator is warned: one refused or lost reply is noise, three are a site that has stopped
# contributing.
SILENT_ROUNDS = 3


class FederationStalled(RuntimeError):
    """Too many rounds in a row without enough valid replies: the run stops."""


class PersonalizedStrategy(SiteBinding, Strategy):  # pylint: disable=too-many-instance-attributes
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
        run_key: str | None = None,
        sites_keep_state: bool | None = None,
    ) -> None:
        SiteBinding.__init__(self, sites, min_available_nodes, max_samples_per_client)
        self.server = server
        self.state: ServerState = server.initial_state()
        self.num_rounds = num_rounds
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.trains_every_client = server.trains_every_client(fraction_train)
        self.fused_evaluation = fused_evaluation and self.trains_every_client and fraction_evaluate >= 1.0
        self.fused_evaluation_requested = fused_evaluation
        self.full_last_round = full_last_round
        self.min_train_replies = min_train_replies
        self.max_failed_rounds = max_failed_rounds
        self.failed_rounds = 0  # consecutive rounds without enough valid replies
        # partition -> (first round, count) of the rounds in a row that asked it to train and
        # got no valid reply from it
        self._unheard: dict[int, tuple[int, int]] = {}
        self.max_weight_ratio = max_weight_ratio
        self.seed = seed
        self.on_round_end = on_round_end
        # Rounds finished before this strategy started (a resumed run): Flower's loop counts
        # from 1, sampling and seeds use the run's absolute round number.
        self.round_offset = 0
        # This run and the runs it continues (``common.site_state``): where each site finds what
        # it kept. The key names a folder at every site, so it is unique to the run.
        self.lineage: Lineage = ((run_key or f"run-{uuid.uuid4().hex}", 1),)
        # Whether the sites keep anything between rounds, and so need the lineage: what their
        # method keeps, or more (their privacy ledger: ``common.config.sites_keep_state``).
        self.sites_keep_state = server.method.keeps_anything_at_site if sites_keep_state is None else sites_keep_state
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
        self.final_accuracy: dict[int, float | None] = {}

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
        self.lineage = (*checkpoint.lineage, (self.lineage[-1][0], checkpoint.completed_rounds + 1))
        home = sorted({*self.server.method.site_parts, *self.server.moved_to_sites} & set(self.state.personal))
        if home:
            # a checkpoint written when the server still kept these: the sites never had them
            log(WARNING, "The checkpoint holds every client's %s, which %s now keeps at the site; the sites "
                "do not have them and start them over from round 0's", " and ".join(home), self.server.method.name)
            for section in home:
                del self.state.personal[section]
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
        template = {k: v.shape for k, v in self.server.reply_template().items()}
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
            if self.sites_keep_state:
                config[p.LINEAGE_RUNS] = [run for run, _ in self.lineage]
                config[p.LINEAGE_STARTS] = [start for _, start in self.lineage]
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
        self.discover(grid, self.discovery_timeout or federation.DISCOVERY_ATTEMPT, strict=False)
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

    def _track_silence(self, server_round: int, asked: set[int], heard: set[int]) -> None:
        """Warn once when a partition asked to train has sent no valid reply in
        :data:`SILENT_ROUNDS` of its rounds in a row (each refusal is logged on its own, but a
        site that never gets through is easy to miss among them): its part of the model stops
        learning, and a round that misses its evaluation leaves it out of the mean accuracy,
        which then flatters the federation. Said again, once, when it is heard from."""
        for pid in sorted(asked):
            if pid in heard:
                _, count = self._unheard.pop(pid, (server_round, 0))
                if count >= SILENT_ROUNDS:
                    log(INFO, "Partition %d sent a valid training reply again in round %d, after %d "
                        "rounds without", pid, server_round, count)
                continue
            since, count = self._unheard.get(pid, (server_round, 0))
            self._unheard[pid] = (since, count + 1)
            if count + 1 == SILENT_ROUNDS:
                log(WARNING, "Partition %d has sent no valid training reply in the %d rounds that asked "
                    "it since round %d (each refusal is logged above): its model is not trained, and "
                    "rounds without its evaluation leave it out of the mean accuracy", pid, SILENT_ROUNDS, since)

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
        asked = {self.node_partition.get(m.metadata.dst_node_id) for m in self._sent}
        self._track_silence(server_round, {pid for pid in asked if pid is not None},
                            {u.partition_id for u in updates})
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
        bounded = self._bounded(updates, server_round)
        step = self.server.step(self.state, bounded, self._sample_weights(updates), server_round)
        record.method.update(step.record)
        metrics = MetricRecord(
            {
                p.TRAIN_LOSS: record.mean_train_loss,
                "num-replies": len(updates),
                "num-rejected": record.rejected,
            }
        )
        # Flower carries the global extractor to the next phase (Local-only's is the initial one:
        # each client's own is in the state)
        return p.to_record(self.extractor), metrics

    def _bounded(self, updates: list[ClientUpdate], server_round: int) -> list[Update]:
        """The replies as the method's step takes them: each one's update of the model parts it
        carries bounded relative to the others' (``ServerPart.bound``; logged when it bites), so
        that no single reply, however large, owns what the step computes from them."""
        bounded, scaled = self.server.bound(self.state, [u.update for u in updates])
        for item in scaled:
            log(WARNING, "Round %d: partition %d's %s update has norm %.3g, over max-norm-ratio = %g times the "
                "other replies' median: scaled down to %.3g", server_round, item.partition_id, item.part, item.norm,
                self.server.cfg.max_norm_ratio, item.bound)
        return bounded

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
        measured = [e.accuracy for e in evaluations if e.accuracy is not None]
        if not measured:
            return None
        return MetricRecord({"accuracy": float(np.mean(measured)), "num-clients": len(measured)})

    def _close_round(self, record: RoundRecord, evaluations: list[ClientEvaluation]) -> None:
        """Complete ``record`` with its evaluations and hand it to ``on_round_end`` (outputs and
        the checkpoint of the state this round left)."""
        measured = [e for e in evaluations if e.accuracy is not None and e.loss is not None]
        record.accuracy = {e.partition_id: e.accuracy for e in measured if e.accuracy is not None}
        record.test_loss = {e.partition_id: e.loss for e in measured if e.loss is not None}
        record.eval_seconds = {e.partition_id: e.seconds for e in measured}
        record.generalized = {e.partition_id: e.generalized_accuracy for e in measured
                              if e.generalized_accuracy is not None}
        record.method.update(self.server.closing_record(self.state))
        withheld = len(evaluations) - len(measured)
        if measured:
            log(INFO, "Round %d: mean personalized accuracy %.2f%% over %d clients%s", record.round,
                100 * record.mean_accuracy, len(measured),
                f" ({withheld} more evaluated and withheld their metrics)" if withheld else "")
        elif withheld:
            log(INFO, "Round %d: %d clients evaluated and withheld their metrics", record.round, withheld)
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
                wait = max(0.0, min(federation.DISCOVERY_ATTEMPT, deadline - time.monotonic()))
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
        if not any(now - asked.get(n, -float("inf")) >= federation.DISCOVERY_ATTEMPT for n in unbound):
            return
        asked.update(dict.fromkeys(unbound, now))
        patience = self.discovery_timeout
        self.discover(grid, max(1.0, min(federation.DISCOVERY_ATTEMPT, deadline - now)), strict=False)
        self.discovery_timeout = patience  # the run's patience, not this attempt's

    def _nodes_of(self, grid: Grid, partitions: set[int]) -> list[int]:
        """The connected nodes bound to ``partitions``, in partition order (not waiting for
        ``min_available_nodes``: the delivery serves whoever is there)."""
        nodes = [n for n in self._candidates(grid) if self.node_partition.get(n) in partitions]
        return sorted(nodes, key=lambda n: self.node_partition[n])

    def _send_final_model(self, grid: Grid, nodes: list[int],
                          timeout: float) -> tuple[dict[int, float | None], set[int]]:
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
