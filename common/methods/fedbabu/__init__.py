"""FedBABU (Oh, Kim, Yun, ICLR 2022): federated training of the body alone, then personalization
by fine-tuning.

* **Training.** The head (the classifier) is the randomly initialized global one and is never
  trained: every client trains only the body (the extractor) for ``local-epochs`` epochs on CE
  through the fixed head, at the baselines' step size eta (``extractor-lr``). The authors' code
  (``jhoon-oh/FedBABU``, ``main_fed.py --local_upt_part body``) gives the head a step size of 0;
  FL-bench (``KarhouTam/FL-bench``, ``src/client/fedbabu.py``) zeroes its gradients.
* **Server.** FedAvg's: the sample-weighted average of the replies (``--aggr_part body`` in the
  authors' code). The head every client sends back is the one it received, bit for bit, so its
  average is the initial head again, exactly (``common.averaging.weighted_average`` sums in
  float64 weights that sum to 1 up to a few ulps and rounds back to float32: the received float32
  value is the nearest one; ``tests/test_fedbabu.py`` checks it).
* **Evaluation.** Before each evaluation the client fine-tunes a copy of the received model, body
  and head, for ``babu-finetune-epochs`` (the paper's tau) epochs on its local training data and
  evaluates that copy; nothing of the fine-tuning goes back to the server. The whole model is
  fine-tuned, as the authors' ``analysis.ipynb`` (both parameter groups) and FL-bench's
  ``FedAvgClient.finetune`` (the client's optimizer over ``model.parameters()``) do.

Choices: tau defaults to 5, the authors' (``--ft_ep 5`` in ``utils/options.py``,
``personalization_epoch = 5`` in ``analysis.ipynb``); FL-bench has no default of its own
(``finetune_epoch`` is 0 and FedBABU asserts it is > 0). Fine-tuning uses the baselines' step
size eta, batch size, momentum and weight decay (the optimizer of training), as FL-bench does
(its fine-tuning reuses the training optimizer and its lr). The authors' notebook fine-tunes with
the optimizer of their training too (batch 50, momentum 0.9, no weight decay in their scripts) at
1e-3, the step size their training ends with (``main_fed.py`` decays 0.1 tenfold at half and at
three quarters of the rounds); this product's training has no decay, so its step size is eta
throughout. ``babu-finetune-epochs = 0`` evaluates the global model with its untrained head (the
paper's accuracy before fine-tuning; FL-bench refuses 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.methods.base import Method, setting


@dataclass(frozen=True)
class FedBABU(Method):
    """FedBABU; ``finetune_epochs`` is tau, the epochs of fine-tuning before each evaluation (run
    config ``babu-finetune-epochs``, default 5, the authors' code's)."""

    finetune_epochs: int = setting(5, "babu-finetune-epochs")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.finetune_epochs, bool) or not isinstance(self.finetune_epochs, int):
            raise ValueError("must be a whole number of epochs")
        if self.finetune_epochs < 0:
            raise ValueError("must be >= 0 (0: the global model with its untrained head)")
