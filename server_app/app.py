"""FedPAC ServerApp: validates the run config, runs the strategy (FedPAC or the baseline the
run config's ``strategy`` names), writes outputs and checkpoints."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, fields
from logging import ERROR, INFO
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from common import protocol as p
from common.config import (ConfigError, FedPACConfig, configured_method, dataset_defaults_note, dp_only_fields,
                           parse_run_config, sites_keep_state)
from common.drift import drift_fields_free
from common.methods.server import server_part
from common.model import FedPACNet, split_state
from common.model import initial_model as seeded_model
from common.partition import dominant_class_groups
from common.sites import PartitionMap, SiteRegistry
from server_app.checkpoint import DEFAULT_KEPT, Checkpoint, checkpoint_file, load_checkpoint, save_checkpoint
from server_app.responsive_grid import ResponsiveGrid, is_simulation
from common.files import atomic_write, npz_bytes
from server_app.report import FinalDelivery, RoundRecord, RunReport
from server_app.strategy import PersonalizedStrategy

app = ServerApp()


def initial_model(cfg: FedPACConfig) -> FedPACNet:
    """The round-0 model, identical for a given seed (``common.model.initial_model``)."""
    return seeded_model(cfg.image_channels, cfg.image_size, cfg.num_classes, cfg.seed, cfg.extractor_front_end)


def run_directory(cfg: FedPACConfig, run_id: int) -> Path:
    """A fresh folder per run under output-dir (relative paths: from the ServerApp's cwd)."""
    root = Path(os.path.expanduser(cfg.output_dir)).resolve()
    return root / f"{time.strftime('%Y%m%d-%H%M%S')}-run{run_id}"


def model_shape(cfg: FedPACConfig) -> tuple[int, int, int]:
    return (cfg.num_classes, cfg.image_size, cfg.image_channels)


def save_final_state(strategy: PersonalizedStrategy, path: Path) -> None:
    """The method's final server state in one .npz (``ServerPart.final_arrays``): the shared
    sections as ``<section>/<array>`` (the global extractor, FedAvg's head, FedPAC's centroids,
    pFedVEM's prior mean), every client's as ``client-<pid>/<section>/<array>`` (personalized
    heads, FedCCFA's anchors, pFedVEM's posterior means; what a site keeps at home is not here)."""
    atomic_write(path, npz_bytes(strategy.server.final_arrays(strategy.state)))


def write_round_outputs(report: RunReport, record: RoundRecord, checkpoint: Checkpoint,
                        checkpoints_kept: int = DEFAULT_KEPT) -> None:
    """A finished round's outputs, most important first: the checkpoint (``checkpoint.rounds``
    ends with ``record``; those of the latest ``checkpoints_kept`` rounds are kept), then the
    tables (metrics.json, rounds.csv, clients.csv), then the charts, drawn in the background
    while the next round trains. A failed checkpoint or table
    write (a full disk, say) stops the run with an OSError naming the file; the checkpoint is
    then never behind the tables, so a run resumed from it has every round the tables show. A
    failed chart is only a warning (``RunReport.paint``).
    """
    save_checkpoint(checkpoint, report.directory, checkpoints_kept)
    report.add(record)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


def resume_command(cfg: FedPACConfig, directory: Path) -> str:
    """The command that continues this run from its checkpoint: ``flwr run`` with the run's
    run-config keys that differ from the defaults, plus ``resume-from``."""
    defaults = FedPACConfig()
    keys = [f"{FedPACConfig.key(f.name)}={_toml(getattr(cfg, f.name))}" for f in fields(FedPACConfig)
            if f.name not in ("resume_from", "method_settings") and getattr(cfg, f.name) != getattr(defaults, f.name)]
    keys += [f"{key}={_toml(value)}" for key, value in cfg.method_settings]
    keys.append(f"resume-from={_toml(str(directory))}")
    return f'flwr run . <federation> --run-config "{" ".join(keys)}"'


def resume_source(cfg: FedPACConfig, directory: Path) -> Path:
    """What the run continues from should it stop now: its own folder once it has saved a
    checkpoint there. Until then a resumed run's last state is still the checkpoint it resumed
    from, and a command naming the new folder would find nothing there (a run that resumed
    nothing has only its own folder to name)."""
    if cfg.resume_from and not checkpoint_file(directory).is_file():
        return Path(cfg.resume_from).expanduser().resolve()
    return directory


def _resume(cfg: FedPACConfig) -> Checkpoint | None:
    if not cfg.resume_from:
        return None
    checkpoint = load_checkpoint(cfg.resume_from)
    if checkpoint.model_shape != model_shape(cfg):
        raise ConfigError(
            f"run config 'resume-from': checkpoint is for model shape {checkpoint.model_shape} "
            f"(classes, size, channels), this run has {model_shape(cfg)}"
        )
    if checkpoint.seed != cfg.seed:
        raise ConfigError(f"run config 'resume-from': checkpoint has seed {checkpoint.seed}, this run {cfg.seed}")
    if checkpoint.strategy != cfg.strategy:
        raise ConfigError(
            f"run config 'resume-from': checkpoint is a '{checkpoint.strategy}' run, this run's "
            f"strategy is '{cfg.strategy}'"
        )
    # as the checkpoint saved it: through JSON, where the method settings' pairs are lists
    current = json.loads(json.dumps(asdict(cfg)))
    differences = config_differences(checkpoint.config, current, checkpoint.completed_rounds)
    if differences:
        raise ConfigError(
            f"run config 'resume-from': this run's config differs from the checkpoint's, so it would "
            f"not continue the same computation: {'; '.join(differences)}. Resume with the checkpoint's "
            "values (its run folder's status.json has the exact command)"
        )
    return checkpoint


# Keys a resumed run may change: where and how long it runs, not what it computes.
RESUMABLE_KEYS = frozenset({
    "num_server_rounds", "output_dir", "resume_from", "device", "round_timeout", "min_available_clients",
    "min_train_replies", "max_failed_rounds", "generalized_every", "save_model_every", "data_dir",
    "fused_evaluation", "partition_map", "checkpoints_kept",
})


def config_differences(saved: dict, current: dict, completed_rounds: int) -> list[str]:
    """``key: checkpoint's value -> this run's`` for every key that changes the computation of
    the rounds after ``completed_rounds`` (an older checkpoint without a saved config has none to
    compare). The drift may change while no label has changed yet under either drift: the
    checkpoint's rounds are then those of this run too (a recurrent or incremental drift run
    continues a sudden one's first 100 rounds). A run without DP ignores the DP settings, which
    compute nothing there (a checkpoint saved before the DP recipe's defaults resumes)."""
    ignored = (RESUMABLE_KEYS | set(drift_fields_free(saved, current, completed_rounds))
               | set(dp_only_fields(current)))
    return [
        f"{FedPACConfig.key(name)}: {saved[name]!r} -> {current[name]!r}"
        for name in sorted(saved)
        if name in current and name not in ignored and saved[name] != current[name]
    ]


def run_fedpac(grid: Grid, cfg: FedPACConfig, run_id: int) -> tuple[PersonalizedStrategy, RunReport]:
    """Run (or resume) the configured method until ``num-server-rounds`` rounds are complete."""
    checkpoint = _resume(cfg)  # fails before any training on a bad checkpoint
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    server = server_part(configured_method(cfg), cfg, extractor, head)
    groups = len(dominant_class_groups(cfg.num_classes))
    directory = run_directory(cfg, run_id)
    report = RunReport(directory, cfg.num_server_rounds, lambda pid: pid % groups, asdict(cfg),
                       outputs=server.outputs)
    log(INFO, "%s outputs: %s", cfg.strategy, directory)

    strategy = PersonalizedStrategy(
        server=server,
        num_rounds=cfg.num_server_rounds,
        fraction_train=cfg.fraction_train,
        fraction_evaluate=cfg.fraction_evaluate,
        fused_evaluation=cfg.fused_evaluation,
        full_last_round=cfg.full_last_round,
        min_available_nodes=cfg.min_available_clients,
        min_train_replies=cfg.min_train_replies,
        max_failed_rounds=cfg.max_failed_rounds,
        max_samples_per_client=cfg.max_samples_per_client,
        max_weight_ratio=cfg.max_weight_ratio,
        seed=cfg.seed,
        sites=SiteRegistry(PartitionMap.parse(cfg.partition_map), trusted_claims=is_simulation(grid)),
        run_key=f"{directory.name}-{uuid.uuid4().hex[:12]}",  # run ids repeat across SuperLinks
        sites_keep_state=sites_keep_state(cfg),
    )
    if isinstance(grid, ResponsiveGrid):  # a sealed reply is measured before it is opened
        grid.reply_limit = strategy.max_reply_bytes
    if checkpoint is not None:
        strategy.restore(checkpoint)
        report.rounds = list(checkpoint.rounds)
        log(INFO, "Resuming from %s after round %d", checkpoint_file(cfg.resume_from), checkpoint.completed_rounds)

    def end_of_round(record: RoundRecord) -> None:
        checkpoint = Checkpoint(
            completed_rounds=record.round,
            state=strategy.state,
            rounds=[*report.rounds, record],
            model_shape=model_shape(cfg),
            seed=cfg.seed,
            strategy=cfg.strategy,
            config=asdict(cfg),
            lineage=strategy.lineage if strategy.sites_keep_state else (),
        )
        write_round_outputs(report, record, checkpoint, cfg.checkpoints_kept)
        write_status("running", record.round)

    def write_status(state: str, completed: int, error: str = "", delivery: FinalDelivery | None = None) -> str:
        """status.json, with the checkpoint to continue from now; returns the command that does."""
        source = resume_source(cfg, directory)
        resume = resume_command(cfg, source)
        report.write_status(state, completed, resume, error, checkpoint_file(source), delivery)
        return resume

    strategy.on_round_end = end_of_round
    write_status("running", strategy.round_offset)
    try:
        strategy.discover(grid, timeout=cfg.round_timeout)
        remaining = cfg.num_server_rounds - strategy.round_offset
        if remaining > 0:
            strategy.start(
                grid=grid, initial_arrays=p.to_record(strategy.extractor), num_rounds=remaining,
                timeout=cfg.round_timeout,
            )
        else:
            log(INFO, "Checkpoint already has %d rounds: nothing to train", strategy.round_offset)
        save_final_state(strategy, directory / "final_state.npz")
        # Every site ends the run with its model, whether or not the last round evaluated it. A
        # simulated client has no site to keep one (its head is in final_state.npz, saved first).
        delivery = None if is_simulation(grid) else strategy.deliver(grid, timeout=cfg.round_timeout)
    except BaseException as err:
        report.close()
        completed = report.rounds[-1].round if report.rounds else strategy.round_offset
        resume = write_status("failed", completed, f"{type(err).__name__}: {err}")
        log(ERROR, "Run stopped after round %d of %d: %s. Continue with: %s", completed,
            cfg.num_server_rounds, err, resume)
        raise
    report.close()  # the charts show the last round before the run says it finished
    write_status("finished", cfg.num_server_rounds, delivery=delivery)
    if spent := report.privacy_line():
        log(INFO, "%s", spent)
    return strategy, report


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run FedPAC (or the run config's baseline) for ``num-server-rounds`` rounds."""
    cfg = parse_run_config(context.run_config)  # fails before any training on a bad value
    note = dataset_defaults_note(context.run_config, cfg)
    if note:
        log(INFO, "%s", note)
    responsive = ResponsiveGrid(grid)
    if responsive.seal:
        log(INFO, "Messages sealed: 3 objects each on every hop (FEDPAC_SEAL_MESSAGES=0: off)")
    _, report = run_fedpac(responsive, cfg, context.run_id)
    log(INFO, "%s finished: final mean personalized accuracy %.2f%%; outputs in %s", cfg.strategy,
        100 * report.rounds[-1].mean_accuracy if report.rounds else float("nan"), report.directory)
