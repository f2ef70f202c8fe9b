"""deploy/fleet_guard.py: through the SuperLink's Fleet API a SuperNode pushes only its own replies
to the server. An enrolled node A attacks node B through Flower's own Fleet message handler and a
real LinkState (in memory and SQLite, as ``flower-superlink --database`` makes them): an
instruction addressed to B (in its own name, the server's or B's), a reply in B's name to a
message the server sent B, a reply of its own to that message, a reply addressed to B. Each is
refused and logged, with the guard that ``patient_superlink.main`` installs, and B receives
nothing; B's own reply still reaches the server. Without the guard Flower hands B the instruction
in the server's name and the server B's answer written by A (and takes the rest quietly), so
these tests fail.

deploy/size_guard.py: the SuperLink counts a reply's bytes as its node pushes them and refuses,
before it is stored, an object or a reply larger than a reply of its run can be (or whose Arrays
inflate past that), while the ServerApp's own pushes, from which the limit derives, go through.
Without that guard Flower stores all of it and the ServerApp pulls and inflates it whole."""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.app.message import remove_content_from_message
from flwr.common.constant import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID, SUPERLINK_NODE_ID
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.fleet_pb2 import PullMessagesRequest, PushMessagesRequest, PushMessagesResponse  # pylint: disable=E0611
from flwr.proto.message_pb2 import PushObjectRequest  # pylint: disable=E0611
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import PushAppMessagesRequest  # pylint: disable=E0611
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.grpc_rere.fleet_servicer import FleetServicer
from flwr.server.superlink.fleet.message_handler import message_handler
from flwr.server.superlink.linkstate import LinkState, LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID, TaskType
from flwr.supercore.error import ApiErrorCode, FlowerError, rpc_error_translator
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree, iterate_object_tree
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.object_store import ObjectStore, ObjectStoreFactory
from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
from flwr.supercore.object_store.sql_object_store import SqlObjectStore
from flwr.superlink.cli.flower_superlink import SuperLinkLifespan
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.servicer.runtime import runtime_handlers

from tests.deployment import ROOT

sys.path.insert(0, str(ROOT / "deploy"))
import fleet_guard  # noqa: E402  pylint: disable=wrong-import-position
import flower_pin  # noqa: E402  pylint: disable=wrong-import-position
import patient_superlink  # noqa: E402  pylint: disable=wrong-import-position
import size_guard  # noqa: E402  pylint: disable=wrong-import-position

DATABASES = {"memory": FLWR_IN_MEMORY_DB_NAME, "sqlite": ":memory:"}  # InMemoryLinkState, SqlLinkState
MiB = 1 << 20


@dataclass
class Link:
    """A SuperLink's LinkState with a running run and two registered, online nodes: A (the
    attacker) and B (the victim)."""

    factory: LinkStateFactory
    state: LinkState
    store: ObjectStore
    run_id: int
    a: int
    b: int
    authors: dict[str, str] = field(default_factory=dict)  # message id -> who wrote the message

    def message(self, src: int, dst: int, reply_to: str = "", author: str = "server",
                content: RecordDict | None = None, expires: float | None = None) -> Message:
        """An evaluate message written by ``author``, as a SuperNode's connection pushes it (its id,
        the hash of its content and metadata, set as the node does), living 600 s or until
        ``expires`` (a reply: when the message it answers does, as Flower requires)."""
        created = time.time()
        ttl = 600.0 if expires is None else expires - created
        metadata = Metadata(self.run_id, "", src, dst, reply_to, "", created, ttl, MessageType.EVALUATE)
        content = RecordDict({"config": ConfigRecord({"from": author})}) if content is None else content
        # the constructor's internal form, with the metadata given (as Flower's own serde builds messages)
        message = Message(content, metadata=metadata)  # type: ignore[call-overload]
        message.metadata.__dict__["_message_id"] = message.object_id
        self.authors[message.metadata.message_id] = author
        return message

    def send(self, dst: int) -> Message:
        """The ServerApp's instruction to ``dst``, stored as the Runtime API's PushMessages does."""
        instruction = self.message(SUPERLINK_NODE_ID, dst)
        stored, _ = self.state.store_message_and_object_tree(instruction, get_object_tree(instruction),
                                                             self.state.start_session(self.run_id))
        assert stored
        return instruction

    def reply(self, node: int, to: Message, src: int | None = None, dst: int = SUPERLINK_NODE_ID,
              content: RecordDict | None = None) -> Message:
        """A reply to ``to`` written by ``node``, in ``src``'s name (its own by default)."""
        return self.message(node if src is None else src, dst, to.metadata.message_id, author=f"node {node}",
                            content=content, expires=to.metadata.created_at + to.metadata.ttl)

    def serve(self, dst: int, content: RecordDict) -> Message:
        """The ServerApp's instruction to ``dst``, pushed as its grid pushes it: the Runtime API's
        PushMessages, then PushObject for each object the SuperLink asks for."""
        instruction, task = self.message(SUPERLINK_NODE_ID, dst, content=content), Task(run_id=self.run_id)
        request = PushAppMessagesRequest(messages_list=[message_to_proto(remove_content_from_message(instruction))],
                                         message_object_trees=[get_object_tree(instruction)])
        response = runtime_handlers.push_messages(request, self.state, task)
        assert list(response.message_ids) == [instruction.metadata.message_id]
        contents = contents_of(instruction)
        for object_id in response.objects_to_push:
            pushed = runtime_handlers.push_object(
                PushObjectRequest(node=Node(node_id=SUPERLINK_NODE_ID), run_id=self.run_id, object_id=object_id,
                                  object_content=contents[object_id], session_id=response.session_id), self.state, task)
            assert pushed.stored
        return instruction

    def push(self, node: int, message: Message) -> PushMessagesResponse:
        """``node`` pushes ``message`` through the Fleet API's handler (the authenticated node id
        in the request, as Flower's NodeAuthServerInterceptor lets it through)."""
        request = PushMessagesRequest(node=Node(node_id=node),
                                      messages_list=[message_to_proto(remove_content_from_message(message))],
                                      message_object_trees=[get_object_tree(message)])
        return message_handler.push_messages(request=request, state=self.state)

    def deliver(self, node: int, message: Message, session: bool = True) -> FlowerError | None:
        """``node`` pushes ``message`` whole, as Flower's SuperNode does: PushMessages, then
        PushObject for each object the SuperLink asks for, children first (without the push
        session's id when not ``session``, as older SuperNodes). The refusal, None when all went in."""
        try:
            self.push_objects(node, message, self.push(node, message), session=session)
        except FlowerError as refusal:
            return refusal
        return None

    def push_objects(self, node: int, message: Message, pushed: PushMessagesResponse, session: bool = True,
                     only: set[str] | None = None) -> None:
        """``node`` pushes the objects of ``message`` that the SuperLink asked for in ``pushed``
        (those in ``only``), children first, as Flower's SuperNode does."""
        contents, asked = contents_of(message), set(pushed.objects_to_push)
        for object_id in dict.fromkeys(tree.object_id for tree in iterate_object_tree(get_object_tree(message))):
            if object_id in asked and (only is None or object_id in only):
                message_handler.push_object(request=PushObjectRequest(
                    node=Node(node_id=node), run_id=self.run_id, object_id=object_id,
                    object_content=contents[object_id], session_id=pushed.session_id if session else ""),
                    state=self.state)

    def held(self, message: Message) -> list[str]:
        """The objects of ``message`` whose content the SuperLink's store holds."""
        return [object_id for object_id in contents_of(message) if self.store.get(object_id)]

    def pulled_by(self, node: int) -> list[Message]:
        """What ``node``'s next PullMessages hands it."""
        response = message_handler.pull_messages(PullMessagesRequest(node=Node(node_id=node)), self.state, self.store)
        return [message_from_proto(proto) for proto in response.messages_list]

    def replies_to(self, instruction: Message) -> list[Message]:
        """The replies to ``instruction`` that the ServerApp's next pull would get."""
        return [reply for reply in self.state.get_message_res({instruction.metadata.message_id}, self.run_id)
                if reply.metadata.src_node_id != SUPERLINK_NODE_ID]  # not the SuperLink's "no reply yet" errors


def contents_of(message: Message) -> dict[str, bytes]:
    """Every object of ``message`` by id, as its sender deflates them."""
    return {object_id: obj.deflate() for object_id, obj in get_all_nested_objects(message).items()}


@pytest.fixture(params=sorted(DATABASES))
def link(request) -> Link:
    stores = ObjectStoreFactory(DATABASES[request.param])  # as flower-superlink --database makes both
    factory = LinkStateFactory(DATABASES[request.param], NoOpFederationManager(), stores)
    state = factory.state()
    a, b = (state.create_node(NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, f"key-{n}".encode(), 30) for n in "ab")
    assert state.activate_node(a, 30) and state.activate_node(b, 30)
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, NOOP_FLWR_AID, TaskType.SERVER_APP)
    task = state.get_run_info(run_ids=[run_id])[0].primary_task_id
    assert task is not None and state.claim_task(task) and state.activate_task(task)
    return Link(factory, state, stores.store(), run_id, a, b)


@pytest.fixture
def guard(monkeypatch) -> None:
    """The guard installed as ``patient_superlink.main`` installs it, removed after the test."""
    monkeypatch.setattr(message_handler, "push_messages", message_handler.push_messages)
    fleet_guard.install()


@pytest.fixture
def warnings(caplog) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.WARNING, logger="flwr"):
        yield caplog


def attempt(link: Link, node: int, message: Message) -> FlowerError | None:
    """``node`` pushes ``message``: the guard's refusal, None when the SuperLink took the push."""
    try:
        link.push(node, message)
    except FlowerError as refusal:
        return refusal
    return None


def refused(refusal: FlowerError | None) -> str:
    """The refusal's message (what the SuperLink's log says), after checking it is the guard's."""
    assert refusal is not None, "the SuperLink took the push"
    assert refusal.code == ApiErrorCode.NO_PERMISSIONS
    return refusal.message


def written_by(link: Link, messages: list[Message]) -> list[tuple[int, str]]:
    """Each message's declared source and who really wrote it (the LinkState keeps a message's
    metadata; its content travels as objects, but its id is the hash of both)."""
    return [(m.metadata.src_node_id, link.authors[m.metadata.message_id]) for m in messages]


@pytest.mark.parametrize("forged_src", ["attacker", "server", "victim"])
def test_a_node_cannot_push_an_instruction_to_another_node(link, guard, warnings, forged_src):
    src = {"attacker": link.a, "server": SUPERLINK_NODE_ID, "victim": link.b}[forged_src]
    refusal = attempt(link, link.a, link.message(src, link.b, author="attacker"))
    assert written_by(link, link.pulled_by(link.b)) == []
    why = refused(refusal)
    assert why.startswith(f"node {link.a} pushed an instruction ('evaluate', from node {src} to node {link.b})")
    assert f"Refused PushMessages from node {link.a}: it pushed an instruction" in warnings.text
    # the ServerApp's own instructions still go out
    sent = link.send(link.b)
    assert [m.metadata.message_id for m in link.pulled_by(link.b)] == [sent.metadata.message_id]


def test_a_node_cannot_answer_in_another_node_s_name_and_the_victim_s_own_reply_goes_through(link, guard, warnings):
    instruction = link.send(link.b)
    assert len(link.pulled_by(link.b)) == 1
    refusal = attempt(link, link.a, link.reply(link.a, instruction, src=link.b))
    assert written_by(link, link.replies_to(instruction)) == []
    assert refused(refusal) == f"node {link.a} pushed a reply ('evaluate') in the name of node {link.b}"
    assert f"Refused PushMessages from node {link.a}: it pushed a reply ('evaluate') in the name" in warnings.text
    honest = link.reply(link.b, instruction)
    assert link.push(link.b, honest).results == {honest.metadata.message_id: 0}
    assert written_by(link, link.replies_to(instruction)) == [(link.b, f"node {link.b}")]


@pytest.mark.parametrize("case", ["reply-to-the-victim-s-message", "reply-addressed-to-the-victim"])
def test_what_flower_drops_quietly_is_refused_loudly(link, guard, warnings, case):
    """Flower's LinkState stores neither of these (a reply's source must be its message's
    destination, its destination the server), but answers the node "stored" and names no requester."""
    if case == "reply-to-the-victim-s-message":  # A answers in its own name a message sent to B
        instruction, replier = link.send(link.b), link.b
        forged = link.reply(link.a, instruction)
        expected = f"a reply ('evaluate') to message {instruction.metadata.message_id}, which was sent to node {link.b}"
    else:  # A answers its own message, to B instead of the server
        instruction, replier = link.send(link.a), link.a
        forged = link.reply(link.a, instruction, dst=link.b)
        expected = f"a reply ('evaluate') addressed to node {link.b}, not to the server"
    refusal = attempt(link, link.a, forged)
    assert written_by(link, link.replies_to(instruction)) == []
    assert expected in refused(refusal)
    assert f"Refused PushMessages from node {link.a}: it pushed {expected}" in warnings.text
    honest = link.reply(replier, instruction)
    link.push(replier, honest)
    assert written_by(link, link.replies_to(instruction)) == [(replier, f"node {replier}")]


def test_a_late_reply_to_a_message_the_link_no_longer_has_is_left_to_flower(link, guard, warnings):
    """Flower drops a reply to a message it does not have (expired, or never sent) and answers as
    usual; an honest node's late reply lands there, so the guard does not refuse it."""
    gone = link.message(SUPERLINK_NODE_ID, link.b)  # never stored
    late = link.reply(link.b, gone)
    assert link.push(link.b, late).results == {late.metadata.message_id: 0}
    assert "Refused PushMessages" not in warnings.text


def test_the_refused_node_is_answered_permission_denied_with_the_reason(link, guard):
    """What the SuperNode gets: Flower's FleetServicer under its error-translating interceptor
    turns the refusal into PERMISSION_DENIED, on which Flower's SuperNode drops the message
    instead of retrying it."""
    aborted: list[tuple[Any, str]] = []  # (grpc.StatusCode, details)

    class Aborted(Exception):
        """What grpc's ``context.abort`` raises to end the call."""

    class Context:
        def abort(self, code: Any, details: str) -> None:
            aborted.append((code, details))
            raise Aborted

        def code(self) -> Any:
            return aborted[-1][0] if aborted else None

    forged = link.message(SUPERLINK_NODE_ID, link.b, author="attacker")
    request = PushMessagesRequest(node=Node(node_id=link.a), messages_list=[message_to_proto(forged)],
                                  message_object_trees=[get_object_tree(forged)])
    servicer = FleetServicer(link.factory, ObjectStoreFactory(), enable_supernode_auth=True)
    context = Context()
    with contextlib.suppress(Aborted), rpc_error_translator(context, "/flwr.proto.Fleet/PushMessages"):
        servicer.PushMessages(request, context)
    assert written_by(link, link.pulled_by(link.b)) == []
    assert [code.name for code, _ in aborted] == ["PERMISSION_DENIED"]
    details = aborted[0][1]
    assert json.loads(details)["public_details"] == fleet_guard.PUBLIC_DETAILS


def test_the_superlink_launcher_installs_the_guard(link, monkeypatch):
    """``patient_superlink.main`` (what superlink.sh and the compose SuperLink run) guards the
    Fleet API (both guards, the size guard with ``FEDPAC_SUPERLINK_MAX_REPLY_BYTES``) and
    supervises its SuperExec before it starts Flower's SuperLink."""
    points = [(message_handler, "push_messages"), (message_handler, "pull_messages"),
              (runtime_handlers, "pull_messages"), (message_handler, "pull_object"),
              (runtime_handlers, "pull_object"), (InMemoryObjectStore, "put"), (SqlObjectStore, "put")]
    points += [(state, name) for state in (InMemoryLinkState, SqlLinkState)
               for name in ("store_message_ins", "store_message_res")]
    points += SIZE_HANDLERS
    points += [(SuperLinkLifespan, "_start_superexec_if_needed"), (SuperLinkLifespan, "shutdown")]
    for owner, name in points:
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    monkeypatch.setattr(patient_superlink.sql_mixin, "SQLITE_PRAGMAS", patient_superlink.sql_mixin.SQLITE_PRAGMAS)
    monkeypatch.setattr(sys, "argv", ["patient_superlink.py"])
    monkeypatch.setenv("FEDPAC_SUPERLINK_PULL_WAIT", "0")
    monkeypatch.setenv("FEDPAC_SUPERLINK_OBJECT_WAIT", "0")
    monkeypatch.setenv(size_guard.ENVIRONMENT, str(MiB))
    started = []
    monkeypatch.setattr(patient_superlink, "flower_superlink", lambda: started.append(message_handler.push_messages))
    patient_superlink.main()
    assert started and started[0] is message_handler.push_messages
    # the SuperExec is supervised (tests/test_supervised_superexec.py)
    assert SuperLinkLifespan._start_superexec_if_needed.__qualname__.startswith("install.")  # noqa: SLF001
    refusal = attempt(link, link.a, link.message(SUPERLINK_NODE_ID, link.b, author="attacker"))
    assert written_by(link, link.pulled_by(link.b)) == []
    refused(refusal)
    # and the size guard, with the operator's limit: a 2 MiB reply is refused, its objects never stored
    instruction = link.send(link.b)
    oversize = link.reply(link.b, instruction, content=records(2 * MiB))
    assert refused(link.deliver(link.b, oversize)).endswith(f"allowed ({size_guard.ENVIRONMENT})")
    assert link.held(oversize) == []


def test_the_guard_refuses_another_flower(monkeypatch):
    import importlib.metadata
    import importlib.util

    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.40.0" if name == "flwr" else real_version(name))
    spec = importlib.util.spec_from_file_location("_fresh_fleet_guard", ROOT / "deploy" / "fleet_guard.py")
    assert spec is not None and spec.loader is not None
    with pytest.raises(flower_pin.FlowerVersionError, match="deploy/fleet_guard.py .*flwr 1.40.0 is installed"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_the_superlink_image_carries_the_launcher_s_modules():
    """The compose SuperLink runs /opt/fedpac/patient_superlink.py: its image must hold every
    deploy/ module the launcher imports, the guard included, or the container fails at start
    (or the image fails to build)."""
    needed, pending = set(), ["patient_superlink"]
    while pending:
        name = pending.pop()
        needed.add(name)
        tree = ast.parse((ROOT / "deploy" / f"{name}.py").read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        pending += [m for m in imported if (ROOT / "deploy" / f"{m}.py").is_file() and m not in needed]
    assert {"fleet_guard", "size_guard"} <= needed
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    (copy,) = [line for line in dockerfile.splitlines() if line.startswith("COPY deploy/patient_superlink.py")]
    assert {f"deploy/{name}.py" for name in needed} <= set(copy.split()), copy
    # and the build context must carry them: .dockerignore excludes everything it does not name
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert {f"deploy/{name}.py" for name in needed} <= allowed, allowed


# --- deploy/size_guard.py: no reply larger than its run's ------------------------------------------

SIZE_HANDLERS = [(message_handler, "push_messages"), (message_handler, "push_object"),
                 (runtime_handlers, "push_messages"), (runtime_handlers, "push_object")]


@pytest.fixture
def sized(monkeypatch) -> Callable[[size_guard.Policy], size_guard.SizeGuard]:
    """Installs the size guard with a given policy as ``patient_superlink.main`` installs it
    (the Fleet and Runtime API's push handlers wrapped), removed after the test."""
    for owner, name in SIZE_HANDLERS:
        monkeypatch.setattr(owner, name, getattr(owner, name))
    return size_guard.install


def records(*sizes: int) -> RecordDict:
    """Content of one ConfigRecord per size, holding that many random bytes (no two alike)."""
    return RecordDict({f"record-{i}": ConfigRecord({"blob": os.urandom(n)}) for i, n in enumerate(sizes)})


def model(*sizes: int) -> RecordDict:
    """Content as Flower carries a model: an ArrayRecord of one random float32 array per size (in
    bytes), and metrics (random too: no two messages share an object)."""
    rng = np.random.default_rng()
    arrays = {f"w{i}": Array(rng.random(n // 4, dtype=np.float32)) for i, n in enumerate(sizes)}
    return RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"loss": float(rng.random())})})


def size_of(message: Message) -> int:
    """Bytes of all of ``message``'s objects."""
    return sum(len(content) for content in contents_of(message).values())


def test_an_object_larger_than_a_reply_may_be_is_refused_before_it_is_stored(link, sized, warnings):
    sized(size_guard.Policy(configured=MiB))
    instruction = link.send(link.b)
    reply = link.reply(link.b, instruction, content=records(2 * MiB))
    big = max(len(content) for content in contents_of(reply).values())
    why = refused(link.deliver(link.b, reply))
    assert why == (f"node {link.b} pushed an object of {big:,} bytes (ConfigRecord), more than the 1,048,576 "
                   f"allowed ({size_guard.ENVIRONMENT})")
    assert f"Refused PushObject from node {link.b}: it pushed an object of {big:,} bytes" in warnings.text
    # nothing of it is stored, and the reply is gone: a ServerApp pulling it is told at once
    assert link.held(reply) == [] and link.replies_to(instruction) == []


@pytest.mark.parametrize("session", [True, False], ids=["session-id", "no-session-id"])
def test_a_reply_whose_objects_each_fit_but_not_together_is_refused(link, sized, warnings, session):
    sized(size_guard.Policy(configured=MiB))
    instruction = link.send(link.b)
    reply = link.reply(link.b, instruction, content=records(400 * 1024, 400 * 1024, 400 * 1024))
    assert max(len(content) for content in contents_of(reply).values()) < MiB < size_of(reply)
    why = refused(link.deliver(link.b, reply, session=session))
    assert why.startswith(f"node {link.b} pushed a reply ({reply.metadata.message_id}) of ")
    assert why.endswith(f"bytes, more than the 1,048,576 allowed ({size_guard.ENVIRONMENT})")
    assert f"Refused PushObject from node {link.b}: it pushed a reply ({reply.metadata.message_id}) of" in warnings.text
    assert link.held(reply) == [] and link.replies_to(instruction) == []


def test_an_array_that_inflates_past_the_limit_is_refused(link, sized, warnings, monkeypatch):
    """An Array object lists the chunks its data concatenates: a node whose Flower cuts 1 KiB
    chunks sends 4 MiB of zeros as three distinct chunks and a list naming them 4,097 times, some
    15 KB in all, which the ServerApp inflates to 4 MiB (a list naming one 5 MB chunk a million
    times, to 5 TB)."""
    sized(size_guard.Policy(configured=MiB))
    instruction = link.send(link.b)
    monkeypatch.setattr("flwr.app.message.array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", 1024)
    zeros = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(MiB, dtype=np.float32))})})
    reply = link.reply(link.b, instruction, content=zeros)
    inflated = inflate_object_from_contents(reply.metadata.message_id, contents_of(reply))
    assert size_of(reply) < 20_000 and len(inflated.content["arrays"]["w"].data) > 4 * MiB
    why = refused(link.deliver(link.b, reply))
    assert f"pushed a reply ({reply.metadata.message_id}) whose arrays inflate to " in why
    assert "Refused PushObject" in warnings.text
    assert link.held(reply) == [] and link.replies_to(instruction) == []


def test_an_array_chunk_larger_than_flower_cuts_them_is_refused(link, sized, monkeypatch):
    """The inflated size is bounded only while every chunk is one of Flower's: a node cutting 8 MiB
    chunks is refused even under a limit its reply fits."""
    sized(size_guard.Policy(configured=64 * MiB))
    instruction = link.send(link.b)
    monkeypatch.setattr("flwr.app.message.array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", 8 * MiB)
    reply = link.reply(link.b, instruction, content=model(6 * MiB))
    why = refused(link.deliver(link.b, reply))
    chunk = size_guard.CHUNK_BYTES
    assert why.endswith(f"(ArrayChunk), more than the {chunk:,} allowed (a chunk as Flower cuts arrays)")
    assert link.held(reply) == []


def test_a_reply_the_size_of_its_run_s_instructions_passes_and_a_larger_one_does_not(link, sized, warnings):
    """The limit derives from what the ServerApp pushed in the run: 2 x its largest instruction
    (measured as the ServerApp pushes it) + an allowance. The ServerApp's 1 MiB instructions go
    through although the limit was 64 KiB before it pushed any; an honest reply half as large again
    goes through whole; a reply whose arrays each fit but together exceed 2 x does not."""
    guard = sized(size_guard.Policy(allowance=64 * 1024, fallback=64 * 1024))
    to_a, to_b = link.serve(link.a, model(MiB)), link.serve(link.b, model(MiB))
    assert link.held(to_a) == list(contents_of(to_a)) and link.held(to_b) == list(contents_of(to_b))
    largest = max(size_of(to_a), size_of(to_b))
    limit = 2 * largest + 64 * 1024
    assert guard.limit(link.run_id).bytes == limit
    honest = link.reply(link.b, to_b, content=model(MiB, MiB // 2))
    assert link.deliver(link.b, honest) is None
    assert link.held(honest) == list(contents_of(honest))
    assert written_by(link, link.replies_to(to_b)) == [(link.b, f"node {link.b}")]
    assert "Refused" not in warnings.text
    oversize = link.reply(link.a, to_a, content=model(MiB, MiB, MiB // 2))
    why = refused(link.deliver(link.a, oversize))
    assert why.endswith(f"bytes, more than the {limit:,} allowed (2 x the run's largest instruction, "
                        f"{largest:,} bytes, + 65,536)")
    assert link.held(oversize) == [] and link.replies_to(to_a) == []


def test_the_server_app_s_pushes_are_never_refused(link, sized):
    """Only the Fleet API is limited: under a limit pinned at 1 MiB the ServerApp still sends a
    2 MiB instruction, which its node pulls, while that node's 2 MiB reply is refused."""
    sized(size_guard.Policy(configured=MiB))
    instruction = link.serve(link.b, records(2 * MiB))
    assert link.held(instruction) == list(contents_of(instruction))
    assert [m.metadata.message_id for m in link.pulled_by(link.b)] == [instruction.metadata.message_id]
    refused(link.deliver(link.b, link.reply(link.b, instruction, content=records(2 * MiB))))


def test_a_reply_that_names_an_object_another_push_sends_counts_it(link, sized, warnings):
    """Flower stores an object once: a reply may name an object that another of its node's
    replies pushes, and the ServerApp pulls it with both. Node A answers two instructions at once;
    the second reply names the first's 600 KiB record and pushes only its own 600 KiB: counted
    where it was stored, the shared record takes the second reply past 1 MiB, and it is deleted."""
    sized(size_guard.Policy(configured=MiB))
    first_instruction, second_instruction = link.send(link.a), link.send(link.a)
    shared = ConfigRecord({"blob": os.urandom(600 * 1024)})
    first = link.reply(link.a, first_instruction, content=RecordDict({"shared": shared}))
    second = link.reply(link.a, second_instruction, content=RecordDict(
        {"shared": shared, "own": ConfigRecord({"blob": os.urandom(600 * 1024)})}))
    first_push, second_push = link.push(link.a, first), link.push(link.a, second)
    shared_id = shared.object_id
    assert shared_id in first_push.objects_to_push and shared_id in second_push.objects_to_push
    link.push_objects(link.a, second, second_push, only=set(second_push.objects_to_push) - {shared_id})
    link.push_objects(link.a, first, first_push)  # stores the shared record: the second reply is over
    assert f"Refused the reply of node {link.a}: it named a reply ({second.metadata.message_id}) of " in warnings.text
    assert link.replies_to(second_instruction) == []
    assert written_by(link, link.replies_to(first_instruction)) == [(link.a, f"node {link.a}")]
    assert link.held(first) == list(contents_of(first))


def test_a_reply_that_names_objects_stored_before_counts_them(link, sized, warnings):
    """A reply may name objects the store holds already (its node's earlier replies, not yet
    pulled): the ServerApp pulls them with it. Node A's third reply names its first two replies'
    600 KiB records and nothing new: refused when it is declared, before anything of it is stored."""
    sized(size_guard.Policy(configured=MiB))
    instructions = [link.send(link.a) for _ in range(3)]
    first = link.reply(link.a, instructions[0], content=records(600 * 1024))
    second = link.reply(link.a, instructions[1], content=records(600 * 1024))
    assert link.deliver(link.a, first) is None and link.deliver(link.a, second) is None
    named = RecordDict({"first": first.content["record-0"], "second": second.content["record-0"]})
    third = link.reply(link.a, instructions[2], content=named)
    why = refused(link.deliver(link.a, third))
    assert why.startswith(f"node {link.a} pushed a reply ({third.metadata.message_id}) of ")
    assert f"Refused PushMessages from node {link.a}: it pushed a reply" in warnings.text
    assert link.replies_to(instructions[2]) == []
    for instruction, reply in ((instructions[0], first), (instructions[1], second)):
        assert written_by(link, link.replies_to(instruction)) == [(link.a, f"node {link.a}")]
        assert link.held(reply) == list(contents_of(reply))


def test_the_count_of_a_reply_s_arrays(monkeypatch):
    """The decision without Flower's handlers: an Array's data counted at its chunks' sizes, a
    chunk not yet arrived as a whole chunk until it does, an Array repeating an Array refused."""
    monkeypatch.setattr("flwr.app.message.array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", 1024)
    array = Array(np.zeros(1000, dtype=np.float32))  # 4,128 bytes: chunks of 1,024 (three alike) and 32
    contents = {object_id: obj.deflate() for object_id, obj in get_all_nested_objects(array).items()}
    chunks = {object_id: len(content) for object_id, content in contents.items() if object_id != array.object_id}
    arrival = size_guard.Arrival.of(array.object_id, contents[array.object_id])
    assert arrival.kind == "Array" and sum(arrival.references.values()) == 5 and len(chunks) == 3
    data = sum(n * chunks[chunk] for chunk, n in arrival.references.items())
    limit = size_guard.Limit(64 * MiB, "a test")
    in_order = size_guard.Tree(1, "root", 7, pending=set(contents))
    for object_id, content in contents.items():  # children first, as a SuperNode pushes them
        in_order.count(size_guard.Arrival.of(object_id, content))
    assert (in_order.pushed, in_order.inflated) == (sum(map(len, contents.values())), data)
    early = size_guard.Tree(1, "root", 7, pending=set(contents))
    early.count(arrival)  # before its chunks: each counted whole
    assert early.inflated == 5 * size_guard.CHUNK_BYTES and early.refusal(limit) is None
    for object_id, content in contents.items():
        early.count(size_guard.Arrival.of(object_id, content))
    assert early.inflated == data and not early.pending
    nested = size_guard.Arrival("outer", "Array", 100, {array.object_id: 1000})
    assert in_order.refusal(limit, nested) == "a reply (root) with an Array that repeats another Array"
    assert size_guard.object_refusal("ArrayChunk", size_guard.CHUNK_BYTES + 1, limit) is not None
    assert size_guard.object_refusal("ConfigRecord", 64 * MiB, limit) is None
    assert size_guard.object_refusal("ConfigRecord", 64 * MiB + 1, limit) is not None


@pytest.mark.parametrize("raw, limit", [(None, None), ("auto", None), ("", None), (str(MiB), MiB),
                                        ("70000000", 70_000_000), ("1000", SystemExit), ("lots", SystemExit),
                                        ("-5", SystemExit), ("1e8", SystemExit)])
def test_the_operator_pins_the_limit_or_leaves_it_to_the_run(raw, limit):
    environ = {} if raw is None else {size_guard.ENVIRONMENT: raw}
    if limit is SystemExit:
        with pytest.raises(SystemExit, match=size_guard.ENVIRONMENT):
            size_guard.configured_limit(environ)
    else:
        assert size_guard.configured_limit(environ) == limit
    if limit is None:
        assert size_guard.Policy(limit).limit(None).bytes == size_guard.DEFAULT_MAX_REPLY_BYTES
