"""server_app/simulation_engine.py: the engine's message hand-over, asking only the nodes that
have a message waiting, hands over the same messages in the same order as Flower's."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue

import pytest
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory

from server_app import ray_cluster, simulation_engine

FLOWER_HAND_OVER = vce_api.add_messages_to_queue


@dataclass
class Metadata:
    dst_node_id: int
    delivered_at: str = ""


@dataclass
class Stored:
    name: str
    metadata: Metadata


@dataclass
class LinkState:
    """The in-memory link state's messages, lock and ``get_message_ins`` as Flower 1.39 keeps
    them (its real one needs a run, a federation and an object store for every message)."""

    message_ins_store: dict[str, Stored] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    asked: list[int] = field(default_factory=list)

    def get_message_ins(self, node_id: int, limit: int | None) -> list[Stored]:
        self.asked.append(node_id)
        with self.lock:
            found = [m for m in self.message_ins_store.values()
                     if m.metadata.dst_node_id == node_id and not m.metadata.delivered_at][:limit]
        for message in found:
            message.metadata.delivered_at = "now"
        return found


def state_with_messages() -> LinkState:
    state = LinkState()
    # node 7 has two messages (one per pass), node 3 one, node 5 one already delivered
    for name, node, delivered in (("a", 7, ""), ("b", 3, ""), ("c", 7, ""), ("d", 5, "earlier")):
        state.message_ins_store[name] = Stored(name, Metadata(node, delivered))
    return state


def hand_over(function, state: LinkState, nodes: dict[int, int], expected: int) -> list[str]:  # noqa: ANN001
    """The messages ``function`` queues, in order, once it has queued ``expected`` of them."""
    queue: Queue = Queue()
    stop = threading.Event()
    thread = threading.Thread(target=function, args=(state, queue, nodes, stop))
    thread.start()
    names = [queue.get(timeout=10).name for _ in range(expected)]
    stop.set()
    thread.join()
    assert queue.empty()
    return names


def test_the_same_messages_in_the_same_order_asking_only_nodes_with_one_waiting():
    nodes = {node: pid for pid, node in enumerate((9, 7, 5, 3, 1))}
    flowers, ours = state_with_messages(), state_with_messages()
    assert hand_over(simulation_engine.add_messages_to_queue, ours, nodes, 3) == \
        hand_over(FLOWER_HAND_OVER, flowers, nodes, 3) == ["a", "b", "c"]
    assert set(flowers.asked) == {9, 7, 5, 3, 1}
    assert set(ours.asked) <= {7, 3}  # never a node without a message


def test_a_link_state_kept_elsewhere_is_asked_for_every_node():
    class Elsewhere:
        pass

    assert simulation_engine.nodes_with_messages(Elsewhere(), [4, 2]) == [4, 2]


def test_it_is_installed_on_the_pinned_flower_only(monkeypatch):
    import importlib.metadata

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "deploy"))
    import flower_pin  # pylint: disable=import-outside-toplevel

    assert simulation_engine.WRITTEN_FOR == flower_pin.FLOWER_VERSION
    monkeypatch.setattr(vce_api, "add_messages_to_queue", FLOWER_HAND_OVER)
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.40.0" if name == "flwr" else real_version(name))
    simulation_engine.install()
    assert vce_api.add_messages_to_queue is FLOWER_HAND_OVER
    monkeypatch.setattr(importlib.metadata, "version", real_version)
    simulation_engine.install()
    assert vce_api.add_messages_to_queue is simulation_engine.add_messages_to_queue


def test_flowers_in_memory_link_state_keeps_what_the_hand_over_reads():
    state = LinkStateFactory(vce_api.FLWR_IN_MEMORY_DB_NAME, vce_api.NoOpFederationManager(),
                             vce_api.ObjectStoreFactory()).state()
    assert isinstance(state.message_ins_store, dict)
    assert hasattr(state.lock, "__enter__")


@pytest.mark.parametrize(("address", "shipped"), [("local", False), ("", False), ("10.0.0.1:6390", True)])
def test_the_runtime_env_hook_installs_the_hand_over_and_ships_the_app_to_a_cluster(monkeypatch, address, shipped):
    monkeypatch.setattr(vce_api, "add_messages_to_queue", FLOWER_HAND_OVER)  # undone after the test
    monkeypatch.setenv("RAY_ADDRESS", address)
    flower = {"env_vars": {"PYTHONPATH": "/head/only"}}
    result = ray_cluster.runtime_env_hook(flower)
    assert vce_api.add_messages_to_queue is simulation_engine.add_messages_to_queue
    assert ("py_modules" in result) == shipped
    assert result["env_vars"] == {"PYTHONPATH": "/head/only"}
