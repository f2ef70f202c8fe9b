"""Every run-config key, given a bad value, is refused by ``parse_run_config`` with a message
naming the key: one table, checked for completeness against pyproject.toml.

``BAD_VALUES`` gives each key the values of its own type that the product must refuse: out of
range, unknown names, and the combinations with other keys that ``_validate``'s cross-key rules
forbid. Wrong types (a string for a number, a float for an int, a bool for anything else) are
refused for every key alike, so those rows are derived from each key's default instead of being
written out. A key whose every value of its type is acceptable sits in ``NO_INVALID_VALUE`` with
the reason; a new key in pyproject.toml fails the completeness test until it is in one of them.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from common.config import ConfigError, method_settings, parse_run_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


@dataclass(frozen=True)
class Bad:
    """A value that must be refused; ``fragment`` is the part of the message that says why, and
    ``given`` the other keys a cross-key rule needs (a bad value only in their company)."""

    value: Any
    fragment: str
    given: dict[str, Any] = field(default_factory=dict)


# The named datasets fix the model's shape (``_apply_dataset``), so the shape keys only count,
# and can only be wrong, for a generic Hugging Face dataset.
HF = {"dataset": "hf", "hf-repo": "user/data"}
# super-labels halves a named dataset's 10 classes: 5, too few for the drift's label swaps.
FIVE_CLASSES = {"partition": "super-labels"}
FINGERPRINT = "SHA256:" + "A" * 43

BAD_VALUES: dict[str, list[Bad]] = {
    "strategy": [Bad("fedsgd", "one of fedpac, "), Bad("FedPAC", "one of fedpac, ")],
    "num-server-rounds": [Bad(0, ">= 1"), Bad(-3, ">= 1")],
    "fraction-train": [
        Bad(0.0, "in (0, 1]"), Bad(1.5, "in (0, 1]"), Bad(-0.5, "in (0, 1]"),
        # pFedVEM draws its own sample: a second sampling on top would change its protocol
        Bad(0.5, "must be 1 with strategy 'pfedvem'", {"strategy": "pfedvem"}),
    ],
    "min-available-clients": [Bad(0, ">= 1")],
    "min-train-replies": [Bad(0, ">= 1")],
    "max-failed-rounds": [Bad(-1, ">= 0")],
    "max-samples-per-client": [Bad(-1, ">= 0 (0: no bound)")],
    "max-weight-ratio": [Bad(0.5, "0 (no cap) or >= 1"), Bad(-1.0, "0 (no cap) or >= 1")],
    "max-norm-ratio": [Bad(0.5, "0 (no bound) or >= 1"), Bad(-1.0, "0 (no bound) or >= 1")],
    "shared-aggregation": [Bad("mode", "one of mean, median, trimmed-mean")],
    "trim-fraction": [Bad(0.5, "in [0, 0.5)"), Bad(-0.1, "in [0, 0.5)")],
    "checkpoints-kept": [Bad(0, ">= 1")],
    "fraction-evaluate": [Bad(0.0, "in (0, 1]"), Bad(1.01, "in (0, 1]")],
    "round-timeout": [Bad(0.0, "> 0 seconds"), Bad(-60.0, "> 0 seconds")],
    "partition-map": [
        Bad("supernode-0", "is not NAME=PARTITION"),
        Bad("site-a=one", "is not NAME=PARTITION"),
        Bad("=3", "is not NAME=PARTITION"),
        Bad("SHA256:short=1", "is not a SHA256 key fingerprint"),
        Bad("site-a=1,site-a=2", "'site-a' is mapped twice"),
        Bad(f"site-a=1,{FINGERPRINT}=1", "partition 1 is mapped to both"),
    ],
    "local-epochs": [Bad(0, ">= 1")],
    "head-epochs": [Bad(-1, ">= 0")],
    "batch-size": [Bad(0, ">= 1")],
    "head-lr": [Bad(0.0, "> 0"), Bad(-0.1, "> 0")],
    # 0 is the dataset's own step size, so only a negative one is wrong
    "extractor-lr": [Bad(-0.01, "> 0")],
    "momentum": [Bad(1.0, "in [0, 1)"), Bad(-0.1, "in [0, 1)")],
    "weight-decay": [Bad(-1e-4, ">= 0")],
    "lambda-align": [Bad(-1.0, ">= 0")],
    "fedrep-head-epochs": [Bad(-1, ">= 0")],
    "fedrep-body-epochs": [Bad(0, ">= 1")],
    "fedrep-head-lr": [Bad(-0.1, ">= 0 (0: extractor-lr)")],
    "finetune-epochs": [Bad(-1, ">= 0")],
    "balanced-epochs": [Bad(0, ">= 1")],
    "balanced-lr": [Bad(0.0, "> 0")],
    "balanced-samples-per-class": [Bad(0, ">= 1")],
    "cluster-eps": [Bad(-0.1, ">= 0")],
    "cluster-weights": [Bad("size", "one of uniform, label")],
    "align-gamma": [Bad(-1.0, ">= 0")],
    "align-lambda": [Bad(-1.0, ">= 0")],
    "align-temperature": [Bad(0.0, "> 0")],
    "align-from-round": [Bad(-1, ">= 0")],
    "vem-protocol": [Bad("some-train", "one of all-train, sampled-train")],
    "vem-sampling-rate": [Bad(0.0, "in (0, 1]"), Bad(1.5, "in (0, 1]")],
    "vem-head-steps": [Bad(-1, ">= 0")],
    "vem-mc-samples": [Bad(0, ">= 1")],
    "vem-head-lr": [Bad(0.0, "> 0")],
    "vem-base-lr": [Bad(-1e-3, "> 0")],
    "vem-momentum": [Bad(1.0, "in [0, 1)"), Bad(-0.5, "in [0, 1)")],
    "vem-batch-size": [Bad(0, ">= 1")],
    "vem-initial-sigma": [Bad(0.0, "> 0")],
    "alpha-threshold": [Bad(1.0, "in [0, 1)"), Bad(-0.1, "in [0, 1)")],
    "qp-solver": [Bad("scipy", "one of vectorized, cvxpy")],
    "extractor-front-end": [Bad("resnet", "one of auto, none, scatternet")],
    "dp-lambda-align": [Bad(-0.5, ">= 0")],
    "dataset": [Bad("imagenet", "one of mnist-5k, ")],
    # a generic dataset needs a source: a Hugging Face name or a saved DatasetDict
    "hf-repo": [Bad("", "a Hugging Face dataset name", {"dataset": "hf"})],
    "num-classes": [Bad(1, ">= 2", HF), Bad(0, ">= 2", HF)],
    "image-size": [Bad(30, "28 or 32", HF)],
    "image-channels": [Bad(2, "1 or 3", HF)],
    "partition": [
        Bad("iid", "one of fedpac, "),
        # a pair splits the classes into two complementary halves
        Bad("vem-pairs", "odd number of classes (7)", {**HF, "num-classes": 7}),
    ],
    "uniform-share": [Bad(120.0, "in [0, 100]"), Bad(-1.0, "in [0, 100]")],
    "samples-per-client": [Bad(0, ">= 1")],
    "test-samples-per-client": [Bad(0, ">= 1")],
    "dirichlet-alpha": [Bad(0.0, "> 0"), Bad(-0.5, "> 0")],
    "pathological-classes": [
        Bad(0, "in [1, num-classes = 10]"),
        Bad(11, "in [1, num-classes = 10]"),
        # the bound is the model's classes after the dataset sets them, not the key as given
        Bad(6, "in [1, num-classes = 5]", FIVE_CLASSES),
    ],
    "min-train-per-class": [Bad(-1, ">= 0")],
    "min-test-per-class": [Bad(-1, ">= 0")],
    "class-train-samples": [Bad(-1, ">= 0 (0: all of the class)")],
    "class-test-samples": [Bad(-1, ">= 0 (0: all of the class)")],
    "drift": [
        Bad("sideways", "one of none, sudden"),
        # the swaps relabel classes up to 6
        Bad("sudden", "'none' for fewer than 7 classes", FIVE_CLASSES),
    ],
    "drift-rounds": [
        Bad("soon", "empty or comma-separated round numbers >= 0"),
        Bad("100,,150", "empty or comma-separated round numbers >= 0"),
        Bad("-1", "empty or comma-separated round numbers >= 0"),
        Bad("100.5", "empty or comma-separated round numbers >= 0"),
        Bad("100", "drift 'none' takes no drift rounds"),
        Bad("100,150", "needs exactly 1 drift round(s)", {"drift": "sudden"}),
        Bad("150,100", "two increasing rounds", {"drift": "recurrent"}),
        Bad("120,110,100", "three non-decreasing rounds", {"drift": "incremental"}),
    ],
    "generalized-every": [Bad(-1, ">= 0")],
    "normalize-mean": [
        Bad("0.5,0.5", "empty or 1 comma-separated number(s)"),
        Bad("half", "empty or 1 comma-separated number(s)"),
        Bad("nan", "empty or 1 comma-separated number(s)"),
        Bad("inf", "empty or 1 comma-separated number(s)"),
        Bad("0.5,0.5", "empty or 3 comma-separated number(s)", {**HF, "image-channels": 3}),
    ],
    "normalize-std": [
        Bad("0", "empty or 1 comma-separated number(s) > 0"),
        Bad("-0.2", "empty or 1 comma-separated number(s) > 0"),
        Bad("0.2,0.2", "empty or 1 comma-separated number(s) > 0"),
        Bad("inf", "empty or 1 comma-separated number(s) > 0"),
        # one without the other would normalize half-way: both or neither
        Bad("", "set together with normalize-mean", {"normalize-mean": "0.5"}),
        Bad("0.2", "set together with normalize-mean"),
    ],
    # the clients seed their generators with seed * 1_000_003 + ..., which must fit 64 bits
    "seed": [Bad(-1, "in [0, 2**32)"), Bad(2**32, "in [0, 2**32)"), Bad(2**60, "in [0, 2**32)")],
    "device": [Bad("tpu", "one of auto, cpu, cuda"), Bad("", "one of auto, cpu, cuda")],
    "output-dir": [Bad("", "a non-empty path")],
    "save-model-every": [Bad(-1, ">= 0")],
    "dp-noise-multiplier": [Bad(0.0, "> 0"), Bad(-1.0, "> 0")],
    "dp-max-grad-norm": [Bad(0.0, "> 0")],
    "dp-statistics-noise-multiplier": [Bad(0.0, "> 0")],
    "dp-feature-clip": [Bad(-1.0, "> 0")],
    "dp-delta": [Bad(0.0, "in (0, 1)"), Bad(1.0, "in (0, 1)")],
    "dp-epsilon-budget": [
        Bad(-1.0, ">= 0 (0: no budget)"),
        # a budget below the target would stop every site before the last round
        Bad(2.0, "0 or >= dp-target-epsilon = 3", {"dp-target-epsilon": 3.0}),
    ],
    "dp-target-epsilon": [Bad(-0.5, ">= 0 (0: the noise as given)")],
    "dp-accountant": [Bad("pld", "one of rdp, prv")],
    "dp-batch-size": [Bad(-1, ">= 0")],
    "dp-step-size": [Bad(-0.5, ">= 0")],
    "dp-momentum": [Bad(1.0, "in [0, 1)"), Bad(-0.1, "in [0, 1)")],
    # per-sample gradients are taken in float32
    "mixed-precision": [Bad(True, "false with dp = true", {"dp": True})],
    # the methods' own settings (common.methods.base.setting)
    "prox-mu": [Bad(-0.01, "must be >= 0")],
    "ditto-lambda": [Bad(-1.0, "must be >= 0")],
    "babu-finetune-epochs": [Bad(-1, "must be >= 0")],
    "knn-neighbours": [Bad(0, "must be >= 1")],
    "knn-interpolation": [Bad(-0.1, "must be in [0, 1]"), Bad(1.5, "must be in [0, 1]")],
    "knn-tuning-holdout": [Bad(-0.1, "must be in [0, 1)"), Bad(1.0, "must be in [0, 1)")],
    # kNN-Per's prediction reads the training records as they are: no private release covers it
    "dp": [Bad(True, "false with strategy 'knn-per'", {"strategy": "knn-per"}),
           Bad(True, "false with strategy 'pfedme'", {"strategy": "pfedme"}),
           Bad(True, "false with strategy 'fedfomo'", {"strategy": "fedfomo"})],
    "apfl-alpha": [Bad(-0.1, "must be in [0, 1]"), Bad(1.5, "must be in [0, 1]")],
    "apfl-mixing": [Bad("logits", "must be one of 'parameters', 'outputs', 'rounds'"),
                    Bad("outputs", "do not go together: apfl-adapt-alpha follows the gradient of the paper's "
                        "v_bar", {"strategy": "apfl", "apfl-adapt-alpha": True}),
                    Bad("rounds", "do not go together: apfl-adapt-alpha follows the gradient of the paper's "
                        "v_bar", {"strategy": "apfl", "apfl-adapt-alpha": True})],
    "pfedme-lambda": [Bad(0.0, "must be > 0"), Bad(-1.0, "must be > 0")],
    "pfedme-k": [Bad(0, "must be >= 1")],
    "pfedme-personal-lr": [Bad(0.0, "must be > 0")],
    "pfedme-beta": [Bad(0.0, "must be > 0")],
    "fedfomo-models": [Bad(0, "must be >= 1")],
    "fedfomo-val-fraction": [Bad(0.0, "must be in (0, 1)"), Bad(1.0, "must be in (0, 1)")],
    "fedfomo-epsilon": [Bad(-0.1, "must be in [0, 1]"), Bad(1.5, "must be in [0, 1]")],
    "pfedhn-server-lr": [Bad(0.0, "must be a step size > 0"), Bad(-0.01, "must be a step size > 0")],
    "pfedhn-embedding-dim": [Bad(0, "must be a whole number >= 1")],
    "pfedhn-hidden": [Bad(0, "must be a whole number >= 1")],
}

NO_INVALID_VALUE: dict[str, str] = {
    "full-last-round": "a switch: both values are meaningful",
    "head-with-extractor": "a switch: both values are meaningful",
    "fused-evaluation": "a switch: both values are meaningful (it is ignored where it cannot apply)",
    "clustered-anchors": "a switch: both values are meaningful",
    "agreeing-heads": "a switch: both values are meaningful (methods that mix no heads ignore it)",
    "apfl-adapt-alpha": "a switch: both values are meaningful",
    "data-dir": "a path, read when the data is loaded (the pre-flight reports a bad one); '' is the default",
    "resume-from": "a path checked when the checkpoint is loaded (server_app.app), not by the parser",
}

# Values of the wrong type for each type a key can have. An int is a valid float (TOML writes 1
# for 1.0), and a float holding a whole number a valid int.
WRONG_TYPES: dict[type, list[Any]] = {
    bool: [1, 0, "true", 1.0],
    int: [2.5, "5", True, float("nan"), [1]],
    float: ["0.5", True, False, [0.5]],
    str: [1, 0.5, True, ["a"]],
}

# Finite floats only: an infinite step size, rate or scale makes training NaN, and the range
# checks alone let +inf through every "> 0" bound.
NON_FINITE = [float("inf"), float("-inf"), float("nan"), 10**400]  # the int: no float holds it


def _parse(key: str, value: Any, given: dict[str, Any] | None = None):
    return parse_run_config({**DEFAULTS, **(given or {}), key: value})


def _rows() -> list[tuple[str, Bad]]:
    rows = [(key, bad) for key, bads in BAD_VALUES.items() for bad in bads]
    for key, default in DEFAULTS.items():
        kind = type(default)
        rows += [(key, Bad(value, f"wrong type: expected {kind.__name__}")) for value in WRONG_TYPES[kind]]
        if kind is float:
            rows += [(key, Bad(value, "must be a finite number")) for value in NON_FINITE]
    return rows


ROWS = _rows()


@pytest.mark.parametrize("key,bad", ROWS, ids=[f"{key}={bad.value!r}"[:80] for key, bad in ROWS])
def test_a_bad_value_is_refused_with_the_key_and_the_reason(key, bad):
    with pytest.raises(ConfigError) as err:
        _parse(key, bad.value, bad.given)
    message = str(err.value)
    named = f"run config '{key}'" in message or (message.startswith("run config ") and f"'{key}' = " in message)
    assert named and bad.fragment in message, message
    # a message that quotes the value quotes the one given, not some other
    quotes = f"run config '{key}' = " in message and "finite" not in bad.fragment  # NaN, Inf, 10**400 print otherwise
    if quotes and isinstance(bad.value, (int, float)):
        assert f"run config '{key}' = {bad.value!r}" in message, message


def test_every_bad_row_is_bad_only_by_its_own_value():
    """A row's company is valid on its own, so its value is what is refused (a row whose
    ``given`` were invalid already would pass for the wrong reason); a value that is the key's
    default is valid on its own, so the company is what makes it bad."""
    for key, bads in BAD_VALUES.items():
        for bad in bads:
            if bad.value == DEFAULTS[key]:
                assert bad.given, f"{key} = {bad.value!r} is the default: the row needs the company that forbids it"
                parse_run_config({**DEFAULTS, key: bad.value})
            else:
                parse_run_config({**DEFAULTS, **bad.given})


def test_every_key_has_a_bad_value_or_a_reason_why_it_has_none():
    keys = set(DEFAULTS)
    assert not set(BAD_VALUES) & set(NO_INVALID_VALUE), "a key is in both tables"
    missing = sorted(keys - set(BAD_VALUES) - set(NO_INVALID_VALUE))
    assert not missing, f"keys with neither bad values in BAD_VALUES nor a reason in NO_INVALID_VALUE: {missing}"
    stale = sorted((set(BAD_VALUES) | set(NO_INVALID_VALUE)) - keys)
    assert not stale, f"keys in the tables that pyproject.toml no longer has: {stale}"
    assert all(BAD_VALUES.values()), "a key in BAD_VALUES without any row"
    assert set(map(type, DEFAULTS.values())) <= set(WRONG_TYPES), "a key of a type WRONG_TYPES does not cover"


# Odd values of each type that a key with no invalid value must take as they are.
ODD_VALUES: dict[type, list[Any]] = {
    bool: [True, False],
    str: ["", " ", "../not/there yet", "übung/données", "x" * 1000],
}


@pytest.mark.parametrize("key", sorted(NO_INVALID_VALUE))
def test_a_key_without_invalid_values_takes_odd_ones(key):
    for value in ODD_VALUES[type(DEFAULTS[key])]:
        cfg = parse_run_config({**DEFAULTS, key: value})
        if key in method_settings():  # a method's own switch: recorded only away from its default
            assert dict(cfg.method_settings).get(key, DEFAULTS[key]) == value
        else:
            assert getattr(cfg, key.replace("-", "_")) == value


# Values at the edge of what is allowed, or spelled unusually, that must still be accepted: a
# check that refuses them is as wrong as one that lets a bad value through.
ACCEPTED: list[dict[str, Any]] = [
    {"num-server-rounds": 1, "local-epochs": 1, "batch-size": 1, "min-available-clients": 1, "min-train-replies": 1},
    {"samples-per-client": 1, "test-samples-per-client": 1, "balanced-epochs": 1, "balanced-samples-per-class": 1},
    {"vem-mc-samples": 1, "vem-batch-size": 1, "vem-momentum": 0.0, "fedrep-body-epochs": 1},
    {"local-epochs": 2.0, "head-lr": 1, "seed": 2**32 - 1},  # a whole float for an int, an int for a float
    {"fraction-train": 1.0, "fraction-evaluate": 1e-9, "vem-sampling-rate": 1.0, "strategy": "pfedvem"},
    {"max-weight-ratio": 0.0, "max-samples-per-client": 0, "max-failed-rounds": 0},
    {"max-weight-ratio": 1.0, "momentum": 0.0, "vem-momentum": 0.999, "alpha-threshold": 0.0},
    {"head-epochs": 0, "fedrep-head-epochs": 0, "finetune-epochs": 0, "vem-head-steps": 0, "fedrep-head-lr": 0.0},
    {"weight-decay": 0.0, "lambda-align": 0.0, "cluster-eps": 0.0, "align-gamma": 0.0, "align-lambda": 0.0},
    {"align-from-round": 0, "generalized-every": 0, "min-train-per-class": 0, "min-test-per-class": 0},
    {"uniform-share": 0.0, "class-train-samples": 0, "class-test-samples": 0, "save-model-every": 0},
    {"uniform-share": 100.0, "pathological-classes": 10},
    {"pathological-classes": 1},
    {"partition-map": "claims"},
    {"partition-map": f" site-a=0, {FINGERPRINT}=1  supernode-7=2 "},
    {"dataset": "hf", "data-dir": "/saved/dataset-dict"},  # a saved DatasetDict instead of a name
    {**HF, "num-classes": 2, "image-size": 32, "image-channels": 3, "normalize-mean": "0.5, 0.4,0.3",
     "normalize-std": "0.2,0.2,0.2"},
    {**HF, "num-classes": 8, "partition": "vem-pairs", "drift": "sudden", "drift-rounds": "5"},
    {**HF, "num-classes": 7, "drift": "incremental"},  # just enough classes for the swaps
    # a named dataset's shape wins over the keys as given, whatever they say
    {"dataset": "cifar10", "num-classes": 1, "image-size": 64, "image-channels": 2},
    {"normalize-mean": "-1e3", "normalize-std": "1e-3"},
    {"head-lr": 10**300, "round-timeout": 1e300},  # huge, but finite
    {"drift": "recurrent", "drift-rounds": " 0, 1"},
    {"drift": "incremental", "drift-rounds": "100,100,100"},
    {"drift": "sudden", "drift-rounds": ""},  # empty: the pattern's own rounds
    {"device": "cpu", "cluster-weights": "label", "qp-solver": "cvxpy", "vem-protocol": "sampled-train"},
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[",".join(o) for o in ACCEPTED])
def test_edge_values_are_accepted(overrides):
    parse_run_config({**DEFAULTS, **overrides})


def test_a_key_pyproject_does_not_declare_is_refused():
    """A misspelt key must not fall back to its default: the snake_case spelling of every
    kebab-case key (the dataclass field's name) is refused as unknown."""
    for key in (k for k in DEFAULTS if "-" in k):
        with pytest.raises(ConfigError, match=f"unknown run config key\\(s\\): {key.replace('-', '_')}"):
            parse_run_config({**DEFAULTS, key.replace("-", "_"): DEFAULTS[key]})
