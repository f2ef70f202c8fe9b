"""Centralized references: pooled data by group and for everyone, measured as the paper measures."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import FedPACConfig
from experiments.reference import (
    ClientData, all_pooled_group_head, group_pooled, groups, main, pooled, reference_run_config, summary)


def _client(pid: int, group: int, classes: tuple[int, int], n: int = 60, seed: int = 0) -> ClientData:
    """A client of a two-class group: bright squares whose place is the class, under noise."""
    def split(count: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * seed + 10 * pid + salt)
        y = torch.tensor(classes)[torch.arange(count) % 2]
        x = 0.5 * torch.randn(count, 1, 28, 28, generator=g)
        for k in classes:
            row, col = divmod(k, 2)
            x[y == k, :, 14 * row + 3 : 14 * row + 11, 14 * col + 3 : 14 * col + 11] += 2.0
        return x, y
    return ClientData(pid, group, split(n, 0), split(n // 2, 1))


CLIENTS = [_client(0, 0, (0, 1)), _client(1, 1, (2, 3)), _client(2, 0, (0, 1)), _client(3, 1, (2, 3))]
CFG = FedPACConfig(batch_size=20)


def test_groups_and_pooled_data_follow_the_clients_groups():
    members = groups(CLIENTS)
    assert {g: [c.partition_id for c in group] for g, group in members.items()} == {0: [0, 2], 1: [1, 3]}
    x, y = pooled(members[1])
    assert x.shape == (120, 1, 28, 28) and sorted(set(y.tolist())) == [2, 3]
    assert torch.equal(x[:60], CLIENTS[1].train[0]) and torch.equal(x[60:], CLIENTS[3].train[0])


def test_both_references_learn_the_clients_tasks_and_report_every_measured_epoch():
    by_group = group_pooled(CLIENTS, CFG, epochs=3, eval_every=2, seed=0)
    shared = all_pooled_group_head(CLIENTS, CFG, epochs=3, eval_every=2, head_epochs=2, seed=0)
    for curve in (by_group, shared):
        assert [epoch for epoch, _ in curve] == [2, 3]  # every eval_every epochs, and the last
        assert curve[-1][1] > 0.9  # two classes per client: chance is 0.5
    # a reference is a function of its seed: the same seed trains the same models
    assert group_pooled(CLIENTS, CFG, epochs=3, eval_every=2, seed=0) == by_group
    assert summary([(5, 0.8), (10, 0.9), (15, 0.85)]) == {"last_epoch": 15, "last": 0.85, "best_epoch": 10,
                                                           "best": 0.9}


def test_the_command_line_writes_its_references_and_refuses_a_bad_run_config(tmp_path, capsys):
    out = tmp_path / "reference.json"
    main(["--clients", "3", "--epochs", "1", "--set", "dataset=mnist-5k", "--set", "samples-per-client=50",
          "--set", "test-samples-per-client=20", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["references"]) == {"group pooled", "all pooled + group head"}
    assert result["run_config"] == {"dataset": "mnist-5k", "samples-per-client": 50, "test-samples-per-client": 20}
    for ref in result["references"].values():
        assert 0.0 <= ref["last"] <= 1.0 and ref["curve"] == [[1, ref["last"]]]
    assert "group pooled:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="experiments.reference: run config 'local-epochs' = 0 is invalid"):
        main(["--set", "local-epochs=0"])
    with pytest.raises(SystemExit, match="key=value"):
        main(["--set", "no-equals-sign"])
    for flag in ("--eval-every", "--epochs", "--clients"):  # 0 would loop forever or crash at the end
        with pytest.raises(SystemExit, match=f"experiments.reference: {flag} must be >= 1, got 0"):
            main([flag, "0"])


def test_a_set_item_overrides_the_paper_dataset_and_keeps_it_otherwise():
    assert reference_run_config([]) == {"dataset": "fashion-mnist"}
    assert reference_run_config(["seed=1"]) == {"dataset": "fashion-mnist", "seed": 1}
    assert reference_run_config(["dataset=mnist-5k", "seed=1"]) == {"dataset": "mnist-5k", "seed": 1}
