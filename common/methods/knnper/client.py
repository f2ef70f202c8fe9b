"""kNN-Per's client: FedAvg's local update, and before each evaluation a copy of the received
global model whose head interpolates the global softmax with a Gaussian-kernel kNN vote over the
site's training features (``KNNHead``)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from common.config import FedPACConfig
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received
from common.methods.knnper import INTERPOLATION_GRID, KNNPer
from common.model import FedPACNet
from common.training import extract_features, train_joint

# sigma, the Gaussian kernel's length scale (the authors' --kernel_length_scale default)
KERNEL_SCALE = 1.0


def knn_probabilities(queries: torch.Tensor, keys: torch.Tensor, labels: torch.Tensor, k: int, num_classes: int,
                      scale: float = KERNEL_SCALE) -> torch.Tensor:
    """p_kNN(y | z) for each row z of ``queries``: the k nearest ``keys`` (squared Euclidean
    distance d_j), each voting for its label with weight exp(-d_j / (dim * scale)), the votes
    normalized to sum to 1. The weights are a softmax over the k neighbours of -d_j / (dim *
    scale): the same ratios, without the underflow of exp(-d_j / ...) for distant neighbours.
    Fewer than k keys: all of them."""
    distances = torch.cdist(queries, keys).square()
    k = min(k, len(keys))
    nearest, index = distances.topk(k, dim=1, largest=False)
    weights = torch.softmax(-nearest / (queries.shape[1] * scale), dim=1)
    votes = torch.zeros(len(queries), num_classes, dtype=weights.dtype, device=weights.device)
    return votes.scatter_add_(1, labels[index], weights)


def interpolate(p_knn: torch.Tensor, p_global: torch.Tensor, weight: float) -> torch.Tensor:
    """kNN-Per's prediction: lambda p_kNN + (1 - lambda) p_global."""
    return weight * p_knn + (1.0 - weight) * p_global


class KNNHead(nn.Linear):
    """The global head and the site's datastore as one head: its output for features z is
    log(lambda p_kNN(. | z) + (1 - lambda) softmax(W z + b)), whose softmax and argmax are
    kNN-Per's prediction and whose cross-entropy its negative log-likelihood. The datastore is a
    non-persistent buffer: the head's state is the global head's."""

    keys: torch.Tensor
    labels: torch.Tensor

    def __init__(self, head: nn.Linear, keys: torch.Tensor, labels: torch.Tensor, neighbours: int,
                 weight: float) -> None:
        super().__init__(head.in_features, head.out_features, device=head.weight.device, dtype=head.weight.dtype)
        self.load_state_dict(head.state_dict())
        self.register_buffer("keys", keys, persistent=False)
        self.register_buffer("labels", labels, persistent=False)
        self.neighbours = neighbours
        self.interpolation = weight

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        p_global = torch.softmax(super().forward(features).float(), dim=1)
        p_knn = knn_probabilities(features.float(), self.keys, self.labels, self.neighbours, self.out_features)
        p = interpolate(p_knn, p_global, self.interpolation)
        return p.clamp(min=torch.finfo(p.dtype).tiny).log()  # lambda = 1: a class no neighbour has


def tuned_interpolation(head: nn.Linear, features: torch.Tensor, labels: torch.Tensor, neighbours: int,
                        holdout: float, generator: torch.Generator,
                        grid: tuple[float, ...] = INTERPOLATION_GRID) -> float | None:
    """The grid's lambda with the best accuracy on a random share ``holdout`` of the site's
    training samples, the datastore made of the others (the smallest lambda of equals); ``None``
    when that holds out no sample, or all of them."""
    held_out = int(holdout * len(labels))
    if held_out < 1 or held_out >= len(labels):
        return None
    order = torch.randperm(len(labels), generator=generator).to(labels.device)
    query, store = order[:held_out], order[held_out:]
    with torch.no_grad():
        p_global = torch.softmax(head(features[query]).float(), dim=1)
    p_knn = knn_probabilities(features[query], features[store], labels[store], neighbours, head.out_features)
    accuracy = [float((interpolate(p_knn, p_global, w).argmax(dim=1) == labels[query]).float().mean()) for w in grid]
    return grid[accuracy.index(max(accuracy))]


class Routine(ClientRoutine):
    """FedAvg's round (``local-epochs`` epochs of the whole model on CE at the baselines' step
    size); the evaluated model is the received one with a ``KNNHead``."""

    method: KNNPer

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        return ClientResult(num_examples=len(data.y), train_loss=train_joint(model, data.x, data.y, cfg, generator))

    def before_evaluation(self, model: FedPACNet, data: LocalData, cfg: FedPACConfig,
                          generator: torch.Generator) -> FedPACNet:
        """A copy of the received model whose head is kNN-Per's predictor over the datastore of
        the site's training features (the received model itself for a site without training
        data); lambda as set, or tuned by the site (``knn-tuning-holdout``)."""
        del cfg
        if len(data.y) == 0:
            return model
        model = copy.deepcopy(model).eval()
        features = extract_features(model.extractor, data.x)
        weight = self.method.interpolation
        if self.method.tuning_holdout > 0:
            tuned = tuned_interpolation(model.head, features, data.y, self.method.neighbours,
                                        self.method.tuning_holdout, generator)
            weight = weight if tuned is None else tuned
        model.head = KNNHead(model.head, features, data.y, self.method.neighbours, weight)
        return model
