"""What every method is made of: a :class:`Method` (pure data: its name and variant settings, and
what its server does with each part of the model) and, beside it in the method's package, a
client part (``client.py``: the local update, a :class:`ClientRoutine`).

FedPAC, its baselines (Table 1) and ablations (Table 2), FedCCFA (Chen et al., NeurIPS 2024) and
pFedVEM (Zhu et al., CVPR 2023) all train the same split model (feature extractor theta + linear
head phi) on the same data. Their server steps differ in

* what the server does with each part of the model after a round (:class:`Rule`): average it
  over the clients by sample count (eq. 18), mix the heads with the collaboration QP (FedPAC
  eq. 11), merge them class by class within clusters of clients (FedCCFA), keep every
  client's own part (stored on the server by partition-id), or keep every client's Gaussian
  posterior over its head and average the posterior means by confidence into the prior mean
  (pFedVEM);
* which features local training aligns, and to what (:class:`Alignment`): the global class
  centroids (FedPAC eq. 3) or the client's cluster anchors (FedCCFA); either way clients send
  their class means back.

A method's package (``common/methods/<family>/``) holds the :class:`Method` subclass in its
``__init__.py`` and its client part in ``client.py`` (``common.methods.client``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

class Rule(str, Enum):
    """What the server does with one part of the model (extractor or head) after a round."""

    AVERAGE = "average"  # one global copy: the sample-weighted mean of the replies (eq. 18)
    MIX = "mix"  # per client: sum_j alpha_ij phi_j, alpha_i from the collaboration QP (eq. 11)
    # per client: its own trained copy, kept at the site (``common.site_state``); it never travels,
    # since no server step uses it
    LOCAL = "local"
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


# The run-config key of a method's setting, in its field's metadata (:func:`setting`).
RUN_CONFIG_KEY = "run-config"


def setting(default: Any, key: str) -> Any:
    """A method's own knob: a field of its class that the run config sets under ``key`` (kebab
    case, unique across methods). The class's ``__post_init__`` validates it (a ``ValueError``
    there becomes the run config's error for ``key``)."""
    return field(default=default, metadata={RUN_CONFIG_KEY: key})


def settings_of(method: type[Method] | Method) -> dict[str, dataclasses.Field]:
    """A method class's settings by run-config key."""
    return {f.metadata[RUN_CONFIG_KEY]: f for f in dataclasses.fields(method) if RUN_CONFIG_KEY in f.metadata}


@dataclass(frozen=True)
class Method:
    """One federated method: its name, its variant's settings and what its server does with each
    part of the model; its package's ``client.py`` and ``server.py`` hold what a client and the
    server do. A subclass may add its own run-config knobs with :func:`setting`."""

    # Whether the method's server draws the round's sample itself (pFedVEM's S_t), so that
    # fraction-train must not sample on top of it.
    draws_its_own_sample: ClassVar[bool] = False
    # Whether its client part keeps state of its own at the site from one round to the next
    # (Ditto's personal models: ``common.methods.client.SiteState``), beside the model parts kept
    # there (:attr:`site_parts`).
    keeps_site_state: ClassVar[bool] = False
    # Why the method cannot run with ``dp = true``, which the run config then refuses with this
    # reason (kNN-Per: its prediction reads the training records as they are); empty: it can.
    dp_refusal: ClassVar[str] = ""

    name: str
    extractor: Rule = Rule.AVERAGE
    head: Rule = Rule.AVERAGE
    alignment: Alignment = Alignment.NONE

    def __post_init__(self) -> None:
        if self.head in (Rule.MIX, Rule.CLUSTER) and self.extractor is not Rule.AVERAGE:
            # the QP's statistics and the clustered heads compare features of one shared extractor
            raise ValueError(f"{self.name}: head {self.head.value} needs an averaged extractor")
        if self.alignment is not Alignment.NONE and self.extractor is not Rule.AVERAGE:
            raise ValueError(f"{self.name}: feature alignment needs an averaged extractor")
        if (self.alignment is Alignment.ANCHORS) != (self.head is Rule.CLUSTER):
            raise ValueError(f"{self.name}: anchors come from, and only from, clustered heads")
        shares_plain_base = self.extractor is Rule.AVERAGE and self.alignment is Alignment.NONE
        if self.head is Rule.CONFIDENCE and not shares_plain_base:
            raise ValueError(f"{self.name}: posteriors come with an averaged extractor and no feature alignment")

    def configured(self, values: Mapping[str, Any]) -> Method:
        """This method with its settings taken from ``values`` (run-config key -> value; keys of
        other methods' settings are ignored)."""
        changes = {f.name: values[key] for key, f in settings_of(self).items() if key in values}
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def site_parts(self) -> tuple[str, ...]:
        """The model parts (``extractor``, ``head``) that stay at the site: never sent either way."""
        return tuple(part for part, rule in (("extractor", self.extractor), ("head", self.head)) if rule is Rule.LOCAL)

    @property
    def shared_parts(self) -> tuple[str, ...]:
        """The model parts that travel: sent to each client and back in its training reply."""
        return tuple(part for part in ("extractor", "head") if part not in self.site_parts)

    @property
    def keeps_anything_at_site(self) -> bool:
        """Whether its sites keep anything between rounds (model parts or the method's own state)."""
        return bool(self.site_parts) or self.keeps_site_state

    @property
    def has_alpha(self) -> bool:
        """Whether rounds produce a combination-weight matrix (for the alpha plots)."""
        return self.head is Rule.MIX
