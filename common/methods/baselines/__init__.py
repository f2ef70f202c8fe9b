"""The paper's baselines (Table 1): Local-only, FedAvg, FedAvg-FT, FedPer and FedRep, each the
whole model trained locally and a rule for what the server does with each part."""

from __future__ import annotations

from dataclasses import dataclass

from common.methods.base import Method


@dataclass(frozen=True)
class Baseline(Method):
    """Local training of the whole model for ``local-epochs`` epochs (FedAvg, FedPer, Local-only),
    or FedRep's (``representation``): many head epochs on frozen features, then the body.
    FedAvg-FT fine-tunes the received head on the local data before each evaluation."""

    representation: bool = False
    finetune_before_evaluation: bool = False
