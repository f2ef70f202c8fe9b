"""Every method of the product, each described by what it shares, not by a copy of the strategy.

FedPAC, its baselines (Table 1) and ablations (Table 2), FedCCFA (Chen et al., NeurIPS 2024) and
pFedVEM (Zhu et al., CVPR 2023) all train the same split model (feature extractor theta + linear
head phi) on the same data and differ only in

* what the server does with each part of the model after a round (:class:`Rule`): average it
  over the clients by sample count (eq. 18), mix the heads with the collaboration QP (FedPAC
  eq. 11), merge them class by class within clusters of clients (FedCCFA), keep every
  client's own part (stored on the server by partition-id), or keep every client's Gaussian
  posterior over its head and average the posterior means by confidence into the prior mean
  (pFedVEM);
* which features local training aligns, and to what (:class:`Alignment`): the global class
  centroids (FedPAC eq. 3) or the client's cluster anchors (FedCCFA); either way clients send
  their class means back;
* the local training routine (:class:`Routine`);
* whether a client fine-tunes its head before each evaluation (FedAvg-FT).

Where each piece lives: the server rules in ``common.aggregation`` (with the QP in
``common.collaboration`` and the class-level clustering in ``common.clustering``), the routines
and alignment losses in ``client_app.train``, pFedVEM's math in ``common.variational``. The
Flower glue (``server_app.strategy``, ``client_app.app``) reads only these flags; no method has a
strategy or a training loop of its own, and no glue names a method.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Rule(str, Enum):
    """What the server does with one part of the model (extractor or head) after a round."""

    AVERAGE = "average"  # one global copy: the sample-weighted mean of the replies (eq. 18)
    MIX = "mix"  # per client: sum_j alpha_ij phi_j, alpha_i from the collaboration QP (eq. 11)
    LOCAL = "local"  # per client: its own trained copy, kept on the server by partition-id
    # per client, class by class: the mean of the trained rows phi_j[c] of the clients j whose
    # balanced heads cluster with it for class c (FedCCFA)
    CLUSTER = "cluster"
    # per client: its posterior q_j = N(mu_j, sigma_j^2), kept on the server by partition-id; one
    # global prior mean w = sum_{j in S_t} tau_j mu_j / sum tau_j over the round's sample S_t,
    # tau_j = 1 / rho_j^2 (pFedVEM eq. 7). The extractor is then averaged over S_t as well.
    CONFIDENCE = "confidence"


class Alignment(str, Enum):
    """What local extractor training pulls each sample's features towards."""

    NONE = "none"
    CENTROIDS = "centroids"  # FedPAC eq. 3: squared distance to the global class centroid
    ANCHORS = "anchors"  # FedCCFA: contrastive, to the anchors of the client's class clusters


class Routine(str, Enum):
    """The local training routine of a method (``client_app.train``)."""

    ALTERNATING = "alternating"  # FedPAC: head epoch(s) on frozen features, then extractor epochs
    JOINT = "joint"  # FedAvg, FedPer, Local-only: the whole model, E epochs
    REPRESENTATION = "representation"  # FedRep: many head epochs, then extractor epochs
    # FedCCFA: a balanced-batch head from the fixed initial head phi^0 (only for the server's
    # clustering), the personal head, then extractor epochs
    CLUSTERED = "clustered"
    # pFedVEM: rho_j from the posterior as received, the variational E-step on the head (full-batch
    # negative ELBO against the prior N(w, rho_j^2)), then extractor epochs against head samples
    VARIATIONAL = "variational"


# Who trains in a method whose server aggregates a sample S_t (``Method.aggregates_a_sample``):
# every client ("all-train", the pFedMe/pFedVEM protocol) or S_t only ("sampled-train").
SAMPLE_PROTOCOLS = ("all-train", "sampled-train")


@dataclass(frozen=True)
class Method:
    """One federated method, as the flags the server and the clients act on."""

    name: str
    extractor: Rule
    head: Rule
    alignment: Alignment
    routine: Routine
    finetune_before_evaluation: bool = False

    def __post_init__(self) -> None:
        if self.head in (Rule.MIX, Rule.CLUSTER) and self.extractor is not Rule.AVERAGE:
            # the QP's statistics and the clustered heads compare features of one shared extractor
            raise ValueError(f"{self.name}: head {self.head.value} needs an averaged extractor")
        if self.alignment is not Alignment.NONE and self.extractor is not Rule.AVERAGE:
            raise ValueError(f"{self.name}: feature alignment needs an averaged extractor")
        if (self.alignment is Alignment.ANCHORS) != (self.head is Rule.CLUSTER):
            raise ValueError(f"{self.name}: anchors come from, and only from, clustered heads")
        if (self.routine is Routine.CLUSTERED) != (self.head is Rule.CLUSTER):
            raise ValueError(f"{self.name}: clustered heads need the balanced heads of the clustered routine")
        if (self.routine is Routine.VARIATIONAL) != (self.head is Rule.CONFIDENCE):
            raise ValueError(f"{self.name}: confidence-weighted heads need the posteriors of the variational routine")
        shares_plain_base = self.extractor is Rule.AVERAGE and self.alignment is Alignment.NONE
        if self.head is Rule.CONFIDENCE and not shares_plain_base:
            raise ValueError(f"{self.name}: posteriors come with an averaged extractor and no feature alignment")

    @property
    def needs_statistics(self) -> bool:
        """h_i, V_i (before training) for the collaboration QP: only when heads are mixed."""
        return self.head is Rule.MIX

    @property
    def needs_centroids(self) -> bool:
        """Alignment targets down (global centroids or the client's anchors) and local class
        means up: only with feature alignment."""
        return self.alignment is not Alignment.NONE

    @property
    def sends_balanced_head(self) -> bool:
        """The balanced-batch head travels up beside the trained one: the clustering input."""
        return self.head is Rule.CLUSTER

    @property
    def needs_initial_head(self) -> bool:
        """The fixed initial head phi^0 travels down: the clustered routine's balanced head
        starts from it every round."""
        return self.routine is Routine.CLUSTERED

    @property
    def personal_heads(self) -> bool:
        """Whether the server keeps a head per client (everything but an averaged head)."""
        return self.head is not Rule.AVERAGE

    @property
    def keeps_posteriors(self) -> bool:
        """The server keeps every client's posterior (mean as its head, and the scales s) by
        partition-id, sends it down with the prior mean w and gets it back trained: the posterior
        is client state that must outlive rounds, SuperNode restarts and a resumed server."""
        return self.head is Rule.CONFIDENCE

    @property
    def keeps_global_head(self) -> bool:
        """One head on the server besides any personal ones: FedAvg's average, pFedVEM's prior
        mean w. It is checkpointed."""
        return self.head in (Rule.AVERAGE, Rule.CONFIDENCE)

    @property
    def aggregates_a_sample(self) -> bool:
        """The server draws the round's sample S_t itself (each client with probability r, at
        least 2) and aggregates only S_t's replies; who *trains* is the protocol's choice
        (every client, or S_t only). pFedVEM's (and pFedMe's) protocol."""
        return self.head is Rule.CONFIDENCE

    @property
    def evaluates_local_model(self) -> bool:
        """A training reply also carries the accuracy of the locally trained model before
        aggregation (pFedVEM's own evaluation: the local base with the posterior mean)."""
        return self.routine is Routine.VARIATIONAL

    @property
    def sends_class_counts(self) -> bool:
        """n_ik travel with any statistics: they weight centroids and define h_i's p_ik."""
        return self.needs_statistics or self.needs_centroids

    @property
    def has_alpha(self) -> bool:
        """Whether rounds produce a combination-weight matrix (for the alpha plots)."""
        return self.head is Rule.MIX


FEDPAC = Method("fedpac", Rule.AVERAGE, Rule.MIX, Alignment.CENTROIDS, Routine.ALTERNATING)
NO = Alignment.NONE

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        FEDPAC,
        # Table 2's ablations: the FedPAC routine with one or both of its components switched off.
        # Neither: the alternating routine alone, every client keeps its own head (the column
        # "None", which is FedPer trained head-then-extractor).
        Method("fedpac-none", Rule.AVERAGE, Rule.LOCAL, NO, Routine.ALTERNATING),
        # Alignment only: no classifier collaboration, every client keeps its own head
        # (alpha = identity).
        Method("fedpac-align", Rule.AVERAGE, Rule.LOCAL, Alignment.CENTROIDS, Routine.ALTERNATING),
        # Collaboration only: lambda = 0 (no centroids at all), heads mixed by the QP.
        Method("fedpac-collab", Rule.AVERAGE, Rule.MIX, NO, Routine.ALTERNATING),
        # Table 1's baselines.
        Method("local", Rule.LOCAL, Rule.LOCAL, NO, Routine.JOINT),
        Method("fedavg", Rule.AVERAGE, Rule.AVERAGE, NO, Routine.JOINT),
        Method("fedavg-ft", Rule.AVERAGE, Rule.AVERAGE, NO, Routine.JOINT, finetune_before_evaluation=True),
        Method("fedper", Rule.AVERAGE, Rule.LOCAL, NO, Routine.JOINT),
        Method("fedrep", Rule.AVERAGE, Rule.LOCAL, NO, Routine.REPRESENTATION),
        # FedCCFA: classifier clustering and feature alignment under distributed concept drift.
        Method("fedccfa", Rule.AVERAGE, Rule.CLUSTER, Alignment.ANCHORS, Routine.CLUSTERED),
        # pFedVEM: a Bayesian linear head per client, confidence-weighted prior mean, FedAvg base.
        Method("pfedvem", Rule.AVERAGE, Rule.CONFIDENCE, NO, Routine.VARIATIONAL),
    )
}
