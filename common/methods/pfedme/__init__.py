"""pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020): personalized models regularized by Moreau envelopes.

Each client i keeps a local copy w_i of the global model w and, for every minibatch D of its
local steps, first solves the inner problem

    theta_i = argmin_theta  f_i(theta; D) + (lambda / 2) ||theta - w_i||^2

approximately with K gradient steps at the personal step size (``pfedme-personal-lr``), then moves
its local copy towards that personalized model, w_i <- w_i - eta * lambda * (w_i - theta_i), at
the baselines' step size eta (``extractor-lr``). After its local steps it sends w_i; the server
takes w <- (1 - beta) w + beta * mean_i(w_i) (Algorithm 1; beta = 1 is FedAvg's average). The
personalized model a client evaluates is its last theta_i, kept at the site between rounds.

Where this follows the authors' code (``CharlieDinh/pFedMe``, ``userpFedMe.py``,
``fedoptimizer.pFedMeOptimizer``) rather than the paper's pseudocode, which leaves these open:

* **Local steps.** The paper's R local rounds, each on one sampled minibatch, are here
  ``local-epochs`` epochs over a fresh shuffle of the site's data, one local round per minibatch
  (as FL-bench's ``pfedme`` client does); the authors draw R = 20 batches in turn.
* **Inner solve.** Both theta_i and w_i start every round at the received w (the authors'
  ``set_parameters``); theta_i is warm-started from its previous value at every further
  minibatch. Each of the K steps is plain gradient descent, theta <- theta - lr_p * (grad f +
  lambda (theta - w_i) + mu theta), without momentum, as the authors' optimizer is; their L2
  term mu (1e-3) is the product's ``weight-decay``.
* **Outer step.** w_i's step is a gradient step on its Moreau envelope F_i, whose gradient is
  lambda (w_i - theta_i) (the paper's eq. 8 and Algorithm 1), taken by SGD at eta with the
  baselines' ``momentum`` (0.5, the FedPAC paper's optimizer for every method; its buffer lives
  for the round, as every local optimizer's). ``momentum = 0`` gives the paper's and the
  authors' w_i <- w_i - eta * lambda * (w_i - theta_i) exactly. Without it pFedMe moves w at
  about plain SGD's pace (at the inner solution lambda (w - theta) = grad f(theta)), half of the
  other baselines' in the same rounds.
* **Defaults.** lambda = 10 and K = 5 are the FedPAC paper's (Appendix B.3); beta = 1 and the
  personal step size 0.09 the authors' defaults (``main.py``; their MNIST results were run with
  0.09). The server weighs the average by sample count, as the authors' ``aggregate_parameters``.

Differential privacy is refused (:attr:`PFedMe.dp_refusal`): the K inner steps all read the same
minibatch, which the DP-SGD accountant (one Poisson sample per step) does not count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from common.methods.base import Method, setting


@dataclass(frozen=True)
class PFedMe(Method):
    """pFedMe; ``lam`` is the Moreau envelope's lambda (``pfedme-lambda``), ``k`` the inner
    solver's gradient steps per minibatch (``pfedme-k``), ``personal_lr`` their step size
    (``pfedme-personal-lr``) and ``beta`` the server's step towards the clients' mean
    (``pfedme-beta``)."""

    keeps_site_state = True  # the personalized model theta_i, which the site evaluates
    # Why ``dp = true`` is refused for this method (``common.config``).
    dp_refusal: ClassVar[str] = (
        "pFedMe's K inner steps all read the same minibatch, a release the DP-SGD accountant (one "
        "Poisson sample per step) does not count")

    lam: float = setting(10.0, "pfedme-lambda")
    k: int = setting(5, "pfedme-k")
    personal_lr: float = setting(0.09, "pfedme-personal-lr")
    beta: float = setting(1.0, "pfedme-beta")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.lam) and self.lam > 0):
            raise ValueError("must be > 0 (the pull of theta_i towards w_i, and w_i's step towards theta_i)")
        if isinstance(self.k, bool) or not isinstance(self.k, int):
            raise ValueError("must be a whole number of inner steps")
        if self.k < 1:
            raise ValueError("must be >= 1")
        if not (math.isfinite(self.personal_lr) and self.personal_lr > 0):
            raise ValueError("must be > 0")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError("must be > 0 (1: the server takes the clients' mean)")
