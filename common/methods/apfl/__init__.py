"""APFL (Deng et al., 2020, "Adaptive Personalized Federated Learning"): a global model w learned
by FedAvg, and at every site a local model v_i and a mixing weight alpha_i; the site's
personalized model is the interpolation v_bar_i = alpha_i v_i + (1 - alpha_i) w (Algorithm 1).

Every local step, on one minibatch, updates both models from their values before the step:
w on its own loss, w <- w - eta grad f_i(w), and v on the loss of the mixed model,
v <- v - eta grad_v f_i(v_bar) = v - eta alpha_i grad f_i(v_bar). With ``apfl-adapt-alpha`` the
mixing weight follows its own gradient as well, alpha <- clip(alpha - eta <v - w, grad f_i(v_bar)>,
0, 1) (Section 3.2). Only w goes back to the server, which is FedAvg's; v_i (and an adapted
alpha_i) stay at the site, and the site evaluates v_bar_i, mixed with the global model it received.

Where this departs from the paper or from the code of others, and why:

* alpha is fixed at 0.25 by default: the FedPAC paper's value (its Appendix: tuned over
  {0.25, 0.5, 0.75}, "set 0.25 for all settings"); the APFL authors' code (FedTorch's
  ``fed_adaptive_alpha``) and FL-bench make adapting it an option, as it is here.
* The models are mixed in parameter space by default, as the paper defines v_bar
  (``apfl-mixing = "parameters"``): v_bar is one network of the harness's architecture. The
  authors' FedTorch code and FL-bench mix the two models' outputs instead, alpha v(x) +
  (1 - alpha) w(x), which for a network with non-linear layers is another model:
  ``apfl-mixing = "outputs"`` does that. There v steps on the loss of the mixed outputs with w's
  outputs held fixed, v <- v - eta grad_v f(alpha v(x) + (1 - alpha) w(x)), w on its own loss as
  before, and the site evaluates (and saves) the two networks side by side as one
  (``common.model.output_mixture``). Adapting alpha is the paper's rule for its parameter-space
  v_bar; the authors' code applies that same rule to the output mixture, where it is not the
  mixture's gradient, so ``apfl-adapt-alpha`` is refused with outputs mixed.
* Both updates of a step use the step's starting w and v (Algorithm 1's v_bar^(t-1)). FL-bench
  updates w first and then v against a v_bar made of the updated w.
* v steps on the gradient the paper gives it, alpha grad f(v_bar), so that v_bar's own part,
  alpha (v - w), moves by alpha^2 eta grad f(v_bar) a step: 1/16 of the step at alpha = 0.25.
  PFLlib's APFL is another algorithm: its personal model trains on its own loss at the full
  step, beside w, and after each round's epochs it is replaced by (1 - alpha) w + alpha v in
  parameter space (w as the site's epochs left it), the model it evaluates and trains from the
  next round. ``apfl-mixing = "rounds"`` does that, with alpha fixed (PFLlib adapts it by a
  rule of its own, the gradient of neither mixture, so ``apfl-adapt-alpha`` is refused there
  too).
* The alpha step is the paper's gradient alone: FedTorch and FL-bench add a 0.02 alpha
  regularizer (and FL-bench adapts alpha only in the first epoch), neither of which the paper has.
* A site that has never trained starts v_i from the global model it receives (as Ditto's
  personal model does here); the paper starts every v_i from w^(0). A site that first trains in
  a later round thus starts from a global model that has learned, and its v_bar is the global
  model until it trains.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.methods.base import Method, setting

PARAMETERS = "parameters"  # v_bar = alpha v + (1 - alpha) w, one network (the paper)
OUTPUTS = "outputs"  # alpha v(x) + (1 - alpha) w(x) (the authors' FedTorch code, FL-bench)
ROUNDS = "rounds"  # v trains on its own loss, then v := (1 - alpha) w + alpha v after each round (PFLlib)
MIXINGS = (PARAMETERS, OUTPUTS, ROUNDS)


@dataclass(frozen=True)
class APFL(Method):
    """APFL; ``alpha`` is the mixing weight alpha_i of the local model in v_bar_i (run config
    ``apfl-alpha``; the FedPAC paper's value is 0.25), every site's starting value when
    ``adapt_alpha`` (``apfl-adapt-alpha``) lets each site adapt its own by gradient descent;
    ``mixing`` (``apfl-mixing``) mixes the two models' parameters at every step (the paper),
    their outputs (the authors' code) or their parameters once a round (PFLlib)."""

    keeps_site_state = True  # the local models v_i (and the adapted alpha_i)

    alpha: float = setting(0.25, "apfl-alpha")
    adapt_alpha: bool = setting(False, "apfl-adapt-alpha")
    mixing: str = setting(PARAMETERS, "apfl-mixing")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError("must be in [0, 1] (0: the global model alone, 1: the local model alone)")
        if self.mixing not in MIXINGS:
            raise ValueError(f"must be one of {', '.join(map(repr, MIXINGS))}")
        if self.adapt_alpha and self.mixing != PARAMETERS:
            raise ValueError("apfl-adapt-alpha follows the gradient of the paper's v_bar (its Section 3.2), which "
                             f"apfl-mixing = {self.mixing!r} does not train: use apfl-mixing = 'parameters' to adapt "
                             "alpha")
