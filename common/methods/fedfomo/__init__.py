"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez, ICLR 2021): personalized federated learning by
first-order model optimization.

The server keeps every client's latest model theta_n and an affinity matrix P. In each round it
sends client i its own model theta_i and the models of M other clients, chosen epsilon-greedily
by P_i (a random one with probability epsilon, else the highest affinity not yet chosen). The
client weighs each downloaded model by how much it lowers the loss on a validation split of its
own training data, per unit of distance,

    w_n = (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i||,

keeps the positive ones normalized to sum to 1 and moves to theta_i + sum_n w_n (theta_n -
theta_i) (the paper's eq. 5-6; with no positive weight it keeps theta_i); then it trains that model
for ``local-epochs`` epochs on the rest of its training data (CE, the baselines' step size eta)
and sends it back with the weights w_n. The server keeps the model as the client's and adds the
weights to P_i. Each client evaluates its own latest model, the one the server holds for it.

Where this follows the authors' code (``NVlabs/FedFomo``) or FL-bench's (``KarhouTam/FL-bench``,
``fedfomo``), and where it departs:

* **Which models.** The candidates are the clients whose model the server holds, but client i
  itself: in round 1 there are none, and every client trains its own copy of the initial model
  (the authors': "everyone locally trains first"). The authors offer only the models uploaded in
  the previous round; the server here offers each client's latest (the same with every client
  training every round, as in Table 1).
* **Exploration.** epsilon starts at ``fedfomo-epsilon`` (0.3, the authors' ``EPSILON``) in the
  first round with models to download, and decays by 0.05 a round (their ``EPSILON_DECAY``) to 0.
  Ties in P are broken at random, as the authors' ``lexsort`` does; the draws are seeded by (seed,
  round, partition), so that a run and its resume choose alike. FL-bench takes the top M alone.
* **Affinity.** P starts at 0; each reply adds its weights w_n (signed, before the clipping at
  0) divided by |sum_n w_n|, as the authors' ``update_client_weights`` does (FL-bench adds them
  unscaled).
* **Validation split.** A fixed ``fedfomo-val-fraction`` (0.2, FL-bench's ``valset_ratio``) of
  the site's training data, drawn once from the run's seed; the rest is what the client trains
  on. The authors split each local set 0.6 / 0.2 / 0.2 into train, validation and test.
* **Distance.** Over every parameter of the model; a downloaded model identical to the client's
  gets w_n = 0 (the paper's quotient is 0 / 0 there; FL-bench adds 1e-5 to the norm).
* **The global model.** Both model parts are sent and received whole (``Rule.AVERAGE``: they
  travel); the server also keeps the sample-weighted average of the replies, the model average
  the authors' server maintains beside the clients' models. No client ever receives it: it is
  the run's global extractor and head in the outputs only.

Differential privacy is refused (:attr:`FedFomo.dp_refusal`): the weights, and the combined model
the client then trains, are computed from the losses on its validation records outside DP-SGD.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from common.methods.base import Method, setting


@dataclass(frozen=True)
class FedFomo(Method):
    """FedFomo; ``models`` is M, the other clients' models each client downloads
    (``fedfomo-models``, the FedPAC paper's 5), ``val_fraction`` the share of a site's training
    data it weighs them on (``fedfomo-val-fraction``), ``epsilon`` the first exploration
    probability (``fedfomo-epsilon``)."""

    # Why ``dp = true`` is refused for this method (``common.config``).
    dp_refusal: ClassVar[str] = (
        "FedFomo weighs the other sites' models by their losses on the site's validation records, "
        "outside DP-SGD (the weights it sends and the model it trains from them are not private), and "
        "every site receives other sites' whole models")

    models: int = setting(5, "fedfomo-models")
    val_fraction: float = setting(0.2, "fedfomo-val-fraction")
    epsilon: float = setting(0.3, "fedfomo-epsilon")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.models, bool) or not isinstance(self.models, int):
            raise ValueError("must be a whole number of models")
        if self.models < 1:
            raise ValueError("must be >= 1")
        if not (math.isfinite(self.val_fraction) and 0.0 < self.val_fraction < 1.0):
            raise ValueError("must be in (0, 1)")
        if not (math.isfinite(self.epsilon) and 0.0 <= self.epsilon <= 1.0):
            raise ValueError("must be in [0, 1]")
