"""The server benchmark compares like with like: its naive reference computes the same round."""

import importlib.util
from pathlib import Path

import numpy as np

from common.aggregation import aggregate_round
from common.collaboration import collaboration_matrix_direct, qp_objective

# loaded by path: bench/ is not a package, and putting it on sys.path would shadow test helpers
_spec = importlib.util.spec_from_file_location(
    "bench_server_aggregation", Path(__file__).resolve().parents[1] / "bench" / "server_aggregation.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
naive_round, synthetic_round = bench.naive_round, bench.synthetic_round


def test_naive_reference_and_aggregate_round_agree():
    data = synthetic_round(6, 10, "clustered", seed=1)
    ours = aggregate_round(**data, alpha_threshold=0.0)
    extractor, centroids, alpha, heads = naive_round(data, threshold=0.0)
    for key, value in extractor.items():
        np.testing.assert_allclose(ours.extractor[key], value, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours.centroids, centroids, rtol=1e-5, atol=1e-6)
    for i in range(6):
        p = collaboration_matrix_direct(data["h"], data["v"], data["num_examples"], i)
        assert qp_objective(p, ours.collaboration.alpha[i]) <= qp_objective(p, alpha[i]) * (1 + 1e-6) + 1e-12
    for key in heads[0]:
        np.testing.assert_allclose(
            np.stack([h[key] for h in ours.heads]), np.stack([h[key] for h in heads]), atol=5e-3
        )
