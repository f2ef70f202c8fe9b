"""The collaboration QP: P_i from the Gram identity, solutions against brute force."""

import itertools

import numpy as np
import pytest

from common import protocol
from common.config import FedPACConfig
from common.methods import METHODS
from common.methods.server import Update, server_part

from common.methods.fedpac.collaboration import (
    collaboration_matrix,
    collaboration_matrix_direct,
    collaboration_weights,
    PrivateStatistics,
    credible_inflation,
    credible_noise,
    debiased_gram,
    mix_heads,
    qp_objective,
    solve_simplex_qp,
    sparsify,
    gram_matrix,
    variance_terms,
)

SOLVERS = ["vectorized", "cvxpy"]


def collaboration_matrices(h, v, n):
    gram, variance = gram_matrix(h), variance_terms(v, n)
    return [collaboration_matrix(gram, variance, i) for i in range(len(h))]


def _stats(m, k=3, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(m, k, d)), rng.uniform(0.5, 2.0, m), rng.integers(50, 600, m).astype(float)


def _simplex_grid(m, steps):
    """Every point of the simplex with coordinates in multiples of 1/steps."""
    for combo in itertools.product(range(steps + 1), repeat=m - 1):
        if sum(combo) <= steps:
            yield np.array([*combo, steps - sum(combo)], dtype=float) / steps


def _brute_force(p, steps):
    return min(_simplex_grid(len(p), steps), key=lambda a: qp_objective(p, a))


@pytest.mark.parametrize("m", [2, 3, 5])
def test_gram_identity_equals_direct_definition(m):
    h, v, n = _stats(m)
    matrices = collaboration_matrices(h, v, n)
    for i in range(m):
        np.testing.assert_allclose(matrices[i], collaboration_matrix_direct(h, v, n, i), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(matrices[i], matrices[i].T, atol=1e-12)
        assert np.linalg.eigvalsh(matrices[i]).min() > -1e-9  # PSD up to rounding


@pytest.mark.parametrize("m,seed", [(2, 0), (2, 1), (3, 2), (3, 3), (4, 4)])
def test_qp_matches_brute_force(m, seed):
    h, v, n = _stats(m, seed=seed)
    steps = {2: 2000, 3: 300, 4: 60}[m]
    for i, p in enumerate(collaboration_matrices(h, v, n)):
        alpha = solve_simplex_qp(p)
        assert alpha.min() >= -1e-8 and alpha.sum() == pytest.approx(1.0, abs=1e-8)
        best = _brute_force(p, steps)
        # the solver is at least as good as the finest grid point, and close to it
        assert qp_objective(p, alpha) <= qp_objective(p, best) + 1e-9
        np.testing.assert_allclose(alpha, best, atol=2.0 / steps + 1e-3, err_msg=f"row {i}")


@pytest.mark.parametrize("solver", SOLVERS)
def test_identical_clients_weight_by_n_over_v(solver):
    # with identical h the cross terms vanish: minimize sum alpha_j^2 V_j / n_j -> alpha ~ n / V
    m = 4
    h = np.repeat(np.random.default_rng(1).normal(size=(1, 3, 4)), m, axis=0)
    v = np.array([1.0, 2.0, 1.0, 4.0])
    n = np.array([100.0, 100.0, 300.0, 200.0])
    expected = (n / v) / (n / v).sum()
    result = collaboration_weights(h, v, n, threshold=0.0, solver=solver)
    for row, status in zip(result.alpha, result.status):
        assert status == ("optimal" if solver == "vectorized" else "cvxpy")
        np.testing.assert_allclose(row, expected, atol=1e-6)


@pytest.mark.parametrize("solver", SOLVERS)
def test_single_client_keeps_its_own_head(solver):
    h, v, n = _stats(1)
    result = collaboration_weights(h, v, n, solver=solver)
    np.testing.assert_array_equal(result.alpha, [[1.0]])


@pytest.mark.parametrize("solver", SOLVERS)
def test_client_with_an_empty_class(solver):
    h, v, n = _stats(3, seed=5)
    h[1, 2] = 0.0  # client 1 has no sample of class 2: p_1,2 = 0 so that row of h_1 is zero
    result = collaboration_weights(h, v, n, threshold=0.0, solver=solver)
    np.testing.assert_allclose(result.alpha.sum(axis=1), 1.0, atol=1e-9)
    for i, p in enumerate(collaboration_matrices(h, v, n)):
        assert qp_objective(p, result.alpha[i]) <= qp_objective(p, _brute_force(p, 300)) + 1e-9


def test_slightly_indefinite_p_from_float_noise_is_solved():
    h, v, n = _stats(3, seed=6)
    p = collaboration_matrices(h, v, n)[0]
    eigenvalues, vectors = np.linalg.eigh(p)
    eigenvalues[0] = -1e-9 * eigenvalues.max()  # what cancellation can leave behind
    noisy = vectors @ np.diag(eigenvalues) @ vectors.T
    noisy[0, 1] += 1e-13  # and a touch of asymmetry
    assert np.linalg.eigvalsh(0.5 * (noisy + noisy.T)).min() < 0
    alpha = solve_simplex_qp(noisy)
    assert alpha.min() >= -1e-8 and alpha.sum() == pytest.approx(1.0, abs=1e-8)
    tolerance = 1e-8 * np.abs(noisy).max()  # the solver works on P scaled to unit diagonal
    assert qp_objective(noisy, alpha) <= qp_objective(noisy, _brute_force(noisy, 300)) + tolerance


@pytest.mark.parametrize("solver", SOLVERS)
def test_tiny_and_huge_scales_give_the_same_weights(solver):
    h, v, n = _stats(3, seed=7)
    base = collaboration_weights(h, v, n, threshold=0.0, solver=solver).alpha
    for scale in (1e-6, 1e6):
        scaled = collaboration_weights(h * scale, v * scale**2, n, threshold=0.0, solver=solver).alpha
        np.testing.assert_allclose(scaled, base, atol=1e-5)


@pytest.mark.parametrize("solver", SOLVERS)
def test_failed_solve_falls_back_to_own_head_and_logs(caplog, solver):
    h, v, n = _stats(3, seed=8)
    v[1] = np.nan  # poisons every P_i (V_1 / n_1 sits on each diagonal)
    result = collaboration_weights(h, v, n, solver=solver)
    np.testing.assert_array_equal(result.alpha, np.eye(3))
    assert all(status.startswith("fallback") for status in result.status)
    assert "keeps its own head" in caplog.text


def test_sparsify_drops_small_weights_and_renormalizes():
    alpha = sparsify(np.array([0.6995, 0.3, 0.0005, -1e-9]), threshold=1e-3)
    np.testing.assert_allclose(alpha, np.array([0.6995, 0.3, 0, 0]) / 0.9995)


def test_mix_heads_combines_weight_and_bias_per_row():
    heads = [
        {"head.weight": np.full((2, 3), float(j), dtype=np.float32),
         "head.bias": np.full(2, 10.0 * j, dtype=np.float32)}
        for j in range(3)
    ]
    alpha = np.array([[1.0, 0, 0], [0.25, 0.25, 0.5]])
    mixed = mix_heads(heads, alpha)
    np.testing.assert_allclose(mixed[0]["head.weight"], 0.0)
    np.testing.assert_allclose(mixed[1]["head.weight"], 0.25 * 0 + 0.25 * 1 + 0.5 * 2)
    np.testing.assert_allclose(mixed[1]["head.bias"], 0.25 * 10 + 0.5 * 20)
    assert mixed[1]["head.weight"].dtype == np.float32


def _clustered(m, k=10, d=32, groups=5, noise=0.05, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(groups, k, d))
    h = centers[np.arange(m) % groups] + noise * rng.normal(size=(m, k, d))
    return h, rng.uniform(20, 40, m), np.full(m, 600.0)


@pytest.mark.parametrize("kind,m", [("random", 8), ("random", 60), ("clustered", 10), ("clustered", 60)])
def test_vectorized_solver_matches_cvxpy(kind, m):
    h, v, n = _stats(m, k=10, d=32, seed=m) if kind == "random" else _clustered(m)
    fast = collaboration_weights(h, v, n, threshold=0.0, solver="vectorized")
    reference = collaboration_weights(h, v, n, threshold=0.0, solver="cvxpy")
    assert fast.status == ["optimal"] * m
    for i, p in enumerate(collaboration_matrices(h, v, n)):
        ours, theirs = qp_objective(p, fast.alpha[i]), qp_objective(p, reference.alpha[i])
        assert ours <= theirs + 1e-6 * abs(theirs)  # the goal: within 1e-6 of cvxpy
    if kind == "clustered":  # weight stays inside the group
        groups = np.arange(m) % 5
        same = groups[:, None] == groups[None, :]
        assert (fast.alpha * same).sum(axis=1).min() > 0.99


def test_vectorized_rows_it_cannot_certify_go_to_cvxpy(monkeypatch):
    import common.methods.fedpac.collaboration as collaboration
    from common.methods.fedpac.simplex_qp import BatchSolution

    h, v, n = _stats(4, seed=9)
    monkeypatch.setattr(
        collaboration, "solve_simplex_qps",
        lambda q, b: BatchSolution(alpha=np.full((4, 4), 0.25), converged=np.array([1, 0, 1, 1], bool), iterations=1),
    )
    result = collaboration_weights(h, v, n, threshold=0.0)
    assert result.status == ["optimal", "cvxpy", "optimal", "optimal"]
    expected = collaboration_weights(h, v, n, threshold=0.0, solver="cvxpy").alpha[1]
    np.testing.assert_allclose(result.alpha[1], expected, atol=1e-6)


@pytest.mark.parametrize(("states", "expected"), [
    ({"own": "R", "other": "S"}, None),  # only this process runs (its BLAS threads spin): all cores
    ({"own": "S", "other": "R"}, 1),  # another process wants a core: one thread
    ({"own": "R", "other": "D"}, None),
])
def test_numerics_use_one_thread_while_another_process_runs_and_all_cores_alone(monkeypatch, states, expected):
    """The thread choice behind the collaboration QPs (common.cpu), on a /proc built here: on a
    real machine other processes' states change while the test looks."""
    import io
    import os

    import common.methods.fedpac.collaboration as collaboration
    import common.cpu as cpu

    own = str(os.getpid())
    tasks = {f"/proc/{own}/task/{own}/stat": states["own"], "/proc/4242/task/4243/stat": states["other"]}
    monkeypatch.setattr(cpu.glob, "glob", lambda pattern: list(tasks))
    monkeypatch.setattr(cpu, "open", lambda path, **_: io.StringIO(f"4243 (py thon) {tasks[path]} 1 1"), raising=False)
    monkeypatch.setattr(collaboration, "SOLVER_BLAS_THREADS", None)
    assert cpu.others_running() is (expected == 1)
    assert collaboration.solver_blas_threads(1000) == expected
    assert collaboration.solver_blas_threads(20) == 1  # small problems: one thread always


def test_a_vectorized_solver_that_raises_falls_back_to_cvxpy_for_every_row(monkeypatch):
    import common.methods.fedpac.collaboration as collaboration

    def broken(q, b):
        raise RuntimeError("anything at all")

    h, v, n = _stats(4, seed=9)
    monkeypatch.setattr(collaboration, "solve_simplex_qps", broken)
    result = collaboration_weights(h, v, n, threshold=0.0)
    assert result.status == ["cvxpy"] * 4
    expected = collaboration_weights(h, v, n, threshold=0.0, solver="cvxpy").alpha
    np.testing.assert_allclose(result.alpha, expected, atol=1e-6)


@pytest.mark.parametrize("solver", SOLVERS)
def test_variance_terms_past_half_the_float64_range_are_solved(solver):
    """V_j / n_j of 1.7e308 (a finite V, n = 1): P + P^T, and the sum of P's diagonal, overflow
    to Inf; the clients with such a term are only left out of the others' mixes."""
    h, v, n = _stats(5)
    v[3:], n[3:] = 1.7e308, 1.0
    result = collaboration_weights(h, v, n, solver=solver)
    assert not [s for s in result.status if s.startswith("fallback")]
    np.testing.assert_allclose(result.alpha.sum(axis=1), 1.0)
    assert (result.alpha[:, 3:] == 0).all()  # nobody takes the infinitely noisy heads, not even their own
    assert result.far_off == [3, 4]


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("factor", [1e3, 1e6, 1e9])
def test_a_client_far_off_everyone_elses_scale_leaves_their_weights_alone(solver, factor):
    """Two clients whose h is 1e3-1e9 times the others' (diverged, or malicious): nobody else
    mixes their heads, and everybody else's weights stay within 1e-3 of those without them. Scaling the problem
    by its largest entry made the others' rows come out near uniform (a 20 % share of the own
    label group where it is 100 %)."""
    h, v, n = _clustered(20)
    honest = collaboration_weights(h[:18], v[:18], n[:18], solver=solver)
    alone = honest.alpha
    h[18:] *= factor
    result = collaboration_weights(h, v, n, solver=solver)
    assert honest.far_off == [] and result.far_off == [18, 19]  # named, for the server's log
    assert not [s for s in result.status[:18] if s.startswith("fallback")]
    assert (result.alpha[:18, 18:] == 0).all()
    np.testing.assert_allclose(result.alpha[:18, :18], alone, atol=1e-3)


def test_most_clients_at_zero_leave_the_others_rows_solved():
    """Three of five clients with h = 0 and no variance: the median diagonal is 0, and scaling
    by a tiny fraction of the largest entry instead made the KKT solves inexact (rows 3 and 4
    certified 11 % and 25 % above their optimum)."""
    h = np.zeros((5, 1, 3))
    h[3, 0], h[4, 0] = [1.0, 2.0, 3.0], [1.0, 2.0, 2.9]
    v, n = np.array([0.0, 0.0, 0.0, 1e-3, 1e-3]), np.ones(5)
    fast = collaboration_weights(h, v, n, threshold=0.0, solver="vectorized")
    reference = collaboration_weights(h, v, n, threshold=0.0, solver="cvxpy").alpha
    assert fast.status == ["optimal"] * 5
    for i, p in enumerate(collaboration_matrices(h, v, n)):
        assert qp_objective(p, fast.alpha[i]) <= qp_objective(p, reference[i]) * (1 + 1e-6)


def test_sparsify_keeps_the_largest_weight_when_all_fall_under_the_threshold():
    # the largest sits away from index 0: a one-hot at the wrong client would hand it someone else's head
    alpha = sparsify(np.array([0.2, 0.1, 0.45, 0.25]), threshold=0.5)
    np.testing.assert_array_equal(alpha, [0.0, 0.0, 1.0, 0.0])


def test_a_failing_vectorized_solver_is_logged_with_its_exception_type(monkeypatch, caplog):
    """The operator reads which error it was: the message alone ("singular matrix", "") often
    does not say."""
    import common.methods.fedpac.collaboration as collaboration

    def broken(q, b):
        raise FloatingPointError("")

    h, v, n = _stats(3, seed=10)
    monkeypatch.setattr(collaboration, "solve_simplex_qps", broken)
    collaboration_weights(h, v, n)
    assert "FloatingPointError" in caplog.text


def test_an_overflowed_diagonal_entry_counts_as_far_off():
    """A client whose ||h||^2 + V/n overflowed to inf is named among the far-off ones (logged by
    the strategy), whatever the finite entries say."""
    from common.methods.fedpac.collaboration import _far_off_rows  # pylint: disable=import-outside-toplevel

    assert _far_off_rows(np.array([1.0, np.inf, 1.2, 0.9])) == [1]
    assert _far_off_rows(np.array([np.inf, np.inf])) == [0, 1]
    assert _far_off_rows(np.array([1.0, 1.1, 0.9])) == []


# --- DP: the noise in the clients' h taken off the QPs' distances ---------------------------------


def _noisy_pairs(noise_std=0.03, seed=0):
    """Ten clients in five pairs with the same label mix (FedPAC's partition), 10 classes x 128
    features as on Fashion-MNIST; h_j plus Gaussian noise of ``noise_std`` per entry, as a site
    running DP uploads it (at epsilon 3 the noise is about 0.03 an entry, 1.2 in ||e||^2)."""
    rng = np.random.default_rng(seed)
    groups = rng.normal(scale=0.08, size=(5, 10, 128))  # ||h||^2 ~ 8, pairs ~16 apart
    h = np.repeat(groups, 2, axis=0) + rng.normal(scale=0.002, size=(10, 10, 128))
    noisy = h + rng.normal(scale=noise_std, size=h.shape)
    v, n = np.full(10, 600.0), np.full(10, 6000.0)  # V / n = 0.1
    return h, noisy, v, n, np.full(10, 10 * 128 * noise_std**2)


def _private(noise, n, inflation=None, entries=10 * 128):
    """The DP reports of ``len(noise)`` sites with every class present (10 x 128 noisy entries)."""
    m = len(noise)
    return PrivateStatistics(h_noise=np.asarray(noise, dtype=float), entries=np.full(m, entries),
                             records=np.asarray(n, dtype=float),
                             v_inflation=np.ones(m) if inflation is None else np.asarray(inflation, dtype=float))


def _mate_weight(alpha):
    """The mean weight a client gives its pair-mate (clients 2g and 2g + 1)."""
    return float(np.mean([alpha[i, i ^ 1] for i in range(len(alpha))]))


@pytest.mark.parametrize("solver", SOLVERS)
def test_taking_the_reported_noise_off_the_distances_brings_back_the_noiseless_mix(solver):
    """Noise in h makes every other client look s_i^2 + s_j^2 further away: the QPs then keep
    each client's own head. With the noise taken off, pair-mates mix again as they do without
    noise, and nobody mixes a client of another pair."""
    h, noisy, v, n, noise = _noisy_pairs()
    exact = collaboration_weights(h, v, n, solver=solver).alpha
    blind = collaboration_weights(noisy, v, n, solver=solver).alpha
    debiased = collaboration_weights(noisy, v, n, solver=solver, private=_private(noise, n)).alpha
    assert _mate_weight(exact) > 0.4
    assert _mate_weight(blind) < 0.1
    assert _mate_weight(debiased) > 0.3
    others = debiased.copy()
    for i in range(10):
        others[i, i] = others[i, i ^ 1] = 0.0
    assert others.max() < 0.05


def test_the_debiased_gram_matrix_is_psd_and_unbiased():
    h, noisy, _, _, noise = _noisy_pairs()
    fixed = debiased_gram(gram_matrix(noisy), noise)
    assert np.linalg.eigvalsh(fixed).min() > -1e-9
    exact = gram_matrix(h)
    bias = np.diag(gram_matrix(noisy) - exact).mean()  # ~ s^2 = 1.15
    assert abs(np.mean(np.diag(fixed) - np.diag(exact))) < 0.1 * bias


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("factor", [1.5, 3.0, 1e3])
def test_a_site_over_reporting_its_noise_moves_no_ones_mix(solver, factor):
    """The attack: a hostile site claims more noise in its h than it added, so that the server
    takes more off its distance to everyone and they mix more of its head. Its claim is believed
    up to what a typical site's report makes credible at its n, and no further: every row comes
    out as it does when the site tells the truth. Believed in full, the claim moves the rows."""
    _, noisy, v, n, noise = _noisy_pairs()
    hostile = 3
    lie = noise.copy()
    lie[hostile] *= factor
    honest = collaboration_weights(noisy, v, n, solver=solver, private=_private(noise, n)).alpha
    lied = collaboration_weights(noisy, v, n, solver=solver, private=_private(lie, n)).alpha
    np.testing.assert_allclose(lied, honest, atol=1e-6)
    believed = debiased_gram(gram_matrix(noisy), lie)
    credulous = [sparsify(solve_simplex_qp(collaboration_matrix(believed, variance_terms(v, n), i)), 1e-3)
                 for i in range(10)]
    assert np.abs(np.array(credulous) - honest).max() > 0.01


def test_credible_noise_scales_with_each_sites_n_and_entries_and_caps_only_the_outlier():
    n = np.array([1000.0, 2000.0, 4000.0, 1000.0, 2000.0])
    entries = np.array([1280, 1280, 1152, 1280, 896])  # 10, 10, 9, 10 and 7 classes present
    truth = entries * (50.0 / n) ** 2  # one noise std of the sums at every site
    np.testing.assert_allclose(credible_noise(_private(truth, n, entries=entries)), truth)
    lie = truth.copy()
    lie[2] = 1e6
    np.testing.assert_allclose(credible_noise(_private(lie, n, entries=entries)), truth)
    less = truth.copy()
    less[0] = 0.0  # a site without DP: nothing taken off
    assert credible_noise(_private(less, n, entries=entries))[0] == 0.0
    huge = truth.copy()
    huge[1] = 1e308  # its bound overflows: capped all the same, with no NaN
    assert np.isfinite(credible_noise(_private(huge, n, entries=entries))).all()


@pytest.mark.parametrize("solver", SOLVERS)
def test_heads_inflated_by_dp_sgd_mix_with_their_pair_as_without_noise(solver):
    """A head trained with DP-SGD is as good as one trained on fewer records: with the variance
    term inflated by each site's reported factor, pair-mates share their heads about evenly
    again (the noiseless statistics' mix), where with V / n alone each keeps most of its own."""
    h, noisy, v, n, noise = _noisy_pairs()
    v = v / 20  # V / n = 0.005, as small against the debiased distances' noise as on Fashion-MNIST
    plain = collaboration_weights(noisy, v, n, solver=solver, private=_private(noise, n)).alpha
    inflated = collaboration_weights(noisy, v, n, solver=solver, private=_private(noise, n, np.full(10, 18.0))).alpha
    assert _mate_weight(plain) < 0.2
    assert _mate_weight(inflated) > 0.3
    assert _mate_weight(inflated) > _mate_weight(plain) + 0.15


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("claim", [1.0, 6.0])
def test_a_site_claiming_less_dp_noise_than_the_others_moves_no_ones_mix(solver, claim):
    """The attack: a hostile site claims its head is less noisy than the others' (a smaller
    inflation), so that its variance term shrinks and the others mix more of its head. It is
    believed no further than the median site: every row comes out as with the truth. Believed,
    the claim moves the rows."""
    _, noisy, v, n, noise = _noisy_pairs()
    v = v / 20
    honest_inflation = np.full(10, 18.0)
    lie = honest_inflation.copy()
    lie[3] = claim
    honest = collaboration_weights(noisy, v, n, solver=solver, private=_private(noise, n, honest_inflation)).alpha
    lied = collaboration_weights(noisy, v, n, solver=solver, private=_private(noise, n, lie)).alpha
    np.testing.assert_allclose(lied, honest, atol=1e-6)
    gram, variance = debiased_gram(gram_matrix(noisy), noise), variance_terms(v, n) * lie
    credulous = np.array([sparsify(solve_simplex_qp(collaboration_matrix(gram, variance, i)), 1e-3) for i in range(10)])
    assert credulous[2, 3] > honest[2, 3] + 0.05  # its pair-mate takes more of the hostile head


def test_credible_inflation_raises_only_claims_below_the_median():
    np.testing.assert_allclose(credible_inflation(np.array([18.0, 18.0, 1.0, 40.0, 18.0])), [18, 18, 18, 40, 18])
    np.testing.assert_allclose(credible_inflation(np.ones(4)), np.ones(4))


@pytest.mark.parametrize("solver", SOLVERS)
def test_one_of_two_sites_cannot_move_the_bound_on_its_reports(solver):
    """With two sites the median of their reports is the mean, which one of them sets alone: the
    bounds take the lower median, the smaller of the two. A hostile site reporting huge noise in
    its h, or a huge inflation for the other's sake, leaves both rows as with the truth."""
    _, noisy, v, n, noise = _noisy_pairs()
    pair, v2, n2 = noisy[:2], v[:2] / 20, n[:2]
    honest = collaboration_weights(pair, v2, n2, solver=solver, private=_private(noise[:2], n2, [18.0, 18.0])).alpha
    for lie_noise, lie_inflation in (([noise[0] * 1e3, noise[1]], [18.0, 18.0]), (noise[:2], [1e12, 18.0])):
        lied = collaboration_weights(pair, v2, n2, solver=solver,
                                     private=_private(lie_noise, n2, lie_inflation)).alpha
        assert lied[1, 0] <= honest[1, 0] + 1e-6  # the honest site takes no more of the hostile head
    np.testing.assert_allclose(credible_inflation(np.array([1e12, 18.0])), [1e12, 18.0])


def test_the_server_bounds_each_sites_noise_by_its_own_records_and_classes():
    """The server's reports record: each site's true n (not its capped aggregation weight) and
    the entries of its h that carry noise, d for every class with a count above 0."""
    head = {protocol.HEAD_WEIGHT: np.zeros((3, 4), np.float32), protocol.HEAD_BIAS: np.zeros(3, np.float32)}
    server = server_part(METHODS["fedpac"], FedPACConfig(), {}, head)
    counts = [np.array([3.0, 0.0, 5.0]), np.array([1.0, 1.0, 1.0])]
    updates = [Update(partition_id=i, num_examples=float(c.sum()) * 100, extractor={}, head={}, statistics={},
                      metrics={}, parsed={"h_noise": 0.5, "v_inflation": 2.0, "class_counts": c})
               for i, c in enumerate(counts)]
    private = server.private_statistics(updates)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(private.entries, [8, 12])
    np.testing.assert_array_equal(private.records, [800.0, 300.0])
