"""pFedMe's server: w <- (1 - beta) w + beta * (the sample-weighted mean of the clients' w_i)
(Algorithm 1, line 10); with beta = 1, FedAvg's average."""

from __future__ import annotations

import numpy as np

from common import protocol as p
from common.methods.pfedme import PFedMe
from common.methods.server import EXTRACTOR, HEAD, ServerPart, ServerState, StepResult, Update


def moved_towards(previous: p.NDArrays, mean: p.NDArrays, beta: float) -> p.NDArrays:
    """(1 - beta) * previous + beta * mean, array by array, in float64 and back to each array's
    dtype (beta = 1: ``mean`` itself, bit for bit)."""
    if beta == 1.0:
        return mean
    return {key: ((1.0 - beta) * previous[key].astype(np.float64) + beta * value.astype(np.float64)
                  ).astype(value.dtype) for key, value in mean.items()}


class Server(ServerPart):
    """FedAvg's average of the replies (the base), then the global model moved beta of the way
    from where it was to that average."""

    method: PFedMe

    def summary(self) -> list[str]:
        m = self.method
        return [*super().summary(), f"pFedMe: lambda {m.lam:g}, K {m.k}, personal step size {m.personal_lr:g}, "
                f"beta {m.beta:g}"]

    def step(self, state: ServerState, updates: list[Update], weights: np.ndarray, server_round: int) -> StepResult:
        previous = {section: state.shared[section] for section in (EXTRACTOR, HEAD)}
        result = super().step(state, updates, weights, server_round)
        for section, before in previous.items():
            state.shared[section] = moved_towards(before, state.shared[section], self.method.beta)
        return result


__all__ = ["Server"]
