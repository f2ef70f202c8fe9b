"""Run-config validation: bad values fail before training, naming the key and the range."""

import tomllib
from pathlib import Path

import pytest

from common.config import (ConfigError, FedPACConfig, configured_normalization, dataset_defaults_note, method_settings,
                           parse_run_config)

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_defaults_match_the_dataclass_and_the_paper():
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = parse_run_config(table)
    assert cfg == parse_run_config({})  # one source of truth for defaults
    assert table["extractor-lr"] == 0 and FedPACConfig().extractor_lr == 0.01  # the dataset's
    assert (cfg.local_epochs, cfg.batch_size, cfg.head_lr, cfg.extractor_lr) == (5, 50, 0.1, 0.01)
    assert (cfg.momentum, cfg.weight_decay, cfg.lambda_align, cfg.uniform_share) == (0.5, 5e-4, 1.0, 20.0)
    assert cfg.samples_per_client == 600


def test_every_key_the_run_config_reads_is_declared_for_flwr_run():
    """`flwr run . --run-config "k=v"` refuses a key the app's pyproject does not declare, so a
    key only the experiment runner (which bypasses that check) could set is a broken feature."""
    import dataclasses

    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    declared = {f.name.replace("_", "-") for f in dataclasses.fields(FedPACConfig) if f.name != "method_settings"}
    assert declared | set(method_settings()) == set(table)
    # and at each method's own default, so that a run that leaves a knob alone records no setting
    assert all(table[key] == field.default for key, field in method_settings().items())


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("uniform-share", 120, "[0, 100]"),
        ("uniform-share", -1, "[0, 100]"),
        ("fraction-train", 0.0, "(0, 1]"),
        ("fraction-train", 1.5, "(0, 1]"),
        ("fraction-evaluate", 0, "(0, 1]"),
        ("head-lr", -0.1, "> 0"),
        ("extractor-lr", -0.01, "> 0"),
        ("lambda-align", -1.0, ">= 0"),
        ("weight-decay", -1e-4, ">= 0"),
        ("momentum", 1.0, "[0, 1)"),
        ("local-epochs", 0, ">= 1"),
        ("batch-size", 0, ">= 1"),
        ("num-server-rounds", 0, ">= 1"),
        ("dataset", "imagenet", "one of"),
        ("partition", "iid", "one of"),
        ("device", "tpu", "one of"),
        ("samples-per-client", 0, ">= 1"),
        ("alpha-threshold", 1.0, "[0, 1)"),
    ],
)
def test_invalid_values_name_key_and_range(key, value, fragment):
    with pytest.raises(ConfigError) as err:
        parse_run_config({key: value})
    assert f"'{key}'" in str(err.value) and fragment in str(err.value)
    # and the value it was given (an integer may come back as the float the key holds)
    given = {repr(value)} | ({repr(float(value))} if isinstance(value, (int, float)) else set())
    assert any(f"= {form} " in str(err.value) for form in given), str(err.value)


def test_wrong_types_and_unknown_keys():
    with pytest.raises(ConfigError, match="'local-epochs' = 2.5 has the wrong type"):
        parse_run_config({"local-epochs": 2.5})
    with pytest.raises(ConfigError, match="'full-last-round'.*wrong type"):
        parse_run_config({"full-last-round": 1})
    with pytest.raises(ConfigError, match="unknown run config key"):
        parse_run_config({"lamda-align": 1.0})


def test_named_datasets_fix_the_model_shape():
    cfg = parse_run_config({"dataset": "cifar10", "image-size": 28, "image-channels": 1})
    assert (cfg.image_size, cfg.image_channels, cfg.num_classes) == (32, 3, 10)
    cfg = parse_run_config({"dataset": "hf", "hf-repo": "x/y", "num-classes": 62, "image-size": 28})
    assert cfg.num_classes == 62
    with pytest.raises(ConfigError, match="'hf-repo'"):
        parse_run_config({"dataset": "hf"})


def test_the_dataset_sets_its_step_size_unless_the_run_config_does():
    assert parse_run_config({"dataset": "fashion-mnist"}).extractor_lr == 0.01
    cifar = parse_run_config({"dataset": "cifar10"})
    assert cifar.extractor_lr == 0.02 == FedPACConfig(dataset="cifar10").extractor_lr  # the paper's eta
    assert "0.02" in dataset_defaults_note({"dataset": "cifar10", "extractor-lr": 0.0}, cifar)
    explicit = {"dataset": "cifar10", "extractor-lr": 0.05}
    assert parse_run_config(explicit).extractor_lr == 0.05
    assert "0.05 from the run config, instead of the paper's 0.02" in dataset_defaults_note(
        explicit, parse_run_config(explicit))
    assert dataset_defaults_note({}, parse_run_config({})) is None


def test_a_fixed_normalization_needs_its_mean_and_its_std_together():
    """The run config refuses one without the other (parse_run_config); a config built in code is
    refused where the normalization is read."""
    assert configured_normalization(FedPACConfig()) is None
    assert configured_normalization(FedPACConfig(normalize_mean="0.5", normalize_std="0.25")) == ((0.5,), (0.25,))
    for alone in (FedPACConfig(normalize_mean="0.5"), FedPACConfig(normalize_std="0.25")):
        with pytest.raises(ConfigError, match="'normalize-mean' and 'normalize-std' must be set together"):
            configured_normalization(alone)
