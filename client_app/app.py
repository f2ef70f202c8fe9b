"""FedPAC ClientApp: one local data partition, trained on the GPU when there is one."""

from __future__ import annotations

import time
from functools import lru_cache

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.train import evaluate as evaluate_model
from client_app.train import local_update
from common import protocol as p
from common.config import FedPACConfig, parse_run_config
from common.data import load_dataset, to_tensors
from common.model import FedPACNet
from common.partition import client_split

app = ClientApp()


def select_device(requested: str) -> torch.device:
    """``auto`` picks CUDA when available; asking for ``cuda`` without one is an error."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run config device = 'cuda' but no CUDA device is available")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def partition_of(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config (set by simulation or --node-config)."""
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as err:
        raise RuntimeError(
            f"node config lacks {err}: start the SuperNode with "
            "--node-config 'partition-id=I num-partitions=N'"
        ) from err


@lru_cache(maxsize=64)
def client_tensors(
    cfg: FedPACConfig, partition_id: int, num_partitions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test) on ``device``, built once per process and client."""
    data = load_dataset(cfg)
    split = client_split(cfg, partition_id, num_partitions)
    mean, std = data.train_normalization
    x_train, y_train = to_tensors(
        data.train_images[split.train_indices], split.train_labels, mean, std, device
    )
    x_test, y_test = to_tensors(data.test_images[split.test_indices], split.test_labels, mean, std, device)
    return x_train, y_train, x_test, y_test


def _model_from(record: ArrayRecord, cfg: FedPACConfig, device: torch.device) -> FedPACNet:
    model = FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes)
    model.load_state_dict(record.to_torch_state_dict(), strict=True)
    return model.to(device)


def _setup(msg: Message, context: Context):
    cfg = parse_run_config(context.run_config)
    partition_id, num_partitions = partition_of(context)
    device = select_device(cfg.device)
    model = _model_from(msg.content[p.ARRAYS], cfg, device)
    return cfg, partition_id, num_partitions, device, model


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run FedPAC's local update and reply with the model, centroids and statistics."""
    started = time.perf_counter()
    cfg, partition_id, num_partitions, device, model = _setup(msg, context)
    x, y, _, _ = client_tensors(cfg, partition_id, num_partitions, device)
    server_round = int(msg.content[p.CONFIG][p.SERVER_ROUND])
    received = p.from_record(msg.content[p.CENTROIDS])
    centroids = torch.as_tensor(received[p.CENTROID_VALUES], dtype=torch.float32, device=device)
    mask = torch.as_tensor(received[p.CENTROID_MASK], dtype=torch.bool, device=device)
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + server_round * 1_009 + partition_id)

    update = local_update(model, x, y, centroids, mask, cfg, generator)

    statistics = p.to_record(
        {
            p.CENTROID_VALUES: update.centroids.cpu().numpy(),
            p.CLASS_COUNTS: update.class_counts.cpu().numpy().astype(np.int64),
            p.H: update.statistics.h.float().cpu().numpy(),
        }
    )
    metrics = MetricRecord(
        {
            p.PARTITION_ID: partition_id,
            p.NUM_EXAMPLES: update.statistics.num_samples,
            p.V: update.statistics.v,
            "head-loss": update.head_loss,
            "train-loss": update.train_loss,
            "align-loss": update.align_loss,
            "train-seconds": time.perf_counter() - started,
        }
    )
    content = RecordDict(
        {
            p.ARRAYS: ArrayRecord(torch_state_dict=model.state_dict()),
            p.STATISTICS: statistics,
            p.METRICS: metrics,
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Personalized accuracy: global extractor + this client's combined head, own test split."""
    started = time.perf_counter()
    cfg, partition_id, num_partitions, device, model = _setup(msg, context)
    _, _, x_test, y_test = client_tensors(cfg, partition_id, num_partitions, device)
    loss, accuracy = evaluate_model(model, x_test, y_test)
    metrics = MetricRecord(
        {
            p.PARTITION_ID: partition_id,
            p.NUM_EXAMPLES: len(y_test),
            "accuracy": accuracy,
            "loss": loss,
            "eval-seconds": time.perf_counter() - started,
        }
    )
    return Message(content=RecordDict({p.METRICS: metrics}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Pre-flight: load this client's data and report its partition and sizes.

    The server asks every node this before round 1, so a bad data path, too few samples or a
    missing partition-id stops the run with the client's own message before any training.
    """
    cfg = parse_run_config(context.run_config)
    partition_id, num_partitions = partition_of(context)
    x, y, x_test, _ = client_tensors(cfg, partition_id, num_partitions, select_device(cfg.device))
    metrics = MetricRecord(
        {
            p.PARTITION_ID: partition_id,
            "num-partitions": num_partitions,
            p.NUM_EXAMPLES: len(y),
            "test-examples": len(x_test),
        }
    )
    return Message(content=RecordDict({p.METRICS: metrics}), reply_to=msg)
