"""Payload bytes per client and round: FedPAC (from a run's metrics) against FedAvg.

FedAvg's figure is counted on the records Flower's own FedAvg exchanges for the same model:
`flwr.serverapp.strategy.FedAvg.configure_train` / `configure_evaluate` build the messages
down, and the replies carry the trained model plus a MetricRecord (train) or a MetricRecord
(evaluate), as in Flower's PyTorch quickstart. Same byte counter as FedPAC's run metrics
(`common.protocol.payload_bytes`: tensor data and scalars, no gRPC framing).

    python bench/communication.py --run-dir <a FedPAC run folder>
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.model import FedPACNet  # noqa: E402
from common.protocol import payload_bytes  # noqa: E402


class _OneNode:
    """The only thing FedAvg asks of a Grid when it builds messages: the node ids."""

    def get_node_ids(self):
        return [42]


def fedavg_bytes(num_classes: int = 10) -> tuple[int, int]:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    model = ArrayRecord(torch_state_dict=FedPACNet(1, 28, num_classes).state_dict())
    strategy = FedAvg(min_available_nodes=1, min_train_nodes=1, min_evaluate_nodes=1)
    down = sum(payload_bytes(m.content) for m in strategy.configure_train(1, model, ConfigRecord(), _OneNode()))
    down += sum(payload_bytes(m.content) for m in strategy.configure_evaluate(1, model, ConfigRecord(), _OneNode()))
    train_reply = RecordDict({"arrays": model, "metrics": MetricRecord({"train_loss": 0.0, "num-examples": 600})})
    eval_reply = RecordDict({"metrics": MetricRecord({"eval_loss": 0.0, "eval_acc": 0.0, "num-examples": 200})})
    return down, payload_bytes(train_reply) + payload_bytes(eval_reply)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--out", default="bench/results/communication.json")
    args = parser.parse_args()
    rows = [r for r in csv.DictReader((Path(args.run_dir) / "clients.csv").open()) if r["trained"] == "1"]
    fedpac_down = statistics.median(int(r["bytes_sent"]) for r in rows)
    fedpac_up = statistics.median(int(r["bytes_received"]) for r in rows)
    avg_down, avg_up = fedavg_bytes()
    result = {
        "fedpac_down": fedpac_down, "fedpac_up": fedpac_up,
        "fedavg_down": avg_down, "fedavg_up": avg_up,
        "ratio_total": (fedpac_down + fedpac_up) / (avg_down + avg_up),
        "ratio_up": fedpac_up / avg_up, "ratio_down": fedpac_down / avg_down,
    }
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
