"""A Grid that collects replies as soon as they arrive.

In deployment, Flower 1.39's Grid (``flwr.superlink.grid.http_grid``) looks for replies every
3 s in ``send_and_receive``, so each phase of a round waits on average 1.5 s (up to 3 s) after
its last reply; the simulation's grid looks every 0.1 s. :class:`ResponsiveGrid` wraps either
and polls at ``poll_interval`` with the same semantics (push, then pull until every reply is in
or the timeout has passed), delegating everything else to the wrapped grid.

In a deployment it also seals every message it sends and opens every sealed reply
(``common.protocol.seal``): each object of a message is an authenticated request on every hop,
and a sealed message is 3 objects instead of 6 or 7. The simulation's grid keeps messages in
memory, where sealing would only cost. ``FEDPAC_SEAL_MESSAGES=0`` turns sealing off (to measure
what it saves).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

from flwr.app import Message
from flwr.app.error import Error
from flwr.app.message import make_message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from common import protocol as p

DEFAULT_POLL_INTERVAL = 0.1  # seconds; the simulation grid's own interval


class ResponsiveGrid(Grid):
    """``grid`` with ``send_and_receive`` polling every ``poll_interval`` seconds, sealing the
    messages it pushes when ``seal`` is true (by default: when ``grid`` is a deployment's).

    ``reply_limit`` gives the most bytes a reply may hold (the strategy's
    ``max_reply_bytes``): a sealed reply whose envelope is larger is refused before any of it
    is parsed."""

    def __init__(self, grid: Grid, poll_interval: float = DEFAULT_POLL_INTERVAL, seal: bool | None = None,
                 reply_limit: Callable[[], int] | None = None) -> None:
        self.grid = grid
        self.poll_interval = poll_interval
        self.seal = seals_messages(grid) if seal is None else seal
        self.reply_limit = reply_limit

    def set_run(self, run):  # noqa: ANN001, ANN201
        return self.grid.set_run(run)

    @property
    def run(self):  # noqa: ANN201
        return self.grid.run

    def create_message(self, *args, **kwargs) -> Message:  # noqa: ANN002, ANN003
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self):  # noqa: ANN201
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push ``messages``, their contents sealed (in place) when this grid seals."""
        messages = list(messages)
        if self.seal:
            for msg in messages:
                msg.content = p.seal(msg.content)
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies that arrived, sealed ones opened; a reply whose envelope does not open,
        or is larger than ``reply_limit``, becomes an error reply that names why."""
        limit = self.reply_limit() if self.reply_limit is not None else None
        return [_opened(msg, limit) for msg in self.grid.pull_messages(message_ids)]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``, then pull replies until all arrived or ``timeout`` seconds passed."""
        messages = list(messages)
        if not messages:  # a phase with nothing to send (fused evaluation): no request at all
            return []
        pending = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            arrived = list(self.pull_messages(pending))
            replies.extend(arrived)
            pending.difference_update(msg.metadata.reply_to_message_id for msg in arrived)
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(self.poll_interval)
        return replies


def is_simulation(grid: Grid) -> bool:
    """Whether ``grid`` is a simulation's (its nodes are made by the federation itself, from the
    run's own node configs), looking through a :class:`ResponsiveGrid`."""
    return isinstance(grid.grid if isinstance(grid, ResponsiveGrid) else grid, InMemoryGrid)


def seals_messages(grid: Grid) -> bool:
    """Whether a ServerApp on ``grid`` seals its messages: in a deployment, unless
    ``FEDPAC_SEAL_MESSAGES=0``."""
    return not is_simulation(grid) and os.environ.get("FEDPAC_SEAL_MESSAGES", "1") != "0"


def _opened(msg: Message, limit: int | None = None) -> Message:
    if msg.has_error() or not p.is_sealed(msg.content):
        return msg
    size = p.payload_bytes(msg.content)  # the envelope's length: nothing in it is parsed yet
    try:
        if limit is not None and size > limit:
            raise ValueError(f"{size:,} bytes, more than the {limit:,} a reply of this model can need; "
                             "refused before any of it was decoded")
        msg.content = p.unseal(msg.content)
    except ValueError as err:
        error = Error(code=ErrorCode.UNKNOWN, reason=f"malformed reply: {err}")
        return make_message(metadata=msg.metadata, error=error)
    return msg
