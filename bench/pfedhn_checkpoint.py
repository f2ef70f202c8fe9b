"""Benchmark: where a pFedHN run stands, read from one of its checkpoints.

Per client, on its test split: the accuracy of the model the hypernetwork generates for it (what
the run reports: each client evaluates the model it receives) and of that model after the
client's local update (``local-epochs`` epochs of the whole model, pFedHN's routine). Then, for
each ``--server-lr``, ``--rounds`` more rounds in-process from the checkpoint, the server's step
being the product's (``common.methods.pfedhn.server.Server.step``): every client's generated
model, trained, taken as its reply; the mean generated accuracy after each round. A run that has
levelled off under a constant step and climbs again under a smaller one was held up by the
step's noise, not by what the hypernetwork can represent.

    python bench/pfedhn_checkpoint.py RUN_FOLDER                      # the generated and trained models only
    python bench/pfedhn_checkpoint.py RUN_FOLDER --rounds 6 --server-lr 0.01 0.002 0.0005

RUN_FOLDER is a run's output folder (its ``checkpoint.npz``) or one ``checkpoint-round-<t>.npz``;
the run's own config (in the checkpoint) names the data and the local update. Results:
``bench/results/pfedhn_checkpoint.json`` and ``.csv`` (one row per server step size and round).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.publish import command_line, publish  # noqa: E402
from client_app.app import client_tensors  # noqa: E402
from common.config import FedPACConfig, configured_method, parse_run_config  # noqa: E402
from common.methods.server import ServerPart, ServerState, Update, server_part  # noqa: E402
from common.model import FedPACNet, part_of, split_state  # noqa: E402
from common.training import evaluate, train_joint  # noqa: E402
from server_app.app import initial_model  # noqa: E402
from server_app.checkpoint import Checkpoint, load_checkpoint  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
Site = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def run_config(checkpoint: Checkpoint, server_lr: float | None) -> FedPACConfig:
    """The checkpointed run's config, its hypernetwork step replaced by ``server_lr``."""
    saved = dict(checkpoint.config)
    method_settings = dict(saved.pop("method_settings", ()))
    if server_lr is not None:
        method_settings["pfedhn-server-lr"] = server_lr
    cfg = parse_run_config({**{FedPACConfig.key(name): value for name, value in saved.items()}, **method_settings})
    if not cfg.strategy.startswith("pfedhn"):
        raise SystemExit(f"the checkpoint is of a '{cfg.strategy}' run, not pFedHN's")
    return cfg


def sites(cfg: FedPACConfig, partitions: list[int]) -> dict[int, Site]:
    """Each client's data as its ClientApp reads it in a simulation."""
    return {pid: client_tensors(cfg, pid, len(partitions), torch.device("cpu")) for pid in partitions}


def model_of(cfg: FedPACConfig, arrays: dict[str, np.ndarray]) -> FedPACNet:
    model = initial_model(cfg)
    model.load_state_dict({**model.state_dict(), **{key: torch.from_numpy(value) for key, value in arrays.items()}})
    return model


def local_round(server: ServerPart, state: ServerState, cfg: FedPACConfig, data: dict[int, Site],
                server_round: int) -> tuple[list[float], list[float], list[Update]]:
    """Every client's generated model's accuracy, that model's after the local update, and the
    replies the server would take."""
    generated, trained, updates = [], [], []
    for pid, (x, y, x_test, y_test) in data.items():
        model = model_of(cfg, server.model_for(state, pid))
        generated.append(evaluate(model, x_test, y_test)[1])
        seed = np.random.SeedSequence([cfg.seed, server_round, pid]).generate_state(1)[0]
        train_joint(model, x, y, cfg, torch.Generator().manual_seed(int(seed)))
        trained.append(evaluate(model, x_test, y_test)[1])
        extractor, head = split_state({key: value.detach().numpy().copy() for key, value in model.state_dict().items()
                                       if part_of(key) in server.method.shared_parts})
        updates.append(Update(pid, extractor, head, len(y), {}))
    return generated, trained, updates


def _row(server_lr: float | None, completed_rounds: int, generated: list[float], trained: list[float]) -> dict:
    row = {"server_lr": "" if server_lr is None else server_lr, "completed_rounds": completed_rounds,
           "generated_accuracy": round(100 * float(np.mean(generated)), 2),
           "trained_accuracy": round(100 * float(np.mean(trained)), 2)}
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a pFedHN run's folder or one of its checkpoint files")
    parser.add_argument("--rounds", type=int, default=0, help="rounds to continue for each --server-lr")
    parser.add_argument("--server-lr", type=float, nargs="*", default=[],
                        help="hypernetwork step sizes to continue with")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as a simulated client with one CPU
    checkpoint = load_checkpoint(args.checkpoint)
    cfg = run_config(checkpoint, None)
    partitions = sorted(next(iter(checkpoint.state.personal.values())))
    data = sites(cfg, partitions)
    started = time.time()
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    at = checkpoint.completed_rounds
    generated, trained, first_updates = local_round(server_part(configured_method(cfg), cfg, extractor, head),
                                                    checkpoint.state, cfg, data, at + 1)
    rows = [_row(None, at, generated, trained)]
    for lr in args.server_lr:
        lr_cfg = run_config(checkpoint, lr)
        server = server_part(configured_method(lr_cfg), lr_cfg, extractor, head)
        state = ServerState(shared={k: dict(v) for k, v in checkpoint.state.shared.items()},
                            personal={k: dict(v) for k, v in checkpoint.state.personal.items()})
        updates = first_updates  # the checkpoint's round, the same for every step size
        for server_round in range(at + 1, at + args.rounds + 1):
            server.step(state, updates, np.ones(len(updates)), server_round)
            generated, trained, updates = local_round(server, state, lr_cfg, data, server_round + 1)
            rows.append(_row(lr, server_round, generated, trained))
    summary = {"command": command_line("pfedhn_checkpoint.py", argv), "checkpoint_round": checkpoint.completed_rounds,
               "clients": len(partitions), "seconds": round(time.time() - started), "rows": rows}
    publish(args.out, "pfedhn_checkpoint", rows, summary)


if __name__ == "__main__":
    main()
