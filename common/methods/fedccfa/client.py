"""FedCCFA's local update, in the authors' order (Chen et al., NeurIPS 2024; their ``fedccfa``
client)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from common import privacy
from common import protocol as p
from common.methods.fedccfa.clustering import entropy_weight
from common.config import FedPACConfig
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received
from common.methods.fedccfa import FedCCFA
from common.model import HEAD_PREFIX, FedPACNet
from common.statistics import class_means
from common.training import (AlignmentTerm, alignment_targets, class_counts, head_state, to_numpy,
                             train_extractor, train_head)


def contrastive_alignment_loss(
    features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """FedCCFA's alignment: mean_b CE([cos(f(x_b), A_c) / tau]_c, y_b), as the authors' code.

    The anchors are constants. Classes without an anchor take no part in the softmax; samples
    of such a class contribute zero but count in the batch size, like FedPAC's alignment.
    """
    logits = F.cosine_similarity(features.unsqueeze(1), anchors.unsqueeze(0), dim=2) / temperature
    logits = logits.masked_fill(~mask.unsqueeze(0), float("-inf"))
    aligned = mask[labels]
    if not aligned.any():
        return features.sum() * 0.0
    per_sample = F.cross_entropy(logits[aligned], labels[aligned], reduction="sum")
    return per_sample / len(labels)


def balanced_sample(y: torch.Tensor, per_class: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of m samples of every class present, m = min(``per_class``, the smallest count
    of a present class), drawn without replacement (FedCCFA's ``class_balance_sample``, over
    the classes actually present rather than assuming 0..C'-1)."""
    labels = y.cpu()
    counts = torch.bincount(labels)
    present = torch.nonzero(counts).flatten()
    m = min(per_class, int(counts[present].min()))
    chosen = []
    for c in present.tolist():
        members = torch.nonzero(labels == c).flatten()
        chosen.append(members[torch.randperm(len(members), generator=generator)[:m]])
    return torch.cat(chosen).to(y.device)


def released_balanced_sample(y: torch.Tensor, per_class: int, counts: torch.Tensor,
                             generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """The balanced sample of a site under differential privacy, and its expected size.

    :func:`balanced_sample` reads the exact class counts: one record more can change m and every
    class's draw, so the sample (and the DP-SGD run on it) would not be one record away from the
    neighbouring dataset's. Here ``counts`` are the class counts the site releases this round
    (noised, ``common.training.class_counts``) and every record is drawn on its own, with
    probability min(1, m / n_c) for its class c (m = min(``per_class``, the smallest released
    count of a class released as present)): what decides a record's draw is released, so one
    record more or less changes the sample by that record at most. Each class gives m records in
    expectation; the expected size, also made of released values only, is what DP-SGD's sampling
    rate on the sample is made of (``common.training.sgd_epochs``'s ``public_size``)."""
    counts = counts.to(torch.float64).cpu()
    present = counts > 0
    if not bool(present.any()):
        return torch.zeros(0, dtype=torch.long, device=y.device), 0.0
    m = min(float(per_class), float(counts[present].min()))
    rates = torch.where(present, (m / counts.clamp(min=1.0)).clamp(max=1.0), torch.zeros_like(counts))
    chosen = torch.rand(len(y), generator=generator, dtype=torch.float64) < rates[y.cpu()]
    return torch.nonzero(chosen).flatten().to(y.device), float(counts.clamp(max=m)[present].sum())


class Routine(ClientRoutine):
    """FedCCFA's round.

    1. The balanced head: from the fixed initial head phi^0 (section ``initial-head``),
       ``balanced-epochs`` epochs on a class-balanced sample (frozen extractor). Only the
       server's clustering uses it: starting every client from the same phi^0 is what makes
       their heads comparable.
    2. The personal head: the server's merged head phi^_k (a first participant, whose message
       says it has no personal head yet, starts from its balanced head), ``head-epochs`` epochs
       on all local data.
    3. The extractor, head frozen: CE + H(P_k(Y))/gamma * the contrastive alignment to the
       client's anchors, from round ``align-from-round`` on and once the client has anchors.
    4. The local anchors: class means of the trained extractor's features.
    """

    method: FedCCFA

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        x, y = data.x, data.y
        num_classes = model.num_classes
        counts = class_counts(y, num_classes)
        personal = head_state(model)
        # the head module's own keys (weight, bias), as it is loaded into model.head
        initial = {key.removeprefix(HEAD_PREFIX): torch.as_tensor(np.array(value), device=x.device)
                   for key, value in received.sections.get(p.INITIAL_HEAD, {}).items()}
        model.head.load_state_dict(initial)
        if privacy.active() is None:
            sample, public_size = balanced_sample(y, cfg.balanced_samples_per_class, generator), None
        else:
            sample, public_size = released_balanced_sample(y, cfg.balanced_samples_per_class, counts, generator)
        train_head(model, x[sample], y[sample], cfg, generator, epochs=cfg.balanced_epochs, lr=cfg.balanced_lr,
                   public_size=public_size)
        balanced = head_state(model)
        if bool(received.config.get(p.HAS_PERSONAL_HEAD, False)):
            model.head.load_state_dict(personal)
        head_loss = train_head(model, x, y, cfg, generator)

        weight = entropy_weight(counts.cpu().numpy(), cfg.align_gamma, cfg.align_lambda)
        anchors, mask = alignment_targets(received.sections, x.device)
        alignment: AlignmentTerm | None = None
        aligning = received.server_round >= cfg.align_from_round
        if aligning and anchors is not None and mask is not None and bool(mask.any()):
            alignment = partial(contrastive_alignment_loss, anchors=anchors, mask=mask,
                                temperature=cfg.align_temperature)
        train_loss, align = train_extractor(model, x, y, cfg, generator, alignment, weight)
        local_anchors = class_means(model.extractor, x, y, num_classes)
        statistics = {
            p.CENTROID_VALUES: to_numpy(local_anchors),
            p.CLASS_COUNTS: to_numpy(counts).astype(np.int64),
            p.BALANCED_WEIGHT: to_numpy(balanced["weight"]),
            p.BALANCED_BIAS: to_numpy(balanced["bias"]),
        }
        metrics = {"head-loss": head_loss, "align-loss": align, "align-weight": weight}
        return ClientResult(num_examples=len(y), train_loss=train_loss, statistics=statistics, metrics=metrics)
