"""pFedHN's server part: the hypernetwork phi and its momentum (``shared``), every client's
embedding v_i and its momentum (``personal``, by partition-id); each client is sent the model
h(v_i; phi), and after a round every reply is one step of phi and of its client's v_i
(``common.methods.pfedhn.hypernetwork``)."""

from __future__ import annotations

from logging import INFO

import numpy as np
from flwr.supercore import log

from common import protocol as p
from common.config import FedPACConfig
from common.methods.outputs import Outputs, RoundData
from common.methods.pfedhn import PFedHN
from common.methods.pfedhn.hypernetwork import (
    EMBEDDING,
    Architecture,
    generate,
    gradient,
    initial_embedding,
    initial_phi,
    sgd_step,
    size,
    skeleton,
)
from common.methods.server import (
    LOCAL_ACCURACY_CLIENT_COLUMN,
    LOCAL_ACCURACY_ROUND_COLUMN,
    ServerPart,
    ServerState,
    StepResult,
    Update,
    mean_local_accuracy,
)
from common.model import part_of
from common.validation import fraction_metric

# Sections of the state: phi and its momentum buffers (one for the federation), each client's
# embedding and its momentum buffer (by partition-id; arrays under EMBEDDING).
HYPERNETWORK = "hypernetwork"
HYPERNETWORK_MOMENTUM = "hypernetwork-momentum"
EMBEDDINGS = "embedding"
EMBEDDING_MOMENTUM = "embedding-momentum"


def _log(record: RoundData) -> str:
    local = mean_local_accuracy(record)
    return f" | after the local update {100 * local:.2f}%" if isinstance(local, float) else ""


class Server(ServerPart):
    """pFedHN's server part. ``shared`` also holds the extractor (and head) generated for a node
    bound to no partition, refreshed after every step: the glue's global model."""

    method: PFedHN
    # Beside the generated models' accuracy (the run's), the clients' models after their local update
    outputs = Outputs(round_columns=(LOCAL_ACCURACY_ROUND_COLUMN,), client_columns=(LOCAL_ACCURACY_CLIENT_COLUMN,),
                      log=_log)

    def __init__(self, method: PFedHN, cfg: FedPACConfig, extractor: p.NDArrays, head: p.NDArrays) -> None:
        super().__init__(method, cfg, extractor, head)
        self.architecture = Architecture(method.embedding_dim, method.hidden)
        # what the hypernetwork generates: the model parts that travel (pFedHN-PC: the extractor)
        self.targets = {key: tuple(value.shape) for key, value in self.reply_template().items()}
        self.network = skeleton(self.targets, self.architecture)

    # ------------------------------------------------------------------ state

    def initial_state(self) -> ServerState:
        phi = initial_phi(self.targets, self.architecture, self.cfg.seed)
        state = ServerState(shared={HYPERNETWORK: phi,
                                    HYPERNETWORK_MOMENTUM: {k: np.zeros_like(v) for k, v in phi.items()}})
        self._refresh_shared_model(state)
        return state

    def summary(self) -> list[str]:
        parameters = size(self.targets, self.architecture)
        return [*super().summary(),
                f"Hypernetwork: embedding {self.architecture.embedding_dim} -> {self.architecture.hidden} units x "
                f"{self.architecture.hidden_layers + 1} layers -> the {' and '.join(self.method.shared_parts)} "
                f"({sum(int(np.prod(s)) for s in self.targets.values()):,} weights): {parameters:,} parameters, "
                f"server step {self.method.server_lr:g}"]

    def embedding(self, state: ServerState, partition_id: int | None) -> np.ndarray:
        """v_i: the client's learned embedding, or the seeded one of a client not seen yet."""
        default = {EMBEDDING: initial_embedding(self.architecture.embedding_dim, self.cfg.seed, partition_id)}
        return state.personal_part(EMBEDDINGS, partition_id, default)[EMBEDDING]

    def _refresh_shared_model(self, state: ServerState) -> None:
        model = self.model_for(state, None)
        for part in self.method.shared_parts:
            state.shared[part] = {key: value for key, value in model.items() if part_of(key) == part}

    def check(self, update: Update) -> Update:
        """The trained model's accuracy in [0, 1]."""
        fraction_metric(update.metrics, p.LOCAL_ACCURACY, "local accuracy")
        return update

    # ------------------------------------------------------------------ what travels

    def model_for(self, state: ServerState, partition_id: int | None) -> p.NDArrays:
        """theta_i = h(v_i; phi): the parts the method shares, generated for the client."""
        return generate(self.network, state.shared[HYPERNETWORK], self.embedding(state, partition_id))

    # ------------------------------------------------------------------ the round

    def step(self, state: ServerState, updates: list[Update], weights: np.ndarray, server_round: int) -> StepResult:
        """One step of phi and v_i per reply, in partition order, each against the gradient of
        (1/2) ||h(v_i; phi) - theta~_i||^2 at the phi of that step; ``weights`` are unused: the
        authors' steps are unweighted.

        The first step of a round is the authors' (its phi generated the client's model); the
        later ones see where the earlier steps of the round already moved the client's model.
        Taken at the round's phi instead, every step would push the direction all clients share
        once more (20 clients, 20 times a round): at 20 clients and the paper's step 0.01 that
        overshoot made the generated models oscillate and then diverge within 10 rounds."""
        del weights
        phi, momentum = state.shared[HYPERNETWORK], state.shared[HYPERNETWORK_MOMENTUM]
        for update in updates:
            pid = update.partition_id
            v = self.embedding(state, pid)
            grads = gradient(self.network, phi, v, {**update.extractor, **update.head})
            v_momentum = state.personal_part(EMBEDDING_MOMENTUM, pid, {EMBEDDING: np.zeros_like(v)})[EMBEDDING]
            params, buffers = sgd_step({**phi, EMBEDDING: v}, grads, {**momentum, EMBEDDING: v_momentum},
                                       self.method.server_lr)
            state.keep(EMBEDDINGS, pid, {EMBEDDING: params.pop(EMBEDDING)})
            state.keep(EMBEDDING_MOMENTUM, pid, {EMBEDDING: buffers.pop(EMBEDDING)})
            phi, momentum = params, buffers
        state.shared[HYPERNETWORK], state.shared[HYPERNETWORK_MOMENTUM] = phi, momentum
        self._refresh_shared_model(state)
        log(INFO, "Round %d: %d hypernetwork steps, partitions %s", server_round, len(updates),
            [u.partition_id for u in updates])
        return StepResult()

    # ------------------------------------------------------------------ saving

    def final_arrays(self, state: ServerState) -> p.NDArrays:
        """The base's, without the optimizer's momentum buffers: phi, the embeddings and the
        generated shared model."""
        kept = ServerState(
            shared={k: v for k, v in state.shared.items() if k != HYPERNETWORK_MOMENTUM},
            personal={k: v for k, v in state.personal.items() if k != EMBEDDING_MOMENTUM},
        )
        return super().final_arrays(kept)


__all__ = ["EMBEDDINGS", "EMBEDDING_MOMENTUM", "HYPERNETWORK", "HYPERNETWORK_MOMENTUM", "Server"]
