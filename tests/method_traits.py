"""What each method sends, keeps and measures, written out for the tests from the papers' methods
(not read from the product, whose server parts the tests check against it)."""

from __future__ import annotations

from dataclasses import dataclass

from common.methods.base import Method, Rule
from common.methods.fedbabu import FedBABU
from common.methods.fedccfa import FedCCFA
from common.methods.fedpac import FedPAC
from common.methods.pfedvem import PFedVEM


@dataclass(frozen=True)
class Traits:
    statistics: bool = False  # h_i and V_i for the collaboration QP (FedPAC's classifier collaboration)
    centroids: bool = False  # alignment targets down, local class means up (FedPAC's alignment, FedCCFA)
    class_counts: bool = False  # n_ik with any of the above
    balanced_head: bool = False  # FedCCFA's clustering input
    posteriors: bool = False  # pFedVEM: rho_j up, the prior down; the posterior scales stay at the site
    local_evaluation: bool = False  # pFedVEM's own measure: the locally trained model's accuracy
    global_head: bool = False  # one head on the server: FedAvg's average, pFedVEM's prior mean
    fixed_head: bool = False  # the head is never trained: the initial one throughout (FedBABU)
    # the model parts no server step uses, which stay at the site: FedPer's and FedRep's head
    # (the personal layers), Local-only's whole model, the alignment-only ablation's head
    kept_at_site: tuple[str, ...] = ()
    site_state: tuple[str, ...] = ()  # what the client part keeps between rounds: Ditto's personal model

    @property
    def sends_statistics(self) -> bool:
        return self.class_counts


def traits(method: Method) -> Traits:
    if isinstance(method, FedPAC):
        return Traits(statistics=method.collaborate, centroids=method.align,
                      class_counts=method.align or method.collaborate,
                      kept_at_site=() if method.collaborate else ("head",))
    if isinstance(method, FedCCFA):
        return Traits(centroids=True, class_counts=True, balanced_head=True)
    if isinstance(method, PFedVEM):
        return Traits(posteriors=True, local_evaluation=True, global_head=True,
                      site_state=("pfedvem-posterior-scales",))
    if isinstance(method, FedBABU):
        return Traits(global_head=True, fixed_head=True)
    kept_at_site = {"local": ("extractor", "head"), "fedper": ("head",), "fedrep": ("head",)}.get(method.name, ())
    site_state = ("ditto-personal-model",) if method.name == "ditto" else ()
    # the baselines, FedProx, Ditto
    return Traits(global_head=method.head is Rule.AVERAGE, kept_at_site=kept_at_site, site_state=site_state)
