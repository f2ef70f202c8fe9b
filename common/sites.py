"""Which partition a node serves: decided by who the node is, not by what it says.

A partition is a site's data, and with it everything the server keeps for that site (its
personalized head, its posterior, its anchors). In a deployment with SuperNode authentication
every request a node sends is signed with its private key, and the SuperLink knows each node by
the public key and the name its operator registered (``flwr supernode register KEY.pub
FEDERATION --name NAME``). A node's own ``partition-id`` (its node config) is only a claim: any
enrolled node can claim any partition. So in a deployment the partition follows from the
registered identity, through the run config's ``partition-map``:

* ``""`` (default): a node registered under the name ``supernode-<i>`` serves partition ``i``
  (the names ``deploy/certs.sh register`` gives the keys ``keys/supernode-<i>``);
* ``"NAME=I, ..."`` or ``"SHA256:...=I, ..."``: the operator's map, by registered name or by
  the key's fingerprint (what ``ssh-keygen -lf KEY.pub`` prints), each partition at most once;
* ``"claims"``: every node's own claim is believed (a federation without node authentication,
  on a network that is trusted as a whole).

A node whose identity maps to no partition, or whose claim disagrees with its identity, is
refused and receives nothing; a partition never moves away from a node that is connected. The
simulation's nodes are made by Flower itself from the run's own node configs, so there the
claims are the truth.

This module knows nothing about Flower: ``server_app.strategy`` feeds it node ids, registered
names and public keys, and asks it before it sends a node anything.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import serialization

CLAIMS = "claims"
DEFAULT_NAME = re.compile(r"supernode-(0|[1-9][0-9]{0,8})")
_FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")
# A registered name as the map may spell it: no separators of the map itself.
_NAME = re.compile(r"[^\s,=]+")


def fingerprint(public_key: bytes) -> str:
    """OpenSSH's fingerprint of a public key (``SHA256:`` and the unpadded base64 of the SHA-256
    of its SSH wire encoding), as ``ssh-keygen -lf KEY.pub`` prints it; ``""`` for bytes that are
    not a PEM public key (the SuperLink stores keys as PEM; the simulation has random bytes)."""
    try:
        key = serialization.load_pem_public_key(public_key)
        openssh = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    except (ValueError, TypeError):
        return ""
    blob = base64.b64decode(openssh.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


@dataclass(frozen=True)
class Identity:
    """What the SuperLink vouches for about a node: its registered name and its key's
    fingerprint (each ``""`` when there is none)."""

    name: str = ""
    fingerprint: str = ""

    def describe(self) -> str:
        parts = [f"name '{self.name}'" if self.name else "no registered name"]
        if self.fingerprint:
            parts.append(f"key {self.fingerprint}")
        return ", ".join(parts)


@dataclass(frozen=True)
class PartitionMap:
    """The run config's ``partition-map``, parsed: who serves which partition."""

    trust_claims: bool = False
    entries: dict[str, int] = field(default_factory=dict)  # name or fingerprint -> partition-id

    @classmethod
    def parse(cls, text: str) -> PartitionMap:
        """Parse ``text``; a ValueError names what is wrong with it."""
        text = text.strip()
        if text == CLAIMS:
            return cls(trust_claims=True)
        entries: dict[str, int] = {}
        owners: dict[int, str] = {}
        for item in (part.strip() for part in re.split(r"[,\s]+", text) if part.strip()):
            who, sep, pid_text = item.rpartition("=")
            if not sep or not who or not re.fullmatch(r"[0-9]+", pid_text):
                raise ValueError(f"'{item}' is not NAME=PARTITION or SHA256:FINGERPRINT=PARTITION")
            if who.startswith("SHA256:") and not _FINGERPRINT.fullmatch(who):
                raise ValueError(f"'{who}' is not a SHA256 key fingerprint as ssh-keygen -lf prints it")
            if not _NAME.fullmatch(who):
                raise ValueError(f"'{who}' is not a registered name (no spaces, commas or '=')")
            pid = int(pid_text)
            if who in entries:
                raise ValueError(f"'{who}' is mapped twice")
            if pid in owners:
                raise ValueError(f"partition {pid} is mapped to both '{owners[pid]}' and '{who}'")
            entries[who], owners[pid] = pid, who
        return cls(entries=entries)

    def partition_of(self, identity: Identity) -> int | None:
        """The partition ``identity`` serves, or None when this map gives it none. A key's
        fingerprint in the map wins over its name; an entry spelled as a fingerprint matches
        only a key (anyone who may register a node may name it ``SHA256:...``)."""
        if self.entries:
            if identity.fingerprint in self.entries:
                return self.entries[identity.fingerprint]
            if identity.name and not identity.name.startswith("SHA256:"):
                return self.entries.get(identity.name)
            return None
        match = DEFAULT_NAME.fullmatch(identity.name)
        return int(match.group(1)) if match else None

    def describe(self) -> str:
        if self.trust_claims:
            return "each node's own partition-id (partition-map = 'claims': no identities)"
        if self.entries:
            return f"registered identity, from partition-map ({len(self.entries)} sites)"
        return "registered name: supernode-<i> serves partition i"


@dataclass(frozen=True)
class Refusal:
    """Why a node is refused. ``final``: nothing in this run can change it (the node is not
    asked again); otherwise it may be asked again next round (its partition's node left)."""

    reason: str
    final: bool = True


class SiteRegistry:
    """The run's binding of nodes to partitions.

    ``identities`` is what the SuperLink vouches for about each node (None: nodes are made by
    the federation itself, the simulation, and their claims are the truth)."""

    def __init__(self, partition_map: PartitionMap | None = None, *, trusted_claims: bool = False) -> None:
        self.map = partition_map or PartitionMap()
        self.trusted_claims = trusted_claims or self.map.trust_claims
        self.node_partition: dict[int, int] = {}
        self.refused: dict[int, Refusal] = {}

    def describe(self) -> str:
        """What binds a node to its partition, for the log."""
        if self.trusted_claims and not self.map.trust_claims:
            return "each node's own partition-id (nodes the federation made itself)"
        return self.map.describe()

    def node_of(self, partition_id: int) -> int | None:
        """The node bound to ``partition_id``, if any."""
        return next((node for node, pid in self.node_partition.items() if pid == partition_id), None)

    def backs(self, identity: Identity | None, claimed: int) -> bool:
        """Whether ``identity`` serves the partition a node claims (always, where claims are
        believed): only such nodes' answers may size the federation."""
        return self.trusted_claims or (identity is not None and self.map.partition_of(identity) == claimed)

    def screen(self, node_id: int, identity: Identity, num_partitions: int | None) -> Refusal | None:
        """Refuse, before it is sent anything, a node whose identity serves no partition."""
        if self.trusted_claims:
            return None
        pid = self.map.partition_of(identity)
        if pid is None:
            return self._refuse(node_id, Refusal(f"its identity ({identity.describe()}) serves no partition: "
                                                 "register it as supernode-<i> or name it in partition-map"))
        if num_partitions is not None and pid >= num_partitions:
            return self._refuse(node_id, Refusal(f"its identity ({identity.describe()}) serves partition {pid}, "
                                                 f"not one of the federation's {num_partitions}"))
        return None

    def bind(self, node_id: int, claimed: int, identity: Identity, connected: set[int]) -> Refusal | None:
        """Bind ``node_id`` to its partition, or say why not: its identity gives another partition
        than it claims, or the partition's node is connected. A partition whose node is gone
        goes to the new one (a SuperNode restarted without authentication has a new node id)."""
        if not self.backs(identity, claimed):
            return self._refuse(node_id, Refusal(f"it claims partition {claimed}, its identity "
                                                 f"({identity.describe()}) serves partition "
                                                 f"{self.map.partition_of(identity)}"))
        holder = self.node_of(claimed)
        if holder is not None and holder != node_id:
            if holder in connected:
                return self._refuse(node_id, Refusal(f"partition {claimed} is served by connected node {holder}",
                                                     final=not self.trusted_claims))
            del self.node_partition[holder]
        self.node_partition[node_id] = claimed
        self.refused.pop(node_id, None)
        return None

    def _refuse(self, node_id: int, refusal: Refusal) -> Refusal:
        self.refused[node_id] = refusal
        return refusal
