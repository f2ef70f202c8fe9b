"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds a proximal term,
F_k(w) + (mu / 2) ||w - w^t||^2, keeping each client's update near the global model w^t it
received. The server is FedAvg's: one global model, the sample-weighted average."""

from __future__ import annotations

from dataclasses import dataclass

from common.methods.base import Method, setting


@dataclass(frozen=True)
class FedProx(Method):
    """FedProx; ``mu`` is the proximal term's weight (run config ``prox-mu``; 0 is FedAvg)."""

    mu: float = setting(0.01, "prox-mu")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.mu >= 0:
            raise ValueError("must be >= 0 (0: FedAvg)")
