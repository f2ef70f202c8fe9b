"""Which node serves which partition: the pre-flight and the binding of nodes to partitions
that every round relies on (a node is sent a model only once it is bound), for any method.

A node is screened by the identity the SuperLink vouches for (``common.sites``) before it is sent
anything, then asked for its partition (a query message); its answer binds it where its identity
agrees. :class:`SiteBinding` holds the binding and is the strategy's base
(``server_app.strategy.PersonalizedStrategy``).

With identities (a deployment), one site cannot stop a run: a node whose pre-flight answer is
malformed, names another federation size, or does not come before the timeout is excluded from
the run and logged, and the run starts with the others. Where claims are all there is (the
simulation), nobody can tell which node is wrong, so any problem stops the pre-flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from common import protocol as p
from common.sites import Identity, SiteRegistry, federation_size, fingerprint
from server_app.replies import (
    ClientInfo,
    InvalidReply,
    destinations,
    node_unavailable,
    parse_query_reply,
    reply_source,
)

# Seconds before the pre-flight asks a silent node again (a first message may import torch and
# load a dataset: minutes on a crowded host, but not ten).
DISCOVERY_ATTEMPT = 120.0


@dataclass
class Exclusions:
    """The nodes one discovery left out, and why: ``sites`` for their answer, their silence or a
    partition two keys map to (what can leave a run too few nodes to start), ``refused`` for
    their identity alone (strangers, wrong claims)."""

    sites: dict[int, str] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)


class SiteBinding:
    """The nodes bound to partitions, the federation's size as the clients report it, and the
    pre-flight that binds them (:meth:`discover`)."""

    def __init__(self, sites: SiteRegistry | None, min_available_nodes: int, max_samples_per_client: int) -> None:
        self.sites = sites or SiteRegistry(trusted_claims=True)
        self.min_available_nodes = min_available_nodes
        self.max_samples_per_client = max_samples_per_client
        # the operator's (partition-map), else as the clients report it at discovery
        self.num_partitions: int | None = self.sites.declared_size()
        self.discovery_timeout: float | None = None  # set once discover() has run
        # nodes that did not answer a query during the run: when each may be asked again, and
        # the back-off after its next silence (doubling: a hung site costs a few waits, not one
        # a round)
        self._silent: dict[int, tuple[float, float]] = {}

    @property
    def node_partition(self) -> dict[int, int]:
        """The nodes bound to a partition, and their partition-ids."""
        return self.sites.node_partition

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
            time.sleep(min(1.0, patience - waited))  # not past the patience
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

    def _refuse(self, node_id: int, reason: str, excluded: Exclusions | None = None) -> None:
        log(WARNING, "Refused node %d: %s. It is sent nothing.", node_id, reason)
        if excluded is not None:
            excluded.refused[node_id] = reason

    def _exclude(self, node_id: int, reason: str, excluded: Exclusions) -> None:
        """Leave a node of the federation out of the run for its pre-flight answer (or silence):
        one faulty or hostile site must not stop everyone's run."""
        log(WARNING, "Excluded node %d from this run: %s. It is sent nothing more; once the site is fixed, "
            "resume the run to include it.", node_id, reason)
        self.sites.exclude(node_id, reason)
        excluded.sites[node_id] = reason

    def discover(self, grid: Grid, timeout: float, strict: bool = True) -> dict[int, int]:
        """Bind connected nodes of unknown partition to one: screen each by its registered
        identity (``common.sites``), then ask the others for their partition (a query message).

        Before round 1 (``strict``): every node is screened and asked; a node that is refused
        (its identity serves no partition, or another than it claims, or a partition two keys
        map to) is logged and left out, and the pre-flight waits for ``min_available_nodes``
        nodes that are not refused. With identities, a node whose answer is malformed, names
        another federation size, or does not come within ``timeout`` is excluded from the run
        and logged; the run starts unless that leaves fewer than ``min_available_nodes`` bound,
        and then the error lists every node left out and why. Where claims are believed (the
        simulation), any such problem stops the pre-flight: nothing tells the right node from
        the wrong one. During the run: a node that joined late or restarted is bound before it
        is sent anything, so it gets its own personalized head back; problems are only logged.
        """
        self.discovery_timeout = timeout
        excluded = Exclusions()
        exclusive = strict and not self.sites.trusted_claims  # a faulty node is left out, not fatal
        while True:
            screened, identities, refused = self._screen(grid, excluded)
            if exclusive:
                self._require_enough(excluded, len(self._candidates(grid)))
            nodes = [n for n in screened if n not in self.node_partition and self._may_ask(n, strict)]
            if not nodes:
                if strict and refused:  # the refused counted towards min_available_nodes
                    continue
                break
            replies, gone = self._query(grid, nodes, timeout)
            problems, refused_answers = self._bind_answers(grid, replies, identities, strict, excluded)
            refused = refused or refused_answers
            for node in gone:  # not a client problem: the federation goes on with the nodes it has
                log(WARNING, "discovery: node %d went offline before it answered; left out", node)
            answered = {node for node, _ in replies}
            silent = [node for node in nodes if node not in answered and node not in gone]
            for node in answered:
                self._silent.pop(node, None)
            if silent and exclusive:
                for node in silent:
                    self._exclude(node, f"it did not answer the pre-flight within {timeout:.0f}s", excluded)
                refused = True
            elif silent and strict:
                problems.append(f"{len(silent)} node(s) did not answer within {timeout:.0f}s")
            elif silent:
                self._back_off(silent, timeout)
            if problems and strict:
                raise RuntimeError("clients are not ready to train:\n  " + "\n  ".join(problems))
            for problem in problems:
                log(WARNING, "discovery: %s", problem)
            if exclusive:  # not waiting for other nodes when those connected cannot be enough
                self._require_enough(excluded, len(self._candidates(grid)))
            # a refused node counted towards min_available_nodes: wait for the ones that remain
            if not (strict and refused):
                break
        if exclusive:
            self._require_enough(excluded, len([n for n in grid.get_node_ids() if n in self.node_partition]))
        return dict(self.node_partition)

    def _may_ask(self, node: int, strict: bool) -> bool:
        """Whether discovery may query ``node`` now: always before round 1; during the run, not
        before the back-off of its last silence has passed."""
        return strict or time.monotonic() >= self._silent.get(node, (0.0, 0.0))[0]

    def _back_off(self, silent: list[int], timeout: float) -> None:
        """Nodes that did not answer a query during the run are not asked again, and so not
        waited for, until a back-off has passed: DISCOVERY_ATTEMPT, doubling at every silence."""
        now = time.monotonic()
        for node in silent:
            pause = 2 * self._silent[node][1] if node in self._silent else DISCOVERY_ATTEMPT
            self._silent[node] = (now + pause, pause)
            log(WARNING, "discovery: node %d did not answer within %.0fs; not asked again for %.0fs", node, timeout,
                pause)

    def _require_enough(self, excluded: Exclusions, remaining: int) -> None:
        """Stop the run when the pre-flight excluded a site and fewer than ``min_available_nodes``
        connected nodes ``remaining`` may serve a partition, naming every node left out and why.
        (Too few because nodes never connected is the patience of :meth:`_wait_for_nodes`: the
        run goes on with those there, as without identities.)"""
        if not excluded.sites or remaining >= self.min_available_nodes:
            return
        left_out = {**excluded.refused, **excluded.sites}
        raise RuntimeError(
            f"clients are not ready to train: {remaining} node(s) left to serve a partition, min-available-clients "
            f"is {self.min_available_nodes}; left out:\n  "
            + "\n  ".join(f"node {node}: {why}" for node, why in sorted(left_out.items())))

    def _screen(self, grid: Grid, excluded: Exclusions) -> tuple[list[int], dict[int, Identity], bool]:
        """The connected nodes whose identity may serve a partition, the identities read, and
        whether a node was refused: the others are refused here, before they are sent anything
        at all (the query included)."""
        nodes = self._wait_for_nodes(grid)
        identities = self._identities(grid)
        refused = self._note_keys(identities, excluded)
        kept = []
        for node in nodes:
            if node in self.sites.refused and self.sites.refused[node].final:  # by _note_keys just now
                continue
            if node not in self.node_partition and not self.sites.trusted_claims:
                if node not in identities:  # connected after the list was read: next time
                    continue
                refusal = self.sites.screen(node, identities[node], self.num_partitions)
                if refusal is not None:
                    self._refuse(node, refusal.reason, excluded)
                    refused = True
                    continue
            kept.append(node)
        return kept, identities, refused

    def _note_keys(self, identities: dict[int, Identity], excluded: Exclusions) -> bool:
        """Refuse, loudly, every node of a partition that two registered keys map to in this run
        (``SiteRegistry.note_keys``); returns whether a node was refused."""
        contested, refusals = self.sites.note_keys(identities)
        for pid in contested:
            log(WARNING, "Partition %d is registered under more than one key: %s. Every node of it is refused "
                "for the rest of this run: unregister the wrong key (flwr supernode unregister NODE_ID), "
                "then resume the run.", pid, self.sites.describe_keys(pid))
        for node, refusal in refusals.items():
            self._refuse(node, refusal.reason)
            excluded.sites[node] = refusal.reason
        return bool(refusals)

    def _bind_answers(self, grid: Grid, replies: list[tuple[int, Message]], identities: dict[int, Identity],
                      strict: bool, excluded: Exclusions) -> tuple[list[str], bool]:
        """Bind each answering node to the partition it claims, where its identity (as
        :meth:`_screen` read it) agrees; returns the problems (misconfigured clients) and
        whether a node was refused or excluded."""
        exclusive = strict and not self.sites.trusted_claims
        problems: list[str] = []
        answers: list[tuple[int, ClientInfo]] = []
        refused = False
        for node, reply in replies:
            try:
                answers.append((node, parse_query_reply(reply, self.max_samples_per_client)))
            except InvalidReply as err:
                if exclusive:
                    self._exclude(node, f"its pre-flight answer is invalid: {err}", excluded)
                    refused = True
                else:
                    problems.append(f"node {node}: {err}")
        if self.num_partitions is None and answers:
            self._size_from(answers, identities)
        connected = set(grid.get_node_ids())
        for node, info in sorted(answers):
            identity = identities.get(node, Identity())  # every asked node's, unless claims are believed
            # screened again: the federation's size may only now be known. Who a node is comes
            # first: an answer its identity does not back is refused, and nothing else in it
            # (its num-partitions) can stop the pre-flight
            refusal = self.sites.screen(node, identity, self.num_partitions)
            if refusal is None and self.sites.backs(identity, info.partition_id):
                if info.num_partitions != self.num_partitions:
                    problem = (f"num-partitions {info.num_partitions}, the federation's is {self.num_partitions} "
                               f"({self._size_source()})")
                    if exclusive:
                        self._exclude(node, problem, excluded)
                        refused = True
                    else:
                        problems.append(f"node {node}: {problem}")
                    continue
            refusal = refusal or self.sites.bind(node, info.partition_id, identity, connected)
            if refusal is not None:
                if self.sites.trusted_claims and strict:  # no identity to tell who is right: stop
                    problems.append(f"node {node}: {refusal.reason}")
                else:
                    self._refuse(node, refusal.reason, excluded)
                refused = True
                continue
            log(INFO, "node %d: partition %d/%d, %d training and %d test samples", node, info.partition_id,
                info.num_partitions, info.num_examples, info.test_examples)
        return problems, refused

    def _size_from(self, answers: list[tuple[int, ClientInfo]], identities: dict[int, Identity]) -> None:
        """Every node partitions the same dataset into the same J parts: where the operator did
        not say J (``partition-map``), it is what most of the nodes whose identity backs their
        claim answer (``common.sites.federation_size``); a node that disagrees is misconfigured."""
        backed = [info.num_partitions for node, info in answers
                  if self.sites.backs(identities.get(node), info.partition_id)]
        if not backed:
            return
        self.num_partitions = federation_size(backed)
        if len(set(backed)) > 1:
            log(WARNING, "discovery: the nodes disagree on num-partitions (%s): the federation's is %d, %s",
                ", ".join(f"{n}: {backed.count(n)} node(s)" for n in sorted(set(backed))), self.num_partitions,
                "the most common answer, the smaller on a tie (partition-map sets it: name the sites there)")

    def _size_source(self) -> str:
        return "from partition-map" if self.sites.declared_size() is not None else "as most nodes answer"

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
