"""The batched simplex-QP solver: projection, certification, hard cases."""

import numpy as np
import pytest

from common.simplex_qp import (
    MAX_ITERATIONS,
    MAX_SCALED_DIAGONAL,
    active_set_row,
    duality_gaps,
    problem_scale,
    project_rows_to_simplex,
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
