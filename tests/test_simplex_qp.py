"""The batched simplex-QP solver: projection, certification, hard cases."""

import numpy as np
import pytest

from common.methods.fedpac.simplex_qp import (
    KKT_TOLERANCE,
    MAX_ITERATIONS,
    MAX_SCALED_DIAGONAL,
    POLISH_AT,
    active_set_row,
    duality_gaps,
    polish_rows,
    problem_scale,
    project_rows_to_simplex,
    refine_support,
    solve_simplex_qps,
)


def _bisection_projection(y):
    lo, hi = y.min() - 1.0, y.max()
    for _ in range(200):
        tau = 0.5 * (lo + hi)
        if np.maximum(y - tau, 0).sum() > 1:
            lo = tau
        else:
            hi = tau
    return np.maximum(y - 0.5 * (lo + hi), 0)


def test_projection_matches_bisection_and_lands_on_the_simplex():
    rng = np.random.default_rng(0)
    y = rng.normal(size=(50, 17)) * rng.uniform(0.01, 10, size=(50, 1))
    x = project_rows_to_simplex(y)
    assert x.min() >= 0 and np.allclose(x.sum(axis=1), 1)
    for row_y, row_x in zip(y, x):
        np.testing.assert_allclose(row_x, _bisection_projection(row_y), atol=1e-10)
    np.testing.assert_allclose(project_rows_to_simplex(x), x, atol=1e-12)  # idempotent


def _problem(m, seed, rank=None):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(m, rank or 2 * m))
    gram = h @ h.T
    return gram + np.diag(rng.uniform(1e-4, 1e-2, m)), gram


@pytest.mark.parametrize("m,rank", [(1, None), (2, None), (7, None), (40, None), (40, 3), (150, 10)])
def test_solutions_are_certified_optimal(m, rank):
    q, b = _problem(m, seed=m, rank=rank)
    solution = solve_simplex_qps(q, b)
    assert solution.converged.all()
    assert solution.alpha.min() >= 0 and np.allclose(solution.alpha.sum(axis=1), 1)
    scale = np.abs(np.diag(q)).max()
    assert duality_gaps(solution.alpha, q, b).max() <= 1e-8 * scale


def test_degenerate_zero_problem_and_identical_rows():
    q = np.zeros((4, 4))
    solution = solve_simplex_qps(q, np.zeros((4, 4)))
    assert solution.converged.all() and np.allclose(solution.alpha.sum(axis=1), 1)
    ones = np.ones((5, 5))  # five identical clients, no variance term: any split is optimal
    solution = solve_simplex_qps(ones + 1e-3 * np.eye(5), ones)
    np.testing.assert_allclose(solution.alpha, 0.2, atol=1e-6)


def test_active_set_reaches_the_optimum_from_a_poor_start():
    q, b = _problem(30, seed=3, rank=4)
    reference = solve_simplex_qps(q, b).alpha
    for row in range(0, 30, 7):
        start = np.zeros(30)
        start[(row + 1) % 30] = 1.0  # a vertex far from the answer
        polished = active_set_row(q / np.abs(np.diag(q)).max(), b[row] / np.abs(np.diag(q)).max(), start)
        assert polished is not None
        np.testing.assert_allclose(polished, reference[row], atol=1e-6)


def test_entries_past_half_the_float64_range_are_solved():
    # q + q.T overflows to Inf here; a variance term V_j / n_j this large is a valid reply
    q = np.diag([1.0, 1.0, 1.7e308, 1.7e308])
    solution = solve_simplex_qps(q, np.zeros((2, 4)))
    assert solution.converged.all()
    np.testing.assert_allclose(solution.alpha, [[0.5, 0.5, 0.0, 0.0]] * 2, atol=1e-6)


def test_problem_scale_is_a_typical_diagonal_entry_bounded_against_overflow():
    assert problem_scale(np.array([1.0, 2.0, 3.0, 1e12])) == 2.5  # the median: one outlier does not set it
    assert problem_scale(np.array([1.0, 1.0, 1e300])) == 1e300 / MAX_SCALED_DIAGONAL
    assert problem_scale(np.zeros(4)) == 1.0
    assert problem_scale(np.array([-4.0, 4.0, 4.0])) == 4.0


def test_a_client_far_off_the_others_scale_does_not_stall_their_rows():
    """One client with h 1e3 times the others' sets the step size of every gradient step (1 / the
    largest eigenvalue): on the whole problem the others' rows ran to MAX_ITERATIONS. Left out of
    the steps and certified after, they converge as usual, to the whole problem's optimum."""
    rng = np.random.default_rng(0)
    m = 150
    h = rng.normal(size=(5, 40))[np.arange(m) % 5] + 0.05 * rng.normal(size=(m, 40))
    h[-1] *= 1e3
    gram = h @ h.T
    q = gram + np.diag(rng.uniform(0.01, 0.05, m))
    solution = solve_simplex_qps(q, gram)
    assert solution.converged.all() and solution.iterations < MAX_ITERATIONS
    assert solution.alpha.min() >= 0 and np.allclose(solution.alpha.sum(axis=1), 1)
    row_scale = np.maximum(problem_scale(np.diag(q)), np.diag(q))  # the far row's entries are its own
    assert (duality_gaps(solution.alpha, q, gram) <= 1e-8 * row_scale).all()
    assert solution.alpha[:-1, -1].max() < 1e-3  # nobody else gives it a weight sparsify keeps


def test_polish_does_not_certify_a_support_missing_a_client_the_kkt_conditions_ask_for():
    """q = I makes each row the projection of b onto the simplex: from the vertex (1, 0) the
    multiplier of client 1's bound is 2 (q alpha - b)_1 - nu = 1.6 - 2 < 0, so the vertex is not
    optimal and the polish must move to (0.9, 0.1) before it certifies the row."""
    polished, certified = polish_rows(np.eye(2), np.array([[0.0, -0.8]]), np.array([[1.0, 0.0]]))
    assert certified.all()
    np.testing.assert_allclose(polished, [[0.9, 0.1]], atol=1e-12)


def test_refine_support_drops_a_negative_entry_and_solves_again():
    """On the face {0, 1} the equality-constrained optimum puts -0.25 on client 1; dropping it
    leaves the vertex (1, 0), which the KKT conditions certify (its multiplier is 1 > 0)."""
    refined = refine_support(np.eye(2), np.array([0.5, -1.0]), np.array([0, 1]))
    assert refined is not None
    np.testing.assert_allclose(refined, [1.0, 0.0], atol=1e-12)


def test_active_set_frees_a_bound_whose_multiplier_is_just_past_the_tolerance():
    """Below |nu| = 1 the dual check is absolute: a multiplier of -1.5 KKT_TOLERANCE is a real
    descent direction. With curvature 0.2 along it the optimum moves 3.75 KKT_TOLERANCE off the
    vertex, more than the step tolerance, so the vertex is not the answer."""
    q = 0.1 * np.eye(2)
    b = np.array([0.0, -0.1 + 0.75 * KKT_TOLERANCE])  # multiplier of bound 1 at (1, 0): -1.5 KKT_TOLERANCE
    x = active_set_row(q, b, np.array([1.0, 0.0]))
    assert x is not None
    np.testing.assert_allclose(x, [1.0 - 3.75 * KKT_TOLERANCE, 3.75 * KKT_TOLERANCE], rtol=1e-6, atol=0)


def test_rows_the_polish_cannot_certify_after_leaving_out_a_far_client_are_solved_on_the_whole_problem(
        monkeypatch):
    """The polish on the whole problem is the only certificate of the rows solved without the far
    client; rows it fails go to the gradient steps on the whole problem, and come back certified."""
    import common.methods.fedpac.simplex_qp as simplex_qp

    rng = np.random.default_rng(4)
    m = 12
    h = rng.normal(size=(m, 6))
    h[-1] *= 1e3
    gram = h @ h.T
    q = gram + np.diag(rng.uniform(0.01, 0.05, m))
    real_polish, failed = simplex_qp.polish_rows, []

    def first_whole_polish_fails(q_scaled, b, alpha):
        if len(q_scaled) == m and not failed:  # the polish of _solve_without_far: certify nothing
            failed.append(True)
            return alpha.copy(), np.zeros(len(b), dtype=bool)
        return real_polish(q_scaled, b, alpha)

    monkeypatch.setattr(simplex_qp, "polish_rows", first_whole_polish_fails)
    solution = solve_simplex_qps(q, gram)
    assert failed  # the far client was left out and its polish refused every row
    assert solution.converged.all()
    row_scale = np.maximum(problem_scale(np.diag(q)), np.diag(q))
    assert (duality_gaps(solution.alpha, q, gram) <= 1e-8 * row_scale).all()


def test_refine_support_adds_the_worst_violators_first():
    """q = I: the optimum is the projection of b onto the simplex, on clients 0-2. From the vertex
    e_0 all 62 others violate the KKT conditions, 60 of them weakly; adding the strongest few at a
    time reaches the optimum in a few solves, the weakest first only cycle through the weak ones."""
    b = np.concatenate([[1.0, 0.9, 0.8], np.linspace(0.05, 0.3, 60)])
    refined = refine_support(np.eye(len(b)), b, np.array([0]))
    assert refined is not None
    np.testing.assert_allclose(refined, project_rows_to_simplex(b[None])[0], atol=1e-12)


def test_rows_with_a_support_under_half_the_clients_are_polished_early():
    """The polish waits for a sparse iterate, one on at most half the clients (and at least 64):
    here the 80 rows of one group of 210 clients sit on 81-96 clients at the first polish
    (iteration 25), where it certifies them all; with a tighter gate they wait for ~2000
    gradient steps."""
    rng = np.random.default_rng(0)
    m, group = 210, 80
    h = rng.normal(size=(m, 40))
    h[:group] = rng.normal(size=40) + 0.05 * rng.normal(size=(group, 40))
    gram = h @ h.T
    q = gram + np.diag(rng.uniform(0.5, 1.5, m))
    solution = solve_simplex_qps(q, gram[:group])
    assert solution.converged.all()
    assert solution.iterations <= POLISH_AT[1]
    assert duality_gaps(solution.alpha, q, gram[:group]).max() <= 1e-8 * problem_scale(np.diag(q))


def test_a_kkt_step_that_only_grows_the_iterate_does_not_crash_the_active_set_method():
    """Past ~1e12 between diagonal entries the KKT solve on a face misses sum = 1 by more than
    the step tolerance: the step is then non-negative everywhere, with no bound to block it. The
    method must take it (or give up with None, leaving the row to the caller's fallback), never
    reduce over an empty set of blocking bounds. The optimum here is the vertex e_1 (b = Q[1])."""
    q = np.array([[1.0, 1e5], [1e5, 1e12]])
    x = active_set_row(q, q[1], np.array([1.0, 0.0]))
    assert x is None or np.allclose(x, [0.0, 1.0], atol=1e-9)


def test_a_client_ten_million_times_the_others_scale_is_solved_and_certified():
    """A client whose h is 1e7 times the others' (diagonal 1e14 times): its row reaches the
    active-set method on a face the KKT solve cannot hit exactly (the test above)."""
    rng = np.random.default_rng(14)
    h = rng.normal(size=(5, 4))
    h[-1] *= 1e7
    gram = h @ h.T
    q = gram + np.diag(rng.uniform(0.01, 0.05, 5))
    solution = solve_simplex_qps(q, gram)
    assert solution.converged.all()
    assert solution.alpha.min() >= 0 and np.allclose(solution.alpha.sum(axis=1), 1)
    row_scale = np.maximum(problem_scale(np.diag(q)), np.diag(q))
    assert (duality_gaps(solution.alpha, q, gram) <= 1e-8 * row_scale).all()
