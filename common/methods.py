"""FedPAC and its baselines, each described by what it shares, not by a copy of the strategy.

Every method in the paper's comparison (Table 1) and ablation (Table 2) trains the same split
model (feature extractor theta + linear head phi) on the same data and differs only in

* what the server does with each part of the model after a round (:class:`Rule`): average it
  over the clients by sample count (eq. 18), mix the heads with the collaboration QP (eq. 11),
  or keep every client's own part (stored on the server by partition-id);
* whether local training pulls features towards the global class centroids (feature
  alignment, eq. 3), which is what makes clients compute and send centroids;
* the local training routine (:class:`Routine`);
* whether a client fine-tunes its head before each evaluation (FedAvg-FT).

The server (``server_app.strategy``) and the client (``client_app.train``) read these flags;
no method has a strategy or a training loop of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Rule(str, Enum):
    """What the server does with one part of the model (extractor or head) after a round."""

    AVERAGE = "average"  # one global copy: the sample-weighted mean of the replies (eq. 18)
    MIX = "mix"  # per client: sum_j alpha_ij phi_j, alpha_i from the collaboration QP (eq. 11)
    LOCAL = "local"  # per client: its own trained copy, kept on the server by partition-id


class Routine(str, Enum):
    """The local training routine of a method (``client_app.train``)."""

    ALTERNATING = "alternating"  # FedPAC: head epoch(s) on frozen features, then extractor epochs
    JOINT = "joint"  # FedAvg, FedPer, Local-only: the whole model, E epochs
    REPRESENTATION = "representation"  # FedRep: many head epochs, then extractor epochs


@dataclass(frozen=True)
class Method:
    """One federated method, as the flags the server and the clients act on."""

    name: str
    extractor: Rule
    head: Rule
    alignment: bool  # feature alignment to the global centroids (eq. 3) in local training
    routine: Routine
    finetune_before_evaluation: bool = False

    def __post_init__(self) -> None:
        if self.head is Rule.MIX and self.extractor is not Rule.AVERAGE:
            # the QP's statistics compare features of one shared extractor
            raise ValueError(f"{self.name}: head mixing needs an averaged extractor")
        if self.alignment and self.extractor is not Rule.AVERAGE:
            raise ValueError(f"{self.name}: feature alignment needs an averaged extractor")

    @property
    def needs_statistics(self) -> bool:
        """h_i, V_i (before training) for the collaboration QP: only when heads are mixed."""
        return self.head is Rule.MIX

    @property
    def needs_centroids(self) -> bool:
        """Global centroids down and local centroids up: only with feature alignment."""
        return self.alignment

    @property
    def sends_class_counts(self) -> bool:
        """n_ik travel with any statistics: they weight centroids and define h_i's p_ik."""
        return self.needs_statistics or self.needs_centroids

    @property
    def has_alpha(self) -> bool:
        """Whether rounds produce a combination-weight matrix (for the alpha plots)."""
        return self.head is Rule.MIX


FEDPAC = Method("fedpac", Rule.AVERAGE, Rule.MIX, alignment=True, routine=Routine.ALTERNATING)

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        FEDPAC,
        # Table 2's ablations: the FedPAC routine with one or both of its components switched off.
        # Neither: the alternating routine alone, every client keeps its own head (the column
        # "None", which is FedPer trained head-then-extractor).
        Method("fedpac-none", Rule.AVERAGE, Rule.LOCAL, alignment=False, routine=Routine.ALTERNATING),
        # Alignment only: no classifier collaboration, every client keeps its own head
        # (alpha = identity).
        Method("fedpac-align", Rule.AVERAGE, Rule.LOCAL, alignment=True, routine=Routine.ALTERNATING),
        # Collaboration only: lambda = 0 (no centroids at all), heads mixed by the QP.
        Method("fedpac-collab", Rule.AVERAGE, Rule.MIX, alignment=False, routine=Routine.ALTERNATING),
        # Table 1's baselines.
        Method("local", Rule.LOCAL, Rule.LOCAL, alignment=False, routine=Routine.JOINT),
        Method("fedavg", Rule.AVERAGE, Rule.AVERAGE, alignment=False, routine=Routine.JOINT),
        Method("fedavg-ft", Rule.AVERAGE, Rule.AVERAGE, alignment=False, routine=Routine.JOINT,
               finetune_before_evaluation=True),
        Method("fedper", Rule.AVERAGE, Rule.LOCAL, alignment=False, routine=Routine.JOINT),
        Method("fedrep", Rule.AVERAGE, Rule.LOCAL, alignment=False, routine=Routine.REPRESENTATION),
    )
}
