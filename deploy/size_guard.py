"""A SuperNode's reply is refused where its bytes enter the SuperLink, once it outgrows its run.

Flower 1.39 moves a message as a tree of objects: a SuperNode declares the reply's tree with
``PushMessages``, then sends each object with ``PushObject``, and the SuperLink stores what it is
sent. The ServerApp's grid hands the reply over only after it has pulled every object of the tree
into memory and inflated it. Nothing on that way bounds a size: one object may be as large as a
gRPC message (2 GB), a tree may name any number of objects, and an ``Array`` object lists, by
index, the chunks its data is the concatenation of, so an Array of a few kilobytes that names
one chunk a million times inflates to terabytes. The ServerApp's own check of a reply's size
(``server_app.strategy.max_reply_bytes``) runs on the inflated message: too late, a hostile site's
reply has by then taken the ServerApp's memory. So the bytes are counted where they enter, in the
Fleet API's handlers, and the object that takes a reply past the limit is refused before Flower
stores it.

Two sizes of a reply are held to the limit: the bytes of its objects, which the ServerApp pulls,
and the bytes its Arrays make when inflated (each chunk reference at that chunk's size, or at a
whole chunk while the chunk has not arrived). An object counts wherever it comes from, since Flower
stores each object once and the ServerApp pulls every object the tree names: those the store held
when the tree was declared, and those another push session stores (another reply's, the
ServerApp's) while the tree waits for them. The inflated size is an upper bound only while no
chunk is larger than Flower cuts them and an Array names chunks only, so a chunk larger than
Flower's (a few bytes of head over ``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``), an Array object over
1 MiB (an honest one holds dtype, shape and one small index per 5 MB chunk) and an Array that
repeats another Array (which would multiply the sizes) are refused too.

The limit is derived from the run, not configured: 2 x the largest instruction the ServerApp
pushed in the run + one chunk + 1 MiB. A reply of this product sends back at most the part of the
model its instruction carried, and statistics smaller than it (the ServerApp refuses more itself:
2 x model + 64 KiB); the chunk covers an Array that arrives before its last chunk (then counted
whole). The ServerApp's instructions pass through this SuperLink's Runtime API, so they are
measured as they are pushed, without reading anything back (the instruction a reply answers is
gone from the store by then: its node deleted it on receipt). Until the run has pushed an
instruction this process measured (a SuperLink restarted mid-run) the limit is 64 MiB.
``FEDPAC_SUPERLINK_MAX_REPLY_BYTES`` pins the limit instead, for a ServerApp whose replies are
not proportional to its instructions. The ServerApp's own pushes are measured, never refused.

A refusal is logged as a WARNING naming the node and the sizes, and answered as
``deploy/fleet_guard.py`` answers its own: a ``FlowerError``, PERMISSION_DENIED, on which Flower's
SuperNode drops the reply. The refused reply is deleted with what of it was stored (Flower's own
clean-up of an expired push session), so a ServerApp already pulling it gets "unavailable" at
once instead of waiting for the missing object.

Not bounded here: the SuperLink itself receives each request whole (gRPC admits up to 2 GB) and
holds it while it refuses it; only the ServerApp is kept from it.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import WARNING
from typing import NoReturn, Protocol

from flower_pin import require_flower

# It wraps private Flower handlers and cleans up Flower's push sessions: on another release, a refusal.
require_flower("deploy/size_guard.py")

from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE, SUPERLINK_NODE_ID  # noqa: E402
from flwr.proto.fleet_pb2 import PushMessagesRequest, PushMessagesResponse  # noqa: E402  # pylint: disable=E0611
from flwr.proto.message_pb2 import ObjectTree, PushObjectRequest, PushObjectResponse  # noqa: E402  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import PushAppMessagesRequest, PushAppMessagesResponse  # noqa: E402  # pylint: disable=E0611
from flwr.proto.task_pb2 import Task  # noqa: E402  # pylint: disable=E0611
from flwr.server.superlink.fleet.message_handler import message_handler  # noqa: E402
from flwr.server.superlink.linkstate import LinkState  # noqa: E402
from flwr.supercore import log  # noqa: E402
from flwr.supercore.constant import HEAD_BODY_DIVIDER, HEAD_VALUE_DIVIDER, OBJECT_PUSH_SESSION_TTL_SECONDS  # noqa: E402
from flwr.supercore.error import ApiErrorCode, FlowerError  # noqa: E402
from flwr.supercore.inflatable.inflatable_object import iterate_object_tree  # noqa: E402
from flwr.supercore.object_store import ObjectStore  # noqa: E402
from flwr.superlink.servicer.runtime import runtime_handlers  # noqa: E402

MiB = 1 << 20
ENVIRONMENT = "FEDPAC_SUPERLINK_MAX_REPLY_BYTES"
CHUNK_BYTES = FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE + 1024  # an ArrayChunk object: Flower's chunk and a short head
ARRAY_BYTES = MiB  # an Array object: its head and dtype, shape and one index per chunk
REPLY_FACTOR = 2
REPLY_ALLOWANCE = CHUNK_BYTES + MiB
DEFAULT_MAX_REPLY_BYTES = 64 * MiB
# Flower forgets a push session this long after its last object; a tree nobody finishes is forgotten a minute later.
FORGET_AFTER = OBJECT_PUSH_SESSION_TTL_SECONDS + 60.0

# What the refused SuperNode is told (Flower sends this beside its public message for the code).
PUBLIC_DETAILS = "The SuperLink accepts no reply larger than the replies of its run can be."


# --- the decisions (pure) ------------------------------------------------------------------------

@dataclass(frozen=True)
class Limit:
    """The most bytes a reply of a run may have, and where that number comes from (for the log)."""

    bytes: int
    basis: str


@dataclass(frozen=True)
class Policy:
    """How a run's reply limit is set: ``configured`` bytes when the operator pinned it, else
    ``factor`` x the run's largest instruction + ``allowance``, ``fallback`` before there is one."""

    configured: int | None = None
    factor: int = REPLY_FACTOR
    allowance: int = REPLY_ALLOWANCE
    fallback: int = DEFAULT_MAX_REPLY_BYTES

    def limit(self, largest_instruction: int | None) -> Limit:
        """The limit of a run whose largest instruction measured so far has ``largest_instruction`` bytes."""
        if self.configured is not None:
            return Limit(self.configured, ENVIRONMENT)
        if largest_instruction is None:
            return Limit(self.fallback, "the default: the run has pushed no instruction this SuperLink measured")
        return Limit(self.factor * largest_instruction + self.allowance,
                     f"{self.factor} x the run's largest instruction, {largest_instruction:,} bytes, "
                     f"+ {self.allowance:,}")


def kind_of(content: bytes) -> str:
    """The class an object's head names (its first value), "" when it has none Flower could read."""
    end = content.find(HEAD_VALUE_DIVIDER.encode(), 0, 64)  # class names are short: never scan a big body
    return content[:end].decode("ascii", "replace") if end > 0 else ""


def chunk_references(content: bytes) -> dict[str, int]:
    """How often an Array object's inflated data repeats each of its chunks: Flower's
    ``Array.inflate`` concatenates ``children[i]`` for each ``i`` of ``arraychunk_ids``. Empty when
    the object does not parse (Flower's inflation then fails before it copies a chunk)."""
    end = content.find(HEAD_BODY_DIVIDER)
    try:
        _, children, _ = content[:end].decode("utf-8").split(HEAD_VALUE_DIVIDER)
        ids = children.split(",") if children else []
        indices = json.loads(content[end + len(HEAD_BODY_DIVIDER):])["arraychunk_ids"]
        return dict(Counter(ids[i] for i in indices))
    except (ValueError, KeyError, IndexError, TypeError):
        return {}


def object_refusal(kind: str, size: int, limit: Limit) -> str | None:
    """What is wrong with one object of class ``kind`` and ``size`` bytes (words for the log),
    None when no object of that class that large can be part of a valid reply."""
    cap, basis = {"ArrayChunk": (CHUNK_BYTES, "a chunk as Flower cuts arrays"),
                  "Array": (ARRAY_BYTES, "an Array's list of its chunks")}.get(kind, (limit.bytes, limit.basis))
    if limit.bytes < cap:
        cap, basis = limit.bytes, limit.basis
    if size <= cap:
        return None
    return f"an object of {size:,} bytes ({kind or 'no readable class'}), more than the {cap:,} allowed ({basis})"


def tree_refusal(root: str, pushed: int, inflated: int, nested: bool, limit: Limit) -> str | None:
    """What is wrong with the reply ``root`` whose objects have ``pushed`` bytes and whose Arrays
    inflate to ``inflated`` bytes (words for the log), None when both are within ``limit``.
    ``nested``: one of its Arrays repeats another Array, which Flower never makes, and which would
    make the inflated bytes a product of Arrays instead of a sum."""
    if nested:
        return f"a reply ({root}) with an Array that repeats another Array"
    if pushed > limit.bytes:
        return f"a reply ({root}) of {pushed:,} bytes, more than the {limit.bytes:,} allowed ({limit.basis})"
    if inflated > limit.bytes:
        return (f"a reply ({root}) whose arrays inflate to {inflated:,} bytes, more than the {limit.bytes:,} "
                f"allowed ({limit.basis})")
    return None


@dataclass(frozen=True)
class Arrival:
    """One object as it reaches the SuperLink: its size, and what its inflation repeats."""

    object_id: str
    kind: str
    size: int
    references: Mapping[str, int]  # an Array's: chunk id -> how often its data repeats that chunk

    @classmethod
    def of(cls, object_id: str, content: bytes) -> Arrival:
        """The arrival of ``content``; an Array is parsed only when it is small enough to be one."""
        kind = kind_of(content)
        parse = kind == "Array" and len(content) <= ARRAY_BYTES
        return cls(object_id, kind, len(content), chunk_references(content) if parse else {})


@dataclass
class Tree:
    """One message's object tree as its sender declared it, and what of it has been counted."""

    run_id: int
    root: str
    node_id: int
    pending: set[str]  # objects not yet counted that the SuperLink waits for
    sizes: dict[str, int] = field(default_factory=dict)  # bytes of each object counted
    arrays: set[str] = field(default_factory=set)  # the counted objects that are Arrays
    guessed: Counter[str] = field(default_factory=Counter)  # chunk not yet counted -> its repeats, each counted whole
    pushed: int = 0  # bytes of the counted objects
    inflated: int = 0  # bytes the counted Arrays make when inflated
    nested: bool = False  # an Array repeats an Array
    touched: float = field(default_factory=time.monotonic)

    def totals_after(self, arrival: Arrival) -> tuple[int, int, bool]:
        """(pushed, inflated, nested) once ``arrival`` is counted too. A chunk an Array repeats
        before the chunk arrived counts as a whole chunk (CHUNK_BYTES), then as its size."""
        if arrival.object_id in self.sizes:
            return self.pushed, self.inflated, self.nested
        repeated = sum(n * self.sizes.get(chunk, CHUNK_BYTES) for chunk, n in arrival.references.items())
        inflated = self.inflated + repeated + self.guessed[arrival.object_id] * (arrival.size - CHUNK_BYTES)
        nested = self.nested or (arrival.kind == "Array" and (
            arrival.object_id in self.guessed or any(chunk in self.arrays for chunk in arrival.references)))
        return self.pushed + arrival.size, inflated, nested

    def refusal(self, limit: Limit, arrival: Arrival | None = None) -> str | None:
        """What is wrong with this reply (once ``arrival`` is counted too), None when nothing."""
        totals = (self.pushed, self.inflated, self.nested) if arrival is None else self.totals_after(arrival)
        return tree_refusal(self.root, *totals, limit)

    def count(self, arrival: Arrival) -> None:
        """Count ``arrival`` (once: a retried object is not counted again)."""
        if arrival.object_id not in self.sizes:
            self.pushed, self.inflated, self.nested = self.totals_after(arrival)
            self.sizes[arrival.object_id] = arrival.size
            if arrival.kind == "Array":
                self.arrays.add(arrival.object_id)
            del self.guessed[arrival.object_id]
            self.guessed.update({chunk: n for chunk, n in arrival.references.items() if chunk not in self.sizes})
        self.pending.discard(arrival.object_id)
        self.touched = time.monotonic()


def declared(store: ObjectStore, run_id: int, node_id: int, tree: ObjectTree) -> Tree:
    """The tree ``node_id`` declares, with the objects ``store`` already holds counted (the
    ServerApp pulls those with the rest) and the others pending."""
    counted = Tree(run_id, tree.object_id, node_id, pending=set())
    for object_id in {node.object_id for node in iterate_object_tree(tree)}:
        if content := store.get(object_id):  # b"": announced, not yet pushed; None: unknown
            counted.count(Arrival.of(object_id, content))
        else:
            counted.pending.add(object_id)
    return counted


def configured_limit(environ: Mapping[str, str] = os.environ) -> int | None:
    """The reply limit the operator pinned in ``FEDPAC_SUPERLINK_MAX_REPLY_BYTES`` (bytes), None
    when it is unset or ``auto`` (derived from each run's instructions)."""
    raw = environ.get(ENVIRONMENT, "").strip()
    if raw in ("", "auto"):
        return None
    if not raw.isdigit() or int(raw) < MiB:
        raise SystemExit(f"{ENVIRONMENT} must be 'auto' or a number of bytes of at least {MiB}, got {raw!r}")
    return int(raw)


# --- the glue: Flower's handlers ------------------------------------------------------------------

class FleetPushMessages(Protocol):
    """Flower's Fleet ``push_messages`` handler (FleetServicer calls it with keyword arguments)."""

    def __call__(self, request: PushMessagesRequest, state: LinkState) -> PushMessagesResponse: ...


class FleetPushObject(Protocol):
    """Flower's Fleet ``push_object`` handler (keyword arguments too)."""

    def __call__(self, request: PushObjectRequest, state: LinkState) -> PushObjectResponse: ...


class RuntimePushMessages(Protocol):
    """The SuperLink's Runtime API ``push_messages`` handler (the ServerApp's; positional arguments)."""

    def __call__(self, request: PushAppMessagesRequest, state: LinkState, task: Task) -> PushAppMessagesResponse: ...


class RuntimePushObject(Protocol):
    """The SuperLink's Runtime API ``push_object`` handler (the ServerApp's; positional arguments)."""

    def __call__(self, request: PushObjectRequest, state: LinkState, task: Task) -> PushObjectResponse: ...


class SizeGuard:
    """Counts each reply a SuperNode pushes against its run's limit, and measures the ServerApp's
    instructions the limit derives from. Flower serves the APIs from a pool of threads: one lock."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._replies: dict[str, Tree] = {}  # a SuperNode's push session -> the reply it pushes
        self._instructions: dict[str, list[Tree]] = {}  # a ServerApp's push session -> its messages
        self._largest: dict[int, int] = {}  # run -> bytes of its largest instruction so far

    def limit(self, run_id: int) -> Limit:
        """The reply limit of run ``run_id`` now."""
        with self._lock:
            return self._limit(run_id)

    def _limit(self, run_id: int) -> Limit:
        return self.policy.limit(self._largest.get(run_id))

    # Fleet API: a SuperNode's reply ------------------------------------------------------------

    def fleet_push_messages(self, push_messages: FleetPushMessages) -> FleetPushMessages:
        """``push_messages`` that refuses a reply whose tree names more stored bytes than a reply
        may have, and starts counting the objects Flower then asks the node for."""

        @functools.wraps(push_messages)
        def counted_push_messages(request: PushMessagesRequest, state: LinkState) -> PushMessagesResponse:
            if not request.messages_list or not request.message_object_trees:
                return push_messages(request=request, state=state)  # Flower refuses it
            node_id = request.node.node_id
            run_id = request.messages_list[0].metadata.run_id  # Flower takes the first message alone
            store = state.object_store
            tree = declared(store, run_id, node_id, request.message_object_trees[0])
            if why := tree.refusal(self.limit(run_id)):
                _refuse("PushMessages", node_id, why)
            response = push_messages(request=request, state=state)
            with self._lock:
                tree.pending &= set(response.objects_to_push)
                if not tree.pending:
                    return response
                self._forget_stale()
                self._replies[response.session_id] = tree
                waiting = list(tree.pending)
            # what another session stored since the store was read, the ServerApp pulls too
            late = [Arrival.of(object_id, content) for object_id in waiting if (content := store.get(object_id))]
            with self._lock:
                for arrival in late:
                    tree.count(arrival)
                why = tree.refusal(self._limit(run_id))
                if why is not None or not tree.pending:
                    self._replies.pop(response.session_id, None)
            if why is not None:
                state._cleanup_push_session(response.session_id, cleanup_messages=True)  # pylint: disable=W0212
                _refuse("PushMessages", node_id, why)
            return response

        return counted_push_messages

    def fleet_push_object(self, push_object: FleetPushObject) -> FleetPushObject:
        """``push_object`` that refuses, before it is stored, an object too large for any reply or
        one that takes its reply past the limit (and then deletes that reply)."""

        @functools.wraps(push_object)
        def counted_push_object(request: PushObjectRequest, state: LinkState) -> PushObjectResponse:
            node_id, arrival = request.node.node_id, Arrival.of(request.object_id, request.object_content)
            with self._lock:
                session_id, tree = self._reply_of(request)
                limit = self._limit(request.run_id if tree is None else tree.run_id)
                # an object no reply of ours waits for (Flower stores it only for a session we do
                # not count) is held to the limit as a reply of its own
                counting = tree if tree is not None else Tree(request.run_id, request.object_id, node_id, set())
                why = object_refusal(arrival.kind, arrival.size, limit) or counting.refusal(limit, arrival)
                if tree is not None:
                    if why is None:
                        tree.count(arrival)  # before it is stored: a concurrent push sees it counted
                    if why is not None or not tree.pending:
                        self._replies.pop(session_id, None)
            if why is not None:
                if tree is not None:  # the reply cannot complete: delete it and what of it was stored
                    state._cleanup_push_session(session_id, cleanup_messages=True)  # pylint: disable=W0212
                _refuse("PushObject", node_id, why)
            response = push_object(request=request, state=state)
            if response.stored:
                self._arrived(state, arrival, session_id)
            return response

        return counted_push_object

    def _reply_of(self, request: PushObjectRequest) -> tuple[str, Tree | None]:
        """The push session of ``request`` and the reply that waits for its object (None: no
        reply of ours does). A SuperNode that sends no session id is matched as Flower matches
        it: with the session waiting for that object. The lock is held."""
        if request.session_id:
            tree = self._replies.get(request.session_id)
            waits = tree is not None and tree.run_id == request.run_id and request.object_id in tree.pending
            return request.session_id, tree if waits else None
        for session_id, tree in self._replies.items():
            if tree.run_id == request.run_id and request.object_id in tree.pending:
                return session_id, tree
        return "", None

    def _waits_for(self, object_id: str) -> bool:
        with self._lock:
            return any(object_id in tree.pending for tree in self._replies.values())

    def _arrived(self, state: LinkState, arrival: Arrival, source_session: str) -> None:
        """Count an object just stored in every other reply that waits for it: Flower stores an
        object once, so a reply that names an object another session pushes (the ServerApp's, or
        another node's) gets it without its node pushing it, and the ServerApp pulls it with the
        reply. A reply that then outgrows its limit is deleted."""
        dropped: list[tuple[str, Tree, str]] = []
        with self._lock:
            for session_id, tree in list(self._replies.items()):
                if session_id == source_session or arrival.object_id not in tree.pending:
                    continue
                tree.count(arrival)
                why = tree.refusal(self._limit(tree.run_id))
                if why is not None or not tree.pending:
                    del self._replies[session_id]
                if why is not None:
                    dropped.append((session_id, tree, why))
        for session_id, tree, why in dropped:
            log(WARNING, "Refused the reply of node %s: it named %s", tree.node_id, why)
            state._cleanup_push_session(session_id, cleanup_messages=True)  # pylint: disable=W0212

    # Runtime API: the ServerApp's instructions -------------------------------------------------

    def runtime_push_messages(self, push_messages: RuntimePushMessages) -> RuntimePushMessages:
        """``push_messages`` that starts measuring each instruction the ServerApp pushes."""

        @functools.wraps(push_messages)
        def measured_push_messages(request: PushAppMessagesRequest, state: LinkState,
                                   task: Task) -> PushAppMessagesResponse:
            response = push_messages(request, state, task)
            trees = [declared(state.object_store, task.run_id, SUPERLINK_NODE_ID, tree)
                     for tree, message_id in zip(request.message_object_trees, response.message_ids) if message_id]
            asked = set(response.objects_to_push)
            with self._lock:
                self._forget_stale()
                for tree in trees:
                    tree.pending &= asked
                    self._measure(tree)
                if unfinished := [tree for tree in trees if tree.pending]:
                    self._instructions[response.session_id] = unfinished
            return response

        return measured_push_messages

    def runtime_push_object(self, push_object: RuntimePushObject) -> RuntimePushObject:
        """``push_object`` that adds each object the ServerApp stored to its instructions' sizes
        (and to a reply that named it)."""

        @functools.wraps(push_object)
        def measured_push_object(request: PushObjectRequest, state: LinkState, task: Task) -> PushObjectResponse:
            response = push_object(request, state, task)
            if not response.stored:
                return response
            arrival = Arrival(request.object_id, "", len(request.object_content), {})
            with self._lock:
                trees = self._instructions.get(request.session_id, [])
                for tree in trees:
                    if request.object_id in tree.pending:
                        tree.count(arrival)
                        self._measure(tree)
                if trees and not any(tree.pending for tree in trees):
                    del self._instructions[request.session_id]
            if self._waits_for(request.object_id):
                self._arrived(state, Arrival.of(request.object_id, request.object_content), request.session_id)
            return response

        return measured_push_object

    def _measure(self, tree: Tree) -> None:
        """The lock is held."""
        self._largest[tree.run_id] = max(self._largest.get(tree.run_id, 0), tree.pushed)

    def _forget_stale(self) -> None:
        """Drop the trees nobody has pushed to for longer than Flower keeps their sessions. The
        lock is held."""
        stale = time.monotonic() - FORGET_AFTER
        for session_id in [s for s, tree in self._replies.items() if tree.touched < stale]:
            del self._replies[session_id]
        for session_id in [s for s, trees in self._instructions.items() if max(t.touched for t in trees) < stale]:
            del self._instructions[session_id]


def _refuse(rpc: str, node_id: int, why: str) -> NoReturn:
    log(WARNING, "Refused %s from node %s: it pushed %s", rpc, node_id, why)
    raise FlowerError(ApiErrorCode.NO_PERMISSIONS, f"node {node_id} pushed {why}", public_details=PUBLIC_DETAILS)


def install(policy: Policy | None = None) -> SizeGuard:
    """Count the replies SuperNodes push through the Fleet API of this process, and measure the
    instructions the ServerApp pushes through its Runtime API (``patient_superlink.main``)."""
    guard = SizeGuard(policy if policy is not None else Policy(configured_limit()))
    message_handler.push_messages = guard.fleet_push_messages(message_handler.push_messages)
    message_handler.push_object = guard.fleet_push_object(message_handler.push_object)
    runtime_handlers.push_messages = guard.runtime_push_messages(runtime_handlers.push_messages)
    runtime_handlers.push_object = guard.runtime_push_object(runtime_handlers.push_object)
    return guard
