"""The model's two extractors: the paper's CNN on the images, and the ScatterNet front end
(``extractor-front-end = "scatternet"``), a fixed transform a site applies to its data once, then
one trained layer. What the front end must guarantee: it is the scattering transform itself, it
sends and saves nothing, it is the same wherever it is computed, and a run trains through it."""

from __future__ import annotations

import csv
from typing import cast

import pytest
import torch
from flwr.serverapp import Grid
from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

from client_app import app as client_app
from common.config import parse_run_config
from common.model import FedPACNet, initial_model, model_inputs, scattering_shape
from federation import InProcessGrid
from server_app.app import run_fedpac


def test_the_front_end_is_the_scattering_transform_and_none_is_the_images():
    """``model_inputs`` gives kymatio's J = 2 scattering of each image, its channels flattened,
    whatever chunks it computes it in, with the shape ``scattering_shape`` announces for grey and
    colour images; without a front end the images themselves; an unknown one is refused."""
    images = torch.randn(11, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    scattered = model_inputs(images, "scatternet", chunk=4)
    assert scattered.shape == (11, *scattering_shape(1, 28)) == (11, 81, 7, 7)
    want = ScatteringTorch2D(J=2, shape=(28, 28))(images).flatten(1, 2)
    torch.testing.assert_close(scattered, want)
    assert model_inputs(images, "none") is images
    colour = model_inputs(torch.randn(2, 3, 32, 32), "scatternet")
    assert colour.shape == (2, *scattering_shape(3, 32)) == (2, 243, 8, 8)
    assert model_inputs(images[:0], "scatternet").shape == (0, 81, 7, 7)
    with pytest.raises(ValueError, match="unknown extractor front end 'wavelets'"):
        model_inputs(images, "wavelets")
    with pytest.raises(ValueError, match="unknown extractor front end"):
        FedPACNet(1, 28, 10, "wavelets")


def test_a_front_end_model_holds_only_what_it_trains_and_starts_the_same_everywhere():
    """Behind the front end the model's state is its trained layers only (the filters are neither
    sent nor saved: a state of the paper's CNN does not load into it), its extractor gives the
    128-dimensional embedding, and the round-0 model is the same for a seed."""
    model = initial_model(1, 28, 10, seed=3, front_end="scatternet")
    state = model.state_dict()
    assert sorted(state) == ["extractor.2.bias", "extractor.2.weight", "head.bias", "head.weight"]
    assert state["extractor.2.weight"].shape == (128, 81 * 7 * 7)
    again = initial_model(1, 28, 10, seed=3, front_end="scatternet").state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)
    x = model_inputs(torch.randn(5, 1, 28, 28), "scatternet")
    assert model.extractor(x).shape == (5, 128) and model(x).shape == (5, 10)
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(FedPACNet(1, 28, 10).state_dict())


def test_a_private_run_trains_through_the_front_end(tmp_path):
    """FedPAC with DP on and the ScatterNet front end, through the ServerApp and ClientApps the
    deployment runs: every site's data reaches its model scattered, every site trains and is
    evaluated in both rounds, and its personalized model beats guessing (MNIST, 10 classes)."""
    config = {"strategy": "fedpac", "samples-per-client": 120, "test-samples-per-client": 60,
              "local-epochs": 1, "batch-size": 20, "num-server-rounds": 2, "dp": True,
              "dp-noise-multiplier": 0.5, "dp-batch-size": 40, "dp-step-size": 0.5, "dp-momentum": 0.5,
              "extractor-front-end": "scatternet", "output-dir": str(tmp_path / "out")}
    cfg = parse_run_config(config)
    x, _, x_test, _ = client_app.client_tensors(cfg, 0, 3, torch.device("cpu"))
    assert x.shape == (120, 81, 7, 7) and x_test.shape == (60, 81, 7, 7)
    run_fedpac(cast(Grid, InProcessGrid(config, 3, node_config={"state-dir": str(tmp_path / "sites")})),
                             cfg, 1)
    (run,) = [d for d in (tmp_path / "out").iterdir() if d.is_dir()]
    with open(run / "clients.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for server_round in ("1", "2"):
        trained = sorted(r["partition_id"] for r in rows if r["round"] == server_round and r["trained"] == "1")
        assert trained == ["0", "1", "2"]
    last = [float(r["accuracy"]) for r in rows if r["round"] == "2"]
    assert len(last) == 3 and min(last) > 0.5, last
