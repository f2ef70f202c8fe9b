"""``flower-superlink`` whose state database waits up to a minute for a lock instead of 5 s.

Flower 1.39 keeps the SuperLink's state in SQLite with ``busy_timeout = 5000`` ms. On a busy
host (many SuperNodes pushing replies at once while training holds the cores, or a SuperLink
sharing its machine with other jobs) a thread can hold the write lock for longer than that, and
the request that waited fails with "database is locked": the SuperNode's pull or push of that
message is lost, and the round waits for it until ``round-timeout``. This launcher runs the
unchanged ``flower-superlink`` (same arguments) with the wait raised to
``FEDPAC_SUPERLINK_BUSY_TIMEOUT_MS`` (default 60000).

Both of its poll-based APIs answer by long polling (``deploy/long_poll.py``), waiting up to
``FEDPAC_SUPERLINK_PULL_WAIT`` seconds (default 2; 0: off) when there is nothing to answer yet:
a SuperNode's ``PullMessages`` until the ServerApp stores a message (an idle federation costs
one pull per node every 2 s, and a message goes out as soon as it is stored), and the
ServerApp's ``PullMessages`` until a SuperNode stores a reply (the ServerApp polls for replies
every 0.1 s, ``server_app/responsive_grid.py``; each poll of the HTTP API costs the SuperLink about as
much CPU as a client's whole message). Both ``PullObject``s (a SuperNode's, for a message's
objects; the ServerApp's, for a reply's) wait up to ``FEDPAC_SUPERLINK_OBJECT_WAIT`` seconds
(default 2; 0: off) for an object that is announced but not yet pushed, instead of answering
"not available" and making the puller back off a whole second (``ObjectArrivals``).

    python deploy/patient_superlink.py --ssl-ca-certfile ... # flower-superlink's arguments

Its Fleet API takes from a SuperNode only that node's own replies to the server
(``deploy/fleet_guard.py``): a node cannot push instructions to another node, nor answer in its name.
And it counts a reply's bytes as the node pushes them (``deploy/size_guard.py``): an object, or a
reply's objects together, larger than a reply of that run can be (2 x the largest instruction the
ServerApp pushed in the run + about 6 MiB, or ``FEDPAC_SUPERLINK_MAX_REPLY_BYTES``) is refused
before it is stored, so a hostile site cannot fill the ServerApp's memory with one reply.

With subprocess isolation (``deploy/superlink.sh``) it starts Flower's SuperExec again whenever
that exits (``deploy/supervised_superexec.py``): Flower starts it once, and without it every run
submitted stays ``pending``.

``deploy/superlink.sh`` and the compose cluster start the SuperLink this way. A test checks that
Flower's pragma list still has the entry this replaces.
"""

from __future__ import annotations

import os
import sys

from flower_pin import require_flower

# Before Flower's internals are imported: on another Flower release, a clear refusal.
require_flower("deploy/patient_superlink.py")

import flwr.supercore.sql_mixin as sql_mixin  # noqa: E402
from flwr.server.superlink.fleet.message_handler import message_handler  # noqa: E402
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState  # noqa: E402
from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState  # noqa: E402
from flwr.superlink.cli.flower_superlink import flower_superlink  # noqa: E402
from flwr.superlink.servicer.runtime import runtime_handlers  # noqa: E402

import fleet_guard  # noqa: E402
import size_guard  # noqa: E402
import supervised_superexec  # noqa: E402
from long_poll import LongPoll, ObjectArrivals, wait_for_objects, wait_from_environment  # noqa: E402


def with_busy_timeout(pragmas: tuple[tuple[str, str], ...], milliseconds: int) -> tuple[tuple[str, str], ...]:
    """``pragmas`` with ``busy_timeout`` set to ``milliseconds`` (an error if it has none)."""
    if not any(name == "busy_timeout" for name, _ in pragmas):
        raise RuntimeError("Flower's SQLite pragmas have no busy_timeout: this launcher does not fit this Flower")
    return tuple((name, str(milliseconds) if name == "busy_timeout" else value) for name, value in pragmas)


def long_poll_messages(wait: float) -> tuple[LongPoll, LongPoll]:
    """Make both ``PullMessages`` long polls: the Fleet API's (SuperNodes) woken when a message
    for the nodes is stored, the Runtime API's (ServerApp) when a reply is stored."""
    to_nodes, to_server = LongPoll(wait), LongPoll(wait)
    for state in (InMemoryLinkState, SqlLinkState):
        state.store_message_ins = to_nodes.producer(state.store_message_ins)  # type: ignore[method-assign]
        state.store_message_res = to_server.producer(state.store_message_res)  # type: ignore[method-assign]
    message_handler.pull_messages = to_nodes.handler(message_handler.pull_messages, _has_messages)
    runtime_handlers.pull_messages = to_server.handler(runtime_handlers.pull_messages, _has_messages)
    return to_nodes, to_server


def long_poll_objects(wait: float) -> ObjectArrivals:
    """Make both ``PullObject`` handlers (Fleet API: SuperNodes; Runtime API: the ServerApp)
    wait for an object that was announced but not yet pushed."""
    return wait_for_objects(wait, [(message_handler, "pull_object"), (runtime_handlers, "pull_object")])


def _has_messages(response) -> bool:  # noqa: ANN001  # a PullMessagesResponse of either API
    return len(response.messages_list) > 0


def main() -> None:
    supervised_superexec.install()  # a SuperExec that exits is started again, or every run stays pending
    size_guard.install()  # FEDPAC_SUPERLINK_MAX_REPLY_BYTES, else derived from each run's instructions
    fleet_guard.install()  # installed last, so it runs first: a push in another node's name is refused as such
    long_poll_messages(wait_from_environment("FEDPAC_SUPERLINK_PULL_WAIT", 2.0))
    long_poll_objects(wait_from_environment("FEDPAC_SUPERLINK_OBJECT_WAIT", 2.0))
    raw = os.environ.get("FEDPAC_SUPERLINK_BUSY_TIMEOUT_MS", "60000")
    if not raw.isdigit() or not 1000 <= int(raw) <= 600_000:
        sys.exit(f"patient_superlink: FEDPAC_SUPERLINK_BUSY_TIMEOUT_MS must be 1000..600000, got {raw!r}")
    sql_mixin.SQLITE_PRAGMAS = with_busy_timeout(sql_mixin.SQLITE_PRAGMAS, int(raw))  # type: ignore[attr-defined]
    sys.argv[0] = "flower-superlink"
    flower_superlink()


if __name__ == "__main__":
    main()
