"""Every method of the product, by its run-config name (``strategy``): one line each.

A method's package (``common/methods/<family>/``) holds what it is (its :class:`Method` subclass,
with the variant settings of its ablations) and, in ``client.py``, what its clients do
(``common.methods.base.client_routine``).
"""

from __future__ import annotations

from common.methods.apfl import APFL
from common.methods.base import Alignment, Method, Rule
from common.methods.baselines import Baseline
from common.methods.ditto import Ditto
from common.methods.fedbabu import FedBABU
from common.methods.fedccfa import FedCCFA
from common.methods.fedfomo import FedFomo
from common.methods.fedpac import FedPAC
from common.methods.fedprox import FedProx
from common.methods.fedrod import FedRoD
from common.methods.knnper import KNNPer
from common.methods.pfedhn import PFedHN
from common.methods.pfedme import PFedMe
from common.methods.pfedvem import PFedVEM

FEDPAC = FedPAC("fedpac")

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        FEDPAC,
        # Table 2's ablations: the FedPAC routine with one or both of its components switched off.
        # Neither: the alternating routine alone, every client keeps its own head (the column
        # "None", which is FedPer trained head-then-extractor).
        FedPAC("fedpac-none", align=False, collaborate=False),
        # Alignment only: no classifier collaboration, every client keeps its own head (alpha = identity).
        FedPAC("fedpac-align", collaborate=False),
        # Collaboration only: lambda = 0 (no centroids at all), heads mixed by the QP.
        FedPAC("fedpac-collab", align=False),
        # Table 1's baselines.
        Baseline("local", extractor=Rule.LOCAL, head=Rule.LOCAL),
        Baseline("fedavg"),
        Baseline("fedavg-ft", finetune_before_evaluation=True),
        Baseline("fedper", head=Rule.LOCAL),
        Baseline("fedrep", head=Rule.LOCAL, representation=True),
        # LG-FedAvg (Liang et al., 2020): a local feature extractor at each site, the head averaged.
        Baseline("lg-fedavg", extractor=Rule.LOCAL),
        # FedCCFA: classifier clustering and feature alignment under distributed concept drift.
        FedCCFA("fedccfa"),
        # pFedVEM: a Bayesian linear head per client, confidence-weighted prior mean, FedAvg base.
        PFedVEM("pfedvem"),
        # FedProx: FedAvg with a proximal term in the local objective.
        FedProx("fedprox"),
        # Ditto: FedAvg's global model, and a personal model at each site regularized towards it.
        Ditto("ditto"),
        # FedBABU: the body learned by FedAvg through a fixed random head, fine-tuned before evaluation.
        FedBABU("fedbabu"),
        # Fed-RoD: a generic model (balanced softmax) by FedAvg, and a personal head on top of it at each site.
        FedRoD("fedrod"),
        # kNN-Per: FedAvg's global model, interpolated at evaluation with a kNN over the site's training features.
        KNNPer("knn-per"),
        # APFL: FedAvg's global model, and at each site a local model mixed with it (alpha = 0.25).
        APFL("apfl"),
        # pFedHN: a hypernetwork at the server generates every client's model from its embedding.
        PFedHN("pfedhn"),
        # pFedHN-PC: the hypernetwork generates the extractor; each site keeps a personal head.
        PFedHN("pfedhn-pc", head=Rule.LOCAL),
        # pFedMe: personalized models by Moreau envelopes (K inner steps), their anchors averaged with step beta.
        PFedMe("pfedme"),
        # FedFomo: each client weighs M other clients' models on its validation split and moves towards the better.
        FedFomo("fedfomo"),
    )
}

__all__ = ["FEDPAC", "METHODS", "Alignment", "Method", "Rule"]
