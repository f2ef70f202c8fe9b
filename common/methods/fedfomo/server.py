"""FedFomo's server: every client's latest model and its row of the affinity matrix P; each
client is sent its own model and M others chosen epsilon-greedily by its row; each reply's model
is kept as the client's and its weights added to the row."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from common import protocol as p
from common.config import FedPACConfig
from common.methods.fedfomo import FedFomo
from common.methods.fedfomo.client import PEERS, WEIGHTS
from common.methods.server import ServerPart, ServerState, StepResult, Update
from common.validation import InvalidReply

# Sections of the state: each client's whole model, and its row P_i of the affinity matrix
# (``scores``, indexed by partition-id).
MODELS = "fedfomo-model"
AFFINITY = "fedfomo-affinity"
SCORES = "scores"
# The authors' EPSILON_DECAY: the exploration probability's decrease per round.
EPSILON_DECAY = 0.05


def exploration(epsilon: float, server_round: int) -> float:
    """The round's exploration probability: ``epsilon`` in round 2 (the first with models to
    download), then EPSILON_DECAY less each round, down to 0."""
    return max(0.0, epsilon - EPSILON_DECAY * (server_round - 2))


def choose_peers(scores: np.ndarray, candidates: list[int], m: int, epsilon: float,
                 rng: np.random.Generator) -> list[int]:
    """M of ``candidates`` (fewer when there are fewer), epsilon-greedily: for each slot, with
    probability ``epsilon`` the next of a random order, else the next by affinity ``scores[n]``
    (0 beyond the row's end; ties in random order), skipping those already chosen."""
    tiebreak = rng.random(len(candidates))
    score = [float(scores[n]) if n < len(scores) else 0.0 for n in candidates]
    ranked = [candidates[i] for i in np.lexsort((tiebreak, -np.asarray(score)))] if candidates else []
    shuffled = [candidates[i] for i in rng.permutation(len(candidates))]
    chosen: list[int] = []
    for _ in range(min(m, len(candidates))):
        order = shuffled if rng.random() < epsilon else ranked
        chosen.append(next(n for n in order if n not in chosen))
    return chosen


def updated_scores(scores: np.ndarray, peers: list[int], weights: np.ndarray) -> np.ndarray:
    """P_i after a reply: each peer's weight w_n divided by |sum_n w_n| (the authors'
    normalization; 1e-9 where the sum is nearly 0) added to its score."""
    total = abs(float(weights.sum()))
    increments = weights / (total if total >= 1e-9 else total + 1e-9)
    size = max([len(scores), *(n + 1 for n in peers)])
    row = np.zeros(size, dtype=np.float64)
    row[: len(scores)] = scores
    for n, increment in zip(peers, increments):
        row[n] += increment
    return row


class Server(ServerPart):
    """FedFomo's server part: the clients' models and affinities (``personal``), and the
    sample-weighted average of the replies as the run's global model (``shared``, sent to no one)."""

    method: FedFomo

    def __init__(self, method: FedFomo, cfg: FedPACConfig, extractor: p.NDArrays, head: p.NDArrays) -> None:
        super().__init__(method, cfg, extractor, head)
        self.server_round = 1
        self.sent: dict[int, list[int]] = {}  # this round's peers of each client, by slot

    def summary(self) -> list[str]:
        m = self.method
        return [f"Method {m.name}: every client's own model kept on the server; each client is sent M = {m.models} "
                f"other clients' models, chosen epsilon-greedily by its affinities (epsilon {m.epsilon:g}, less "
                f"{EPSILON_DECAY:g} a round), and weighs them on {m.val_fraction:g} of its training data"]

    def model_for(self, state: ServerState, partition_id: int | None) -> p.NDArrays:
        """The client's own latest model (the initial one before it first trained)."""
        initial = {**self.extractor_template, **self.initial_head}
        return state.personal_part(MODELS, partition_id, initial)

    def select(self, partitions: list[int], population: int, server_round: int, full: bool) -> list[int] | None:
        """Note the round (its exploration and its draws); the glue samples the clients."""
        del partitions, population, full
        self.server_round = server_round
        self.sent = {}
        return None

    def train_sections(self, state: ServerState, partition_id: int | None) -> tuple[p.Sections, dict[str, Any]]:
        """M other clients' models, as ``<slot>/<array>``; which ones is remembered for the reply."""
        if partition_id is None:
            return {}, {}
        models = state.personal.get(MODELS, {})
        scores = state.personal_part(AFFINITY, partition_id, {SCORES: np.zeros(0)})[SCORES]
        rng = np.random.default_rng([self.cfg.seed, self.server_round, partition_id])
        peers = choose_peers(scores, sorted(n for n in models if n != partition_id), self.method.models,
                             exploration(self.method.epsilon, self.server_round), rng)
        self.sent[partition_id] = peers
        if not peers:
            return {}, {}
        return {PEERS: {f"{slot}{p.SECTION_SEPARATOR}{key}": value
                        for slot, n in enumerate(peers) for key, value in models[n].items()}}, {}

    def statistics_shapes(self) -> dict[str, tuple[int, ...]]:
        return {WEIGHTS: (self.method.models,)}

    def check(self, update: Update) -> Update:
        """One weight per model sent, 0 in the slots beyond them."""
        peers = self.sent.get(update.partition_id, [])
        weights = update.statistics[WEIGHTS].astype(np.float64)
        if np.any(weights[len(peers):] != 0):
            raise InvalidReply(f"weights for {self.method.models} models, but {len(peers)} were sent")
        return dataclasses.replace(update, parsed={"peers": peers, "weights": weights[: len(peers)]})

    def step(self, state: ServerState, updates: list[Update], weights: np.ndarray, server_round: int) -> StepResult:
        """The replies' average as the global model (the base); each reply's model kept as its
        client's, its weights added to its affinities."""
        super().step(state, updates, weights, server_round)
        for update in updates:
            pid, peers = update.partition_id, update.parsed["peers"]
            scores = state.personal_part(AFFINITY, pid, {SCORES: np.zeros(0)})[SCORES]
            state.keep(AFFINITY, pid, {SCORES: updated_scores(scores, peers, update.parsed["weights"])})
            state.keep(MODELS, pid, {**update.extractor, **update.head})
        return StepResult(record={"fomo_partitions": [u.partition_id for u in updates],
                                  "fomo_peers": [u.parsed["peers"] for u in updates],
                                  "fomo_weights": [u.parsed["weights"].tolist() for u in updates]})


__all__ = ["Server"]
