"""FedCCFA (Chen et al., NeurIPS 2024): classifier clustering and feature alignment under
distributed concept drift. Every client trains a balanced-batch head from the fixed initial head;
the server clusters those class by class and merges the trained heads and the local anchors
within each cluster; clients align their features to their clusters' anchors."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.methods.base import Alignment, Method, Rule


@dataclass(frozen=True)
class FedCCFA(Method):
    """FedCCFA: clustered heads, aligned to the client's cluster anchors."""

    head: Rule = field(init=False, default=Rule.CLUSTER)
    alignment: Alignment = field(init=False, default=Alignment.ANCHORS)
