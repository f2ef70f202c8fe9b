"""Ditto (Li et al., ICML 2021): a global model learned by FedAvg, and at every site a personal
model v_k trained on F_k(v) + (lambda / 2) ||v - w^t||^2, pulled towards the global model w^t it
received. The personal model stays at the site; what a site evaluates, and keeps at the end of
the run, is its personal model."""

from __future__ import annotations

from dataclasses import dataclass

from common.methods.base import Method, setting


@dataclass(frozen=True)
class Ditto(Method):
    """Ditto; ``lam`` is the personal model's pull towards the global one (run config
    ``ditto-lambda``; the FedPAC paper's value, tuned over {0.1, 1, 10}, is 1)."""

    keeps_site_state = True  # the personal models

    lam: float = setting(1.0, "ditto-lambda")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.lam >= 0:
            raise ValueError("must be >= 0 (0: a local model beside FedAvg's)")
