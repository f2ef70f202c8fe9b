"""pFedHN (Shamsian, Navon, Fetaya, Chechik, ICML 2021, "Personalized Federated Learning using
Hypernetworks"): the server holds a hypernetwork h(v; phi) and a trainable embedding v_i per
client, and sends client i the model theta_i = h(v_i; phi) it generates for it.

* **Client.** Trains the received theta_i as FedAvg's clients do (``local-epochs`` epochs of the
  whole model at the baselines' step size ``extractor-lr``: the FedPAC paper's client step 0.01)
  and sends back theta~_i.
* **Server.** For each reply, the chain rule: the gradient of (phi, v_i) is (d theta_i / d (phi,
  v_i))^T (theta_i - theta~_i), theta_i = h(v_i; phi) at the phi of that step (for the round's
  first step, the one that generated the model: -Delta theta_i backpropagated through h;
  ``hypernetwork.gradient``); one step of the authors' optimizer per reply
  (SGD at ``pfedhn-server-lr``, the FedPAC paper's 0.01, momentum 0.9, weight decay 1e-3, the
  gradient clipped to norm 50: ``hypernetwork.sgd_step``).
* **Hypernetwork.** The authors' ``CNNHyper``: an MLP from the embedding (``pfedhn-embedding-dim``)
  through 3 hidden layers of ``pfedhn-hidden`` units, then one linear generator per weight array
  of the model: every layer is generated, as the authors do for their LeNet. For this harness's
  CNN (117,066 weights on 28x28x1 images, 107,690 on 32x32x3) that is (hidden + 1) x 117,066
  + 31k = 11.9 million parameters of phi at hidden = 100 (47 MB in float32, as much again for its
  momentum): a few milliseconds to generate a model or take a step on a CPU, and ~95 MB in every
  checkpoint.
* **pFedHN-PC** (``pfedhn-pc``; the authors' ``experiments/pfedhn_pc``): the hypernetwork
  generates the extractor alone and every client keeps a personal classifier head at its site,
  trained with it (``Rule.LOCAL``: it never travels).

Departures, and why:

* Clients train in parallel in a round, the authors' loop one client at a time. The replies'
  steps are taken one after the other, in partition order, as the authors' loop steps once per
  client, each against the gradient of (1/2) ||h(v_i; phi) - theta~_i||^2 at the phi of that
  step. The round's first step is exactly the authors' (its phi generated the model the client
  trained); the later ones see how far the earlier steps already moved the client's model. At the
  round's phi instead, each of 20 steps pushed again the change every client asked for: on Table
  1's protocol the generated models oscillated from round 2 and diverged by round 10 (a training
  loss of 90, then no usable reply). The sample counts n_i do not weigh the steps: the authors'
  steps are unweighted.
* A client's embedding is updated (and its momentum kept) only at its own steps. The authors'
  ``nn.Embedding`` table takes every step as a whole: the other clients' rows decay by the weight
  decay and drift with their leftover momentum at each of them.
* Embeddings are created as clients first reply, each drawn N(0, I) (``nn.Embedding``'s
  initialization) from (seed, partition-id): the server need not know the number of clients,
  and a client the hypernetwork has not seen gets the same model on every run with that seed.
* The embedding size defaults to 6, the authors' rule 1 + N / 4 for the paper's N = 20 clients
  (the server does not know N before the clients report it).
* The local update is the harness's (the FedPAC paper: the same local epochs, step size, batch,
  momentum 0.5 and weight decay for every method), not the authors' 50 inner steps of SGD at 5e-3
  with momentum 0.9 and the gradient clipped to norm 50.
* The server's shared extractor and head (``ServerState.shared``, what Flower carries between
  phases and what a node bound to no partition gets) are the model generated for an embedding of
  their own, drawn from the seed like a new client's; no client trains them.

With ``dp = true`` each local step is DP-SGD (``common.training.sgd_epochs``) and the reply, the
trained model, is the round's one release, counted as FedAvg's is; the hypernetwork's step only
post-processes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.methods.base import Method, Rule, setting


def _positive_int(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be a whole number >= 1 ({what})")


@dataclass(frozen=True)
class PFedHN(Method):
    """pFedHN; ``server_lr`` is the hypernetwork's step size (run config ``pfedhn-server-lr``),
    ``embedding_dim`` the clients' embeddings' size and ``hidden`` the MLP's width. ``head`` is
    ``Rule.LOCAL`` for pFedHN-PC (the head stays at the site), ``Rule.AVERAGE`` otherwise: there
    the rules say only which parts travel; the server generates them instead of averaging."""

    server_lr: float = setting(0.01, "pfedhn-server-lr")
    embedding_dim: int = setting(6, "pfedhn-embedding-dim")
    hidden: int = setting(100, "pfedhn-hidden")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.extractor is not Rule.AVERAGE or self.head not in (Rule.AVERAGE, Rule.LOCAL):
            raise ValueError(f"{self.name}: the hypernetwork generates the extractor, and the head or none")
        if isinstance(self.server_lr, bool) or not 0 < self.server_lr < float("inf"):
            raise ValueError("must be a step size > 0")
        _positive_int(self.embedding_dim, "the embedding's size")
        _positive_int(self.hidden, "the hypernetwork's hidden units")
