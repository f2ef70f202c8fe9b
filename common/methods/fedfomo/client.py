"""FedFomo's local update: weigh the downloaded models on the site's validation split, move the
site's model by the weighted sum of their differences to it (the first-order model optimization
step), then train it on the rest of the training data."""

from __future__ import annotations

import copy

import numpy as np
import torch

from common import protocol as p
from common.config import FedPACConfig
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received
from common.methods.fedfomo import FedFomo
from common.model import FedPACNet
from common.training import evaluate, train_joint

# The train message's section with the other clients' models, as ``<slot>/<array>``, and the
# reply's statistics array with the weight of each slot's model.
PEERS = "fedfomo-models"
WEIGHTS = "fedfomo-weights"

State = dict[str, torch.Tensor]


def validation_split(num_samples: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training indices, validation indices): ``fraction`` of the samples (at least one, and one
    left to train on) drawn once from ``seed``, the same every round."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    held_out = min(max(1, round(fraction * num_samples)), num_samples - 1)
    return order[held_out:], order[:held_out]


def peer_models(arrays: p.NDArrays, template: State) -> list[State]:
    """The downloaded models of section ``fedfomo-models``, by slot, as tensors like ``template``.
    Raises ``ValueError`` when a slot's arrays are not the model's."""
    slots: dict[int, dict[str, np.ndarray]] = {}
    for name, value in arrays.items():
        prefix, _, key = name.partition(p.SECTION_SEPARATOR)
        if not prefix.isdigit():
            raise ValueError(f"array '{name}' of the downloaded models is not named <slot>/<array>")
        slots.setdefault(int(prefix), {})[key] = value
    if sorted(slots) != list(range(len(slots))):
        raise ValueError(f"the downloaded models' slots {sorted(slots)} are not 0..{len(slots) - 1}")
    models = []
    for slot in range(len(slots)):
        if set(slots[slot]) != set(template):
            raise ValueError(f"the downloaded model in slot {slot} is not the model's arrays")
        models.append({key: torch.as_tensor(slots[slot][key], dtype=value.dtype, device=value.device)
                       for key, value in template.items()})
    return models


def distance(a: State, b: State) -> float:
    """||a - b|| over every array of the two models."""
    return float(torch.stack([(a[key].double() - b[key].double()).square().sum() for key in a]).sum().sqrt())


def fomo_weights(own_loss: float, losses: list[float], distances: list[float]) -> np.ndarray:
    """The paper's w_n = (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i||, signed; 0 for a
    model at distance 0 (the client's own, or a copy of it)."""
    return np.array([(own_loss - loss) / dist if dist > 0 else 0.0 for loss, dist in zip(losses, distances)],
                    dtype=np.float64)


def mixing_weights(weights: np.ndarray) -> np.ndarray:
    """max(w_n, 0) normalized to sum to 1; all 0 when no model lowered the loss."""
    positive = np.maximum(weights, 0.0)
    total = positive.sum()
    return positive / total if total > 0 else positive


def first_order_update(own: State, peers: list[State], mix: np.ndarray) -> State:
    """theta_i + sum_n mix_n (theta_n - theta_i), array by array."""
    return {key: value + sum((float(m) * (peer[key] - value) for m, peer in zip(mix, peers) if m > 0),
                             torch.zeros_like(value))
            for key, value in own.items()}


def losses_on(model: FedPACNet, states: list[State], x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """The mean cross-entropy on (x, y) of ``model`` with each of ``states`` loaded (a scratch
    copy: ``model`` is left as it is)."""
    scratch = copy.deepcopy(model)
    losses = []
    for state in states:
        scratch.load_state_dict(state)
        losses.append(evaluate(scratch, x, y)[0])
    return losses


class Routine(ClientRoutine):
    """One round at a site: the first-order model optimization step over the downloaded models,
    then ``local-epochs`` epochs of the whole model on CE at the baselines' step size, on the
    training data less the validation split."""

    method: FedFomo

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        train, validation = validation_split(len(data.y), self.method.val_fraction, cfg.seed)
        train, validation = train.to(data.x.device), validation.to(data.x.device)
        own = {key: value.detach().clone() for key, value in model.state_dict().items()}
        peers = peer_models(received.sections.get(PEERS, {}), own)
        if len(peers) > self.method.models:
            raise ValueError(f"the server sent {len(peers)} models, more than fedfomo-models = {self.method.models}")
        x_val, y_val = data.x[validation], data.y[validation]
        own_loss, = losses_on(model, [own], x_val, y_val)
        weights = fomo_weights(own_loss, losses_on(model, peers, x_val, y_val), [distance(peer, own) for peer in peers])
        model.load_state_dict(first_order_update(own, peers, mixing_weights(weights)))
        train_loss = train_joint(model, data.x[train], data.y[train], cfg, generator)
        reported = np.zeros(self.method.models, dtype=np.float64)
        reported[: len(weights)] = weights
        return ClientResult(num_examples=len(data.y), train_loss=train_loss, statistics={WEIGHTS: reported},
                            metrics={"validation-loss": own_loss}, for_server=())


__all__ = ["PEERS", "WEIGHTS", "Routine"]
