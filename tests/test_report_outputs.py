"""The run report names no method: a method's server part declares its columns, tables, charts and
log (``common.methods.outputs``), every run's tables share one schema, and records written
before ``RoundRecord.method`` (a checkpoint of an older version) still resume."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from common.methods import METHODS
from common.methods.outputs import Chart, ClientColumn, Outputs, RoundColumn, Table, reply_metric
from common.methods.server import EXTRACTOR, ServerPart, ServerState, registered_outputs, server_class
from server_app.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from server_app.report import (
    GENERIC_CLIENT_COLUMNS,
    GENERIC_ROUND_COLUMNS,
    RoundRecord,
    RunReport,
    client_columns,
    round_columns,
)


class _Tiny(ServerPart):
    """A method the report has never heard of, declaring one of everything."""

    outputs = Outputs(
        round_columns=(RoundColumn("tiny_total", lambda r: sum(r.method.get("tiny", [])), in_metrics=True),),
        client_columns=(reply_metric("tiny_metric", "tiny-metric"),
                        ClientColumn("tiny_share", lambda r, pid: r.method.get("tiny", [0, 0])[pid])),
        tables=(Table("tiny.csv", ("round", "value"),
                      lambda r: [{"round": r.round, "value": v} for v in r.method.get("tiny", [])]),),
        charts=(Chart("tiny.png", lambda rounds, context, path: path.write_text(f"{len(rounds)} {context.config}"),
                      lambda rounds: any(r.method.get("tiny") for r in rounds)),),
        log=lambda r: f" | tiny {r.method.get('tiny')}",
    )


def _tiny_record(number: int) -> RoundRecord:
    return RoundRecord(round=number, started=0.0, seconds=1.0, accuracy={0: 0.5, 1: 0.25},
                       train={0: {"train-loss": 0.5, "num-examples": 6.0, "tiny-metric": 7.0},
                              1: {"train-loss": 0.25, "num-examples": 6.0}},
                       method={"tiny": [number, 10 * number]})


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_a_method_s_declared_columns_table_chart_and_log_appear_without_the_report_knowing_it(tmp_path):
    report = RunReport(tmp_path, 2, lambda pid: pid, {"strategy": "tiny"}, outputs=_Tiny.outputs)
    for number in (1, 2):
        report.add(_tiny_record(number))
    report.close()
    rounds, clients = _rows(tmp_path / "rounds.csv"), _rows(tmp_path / "clients.csv")
    assert [r["tiny_total"] for r in rounds] == ["11", "22"]
    assert [(r["tiny_metric"], r["tiny_share"]) for r in clients if r["round"] == "2"] == [("7.0", "2"), ("", "20")]
    # every registered method's columns are there too, empty: the tiny method declares none of them
    assert list(rounds[0]) == [*round_columns(), "tiny_total"]
    assert rounds[0]["qp_fallbacks"] == "" and clients[0]["solver_status"] == ""
    assert _rows(tmp_path / "tiny.csv") == [{"round": "1", "value": "1"}, {"round": "1", "value": "10"},
                                            {"round": "2", "value": "2"}, {"round": "2", "value": "20"}]
    assert (tmp_path / "tiny.png").read_text() == "2 {'strategy': 'tiny'}"
    assert (tmp_path / "accuracy.png").exists() and not (tmp_path / "alpha.png").exists()
    entries = json.loads((tmp_path / "metrics.json").read_text())["rounds"]
    assert [(e["tiny"], e["tiny_total"]) for e in entries] == [([1, 10], 11), ([2, 20], 22)]
    assert report.round_line(report.rounds[0]).endswith(" | tiny [1, 10] | 1.0s")


def test_every_method_writes_the_same_columns_and_blanks_those_it_does_not_declare(tmp_path):
    headers = set()
    for name in METHODS:
        report = RunReport(tmp_path / name, 1, lambda pid: pid, {"strategy": name})
        report.add(_tiny_record(1))
        report.close()
        rounds, clients = _rows(tmp_path / name / "rounds.csv"), _rows(tmp_path / name / "clients.csv")
        headers.add((tuple(rounds[0]), tuple(clients[0])))
        outputs = server_class(METHODS[name]).outputs
        undeclared = set(round_columns()) - set(GENERIC_ROUND_COLUMNS) - {c.name for c in outputs.round_columns}
        assert all(rounds[0][column] == "" for column in undeclared), name
        undeclared = set(client_columns()) - set(GENERIC_CLIENT_COLUMNS) - {c.name for c in outputs.client_columns}
        assert all(row[column] == "" for row in clients for column in undeclared), name
    assert headers == {(round_columns(), client_columns())}
    # the generic columns first, then the registered methods' in the registry's order, each once
    declared = [c.name for o in registered_outputs() for c in o.round_columns]
    assert round_columns() == (*GENERIC_ROUND_COLUMNS, *dict.fromkeys(declared))
    assert {"qp_fallbacks", "centroid_classes", "mean_clusters_per_class", "mean_local_accuracy",
            "num_aggregated"} <= set(round_columns())
    assert {"v", "head_loss", "align_loss", "align_weight", "solver_status", "local_accuracy", "rho",
            "aggregated"} <= set(client_columns())


def _old_layout(record: dict) -> dict:
    """A record as checkpoints held it before ``RoundRecord.method``: every method's fields at the
    top level, with their defaults where the method recorded nothing."""
    old = {"alpha_partitions": [], "alpha": [], "solver_status": [], "centroid_classes": 0,
           "cluster_partitions": [], "clusters": [], "sampled": [], "aggregated": []}
    return {**{k: v for k, v in record.items() if k != "method"}, **old, **record["method"]}


@pytest.mark.parametrize("strategy, method", [
    ("fedpac", {"alpha_partitions": [0, 1], "alpha": [[0.75, 0.25], [0.5, 0.5]],
                "solver_status": ["optimal", "fallback-own-head"], "centroid_classes": 7}),
    ("fedccfa", {"cluster_partitions": [0, 1], "clusters": [[0, 0], [0, 1], [-1, 0]]}),
    ("pfedvem", {"sampled": [0, 1], "aggregated": [1]}),
    ("fedavg", {}),
])
def test_a_checkpoint_written_before_records_kept_method_values_apart_resumes_with_the_same_outputs(
        tmp_path, strategy, method):
    records = []
    for number in (1, 2):
        record = RoundRecord(round=number, started=100.0 + number, seconds=1.5, accuracy={0: 0.5, 1: 0.75},
                             test_loss={0: 1.0, 1: 2.0}, bytes_sent={0: 10, 1: 20}, bytes_received={0: 5, 1: 6},
                             train={pid: {"train-loss": 0.5, "num-examples": 6.0, "head-loss": 0.1, "rho": 0.5,
                                          "local-accuracy": 0.25} for pid in (0, 1)},
                             method=dict(method), rejected=number - 1)
        records.append(record)
    state = ServerState(shared={EXTRACTOR: {"w": np.zeros(3, np.float32)}})
    checkpoint = Checkpoint(completed_rounds=2, state=state, rounds=records, model_shape=(10, 28, 1), seed=0,
                            strategy=strategy)
    new_dir, old_dir = tmp_path / "new", tmp_path / "old"
    for directory in (new_dir, old_dir):
        directory.mkdir()
        save_checkpoint(checkpoint, directory)
    # the old layout, as the previous version's save_checkpoint wrote it
    with np.load(old_dir / "checkpoint.npz") as archive:
        arrays = {name: archive[name] for name in archive.files}
    meta = json.loads(str(arrays["meta"]))
    meta["rounds"] = [_old_layout(r) for r in meta["rounds"]]
    assert "method" not in meta["rounds"][0] and "alpha" in meta["rounds"][0]
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(old_dir / "checkpoint.npz", **arrays)

    for directory in (new_dir, old_dir):
        report = RunReport(directory / "out", 3, lambda pid: pid, {"strategy": strategy})
        report.rounds = list(load_checkpoint(directory).rounds)
        report.write()
        report.close()
    for name in ("rounds.csv", "clients.csv", "clusters.csv", "alpha.png", "clusters.png", "confidence.png"):
        new, old = new_dir / "out" / name, old_dir / "out" / name
        assert new.exists() == old.exists(), name
        if new.exists():
            assert new.read_bytes() == old.read_bytes(), name
    new_rounds = json.loads((new_dir / "out" / "metrics.json").read_text())["rounds"]
    old_rounds = json.loads((old_dir / "out" / "metrics.json").read_text())["rounds"]
    # the old records keep every key they had (the other methods' empty ones too); equal on the rest
    assert [{k: o[k] for k in n} for n, o in zip(new_rounds, old_rounds)] == new_rounds
    assert all(r.method == method for r in load_checkpoint(new_dir).rounds)
    restored = load_checkpoint(old_dir).rounds
    assert all({k: v for k, v in r.method.items() if k in method} == method for r in restored)


def test_the_alpha_chart_of_a_thousand_clients_keeps_the_size_of_forty_and_labels_the_groups(tmp_path, monkeypatch,
                                                                                             rendered_charts):
    """One label and 0.3 inch per client made a round of 1,000 clients a 300-inch figure of
    33,000 pixels a side; the figure stops growing, and the groups are labelled instead."""
    import struct

    from common import figures
    from common.methods.fedpac.charts import plot_alpha

    drawn = []
    save = figures.save_figure
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: (drawn.append(fig), save(fig, path)))
    rng = np.random.default_rng(0)

    def chart(m: int) -> tuple[int, int]:
        path = tmp_path / f"alpha-{m}.png"
        plot_alpha(rng.dirichlet(np.ones(m), size=m).tolist(), list(range(m)), 3, lambda pid: pid % 10, path)
        return struct.unpack(">II", path.read_bytes()[16:24])  # the PNG header's width and height

    assert chart(1000) == chart(40)
    thousand, forty = (fig.axes[0] for fig in drawn)
    assert [t.get_text() for t in thousand.get_xticklabels()] == [f"g{g}" for g in range(10)]
    assert [t.get_text() for t in thousand.get_yticklabels()] == [f"g{g}" for g in range(10)]
    assert len(thousand.lines) == 2 * 9  # a line between two groups, across and down
    assert len(forty.get_xticklabels()) == 40
