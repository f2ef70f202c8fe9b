"""A Grid that collects replies as soon as they arrive.

In deployment, Flower 1.39's Grid (``flwr.superlink.grid.http_grid``) looks for replies every
3 s in ``send_and_receive``, so each phase of a round waits on average 1.5 s (up to 3 s) after
its last reply; the simulation's grid looks every 0.1 s. :class:`ResponsiveGrid` wraps either
and polls at ``poll_interval`` with the same semantics (push, then pull until every reply is in
or the timeout has passed), delegating everything else to the wrapped grid.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid

DEFAULT_POLL_INTERVAL = 0.1  # seconds; the simulation grid's own interval


class ResponsiveGrid(Grid):
    """``grid`` with ``send_and_receive`` polling every ``poll_interval`` seconds."""

    def __init__(self, grid: Grid, poll_interval: float = DEFAULT_POLL_INTERVAL) -> None:
        self.grid = grid
        self.poll_interval = poll_interval

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
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

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
