"""The run configuration: every knob of FedPAC, validated before any training starts.

Flower hands the ServerApp and every ClientApp the same ``context.run_config`` (the
``[tool.flwr.app.config]`` table of pyproject.toml plus ``--run-config`` overrides). Both sides
parse it with :func:`parse_run_config`, so a bad value fails fast, with the key and the allowed
range in the message, on whichever side reads it first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from common.methods.fedccfa.clustering import WEIGHTS
from common.drift import DRIFT_PATTERNS, MIN_CLASSES, Drift, parse_drift_rounds
from common.methods import METHODS
from common.methods.base import Method, settings_of
from common.methods.pfedvem import SAMPLE_PROTOCOLS
from common.model import FRONT_ENDS
from common.privacy import ACCOUNTANTS, PrivacySettings
from common.robust import AGGREGATIONS
from common.sites import PartitionMap

DATASETS = ("mnist-5k", "fashion-mnist", "mnist", "cifar10", "hf")
# The paper's step size eta of local training, per dataset (Appendix B.3: 0.01 for
# EMNIST/Fashion-MNIST, 0.02 for CIFAR-10/CINIC-10), for ``extractor-lr = 0``.
DATASET_EXTRACTOR_LR = {"cifar10": 0.02}
DEFAULT_EXTRACTOR_LR = 0.01
PARTITIONS = (
    "fedpac", "concept-shift", "dirichlet", "dirichlet-min", "pathological", "vem-pairs", "super-labels"
)
# pFedVEM's label skew (``vem-pairs``) gives the two clients of a pair complementary halves of the
# classes; ``super-labels`` (our own concept-drift analogue for 28x28 data) groups the classes into
# super-labels of this many members each: the task is the super-label, so the model has
# (the dataset's classes) / SUPER_LABEL_SIZE outputs.
SUPER_LABEL_SIZE = 2
DEVICES = ("auto", "cpu", "cuda")
QP_SOLVERS = ("vectorized", "cvxpy")


class ConfigError(ValueError):
    """A run-config value is missing, of the wrong type or out of range."""


@dataclass(frozen=True)
class FedPACConfig:  # pylint: disable=too-many-instance-attributes
    """Typed view of the run config; field names are the kebab-case keys with underscores."""

    # Method: FedPAC or one of the paper's baselines/ablations (``common.methods.METHODS``)
    strategy: str = "fedpac"
    # The methods' own knobs (``common.methods.base.setting``) given in the run config, as sorted
    # (key, value) pairs: a method declares them in its own package, not here.
    method_settings: tuple[tuple[str, Any], ...] = ()
    # Federation
    num_server_rounds: int = 20
    fraction_train: float = 1.0
    full_last_round: bool = True
    min_available_clients: int = 2
    min_train_replies: int = 1
    max_failed_rounds: int = 3
    # Bounds on one client's influence: a reply (or pre-flight answer) with more training samples
    # than max-samples-per-client is rejected (0: no bound), and a client's aggregation weight n_i
    # is at most max-weight-ratio times the median n of the round's other replies (0: no cap).
    max_samples_per_client: int = 0
    max_weight_ratio: float = 10.0
    # Each reply's update of every model part it sends back (its arrays minus those the server sent
    # it that round), and each of its class means, is scaled down to at most max-norm-ratio times
    # the median norm of the round's other replies' (0: no bound; ``common.robust``). The parts the
    # server averages are combined by shared-aggregation: the sample-weighted mean (eq. 18), or
    # the unweighted coordinate-wise median or trimmed mean (trim-fraction cut from each end).
    max_norm_ratio: float = 3.0
    shared_aggregation: str = "mean"
    trim_fraction: float = 0.2
    # FedPAC's head mixes leave out, for each client, every head whose update points away from
    # the client's own (``common.robust.agreeing_mix``): a sign-flipped head passes the bound.
    agreeing_heads: bool = True
    fraction_evaluate: float = 1.0
    # A round's evaluation travels in the next round's train message (the client evaluates the
    # model it received before training on it): one message per client and round instead of two,
    # the same numbers. Only when every client trains and is evaluated every round; the last
    # round always has an evaluate message of its own.
    fused_evaluation: bool = True
    round_timeout: float = 3600.0
    # Which partition a deployed node serves (``common.sites``): "" by its registered name
    # (supernode-<i> serves i), "NAME=I,..." or "SHA256:...=I,..." by the operator's map,
    # "claims" by each node's own partition-id (no node authentication). The simulation's nodes
    # are the federation's own: their partition-ids are believed.
    partition_map: str = ""
    # Local update (Section 4; Appendix B.3 of the paper)
    local_epochs: int = 5
    head_epochs: int = 1
    # the extractor's epochs train the head too (FedPAC, FedRep): under DP one private step then
    # pays for both, and the head's own epochs (head-epochs, fedrep-head-epochs) may go
    head_with_extractor: bool = False
    batch_size: int = 50
    head_lr: float = 0.1
    extractor_lr: float = 0.0  # 0: the dataset's step size eta (DATASET_EXTRACTOR_LR)
    momentum: float = 0.5
    weight_decay: float = 5e-4
    lambda_align: float = 1.0
    # Baselines. `extractor-lr` is the paper's step size eta of every baseline (Appendix B.3:
    # "the same step size as other baselines"), so joint training, FedRep and fine-tuning use it.
    # FedRep (Collins et al., ICML 2021): many local head epochs per round with the body frozen,
    # then the body: FedRep's own code defaults to 1 body epoch (`--local_rep_ep 1`); 6 of the 7
    # scripts of its paper use 10 head and 5 body epochs (the paper grids' [method-config]).
    # The FedPAC authors' published code has no FedRep.
    fedrep_head_epochs: int = 10
    fedrep_body_epochs: int = 1
    # FedRep's head step size; 0: `extractor-lr`, as FedRep's own code (one `--lr` for both). The
    # FedCCFA authors' FedRep (configs/FedRep.yaml) takes 1 head epoch at clf_lr = 0.1, then 5
    # body epochs at rep_lr = 0.01 (the drift grid's [method-config]).
    fedrep_head_lr: float = 0.0
    # FedAvg-FT: the received global model's head is fine-tuned on the local training data before
    # each evaluation. The authors' code (`local_fine_tuning` in methods/fedavg.py) trains only
    # the classifier keys with the baselines' step size; the paper gives no epoch count. Default
    # one epoch; the paper grids use 5, as the authors' later ReBaFL code calls it (local_epoch = E).
    finetune_epochs: int = 1
    # FedCCFA (Chen et al., NeurIPS 2024; the authors' configs/FedCCFA.yaml). The shared keys
    # (batch-size 64, momentum 0.9, weight-decay 1e-5, head-lr 0.1 and head-epochs 1 for the
    # personal head, extractor-lr 0.01 and local-epochs 5 for the extractor) are set by the run.
    balanced_epochs: int = 5  # epochs of the balanced head (for clustering), from phi^0
    balanced_lr: float = 0.1
    balanced_samples_per_class: int = 5  # m = min(this, the smallest count of a present class)
    cluster_eps: float = 0.1  # DBSCAN radius on the MADD distance
    cluster_weights: str = "uniform"  # how cluster members are averaged: uniform or label (n_jc)
    clustered_anchors: bool = True  # False: one set of anchors, the mean over the round's replies
    align_gamma: float = 20.0  # alignment weight H(P_k(Y)) / gamma; 0 = the fixed align-lambda
    align_lambda: float = 0.0
    align_temperature: float = 0.1  # tau of the contrastive alignment
    align_from_round: int = 21  # the code aligns from its 0-based round 20, our round 21
    # pFedVEM (Zhu et al., CVPR 2023; the authors' experiment/configs/cifar10.json where it differs
    # from FedPAC's defaults; no weight decay, as in the code). The base trains local-epochs (5).
    # Who trains: "all-train" (every client, every round; the paper's protocol) or
    # "sampled-train" (only the round's sample S_t). Either way only S_t is aggregated, each client
    # in S_t with probability vem-sampling-rate (at least 2), seeded by (seed, round).
    vem_protocol: str = "all-train"
    vem_sampling_rate: float = 0.1
    vem_head_steps: int = 10  # full-batch SGD steps of the E-step on (mu, s)
    vem_mc_samples: int = 5  # M: head samples per E-step step and per base minibatch
    vem_head_lr: float = 1e-3
    vem_base_lr: float = 1e-3
    vem_momentum: float = 0.9  # both phases
    vem_batch_size: int = 10  # base minibatches
    vem_initial_sigma: float = 1.0  # every client's posterior starts at N(w^0, vem-initial-sigma^2)
    # Classifier collaboration
    alpha_threshold: float = 1e-3
    qp_solver: str = "vectorized"
    # Data (Appendix B.2)
    dataset: str = "mnist-5k"
    data_dir: str = ""
    hf_repo: str = ""
    num_classes: int = 10
    image_size: int = 28
    image_channels: int = 1
    partition: str = "fedpac"
    uniform_share: float = 20.0
    samples_per_client: int = 600
    test_samples_per_client: int = 200
    dirichlet_alpha: float = 0.5
    pathological_classes: int = 2
    # dirichlet-min (FedCCFA's partition): these many samples of every class go to every client
    # first (train and test), the rest of each class by Dirichlet(dirichlet-alpha); the whole
    # training and test sets are distributed.
    min_train_per_class: int = 5
    min_test_per_class: int = 2
    # vem-pairs and super-labels: how much of the dataset they hand out. 0: all of it (the
    # authors' default); otherwise this many training images of every class, and this many test
    # images of every class in a client's test set (the authors' data-scarce CIFAR-10 variant
    # uses 500 training images per class).
    class_train_samples: int = 0
    class_test_samples: int = 0
    # Distributed concept drift (``common.drift``): label swaps by partition-id mod 10 from the
    # given rounds (1-based: a drift at 100 changes the labels seen from round 101 on). Empty
    # drift-rounds = the paper's: sudden 100, recurrent 100,150, incremental 100,110,120.
    drift: str = "none"
    drift_rounds: str = ""
    # Generalized accuracy (the full test set, relabelled with the client's current concept)
    # every N rounds and at the last round; 0 = only at the last round.
    generalized_every: int = 0
    # Input normalization, one per run so every client's features live on one scale: per-channel
    # values ("0.5" or "0.49,0.48,0.45"); empty = the dataset's constants (``common.data``).
    normalize_mean: str = ""
    normalize_std: str = ""
    # Record-level differential privacy at every site (``common.privacy``), off by default: DP-SGD
    # for every gradient step (each record's gradient clipped to dp-max-grad-norm, Gaussian noise
    # of dp-noise-multiplier times that), the feature statistics from features clipped to
    # dp-feature-clip with noise of dp-statistics-noise-multiplier times their sensitivity, and one
    # accountant per site whose epsilon at dp-delta is reported every round. With
    # dp-epsilon-budget > 0 a site stops training before its epsilon would pass the budget.
    dp: bool = False
    dp_noise_multiplier: float = 1.0
    dp_max_grad_norm: float = 1.0
    dp_statistics_noise_multiplier: float = 10.0
    dp_feature_clip: float = 10.0
    dp_delta: float = 1e-5
    dp_epsilon_budget: float = 0.0
    # > 0: each site scales both noise multipliers by one factor, found before its first round, so
    # that num-server-rounds rounds of its releases reach this epsilon (their ratio stays).
    dp_target_epsilon: float = 0.0
    # How each site composes its releases into epsilon: "rdp" (Rényi DP) or "prv" (the privacy
    # random variable accountant: tighter, so dp-target-epsilon calibrates less noise; slower).
    dp_accountant: str = "rdp"
    # DP-SGD's recipe at every site, for every private step of every method (docs/RESULTS.md,
    # "Differential privacy with a recipe"): the expected Poisson batch, and the step size (taken
    # with dp-momentum and no weight decay); 0 keeps each training routine's own batch size, step
    # sizes, momentum and weight decay.
    dp_batch_size: int = 1024
    dp_step_size: float = 0.5
    dp_momentum: float = 0.9
    # FedPAC's feature-alignment weight under DP, in place of lambda-align: the global centroids
    # it aligns to are released with noise, which alignment turns into noise on every feature.
    dp_lambda_align: float = 0.0
    # What the extractor reads: the images ("none", the paper's CNN) or their scattering
    # ("scatternet": a fixed transform, applied once to a site's data, then one trained layer;
    # ``common.model``), whose features DP-SGD needs far fewer records to learn from. "auto": the
    # ScatterNet with dp on, the paper's CNN without (the config holds the one chosen).
    extractor_front_end: str = "auto"
    # Run
    seed: int = 0
    device: str = "auto"
    mixed_precision: bool = False
    output_dir: str = "outputs"
    resume_from: str = ""
    # The run folder keeps the checkpoints of this many of its latest rounds (checkpoint-round-<t>.npz),
    # beside checkpoint.npz (the latest): resume-from can name an earlier one.
    checkpoints_kept: int = 3
    # Each deployed site keeps its personalized model (node config model-dir) after the last
    # round; with N > 0 also after every N-th round.
    save_model_every: int = 0

    def __post_init__(self) -> None:
        if self.extractor_lr == 0:  # the dataset's step size, however the config was made
            object.__setattr__(self, "extractor_lr", DATASET_EXTRACTOR_LR.get(self.dataset, DEFAULT_EXTRACTOR_LR))
        if self.extractor_front_end == "auto":  # the ScatterNet's features cost no privacy
            object.__setattr__(self, "extractor_front_end", "scatternet" if self.dp else "none")

    @staticmethod
    def key(field_name: str) -> str:
        """The run-config key of a field."""
        return field_name.replace("_", "-")


def _coerce(key: str, value: Any, target: type) -> Any:
    """Convert a TOML value to the field's type, refusing lossy or nonsensical casts."""
    if target is bool:
        if isinstance(value, bool):
            return value
    elif target is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif target is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # +inf passes every "> 0" bound, and a step size, rate or scale of inf trains NaN
            try:
                number = float(value)
            except OverflowError:  # an int past the largest float
                number = math.inf
            if math.isfinite(number):
                return number
            raise ConfigError(f"run config '{key}' = {value!r} is invalid: must be a finite number")
    elif target is str:
        if isinstance(value, str):
            return value
    raise ConfigError(
        f"run config '{key}' = {value!r} has the wrong type: expected {target.__name__}"
    )


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"run config '{key}' = {value!r} is invalid: must be {allowed}")


def _validate(cfg: FedPACConfig) -> None:
    k = FedPACConfig.key
    _check(cfg.strategy in METHODS, k("strategy"), cfg.strategy, f"one of {', '.join(METHODS)}")
    settings = dict(cfg.method_settings)
    for method in METHODS.values():  # every method's knobs given, not only the run's method's
        for key in settings.keys() & settings_of(method).keys():
            try:
                method.configured({key: settings[key]})
            except ValueError as err:
                raise ConfigError(f"run config '{key}' = {settings[key]!r} is invalid: {err}") from err
    try:  # each valid alone; some of the run's method's settings exclude each other
        configured_method(cfg)
    except ValueError as err:
        given = sorted(settings.keys() & settings_of(METHODS[cfg.strategy]).keys())
        values = " and ".join(f"'{key}' = {settings[key]!r}" for key in given)
        raise ConfigError(f"run config {values} do not go together: {err}") from err
    _check(cfg.num_server_rounds >= 1, k("num_server_rounds"), cfg.num_server_rounds, ">= 1")
    for name in ("fraction_train", "fraction_evaluate"):
        value = getattr(cfg, name)
        _check(0.0 < value <= 1.0, k(name), value, "in (0, 1]")
    _check(
        cfg.min_available_clients >= 1, k("min_available_clients"), cfg.min_available_clients, ">= 1"
    )
    _check(cfg.min_train_replies >= 1, k("min_train_replies"), cfg.min_train_replies, ">= 1")
    _check(cfg.max_failed_rounds >= 0, k("max_failed_rounds"), cfg.max_failed_rounds, ">= 0")
    _check(cfg.max_samples_per_client >= 0, k("max_samples_per_client"), cfg.max_samples_per_client,
           ">= 0 (0: no bound)")
    _check(cfg.max_weight_ratio == 0 or cfg.max_weight_ratio >= 1, k("max_weight_ratio"), cfg.max_weight_ratio,
           "0 (no cap) or >= 1")
    _check(cfg.max_norm_ratio == 0 or cfg.max_norm_ratio >= 1, k("max_norm_ratio"), cfg.max_norm_ratio,
           "0 (no bound) or >= 1")
    _check(cfg.shared_aggregation in AGGREGATIONS, k("shared_aggregation"), cfg.shared_aggregation,
           f"one of {', '.join(AGGREGATIONS)}")
    _check(0.0 <= cfg.trim_fraction < 0.5, k("trim_fraction"), cfg.trim_fraction, "in [0, 0.5)")
    _check(cfg.round_timeout > 0, k("round_timeout"), cfg.round_timeout, "> 0 seconds")
    try:
        PartitionMap.parse(cfg.partition_map)
    except ValueError as err:
        raise ConfigError(f"run config 'partition-map' = {cfg.partition_map!r} is invalid: {err}; expected "
                          "'' (supernode-<i> serves partition i), 'claims', or 'NAME=I, SHA256:...=J, ...'") from err
    _check(cfg.local_epochs >= 1, k("local_epochs"), cfg.local_epochs, ">= 1")
    _check(cfg.fedrep_body_epochs >= 1, k("fedrep_body_epochs"), cfg.fedrep_body_epochs, ">= 1")
    for name in ("head_epochs", "fedrep_head_epochs", "finetune_epochs"):
        value = getattr(cfg, name)
        _check(value >= 0, k(name), value, ">= 0")
    _check(cfg.batch_size >= 1, k("batch_size"), cfg.batch_size, ">= 1")
    for name in ("head_lr", "extractor_lr"):
        value = getattr(cfg, name)
        _check(value > 0, k(name), value, "> 0")
    _check(cfg.fedrep_head_lr >= 0, k("fedrep_head_lr"), cfg.fedrep_head_lr, ">= 0 (0: extractor-lr)")
    _check(0.0 <= cfg.momentum < 1.0, k("momentum"), cfg.momentum, "in [0, 1)")
    for name in ("weight_decay", "lambda_align"):
        value = getattr(cfg, name)
        _check(value >= 0, k(name), value, ">= 0")
    for name in ("dp_noise_multiplier", "dp_max_grad_norm", "dp_statistics_noise_multiplier", "dp_feature_clip"):
        value = getattr(cfg, name)
        _check(value > 0, k(name), value, "> 0")
    _check(0.0 < cfg.dp_delta < 1.0, k("dp_delta"), cfg.dp_delta, "in (0, 1)")
    _check(cfg.dp_epsilon_budget >= 0, k("dp_epsilon_budget"), cfg.dp_epsilon_budget, ">= 0 (0: no budget)")
    _check(cfg.dp_target_epsilon >= 0, k("dp_target_epsilon"), cfg.dp_target_epsilon, ">= 0 (0: the noise as given)")
    _check(not cfg.dp_epsilon_budget or cfg.dp_epsilon_budget >= cfg.dp_target_epsilon, k("dp_epsilon_budget"),
           cfg.dp_epsilon_budget, f"0 or >= dp-target-epsilon = {cfg.dp_target_epsilon:g}: a smaller budget stops "
           "every site before the last round")
    _check(cfg.dp_batch_size >= 0, k("dp_batch_size"), cfg.dp_batch_size, ">= 0 (0: each routine's batch size)")
    _check(cfg.dp_step_size >= 0, k("dp_step_size"), cfg.dp_step_size, ">= 0 (0: each routine's step sizes)")
    _check(0 <= cfg.dp_momentum < 1, k("dp_momentum"), cfg.dp_momentum, "in [0, 1)")
    _check(cfg.extractor_front_end in FRONT_ENDS, k("extractor_front_end"), cfg.extractor_front_end,
           f"one of auto, {', '.join(FRONT_ENDS)}")
    _check(cfg.dp_lambda_align >= 0, k("dp_lambda_align"), cfg.dp_lambda_align, ">= 0")
    _check(cfg.dp_accountant in ACCOUNTANTS, k("dp_accountant"), cfg.dp_accountant, f"one of {', '.join(ACCOUNTANTS)}")
    _check(not (cfg.dp and cfg.mixed_precision), k("mixed_precision"), cfg.mixed_precision,
           "false with dp = true (per-sample gradients are taken in float32)")
    refusal = METHODS[cfg.strategy].dp_refusal
    _check(not (cfg.dp and refusal), k("dp"), cfg.dp, f"false with strategy '{cfg.strategy}': {refusal}")
    _check(0.0 <= cfg.alpha_threshold < 1.0, k("alpha_threshold"), cfg.alpha_threshold, "in [0, 1)")
    _check(cfg.qp_solver in QP_SOLVERS, k("qp_solver"), cfg.qp_solver, f"one of {', '.join(QP_SOLVERS)}")
    _check(cfg.dataset in DATASETS, k("dataset"), cfg.dataset, f"one of {', '.join(DATASETS)}")
    _check(
        cfg.dataset != "hf" or bool(cfg.hf_repo or cfg.data_dir),
        k("hf_repo"),
        cfg.hf_repo,
        "a Hugging Face dataset name (or set data-dir to a saved DatasetDict) when dataset = 'hf'",
    )
    _check(cfg.num_classes >= 2, k("num_classes"), cfg.num_classes, ">= 2")
    _check(cfg.image_size in (28, 32), k("image_size"), cfg.image_size, "28 or 32")
    _check(cfg.image_channels in (1, 3), k("image_channels"), cfg.image_channels, "1 or 3")
    _check(
        cfg.partition in PARTITIONS, k("partition"), cfg.partition, f"one of {', '.join(PARTITIONS)}"
    )
    _check(cfg.partition != "vem-pairs" or cfg.num_classes % 2 == 0, k("partition"), cfg.partition,
           f"not 'vem-pairs' with an odd number of classes ({cfg.num_classes}): a pair splits the classes "
           "into two complementary halves")
    _check(0.0 <= cfg.uniform_share <= 100.0, k("uniform_share"), cfg.uniform_share, "in [0, 100]")
    for name in ("samples_per_client", "test_samples_per_client"):
        value = getattr(cfg, name)
        _check(value >= 1, k(name), value, ">= 1")
    _check(cfg.dirichlet_alpha > 0, k("dirichlet_alpha"), cfg.dirichlet_alpha, "> 0")
    _check(
        1 <= cfg.pathological_classes <= cfg.num_classes,
        k("pathological_classes"),
        cfg.pathological_classes,
        f"in [1, num-classes = {cfg.num_classes}]",
    )
    for name in ("normalize_mean", "normalize_std"):
        value = getattr(cfg, name)
        _check(_channel_values(value, cfg.image_channels, positive=name == "normalize_std") is not None,
               k(name), value, f"empty or {cfg.image_channels} comma-separated number(s)"
               + (" > 0" if name == "normalize_std" else ""))
    _check(bool(cfg.normalize_mean.strip()) == bool(cfg.normalize_std.strip()), k("normalize_std"),
           cfg.normalize_std, "set together with normalize-mean (both or neither)")
    # a balanced head trained zero epochs is phi^0 for everyone: nothing would tell clients apart
    for name in ("balanced_epochs", "balanced_samples_per_class"):
        value = getattr(cfg, name)
        _check(value >= 1, k(name), value, ">= 1")
    for name in ("align_from_round", "generalized_every", "min_train_per_class", "min_test_per_class"):
        value = getattr(cfg, name)
        _check(value >= 0, k(name), value, ">= 0")
    for name in ("balanced_lr", "align_temperature"):
        value = getattr(cfg, name)
        _check(value > 0, k(name), value, "> 0")
    for name in ("cluster_eps", "align_gamma", "align_lambda"):
        value = getattr(cfg, name)
        _check(value >= 0, k(name), value, ">= 0")
    _check(cfg.cluster_weights in WEIGHTS, k("cluster_weights"), cfg.cluster_weights,
           f"one of {', '.join(WEIGHTS)}")
    for name in ("class_train_samples", "class_test_samples"):
        _check(getattr(cfg, name) >= 0, k(name), getattr(cfg, name), ">= 0 (0: all of the class)")
    _check(cfg.vem_protocol in SAMPLE_PROTOCOLS, k("vem_protocol"), cfg.vem_protocol,
           f"one of {', '.join(SAMPLE_PROTOCOLS)}")
    _check(0.0 < cfg.vem_sampling_rate <= 1.0, k("vem_sampling_rate"), cfg.vem_sampling_rate, "in (0, 1]")
    _check(cfg.vem_head_steps >= 0, k("vem_head_steps"), cfg.vem_head_steps, ">= 0")
    for name in ("vem_mc_samples", "vem_batch_size"):
        value = getattr(cfg, name)
        _check(value >= 1, k(name), value, ">= 1")
    for name in ("vem_head_lr", "vem_base_lr", "vem_initial_sigma"):
        value = getattr(cfg, name)
        _check(value > 0, k(name), value, "> 0")
    _check(0.0 <= cfg.vem_momentum < 1.0, k("vem_momentum"), cfg.vem_momentum, "in [0, 1)")
    # pFedVEM draws who is aggregated (and, sampled-train, who trains) itself: a second sampling
    # on top would silently change its protocol
    _check(not METHODS[cfg.strategy].draws_its_own_sample or cfg.fraction_train == 1.0, k("fraction_train"),
           cfg.fraction_train, f"1 with strategy '{cfg.strategy}', which samples with vem-sampling-rate "
           "and vem-protocol")
    _check(cfg.drift in DRIFT_PATTERNS, k("drift"), cfg.drift, f"one of {', '.join(DRIFT_PATTERNS)}")
    _check(parse_drift_rounds(cfg.drift_rounds) is not None, k("drift_rounds"), cfg.drift_rounds,
           "empty or comma-separated round numbers >= 0")
    try:
        Drift(cfg.drift, parse_drift_rounds(cfg.drift_rounds) or ())
    except ValueError as err:
        raise ConfigError(f"run config 'drift-rounds' = {cfg.drift_rounds!r} is invalid: {err}") from err
    _check(cfg.drift == "none" or cfg.num_classes >= MIN_CLASSES, k("drift"), cfg.drift,
           f"'none' for fewer than {MIN_CLASSES} classes (the drift swaps labels up to {MIN_CLASSES - 1})")
    _check(cfg.save_model_every >= 0, k("save_model_every"), cfg.save_model_every, ">= 0")
    # the clients seed their torch generators with seed * 1_000_003 + ..., which must fit 64 bits
    _check(0 <= cfg.seed < 2**32, k("seed"), cfg.seed, "in [0, 2**32)")
    _check(cfg.device in DEVICES, k("device"), cfg.device, f"one of {', '.join(DEVICES)}")
    _check(bool(cfg.output_dir), k("output_dir"), cfg.output_dir, "a non-empty path")
    _check(cfg.checkpoints_kept >= 1, k("checkpoints_kept"), cfg.checkpoints_kept, ">= 1")


def _channel_values(text: str, channels: int, positive: bool = False) -> tuple[float, ...] | None:
    """``()`` for an empty string, one float per channel, or None when malformed."""
    if not text.strip():
        return ()
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        return None
    if len(values) != channels or any(not math.isfinite(v) or (positive and v <= 0) for v in values):
        return None
    return values


def configured_normalization(cfg: FedPACConfig) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(mean, std) fixed in the run config, or None when the dataset's constants apply."""
    mean = _channel_values(cfg.normalize_mean, cfg.image_channels)
    std = _channel_values(cfg.normalize_std, cfg.image_channels, positive=True)
    if not mean and not std:
        return None
    if not mean or not std:
        raise ConfigError("run config 'normalize-mean' and 'normalize-std' must be set together")
    return mean, std


def parse_run_config(run_config: Mapping[str, Any]) -> FedPACConfig:
    """Build and validate a :class:`FedPACConfig` from Flower's run config.

    Keys missing from ``run_config`` take their defaults; unknown keys are an error so that a
    typo never silently falls back to a default.
    """
    known = {FedPACConfig.key(f.name): f for f in fields(FedPACConfig) if f.name != "method_settings"}
    method_keys = method_settings()
    unknown = sorted(set(run_config) - set(known) - set(method_keys))
    if unknown:
        raise ConfigError(f"unknown run config key(s): {', '.join(unknown)}")
    values: dict[str, Any] = {
        field.name: _coerce(key, run_config[key], type(field.default))
        for key, field in known.items()
        if key in run_config
    }
    # only the settings that differ from their defaults: pyproject.toml declares every key (so that
    # `flwr run` accepts it), and a run's identity must not change with the knobs of other methods
    given = {key: _coerce(key, run_config[key], type(field.default)) for key, field in method_keys.items()
             if key in run_config}
    values["method_settings"] = tuple(sorted(
        (key, value) for key, value in given.items() if value != method_keys[key].default))
    cfg = _apply_dataset(FedPACConfig(**values))
    _validate(cfg)
    return cfg


def method_settings() -> dict[str, Any]:
    """Every method's own run-config knobs, by key (each declared once, by its method's class)."""
    keys: dict[str, Any] = {}
    owners: dict[str, type] = {}
    for method in METHODS.values():
        for key, field in settings_of(method).items():
            if owners.setdefault(key, type(method)) is not type(method):
                raise ValueError(f"run-config key '{key}' is declared by both {owners[key].__name__} and "
                                 f"{type(method).__name__}")
            keys[key] = field
    return keys


def privacy_settings(cfg: FedPACConfig) -> PrivacySettings | None:
    """The sites' differential privacy (``common.privacy``), or None when ``dp`` is off."""
    if not cfg.dp:
        return None
    return PrivacySettings(noise_multiplier=cfg.dp_noise_multiplier, max_grad_norm=cfg.dp_max_grad_norm,
                           statistics_noise_multiplier=cfg.dp_statistics_noise_multiplier,
                           feature_clip=cfg.dp_feature_clip, delta=cfg.dp_delta, epsilon_budget=cfg.dp_epsilon_budget,
                           target_epsilon=cfg.dp_target_epsilon, rounds=cfg.num_server_rounds,
                           accountant=cfg.dp_accountant, batch_size=cfg.dp_batch_size,
                           step_size=cfg.dp_step_size, momentum=cfg.dp_momentum)


def sites_keep_state(cfg: FedPACConfig) -> bool:
    """Whether the run's sites keep anything from one round to the next: what their method keeps
    there (``Method.keeps_anything_at_site``), or their privacy accountant's ledger."""
    return cfg.dp or configured_method(cfg).keeps_anything_at_site


def configured_method(cfg: FedPACConfig) -> Method:
    """The run's method, with the settings the run config gives it."""
    return METHODS[cfg.strategy].configured(dict(cfg.method_settings))


# The paper's named datasets fix the model's input and output shapes (the server builds the
# model without seeing any data); only a generic Hugging Face dataset reads them from the config.
_DATASET_SHAPES = {
    "mnist-5k": (10, 28, 1),
    "fashion-mnist": (10, 28, 1),
    "mnist": (10, 28, 1),
    "cifar10": (10, 32, 3),
}


def _apply_dataset(cfg: FedPACConfig) -> FedPACConfig:
    """The dataset's input and output shapes (its step size is set by ``FedPACConfig`` itself).

    ``num-classes`` is the model's number of outputs: under ``super-labels`` that is the number
    of super-labels, the named dataset's classes / SUPER_LABEL_SIZE.
    """
    shape = _DATASET_SHAPES.get(cfg.dataset)
    if shape is None:
        return cfg
    classes, image_size, channels = shape
    if cfg.partition == "super-labels":
        classes //= SUPER_LABEL_SIZE
    return FedPACConfig(**{**cfg.__dict__, "num_classes": classes, "image_size": image_size,
                           "image_channels": channels})


def dp_only_fields(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The DP settings (the ``dp_*`` fields) of a config, as ``asdict`` gives it, of a run without
    DP: they compute nothing there, so runs without DP that differ only in them compute the same
    (their defaults changed when the DP recipe became the default)."""
    return () if config.get("dp") else tuple(name for name in config if name.startswith("dp_"))


def alignment_weight(cfg: FedPACConfig) -> float:
    """FedPAC's feature-alignment weight lambda: ``dp-lambda-align`` with dp on, else
    ``lambda-align``."""
    return cfg.dp_lambda_align if cfg.dp else cfg.lambda_align


def dataset_classes(cfg: FedPACConfig) -> int:
    """The number of classes of the run's dataset: ``num-classes`` (the model's outputs) except
    under ``super-labels``, whose task merges SUPER_LABEL_SIZE classes into each output."""
    if cfg.partition == "super-labels":
        return cfg.num_classes * SUPER_LABEL_SIZE
    return cfg.num_classes


def dataset_defaults_note(run_config: Mapping[str, Any], cfg: FedPACConfig) -> str | None:
    """What the log should say about the dataset's own step size: that it was applied, or that
    the run config overrides it (``None`` when the dataset has no step size of its own)."""
    own = DATASET_EXTRACTOR_LR.get(cfg.dataset)
    if own is None:
        return None
    if not run_config.get(FedPACConfig.key("extractor_lr")):
        return f"extractor-lr = {own:g}: the paper's step size for {cfg.dataset} (extractor-lr = 0)"
    return f"extractor-lr = {cfg.extractor_lr:g} from the run config, instead of the paper's {own:g} for {cfg.dataset}"
