"""Fed-RoD (Chen & Chao, ICLR 2022, "On Bridging Generic and Personalized Federated Learning for
Image Classification"): two predictors on one shared extractor.

* **Generic predictor** (extractor theta + generic head psi): trained at every site on the
  balanced softmax loss (Ren et al., NeurIPS 2020), the cross-entropy of the logits shifted by
  the log of the site's class prior, log n_c: a class-balanced risk, the same objective at every
  site whatever its label skew. Averaged by FedAvg; this is what goes back to the server.
* **Personalized predictor**: a personal linear head phi_m kept at the site
  (``common.methods.client.SiteState``), trained on plain cross-entropy of the *sum* of the
  generic logits and its own, psi(z) + phi_m(z), "on top of the generic predictor". Its loss
  reaches neither the extractor nor the generic head (both inputs are detached), as in the
  paper's Algorithm (only the balanced risk updates theta and psi) and in PFLlib's
  ``clientrod.py`` (``self.head(rep.detach())`` on ``out_g.detach() + out_p``). Both losses are
  minimized in the same steps, at the baselines' step size: one SGD step on their sum is PFLlib's
  two optimizers' steps, since they train disjoint parameters from the same point.
* **Evaluation**: the site evaluates the personalized prediction psi(z) + phi_m(z). Both heads
  are linear on the same features, so that is the linear head (W_psi + W_phi, b_psi + b_phi),
  which the site evaluates (and keeps) as an ordinary model.

Departures, and why:

* The personal head starts at zero, a personalized prediction equal to the generic one, and a
  site evaluates the generic model until it first trains. PFLlib and FL-bench start it from a copy
  of the initial random head, which adds random logits that the first round must undo; this
  harness's site has no copy of the initial head of its own (a site first sampled later would
  start from another one), and zero makes "no personal head yet" and "a personal head not yet
  trained" the same prediction.
* FL-bench's ``fedrod.py`` trains the personal head on the extractor's features without detaching
  them and evaluates phi_m(z) alone (``eval_per``); it is not followed here: the paper's
  personalized predictor is the sum, learned on top of the generic one.
* The hypernetwork variant (Fed-RoD with a hypernetwork generating phi_m) is not implemented: the
  FedPAC paper's Table 1 compares the linear personal head.
* With ``dp = true`` the class prior is the site's noised class counts (``common.privacy``, one
  release a round, charged like every other), each floored at 1: a class the noise rounded to 0
  would otherwise put a record's loss at infinity. Every step is DP-SGD over the extractor, the
  generic and the personal head together.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.methods.base import Method


@dataclass(frozen=True)
class FedRoD(Method):
    """Fed-RoD with a linear personal head: no settings of its own (the balanced loss has no
    knob; the personal head trains at the baselines' step size for ``local-epochs`` epochs, with
    the generic model)."""

    keeps_site_state = True  # the personal head
