"""FedBABU's server: FedAvg's average of the bodies, with the head pinned to the initial one.

A client sends back the head it received, unchanged, and the sample-weighted average of those
heads is the initial head again, bit for bit (``tests/test_fedbabu.py``). The server does not rely
on it: a faulty or hostile site that sent another head would otherwise move the head that every
site's body learns through."""

from __future__ import annotations

import numpy as np

from common.methods.server import HEAD, ServerPart, ServerState, StepResult, Update


class Server(ServerPart):
    """FedAvg (the base server part), and the global head reset to the initial one after each step."""

    def step(self, state: ServerState, updates: list[Update], weights: np.ndarray, server_round: int) -> StepResult:
        result = super().step(state, updates, weights, server_round)
        state.shared[HEAD] = dict(self.initial_head)
        return result


__all__ = ["Server"]
