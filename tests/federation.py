"""An in-process federation for tests: the real ClientApp behind a Grid-like object.

``InProcessGrid`` gives the strategy what Flower's Grid gives it (node ids, send and receive),
and delivers every message to the real ``client_app.app`` with a per-node Context, the way a
SuperNode would, minus the network. Tests can reorder replies or tamper with them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module
from flwr.supercore.task_identity import TaskIdentity

import numpy as np
import torch

from client_app.app import app as client_app
from common import protocol as p
from common.config import FedPACConfig
from common.methods.server import EXTRACTOR, HEAD, ServerState
from common.model import FedPACNet

SERVER_NODE_ID = 1


def set_task_identity(run_id: int = 7) -> None:
    """What the ServerApp runtime sets before a strategy creates messages."""
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = SERVER_NODE_ID
    TaskIdentity.task_id = 1


class InProcessGrid:
    """Nodes with random 64-bit ids (as in Flower), each holding one partition."""

    def __init__(
        self,
        run_config: dict,
        num_partitions: int,
        seed: int = 0,
        shuffle_replies: bool = False,
        tamper: Callable[[Message, int], Message | None] | None = None,
        crash_at_round: int | None = None,
        tamper_queries: bool = False,
        node_config: dict | None = None,
    ) -> None:
        """``node_config``: what every node's config holds besides its partition (a site's own
        settings: ``state-dir``, ``dp-noise-secret``, ...)."""
        rng = random.Random(seed)
        self.partition_of_node: dict[int, int] = {}
        self.contexts: dict[int, Context] = {}
        for pid in range(num_partitions):
            node_id = rng.getrandbits(64) | 1 << 63  # uint64, above the int64 range
            self.partition_of_node[node_id] = pid
            self.contexts[node_id] = Context(
                run_id=7,
                node_id=node_id,
                node_config={**(node_config or {}), "partition-id": pid, "num-partitions": num_partitions},
                state=RecordDict(),
                run_config=dict(run_config),
            )
        self.rng = rng
        self.shuffle_replies = shuffle_replies
        self.tamper = tamper
        self.tamper_queries = tamper_queries  # tamper with pre-flight answers too
        self.crash_at_round = crash_at_round
        self.train_rounds = 0
        self.sent: list[Message] = []

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def get_nodes(self) -> list[NodeInfo]:
        """Each node as a SuperLink with node authentication knows it: registered under the
        name ``supernode-<i>`` of its partition (what ``deploy/certs.sh register`` does)."""
        return [NodeInfo(node_id=node, name=f"supernode-{self.partition_of_node[node]}")
                for node in self.get_node_ids()]

    def _deliver(self, msg: Message) -> Message:
        context = self.contexts[msg.metadata.dst_node_id]
        try:
            return client_app(msg, context)
        except Exception as err:  # pylint: disable=broad-except  # a SuperNode reports, not crashes
            return Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            self.train_rounds += 1
            if self.train_rounds == self.crash_at_round:
                raise RuntimeError(f"simulated server crash in round {self.crash_at_round}")
        self.sent.extend(messages)
        replies = [self._deliver(m) for m in messages]
        if self.tamper is not None and (self.tamper_queries or not _queries(messages)):
            replies = [
                r for r in (self.tamper(reply, self.partition_of_node[reply.metadata.src_node_id]) for reply in replies)
                if r is not None
            ]
        if self.shuffle_replies:
            self.rng.shuffle(replies)
        return replies


def _queries(messages: list[Message]) -> bool:
    return bool(messages) and messages[0].metadata.message_type == MessageType.QUERY


# Reply tampering for the bad-reply tests: each returns a function that changes a reply in place.


def set_section(reply: Message, section: str, arrays: p.NDArrays | None) -> None:
    """Replace (``None``: remove) section ``section`` of the reply's packed ``arrays`` record."""
    sections = p.sections_of(reply.content)
    if arrays is None:
        del sections[section]
    else:
        sections[section] = arrays
    reply.content[p.ARRAYS] = p.pack(sections)


def set_array(section: str, key: str, change: Callable[[np.ndarray], np.ndarray]) -> Callable[[Message], None]:
    """Replace array ``key`` of section ``section`` by ``change`` of a copy of it."""
    def tamper(reply: Message) -> None:
        arrays = p.sections_of(reply.content)[section]
        arrays[key] = change(arrays[key].copy())
        set_section(reply, section, arrays)
    return tamper


def drop_section(section: str) -> Callable[[Message], None]:
    """Remove section ``section`` from the reply."""
    def tamper(reply: Message) -> None:
        set_section(reply, section, None)
    return tamper


def set_metric(key: str, value: object) -> Callable[[Message], None]:
    """Set metric ``key`` of the reply's ``metrics`` record to ``value``."""
    def tamper(reply: Message) -> None:
        reply.content[p.METRICS][key] = value
    return tamper


def nan(a: np.ndarray) -> np.ndarray:
    """``a`` with its first element NaN."""
    a.flat[0] = np.nan
    return a


def shared_model(state: ServerState, cfg: FedPACConfig) -> FedPACNet:
    """The server's shared extractor and head as one model: the global model of a method that
    averages both (FedAvg's, Fed-RoD's generic one, kNN-Per's, FedBABU's)."""
    model = FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes)
    model.load_state_dict({key: torch.from_numpy(np.array(value))
                           for key, value in {**state.shared[EXTRACTOR], **state.shared[HEAD]}.items()})
    return model
