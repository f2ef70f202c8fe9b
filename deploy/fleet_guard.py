"""Only the server instructs: the SuperLink takes from a SuperNode nothing but its own replies.

Flower 1.39's Fleet API ``PushMessages`` (``message_handler.push_messages``) hands the pushed
message to the LinkState, which files it by its own metadata: one without
``reply_to_message_id`` becomes an *instruction* for the node it names as ``dst_node_id``, to be
pulled and run there like the ServerApp's. Nothing compares the message with the node that made
the request, so an enrolled node (a site turned hostile, a stolen site key) that knows another
node's id (``flwr supernode ls``, the logs) can

* push an instruction in the SuperLink's name (``src_node_id`` = 1) to that node: the node runs
  it as if the ServerApp had sent it (an ``evaluate`` with an all-zero model replaced the
  victim's saved model);
* push a reply in that node's name to a message the ServerApp sent it: the ServerApp takes it as
  that site's answer, and the site's own answer is then refused as a duplicate.

The request's ``node.node_id`` *is* authenticated: Flower's ``NodeAuthServerInterceptor``
(installed on the gRPC-rere Fleet API, always in 1.39) checks the request's signature with the
public key it carries and aborts with UNAUTHENTICATED unless ``node.node_id`` is the id
registered for that key. This module makes the Fleet API refuse a pushed message unless it is
that node's reply to the server: ``reply_to_message_id`` set, ``src_node_id`` = the requesting
node, ``dst_node_id`` = the SuperLink, and the message it answers, where the LinkState still has
it, sent to that node. Flower checks the last three itself in ``store_message_res``, but quietly:
it stores nothing, logs an ERROR that names no requester, and answers "stored". A refusal here is
logged as a WARNING naming the node and what it pushed, and answered the way Flower answers its
own refusals of a Fleet request, a ``FlowerError``: the SuperNode gets PERMISSION_DENIED ("You do
not have permission to perform this action."), on which Flower's SuperNode drops the message and
carries on (it neither retries nor stops).

``install()`` wraps the handler that both of Flower's Fleet transports call (gRPC-rere's
``FleetServicer`` and the gRPC adapter's, which subclasses it). The adapter has no node
authentication, so there the node id it compares with is the request's own claim;
``deploy/superlink.sh`` serves gRPC-rere with SuperNode authentication.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from logging import WARNING
from typing import Protocol

from flower_pin import require_flower

# It wraps a private Flower handler and reads the LinkStates' stores: on another release, a refusal.
require_flower("deploy/fleet_guard.py")

from flwr.common.constant import SUPERLINK_NODE_ID  # noqa: E402
from flwr.proto.fleet_pb2 import PushMessagesRequest, PushMessagesResponse  # noqa: E402  # pylint: disable=E0611
from flwr.proto.message_pb2 import Metadata as MetadataProto  # noqa: E402  # pylint: disable=E0611
from flwr.server.superlink.fleet.message_handler import message_handler  # noqa: E402
from flwr.server.superlink.linkstate import LinkState  # noqa: E402
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState  # noqa: E402
from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState  # noqa: E402
from flwr.supercore import log  # noqa: E402
from flwr.supercore.error import ApiErrorCode, FlowerError  # noqa: E402
from flwr.supercore.utils import int64_to_uint64  # noqa: E402


class PushHandler(Protocol):
    """Flower's Fleet ``push_messages`` handler (FleetServicer calls it with keyword arguments)."""

    def __call__(self, request: PushMessagesRequest, state: LinkState) -> PushMessagesResponse: ...


# What the refused SuperNode is told (Flower sends this beside its public message for the code).
PUBLIC_DETAILS = "The SuperLink accepts from a SuperNode only its own replies to messages sent to it."


@dataclass(frozen=True)
class Push:
    """One pushed message as its metadata declares it, and the node that pushed it."""

    node_id: int  # the requesting node: authenticated by Flower's NodeAuthServerInterceptor
    src_node_id: int
    dst_node_id: int
    reply_to_message_id: str
    message_type: str

    @classmethod
    def of(cls, node_id: int, metadata: MetadataProto) -> Push:
        """The push of a message with ``metadata`` (a PushMessagesRequest's) by ``node_id``."""
        return cls(node_id, metadata.src_node_id, metadata.dst_node_id, metadata.reply_to_message_id,
                   metadata.message_type)


def refusal(push: Push, addressee: Callable[[str], int | None]) -> str | None:
    """What is wrong with ``push`` (in words for the log), None when it is the node's own reply to
    the server. ``addressee(message_id)`` is the node the LinkState's message ``message_id`` was
    sent to, None when it has no such message: Flower then stores nothing for the reply, and that
    is where an honest node's late reply to an expired message lands too, so it is no refusal here."""
    if not push.reply_to_message_id:
        return (f"an instruction ({push.message_type!r}, from node {push.src_node_id} to node "
                f"{push.dst_node_id}): only the server sends those")
    if push.src_node_id != push.node_id:
        return f"a reply ({push.message_type!r}) in the name of node {push.src_node_id}"
    if push.dst_node_id != SUPERLINK_NODE_ID:
        return f"a reply ({push.message_type!r}) addressed to node {push.dst_node_id}, not to the server"
    sent_to = addressee(push.reply_to_message_id)
    if sent_to is not None and sent_to != push.node_id:
        return (f"a reply ({push.message_type!r}) to message {push.reply_to_message_id}, which was sent to "
                f"node {sent_to}")
    return None


def addressee(state: LinkState, message_id: str) -> int | None:
    """The node the instruction ``message_id`` stored in ``state`` was sent to, None if ``state``
    has none by that id (never sent, expired, or answered and cleaned up). Flower's LinkState API
    has no read of one instruction that leaves it undelivered, so this reads each state's store."""
    if isinstance(state, InMemoryLinkState):
        with state.lock:
            message = state.message_ins_store.get(message_id)
        return None if message is None else message.metadata.dst_node_id
    if isinstance(state, SqlLinkState):
        row = state.get_valid_message_ins(message_id)  # dst_node_id stored as a signed 64-bit int
        return None if row is None else int64_to_uint64(row["dst_node_id"])
    raise TypeError(f"deploy/fleet_guard.py cannot read the messages of a {type(state).__name__}")


def guarded(push_messages: PushHandler) -> PushHandler:
    """``push_messages`` that first refuses (logs, then raises ``FlowerError``) a request carrying
    a message other than the requesting node's own reply to the server."""

    @functools.wraps(push_messages)
    def guarded_push_messages(request: PushMessagesRequest, state: LinkState) -> PushMessagesResponse:
        node_id = request.node.node_id
        for message in request.messages_list:
            why = refusal(Push.of(node_id, message.metadata), functools.partial(addressee, state))
            if why is not None:
                log(WARNING, "Refused PushMessages from node %s: it pushed %s", node_id, why)
                raise FlowerError(ApiErrorCode.NO_PERMISSIONS, f"node {node_id} pushed {why}",
                                  public_details=PUBLIC_DETAILS)
        return push_messages(request, state)

    return guarded_push_messages


def install() -> None:
    """Guard the Fleet API's PushMessages handler of this process (``patient_superlink.main``)."""
    message_handler.push_messages = guarded(message_handler.push_messages)
