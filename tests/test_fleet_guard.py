"""deploy/fleet_guard.py: through the SuperLink's Fleet API a SuperNode pushes only its own replies
to the server. An enrolled node A attacks node B through Flower's own Fleet message handler and a
real LinkState (in memory and SQLite, as ``flower-superlink --database`` makes them): an
instruction addressed to B (in its own name, the server's or B's), a reply in B's name to a
message the server sent B, a reply of its own to that message, a reply addressed to B. Each is
refused and logged, with the guard that ``patient_superlink.main`` installs, and B receives
nothing; B's own reply still reaches the server. Without the guard Flower hands B the instruction
in the server's name and the server B's answer written by A (and takes the rest quietly), so
these tests fail."""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message, MessageType, Metadata, RecordDict
from flwr.app.message import remove_content_from_message
from flwr.common.constant import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID, SUPERLINK_NODE_ID
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.fleet_pb2 import PullMessagesRequest, PushMessagesRequest, PushMessagesResponse  # pylint: disable=E0611
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.server.superlink.fleet.grpc_rere.fleet_servicer import FleetServicer
from flwr.server.superlink.fleet.message_handler import message_handler
from flwr.server.superlink.linkstate import LinkState, LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID, TaskType
from flwr.supercore.error import ApiErrorCode, FlowerError, rpc_error_translator
from flwr.supercore.inflatable.inflatable_object import get_object_tree
from flwr.supercore.object_store import ObjectStore, ObjectStoreFactory
from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
from flwr.supercore.object_store.sql_object_store import SqlObjectStore
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.servicer.runtime import runtime_handlers

from tests.deployment import ROOT

sys.path.insert(0, str(ROOT / "deploy"))
import fleet_guard  # noqa: E402  pylint: disable=wrong-import-position
import flower_pin  # noqa: E402  pylint: disable=wrong-import-position
import patient_superlink  # noqa: E402  pylint: disable=wrong-import-position

DATABASES = {"memory": FLWR_IN_MEMORY_DB_NAME, "sqlite": ":memory:"}  # InMemoryLinkState, SqlLinkState


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

    def message(self, src: int, dst: int, reply_to: str = "", author: str = "server") -> Message:
        """An evaluate message written by ``author``, as a SuperNode's connection pushes it (its id,
        the hash of its content and metadata, set as the node does)."""
        metadata = Metadata(self.run_id, "", src, dst, reply_to, "", time.time(), 600, MessageType.EVALUATE)
        # the constructor's internal form, with the metadata given (as Flower's own serde builds messages)
        message = Message(RecordDict({"config": ConfigRecord({"from": author})}), metadata=metadata)  # type: ignore[call-overload]
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

    def reply(self, node: int, to: Message, src: int | None = None, dst: int = SUPERLINK_NODE_ID) -> Message:
        """A reply to ``to`` written by ``node``, in ``src``'s name (its own by default)."""
        return self.message(node if src is None else src, dst, to.metadata.message_id, author=f"node {node}")

    def push(self, node: int, message: Message) -> PushMessagesResponse:
        """``node`` pushes ``message`` through the Fleet API's handler (the authenticated node id
        in the request, as Flower's NodeAuthServerInterceptor lets it through)."""
        request = PushMessagesRequest(node=Node(node_id=node),
                                      messages_list=[message_to_proto(remove_content_from_message(message))],
                                      message_object_trees=[get_object_tree(message)])
        return message_handler.push_messages(request=request, state=self.state)

    def pulled_by(self, node: int) -> list[Message]:
        """What ``node``'s next PullMessages hands it."""
        response = message_handler.pull_messages(PullMessagesRequest(node=Node(node_id=node)), self.state, self.store)
        return [message_from_proto(proto) for proto in response.messages_list]

    def replies_to(self, instruction: Message) -> list[Message]:
        """The replies to ``instruction`` that the ServerApp's next pull would get."""
        return [reply for reply in self.state.get_message_res({instruction.metadata.message_id}, self.run_id)
                if reply.metadata.src_node_id != SUPERLINK_NODE_ID]  # not the SuperLink's "no reply yet" errors


@pytest.fixture(params=sorted(DATABASES))
def link(request) -> Link:
    stores = ObjectStoreFactory()
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
    Fleet API before it starts Flower's SuperLink."""
    points = [(message_handler, "push_messages"), (message_handler, "pull_messages"),
              (runtime_handlers, "pull_messages"), (message_handler, "pull_object"),
              (runtime_handlers, "pull_object"), (InMemoryObjectStore, "put"), (SqlObjectStore, "put")]
    points += [(state, name) for state in (InMemoryLinkState, SqlLinkState)
               for name in ("store_message_ins", "store_message_res")]
    for owner, name in points:
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    monkeypatch.setattr(patient_superlink.sql_mixin, "SQLITE_PRAGMAS", patient_superlink.sql_mixin.SQLITE_PRAGMAS)
    monkeypatch.setattr(sys, "argv", ["patient_superlink.py"])
    monkeypatch.setenv("FEDPAC_SUPERLINK_PULL_WAIT", "0")
    monkeypatch.setenv("FEDPAC_SUPERLINK_OBJECT_WAIT", "0")
    started = []
    monkeypatch.setattr(patient_superlink, "flower_superlink", lambda: started.append(message_handler.push_messages))
    patient_superlink.main()
    assert started and started[0] is message_handler.push_messages
    refusal = attempt(link, link.a, link.message(SUPERLINK_NODE_ID, link.b, author="attacker"))
    assert written_by(link, link.pulled_by(link.b)) == []
    refused(refusal)


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
    assert "fleet_guard" in needed
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    (copy,) = [line for line in dockerfile.splitlines() if line.startswith("COPY deploy/patient_superlink.py")]
    assert {f"deploy/{name}.py" for name in needed} <= set(copy.split()), copy
    # and the build context must carry them: .dockerignore excludes everything it does not name
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert {f"deploy/{name}.py" for name in needed} <= allowed, allowed
