"""Which partition a node serves: decided by who the node is, not by what it says.

A partition is a site's data, and with it everything the server keeps for that site (its
personalized head, its posterior, its anchors). In a deployment with SuperNode authentication
every request a node sends is signed with its private key, and the SuperLink knows each node by
the public key and the name its operator registered (``flwr supernode register KEY.pub
FEDERATION --name NAME``). A node's own ``partition-id`` (its node config) is only a claim: any
enrolled node can claim any partition. So in a deployment the partition follows from the
registered identity, through the run config's ``partition-map``:

* ``""`` (default): a node registered under the name ``supernode-<i>`` serves partition ``i``
  (the name the operator gives a site's key: ``deploy/certs.sh register --name supernode-<i>
  KEY.pub FEDERATION``, which refuses a name another key holds; never the key file's name);
* ``"NAME=I, ..."`` or ``"SHA256:...=I, ..."``: the operator's map, by registered name or by
  the key's fingerprint (what ``ssh-keygen -lf KEY.pub`` prints), each partition at most once;
* ``"claims"``: every node's own claim is believed (a federation without node authentication,
  on a network that is trusted as a whole).

A node whose identity maps to no partition, or whose claim disagrees with its identity, is
refused and receives nothing; a partition never moves away from a node that is connected. The
simulation's nodes are made by Flower itself from the run's own node configs, so there the
claims are the truth.

**One partition, one key.** Flower does not keep registered names unique, and a name is only as
good as the registration: a second key registered as ``supernode-0`` (a rogue that sent its own
key under that file name) maps to partition 0 as well. The registry notes every key it sees map
to a partition. Once a partition has seen two keys in a run it is *contested*: every node of it,
the one serving it included, is refused for the rest of the run, and the log names both keys'
fingerprints. Not "the first connected wins", which is a coin flip of node ids, and not "the
partition goes to the one that is left when the other disconnects": a rogue would simply wait
for the honest site to go offline (or knock it off the network) and take its personalized model.
The operator settles it: unregister the wrong key (``flwr supernode unregister``), then resume
the run, whose registry starts from the keys that are registered then. A node with the same key
as the one serving the partition (a restarted SuperNode; without authentication, no key at all)
is no second key: it is refused while that node is connected and takes the partition once it is
gone.

**The federation's size.** With a ``partition-map`` of names or keys, the operator said which
partitions there are: the largest mapped partition plus one, whatever any node answers. With the
default map the size is the ``num-partitions`` that most of the nodes whose identity backs their
claim report, and on a tie the smaller one: a node registered as ``supernode-<i>`` backs only a
claim above ``i``, so nodes registered beyond the federation can only pull the size up, never
down. An operator who trusts neither every site's configuration nor every registration names
the sites in ``partition-map``.

This module knows nothing about Flower: ``server_app.strategy`` feeds it node ids, registered
names and public keys, and asks it before it sends a node anything.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
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

    def size(self) -> int | None:
        """The number of partitions the operator's map names (its largest partition plus one:
        a partition it leaves out has no site), or None when it names none."""
        return max(self.entries.values()) + 1 if self.entries else None

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
        # every key seen mapping to a partition in this run: partition -> fingerprint -> who
        self.keys_seen: dict[int, dict[str, str]] = {}

    def describe(self) -> str:
        """What binds a node to its partition, for the log."""
        if self.trusted_claims and not self.map.trust_claims:
            return "each node's own partition-id (nodes the federation made itself)"
        return self.map.describe()

    def declared_size(self) -> int | None:
        """The federation's number of partitions as the operator declared it (``partition-map``
        entries), or None: then the nodes' answers decide it (:func:`federation_size`)."""
        return None if self.trusted_claims else self.map.size()

    def node_of(self, partition_id: int) -> int | None:
        """The node bound to ``partition_id``, if any."""
        return next((node for node, pid in self.node_partition.items() if pid == partition_id), None)

    def backs(self, identity: Identity | None, claimed: int) -> bool:
        """Whether ``identity`` serves the partition a node claims (always, where claims are
        believed): only such nodes' answers may size the federation."""
        return self.trusted_claims or (identity is not None and self.map.partition_of(identity) == claimed)

    def contested(self, partition_id: int) -> bool:
        """Whether two keys have mapped to ``partition_id`` in this run (see the module's
        docstring: nobody serves it until the operator keeps one)."""
        return len(self.keys_seen.get(partition_id, {})) > 1

    def note_keys(self, identities: Mapping[int, Identity]) -> tuple[list[int], dict[int, Refusal]]:
        """Note the key of every connected node whose identity maps to a partition, and refuse
        every node of a partition that two keys have mapped to (its bound node too, connected or
        not). Returns the partitions found contested for the first time, and the nodes this call
        refused."""
        newly: list[int] = []
        for identity in identities.values():
            pid = self._keyed_partition(identity)
            if pid is not None:
                was_contested = self.contested(pid)
                self.keys_seen.setdefault(pid, {})[identity.fingerprint] = identity.name
                if self.contested(pid) and not was_contested:
                    newly.append(pid)
        refused: dict[int, Refusal] = {}
        for node, pid in list(self.node_partition.items()):
            if self.contested(pid):
                del self.node_partition[node]
                refused[node] = self._refuse(node, self._contest_refusal(pid))
        for node, identity in sorted(identities.items()):
            pid = None if self.trusted_claims else self.map.partition_of(identity)
            if pid is not None and self.contested(pid) and node not in self.refused:
                refused[node] = self._refuse(node, self._contest_refusal(pid))
        return sorted(newly), refused

    def _keyed_partition(self, identity: Identity) -> int | None:
        """The partition ``identity`` maps to, where it has a key that can tell it apart."""
        if self.trusted_claims or not identity.fingerprint:
            return None
        return self.map.partition_of(identity)

    def describe_keys(self, partition_id: int) -> str:
        """The keys seen mapping to ``partition_id``, with the names they are registered under."""
        keys = self.keys_seen.get(partition_id, {})
        return ", ".join(f"{fp} ({Identity(name).describe()})" for fp, name in sorted(keys.items()))

    def _contest_refusal(self, partition_id: int) -> Refusal:
        return Refusal(f"partition {partition_id} has seen {len(self.keys_seen[partition_id])} keys in this run, "
                       f"{self.describe_keys(partition_id)}: nobody serves it until the operator unregisters "
                       "the wrong one and resumes the run")

    def screen(self, node_id: int, identity: Identity, num_partitions: int | None) -> Refusal | None:
        """Refuse, before it is sent anything, a node whose identity serves no partition (or a
        contested one)."""
        if self.trusted_claims:
            return None
        pid = self.map.partition_of(identity)
        if pid is None:
            return self._refuse(node_id, Refusal(f"its identity ({identity.describe()}) serves no partition: "
                                                 "register it as supernode-<i> or name it in partition-map"))
        if num_partitions is not None and pid >= num_partitions:
            return self._refuse(node_id, Refusal(f"its identity ({identity.describe()}) serves partition {pid}, "
                                                 f"not one of the federation's {num_partitions}"))
        if self.contested(pid):
            return self._refuse(node_id, self._contest_refusal(pid))
        return None

    def bind(self, node_id: int, claimed: int, identity: Identity, connected: set[int]) -> Refusal | None:
        """Bind ``node_id`` to its partition, or say why not: its identity gives another partition
        than it claims, the partition is contested, or the partition's node is connected. A
        partition whose node is gone goes to the new one (a SuperNode restarted without
        authentication has a new node id; one with another key has made the partition
        contested, :meth:`note_keys`)."""
        if not self.backs(identity, claimed):
            return self._refuse(node_id, Refusal(f"it claims partition {claimed}, its identity "
                                                 f"({identity.describe()}) serves partition "
                                                 f"{self.map.partition_of(identity)}"))
        if not self.trusted_claims and self.contested(claimed):
            return self._refuse(node_id, self._contest_refusal(claimed))
        holder = self.node_of(claimed)
        if holder is not None and holder != node_id:
            if holder in connected:
                return self._refuse(node_id, Refusal(f"partition {claimed} is served by connected node {holder}",
                                                     final=not self.trusted_claims))
            del self.node_partition[holder]
        self.node_partition[node_id] = claimed
        self.refused.pop(node_id, None)
        return None

    def exclude(self, node_id: int, reason: str) -> Refusal:
        """Refuse ``node_id`` for the rest of the run for a reason found outside the registry (its
        pre-flight answer): it is sent nothing more."""
        self.node_partition.pop(node_id, None)
        return self._refuse(node_id, Refusal(reason))

    def _refuse(self, node_id: int, refusal: Refusal) -> Refusal:
        self.refused[node_id] = refusal
        return refusal


def federation_size(claims: list[int]) -> int:
    """The federation's number of partitions from the claims of nodes whose identity backs them:
    the one most of them share, the smaller on a tie (a node serving partition ``i`` backs only
    a claim above ``i``: nodes registered beyond the federation can only pull the size up), so
    the choice depends neither on the order the answers arrived in nor on who claims most."""
    return min(set(claims), key=lambda n: (-claims.count(n), n))
