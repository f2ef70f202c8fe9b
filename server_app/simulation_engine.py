"""A faster hand-over of messages in Flower's simulation engine, for federations of many clients.

Flower 1.39's engine hands the ServerApp's messages to the Ray workers from a thread that, ten
times a second, asks its link state for the next message of *every* simulated node, and each
such request walks *every* stored message (checking each one's expiry and federation on the
way): with 1,000 nodes and the 100 messages of a round in store, 100,000 checks per pass, which
kept a core busy for the whole round, the core the ClientApps needed. :func:`install` replaces
that thread's function with one that first finds, in one walk, the nodes that have a message
waiting, and asks for those nodes' messages only, in Flower's order. Which messages are handed
over, and in which order, is unchanged.

Installed by the simulations this project starts itself (``experiments.simulation``, the
benchmarks) and, for ``flwr run``, by the Ray runtime-environment hook
(``server_app.ray_cluster.runtime_env_hook``) that ``deploy/simulate.sh`` sets: the engine starts Ray,
which calls the hook, before it starts that thread.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Iterable
from logging import WARNING
from queue import Queue
from typing import Any

from flwr.app import Message
from flwr.common.logger import log
from flwr.server.superlink.fleet.vce import vce_api

# The Flower release whose engine this replaces a part of (deploy/flower_pin.py pins the same,
# tests/test_simulation_engine.py checks it): on another, the engine keeps its own hand-over.
WRITTEN_FOR = "1.39.0"


def nodes_with_messages(state: Any, nodes: Iterable[int]) -> list[int]:
    """The nodes of ``nodes`` (in their order) that have a message not yet delivered, from one
    walk over the stored messages; all of ``nodes`` for a link state that keeps its messages
    elsewhere (only the in-memory one is walked)."""
    store = getattr(state, "message_ins_store", None)
    lock = getattr(state, "lock", None)
    if store is None or lock is None:
        return list(nodes)
    with lock:
        waiting = {message.metadata.dst_node_id for message in store.values() if not message.metadata.delivered_at}
    return [node for node in nodes if node in waiting]


def add_messages_to_queue(state: Any, queue: Queue[Message], nodes_mapping: dict[int, int],
                          f_stop: threading.Event) -> None:
    """``vce_api.add_messages_to_queue``, asking only the nodes that have a message waiting."""
    while not f_stop.is_set():
        for node_id in nodes_with_messages(state, nodes_mapping.keys()):
            for message in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(message)
        f_stop.wait(0.1)


def install() -> None:
    """Make the engine's message hand-over :func:`add_messages_to_queue` (idempotent), on the
    Flower release it was written for; on another, log that the engine keeps its own."""
    installed = importlib.metadata.version("flwr")
    if installed != WRITTEN_FOR:
        log(WARNING, "flwr %s is installed, not %s: the simulation engine keeps its own message hand-over, "
            "slower with many clients", installed, WRITTEN_FOR)
        return
    vce_api.add_messages_to_queue = add_messages_to_queue
