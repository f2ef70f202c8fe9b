"""pFedVEM (Zhu et al., CVPR 2023): a Bayesian linear head per client, its posterior kept between
rounds; the server averages the posterior means by confidence into a prior mean over a sample
S_t of the clients, and the base (the extractor) by FedAvg over S_t."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.methods.base import Method, Rule

# Who trains in a round whose server aggregates a sample S_t: every client ("all-train", the
# pFedMe/pFedVEM protocol) or S_t only ("sampled-train").
SAMPLE_PROTOCOLS = ("all-train", "sampled-train")


@dataclass(frozen=True)
class PFedVEM(Method):
    """pFedVEM: Gaussian heads, confidence-weighted prior mean, FedAvg base over S_t."""

    draws_its_own_sample = True
    keeps_site_state = True  # each client's posterior scales s_j, which no server step uses
    head: Rule = field(init=False, default=Rule.CONFIDENCE)
