"""``flower-supernode`` that looks for new messages every half second instead of every 3 s.

Flower 1.39's SuperNode loop (``flwr.supernode.start_client_internal``) sleeps a fixed 3 s after
every pull that found no message, and 0.5 s between looks for its ClientApp's reply. In a
federation every node is idle while the server aggregates, so each phase of each round waits up
to 3 s (about 2.9 s with 20 nodes: the slowest node decides) before any training starts, which
is a large part of a round that computes for a few seconds. This launcher runs the unchanged
``flower-supernode`` (same arguments, same TLS, authentication and gRPC) with those two waits
shortened to ``FEDPAC_NODE_PULL_INTERVAL`` (default 0.5 s) and 0.1 s. An idle node then asks the
SuperLink about twice a second, a small authenticated request (a long poll when the SuperLink
is ``deploy/patient_superlink.py``).

Its Runtime API answers a ClientApp executor's ``AcquireTask`` by long polling
(``deploy/long_poll.py``): with no task pending it waits up to ``FEDPAC_NODE_TASK_WAIT`` seconds
(default 2; 0: off) for the node to store one. An executor polling every 0.1 s then costs one
request per 2 s while the node is idle instead of ten a second, and gets a new task as soon as
it is stored.

    python deploy/fast_supernode.py --superlink HOST:9092 ...   # flower-supernode's arguments

Its Runtime API's ``PullObject`` waits up to ``FEDPAC_NODE_OBJECT_WAIT`` seconds (default 2;
0: off) for an object the node announced but has not stored yet: a ClientApp takes its task
as soon as the node created it, while the node is still pulling the message's objects from the
SuperLink, and Flower's puller backs off a whole second after each "not available yet"
(``long_poll.ObjectArrivals``).

While its ClientApp works, the loop looks for the reply in the node's state every 0.5 s
(0.1 s here); that look is a long poll too (``FEDPAC_NODE_REPLY_WAIT``, default 2 s), woken when
the Runtime API stores the reply, so a node costs nothing while it waits and sends the reply on
at once. Two more periodic wake-ups, which made most of an idle node's CPU (7 ms/s per node,
20 nodes on one host: 0.14 cores), are removed: the gRPC channel's connectivity subscription
(grpcio polls the channel every 0.2 s in a thread of its own for it, and Flower only logs the
state at DEBUG level) and the Runtime API's uvicorn tick (every 0.1 s; here every second, so the
API stops up to a second later).

``deploy/supernode.sh`` and the compose cluster start SuperNodes this way; ``supernode.sh
--executor cold`` runs Flower's own ``flower-supernode`` unchanged. The waits are found by
value in the loop's source (a test checks they are still there), so a Flower version whose loop
differs fails that test instead of silently running at its own pace.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import time
import types
from collections.abc import Sequence
from typing import Any

from flower_pin import require_flower

# Before Flower's internals are imported: on another Flower release, a clear refusal.
require_flower("deploy/fast_supernode.py")

import flwr.client.grpc_rere_client.connection as fleet_connection  # noqa: E402
import flwr.supernode.start_client_internal as supernode_loop  # noqa: E402
import uvicorn  # noqa: E402
from flwr.app import Message  # noqa: E402
from flwr.supercore.heartbeat import HeartbeatSender  # noqa: E402
from flwr.supernode.cli.flower_supernode import flower_supernode  # noqa: E402
from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState  # noqa: E402
from flwr.supernode.servicer.runtime import runtime_handlers  # noqa: E402

from long_poll import LongPoll, ObjectArrivals, wait_for_objects, wait_from_environment  # noqa: E402

IDLE_PULL_WAIT = 3.0  # Flower 1.39's wait after an empty pull
REPLY_WAIT = 0.5  # Flower 1.39's wait between looks for the ClientApp's reply


def shortened_sleep(pull_interval: float, reply_interval: float = 0.1):  # noqa: ANN201
    """``time.sleep`` for the SuperNode loop: its two fixed waits shortened, any other kept."""
    def sleep(seconds: float) -> None:
        if seconds == IDLE_PULL_WAIT:
            seconds = pull_interval
        elif seconds == REPLY_WAIT:
            seconds = reply_interval
        time.sleep(seconds)

    return sleep


def patched_time_module(pull_interval: float) -> types.SimpleNamespace:
    """The ``time`` module as the SuperNode loop sees it: everything but ``sleep`` unchanged."""
    names = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    return types.SimpleNamespace(**{**names, "sleep": shortened_sleep(pull_interval)})


def long_poll_tasks(wait: float) -> LongPoll:
    """Make the Runtime API's ``AcquireTask`` a long poll, woken when the node creates a task."""
    poll = LongPoll(wait)
    InMemoryNodeState.create_task = poll.producer(InMemoryNodeState.create_task)  # type: ignore[method-assign]
    runtime_handlers.acquire_task = poll.handler(runtime_handlers.acquire_task, lambda response: bool(response.token))
    return poll


def long_poll_replies(wait: float) -> LongPoll:
    """Make the node loop's look for its ClientApp's reply (``get_messages(is_reply=True)``) a
    long poll, woken when the node stores a message; every other look is unchanged."""
    poll = LongPoll(wait)
    InMemoryNodeState.store_message = poll.producer(InMemoryNodeState.store_message)  # type: ignore[method-assign]
    look = InMemoryNodeState.get_messages
    wait_for_reply = poll.handler(look, answered=bool)

    @functools.wraps(look)
    def get_messages(self: InMemoryNodeState, *, run_ids: Sequence[int] | None = None,
                     is_reply: bool | None = None, limit: int | None = None) -> Sequence[Message]:
        return (wait_for_reply if is_reply else look)(self, run_ids=run_ids, is_reply=is_reply, limit=limit)

    InMemoryNodeState.get_messages = get_messages  # type: ignore[method-assign]
    return poll


def long_poll_objects(wait: float) -> ObjectArrivals:
    """Make the Runtime API's ``PullObject`` (the ClientApp's) wait for an object that the node
    announced but is still pulling from the SuperLink."""
    return wait_for_objects(wait, [(runtime_handlers, "pull_object")])


def without_connectivity_polling() -> None:
    """The node's channel to the SuperLink without Flower's connectivity subscription: grpcio
    serves a subscription from a thread that polls the channel every 0.2 s for as long as the
    channel lives, and Flower's callback only logs the state at DEBUG level."""
    create = fleet_connection.create_channel

    @functools.wraps(create)
    def create_channel(*args: Any, **kwargs: Any) -> Any:
        channel = create(*args, **kwargs)
        channel.subscribe = _no_subscription
        return channel

    fleet_connection.create_channel = create_channel  # type: ignore[assignment]


def _no_subscription(callback: Any, try_to_connect: bool = False) -> None:  # noqa: ARG001
    """``grpc.Channel.subscribe`` that subscribes nothing."""


UVICORN_TICK = 0.1  # uvicorn's main loop: a tick every 0.1 s, the date header every 10th


async def _main_loop_every_second(self: uvicorn.Server) -> None:
    """uvicorn's ``Server.main_loop`` ticking once a second instead of ten times: each tick
    counts as ten of uvicorn's, so the date header and its other per-second work keep their pace."""
    ticks_per_second = round(1 / UVICORN_TICK)
    counter = 0
    should_exit = await self.on_tick(counter)
    while not should_exit:
        counter = (counter + ticks_per_second) % 864000
        await asyncio.sleep(1.0)
        should_exit = await self.on_tick(counter)


def slower_uvicorn_tick() -> None:
    """The Runtime API's uvicorn server ticks once a second (it stops up to a second later)."""
    uvicorn.Server.main_loop = _main_loop_every_second  # type: ignore[method-assign]


def stop_heartbeat_once_ended(sender: HeartbeatSender) -> None:
    """``HeartbeatSender.stop`` that also accepts a sender whose thread has already ended.

    When the SuperLink refuses the node's key (``flwr supernode unregister``), Flower 1.39's
    SuperNode exits with status 0, unless its heartbeat thread saw the refusal first and ended:
    then the exit's ``deactivate_node`` raises "Heartbeat sender is not running", the node exits
    with status 1, and ``supernode.sh`` takes a revoked node for a crashed one and restarts it.
    """
    if sender._thread.is_alive():  # noqa: SLF001
        _flower_heartbeat_stop(sender)
    else:
        sender._stop_event.set()  # noqa: SLF001


_flower_heartbeat_stop = HeartbeatSender.stop


def tolerant_heartbeat_stop() -> None:
    """A revoked node ends with status 0 whichever of its threads sees the refusal first."""
    HeartbeatSender.stop = stop_heartbeat_once_ended  # type: ignore[method-assign]


def main() -> None:
    tolerant_heartbeat_stop()
    long_poll_tasks(wait_from_environment("FEDPAC_NODE_TASK_WAIT", 2.0))
    long_poll_replies(wait_from_environment("FEDPAC_NODE_REPLY_WAIT", 2.0))
    long_poll_objects(wait_from_environment("FEDPAC_NODE_OBJECT_WAIT", 2.0))
    without_connectivity_polling()
    slower_uvicorn_tick()
    try:
        interval = float(os.environ.get("FEDPAC_NODE_PULL_INTERVAL", "0.5"))
    except ValueError:
        interval = -1.0
    if not 0.05 <= interval <= IDLE_PULL_WAIT:
        sys.exit(f"fast_supernode: FEDPAC_NODE_PULL_INTERVAL must be between 0.05 and {IDLE_PULL_WAIT} s, "
                 f"got {os.environ.get('FEDPAC_NODE_PULL_INTERVAL')!r}")
    supernode_loop.time = patched_time_module(interval)  # type: ignore[assignment]
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
