"""All of a round's collaboration QPs solved together, in numpy.

On the simplex (sum alpha = 1) client i's objective alpha^T P_i alpha equals

    f_i(alpha) = alpha^T Q alpha - 2 b_i^T alpha + G_ii,   Q = G + diag(V / n),  b_i = G[i]

with G = H H^T the Gram matrix of the flattened h's. Q is the *same* for every client; only the
linear term differs. So one matrix product per iteration advances all m problems:

1. accelerated projected gradient (FISTA with adaptive restart) on all rows at once, with the
   Frank-Wolfe duality gap as the stopping rule;
2. a *polish* per row: on the support the iterate has found, solve the equality-constrained
   KKT system exactly and certify optimality (primal and dual feasibility); a few active-set
   corrections fix a support that is off by a few clients.

A row that is neither certified nor within the gap tolerance is reported as not converged, and
the caller falls back to cvxpy for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Tolerances on the problem scaled to unit median diagonal (relative to a typical ||h||^2).
GAP_TOLERANCE = 1e-10
KKT_TOLERANCE = 1e-9
SUPPORT_EPS = 1e-6
MAX_ITERATIONS = 3000
POLISH_AT = (25, 50, 100, 200, 400, 800, 1600)
MAX_ACTIVE_SET_STEPS = 1000
FAST_REFINEMENT_STEPS = 20
MIN_POLISH_SUPPORT = 64
# The median gives way to (largest diagonal entry) / this: Clarabel (the cvxpy fallback) fails
# on a problem whose scaled entries span much more (1e50 failed on a V_j / n_j of 1.7e308, a
# valid reply). Past it the other clients' rows are no longer solved as if the far one were
# absent.
MAX_SCALED_DIAGONAL = 1e30
# A client whose diagonal is this many times the median (its ||h|| 100 times a typical
# client's) sits out the gradient steps: see _solve_without_far.
FAR_DIAGONAL = 1e4


@dataclass(frozen=True)
class BatchSolution:
    alpha: np.ndarray  # (r, m): one row on the simplex per row of b
    converged: np.ndarray  # (r,) bool: certified by KKT or by the duality gap
    iterations: int


def project_rows_to_simplex(y: np.ndarray) -> np.ndarray:
    """Euclidean projection of every row onto the probability simplex (sort-based, exact)."""
    m = y.shape[1]
    u = -np.sort(-y, axis=1)
    cumulative = np.cumsum(u, axis=1) - 1.0
    positive = u - cumulative / np.arange(1, m + 1) > 0
    rho = m - np.argmax(positive[:, ::-1], axis=1)  # number of positive entries
    theta = cumulative[np.arange(len(y)), rho - 1] / rho
    return np.maximum(y - theta[:, None], 0.0)


def problem_scale(diagonal: np.ndarray) -> float:
    """What a collaboration QP is divided by (its argmin is scale-invariant): the median
    |diagonal|, a typical client's ||h||^2 + V / n. Not the max: one client whose statistics are
    orders of magnitude off the others' (diverged or malicious) would shrink everyone else's
    problem under the solvers' tolerances, and every other row would come out near uniform."""
    diagonal = np.abs(diagonal)
    largest = float(diagonal.max())
    # a zero median (most clients with h = 0 and no variance) says nothing of the scale of the
    # rest: the largest entry does, as it did before
    typical = float(np.median(diagonal)) or largest
    scale = max(typical, largest / MAX_SCALED_DIAGONAL)
    return scale if scale > 0 else 1.0


def far_off_scale(diagonal: np.ndarray) -> np.ndarray:
    """Which clients' diagonal (||h||^2 + V / n) lies over FAR_DIAGONAL times the problem's scale:
    those whose statistics are orders of magnitude off a typical client's (diverged, malicious).
    Never all of them: at most half the diagonal lies above 1e4 times its median."""
    return np.abs(diagonal) / problem_scale(diagonal) > FAR_DIAGONAL


def _largest_eigenvalue(q: np.ndarray) -> float:
    if len(q) <= 64:
        return float(np.linalg.eigvalsh(q)[-1])
    from scipy.sparse.linalg import eigsh  # pylint: disable=import-outside-toplevel

    try:
        return float(eigsh(q, k=1, which="LA", return_eigenvectors=False, tol=1e-6)[0]) * 1.001
    except Exception:  # pylint: disable=broad-except  # ARPACK rarely fails; the exact route is fine
        return float(np.linalg.eigvalsh(q)[-1])


def _supports(alpha: np.ndarray) -> np.ndarray:
    """Each row's support: entries above SUPPORT_EPS relative to the row's largest."""
    return alpha > SUPPORT_EPS * alpha.max(axis=1, keepdims=True)


def duality_gaps(alpha: np.ndarray, q: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Frank-Wolfe gaps: an upper bound on f_i(alpha_i) - min f_i for every row."""
    grad = 2.0 * (alpha @ q - b)
    return np.einsum("ij,ij->i", grad, alpha) - grad.min(axis=1)


def _kkt_solve(q: np.ndarray, b_rows: np.ndarray, support: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimize on the face {alpha_j = 0 outside ``support``, sum alpha = 1}, ignoring alpha >= 0.

    Solves [2 Q_SS  -1; 1^T  0] [alpha_S; nu] = [2 b_S; 1] for every row of ``b_rows`` at once
    (one factorization for all rows that share a support). Returns (alpha_S rows, nu per row).
    """
    k = len(support)
    kkt = np.zeros((k + 1, k + 1))
    kkt[:k, :k] = 2.0 * q[np.ix_(support, support)]
    kkt[:k, k] = -1.0
    kkt[k, :k] = 1.0
    rhs = np.concatenate([2.0 * b_rows[:, support], np.ones((len(b_rows), 1))], axis=1).T
    try:
        solution = np.linalg.solve(kkt, rhs)
    except np.linalg.LinAlgError:
        solution = np.linalg.lstsq(kkt, rhs, rcond=None)[0]
    return solution[:k].T, solution[k]


def refine_support(q: np.ndarray, b_row: np.ndarray, support: np.ndarray) -> np.ndarray | None:
    """Fast path: re-solve on the face after dropping every negative entry or adding every
    dual violator at once. Usually a few solves; it can cycle, hence the step limit and the
    active-set method behind it. Returns the certified optimum or None."""
    for _ in range(FAST_REFINEMENT_STEPS):
        if len(support) == 0:
            return None
        solved, nus = _kkt_solve(q, b_row[None], support)
        values, nu = solved[0], float(nus[0])
        if values.min() < -KKT_TOLERANCE:
            support = support[values >= -KKT_TOLERANCE]
            continue
        alpha = np.zeros(len(b_row))
        alpha[support] = np.maximum(values, 0.0)
        alpha /= alpha.sum()
        violation = nu - 2.0 * (q @ alpha - b_row)
        violation[support] = -np.inf
        violators = np.flatnonzero(violation > KKT_TOLERANCE * max(1.0, abs(nu)))
        if len(violators) == 0:
            return alpha
        # the worst few, not all: a flood of weak violators makes every later solve large
        most = max(4, len(support) // 4)
        violators = violators[np.argsort(-violation[violators])[:most]]
        support = np.union1d(support, violators)
    return None


def active_set_row(q: np.ndarray, b_row: np.ndarray, start: np.ndarray) -> np.ndarray | None:
    """Primal active-set method (Nocedal & Wright, Alg. 16.3) from a feasible starting point.

    Iterates stay on the simplex; each step frees one bound or adds one blocking bound, so it
    cannot cycle the way all-at-once support updates can. Returns the optimum or None.
    """
    m = len(b_row)
    x = np.where(start > SUPPORT_EPS * start.max(), start, 0.0)
    x /= x.sum()
    free = x > 0
    for _ in range(MAX_ACTIVE_SET_STEPS):
        support = np.flatnonzero(free)
        values, nu = _kkt_solve(q, b_row[None], support)
        target = np.zeros(m)
        target[support] = values[0]
        step = target - x
        if np.abs(step).max() <= KKT_TOLERANCE:
            multipliers = 2.0 * (q @ x - b_row) - nu[0]  # >= 0 on the bounds at optimality
            multipliers[free] = np.inf
            worst = int(np.argmin(multipliers))
            if multipliers[worst] >= -KKT_TOLERANCE * max(1.0, abs(float(nu[0]))):
                return x
            free[worst] = True
            continue
        shrinking = np.flatnonzero(free & (step < 0))
        ratios = -x[shrinking] / step[shrinking]
        length = min(1.0, ratios.min()) if len(shrinking) else 1.0
        x = np.maximum(x + length * step, 0.0)
        if length < 1.0:
            free[shrinking[np.argmin(ratios)]] = False
            x[~free] = 0.0
        x /= x.sum()
    return None


def polish_rows(q: np.ndarray, b: np.ndarray, alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Certify (or correct) every row's iterate by an exact solve on its support.

    Rows whose iterates share a support share one factorization, and the dual check of all
    rows is one matrix product; only rows that fail it get per-row active-set steps.
    Returns (alpha, certified).
    """
    rows, m = alpha.shape
    supports = _supports(alpha)
    candidates = np.zeros((rows, m))
    nus = np.zeros(rows)
    primal_ok = np.zeros(rows, dtype=bool)
    groups: dict[bytes, list[int]] = {}
    for row, mask in enumerate(supports):
        groups.setdefault(np.packbits(mask).tobytes(), []).append(row)
    for members in groups.values():
        support = np.flatnonzero(supports[members[0]])
        values, group_nus = _kkt_solve(q, b[members], support)
        for row, row_values, nu in zip(members, values, group_nus):
            nus[row] = nu
            primal_ok[row] = row_values.min() >= -KKT_TOLERANCE
            # clipped, it is a feasible start for the active-set method when not optimal
            candidates[row, support] = np.maximum(row_values, 0.0)
            if candidates[row].sum() <= 0:
                candidates[row] = alpha[row]
    candidates /= candidates.sum(axis=1, keepdims=True)
    violation = nus[:, None] - 2.0 * (candidates @ q - b)
    violation[supports] = -np.inf
    tolerance = KKT_TOLERANCE * np.maximum(1.0, np.abs(nus))
    certified = primal_ok & (violation.max(axis=1) <= tolerance)
    for uncertified in np.flatnonzero(~certified):
        row = int(uncertified)
        polished = refine_support(q, b[row], np.flatnonzero(supports[row])) if primal_ok[row] else None
        if polished is None:
            polished = refine_support(q, b[row], np.flatnonzero(candidates[row] > 0))
        if polished is None:
            polished = active_set_row(q, b[row], candidates[row])
        if polished is not None:
            candidates[row], certified[row] = polished, True
        else:
            candidates[row] = alpha[row]
    return candidates, certified


def solve_simplex_qps(q: np.ndarray, b: np.ndarray) -> BatchSolution:
    """min_{alpha_i in simplex} alpha_i^T Q alpha_i - 2 b_i^T alpha_i for every row i of ``b``.

    ``q``: (m, m) PSD; ``b``: (r, m). Float64 throughout. Clients far off the others' scale are
    left out of the gradient steps (:func:`_solve_without_far`).
    """
    q = 0.5 * q + 0.5 * q.T  # halves first: q + q.T overflows past half the float64 range
    far = far_off_scale(np.diag(q))
    scale = problem_scale(np.diag(q))
    q, b = q / scale, b / scale
    if far.any():
        return _solve_without_far(q, b, far)
    return _solve_scaled(q, b)


def _solve_without_far(q: np.ndarray, b: np.ndarray, far: np.ndarray) -> BatchSolution:
    """Solve every row without the ``far`` clients, then polish and certify it on the whole problem.

    A far client's diagonal sets the step size of every gradient step (1 / the largest
    eigenvalue), so with it in the problem the others' rows hardly move and are certified only
    by the last polish, after all MAX_ITERATIONS of them. Without it they converge as usual; the
    polish then adds a far client to a row's support where the KKT conditions ask for it (its
    own row, or a weight of ~1e-6 that sparsify drops) and certifies the row on the whole
    problem. Rows it cannot certify are solved on the whole problem.
    """
    near = ~far
    inner = _solve_scaled(q[np.ix_(near, near)], b[:, near])
    start = np.zeros(b.shape)
    start[:, near] = inner.alpha
    alpha, certified = polish_rows(q, b, start)
    iterations = inner.iterations
    redo = np.flatnonzero(~certified)
    if len(redo):
        whole = _solve_scaled(q, b[redo])
        alpha[redo], certified[redo] = whole.alpha, whole.converged
        iterations = max(iterations, whole.iterations)
    return BatchSolution(alpha=alpha, converged=certified, iterations=iterations)


def _solve_scaled(q: np.ndarray, b: np.ndarray) -> BatchSolution:
    """Accelerated projected gradient on all rows, polished (the module's steps 1 and 2), on a
    problem already symmetrized and scaled."""
    rows, m = b.shape
    lipschitz = 2.0 * max(_largest_eigenvalue(q), 1e-12)
    alpha = np.full((rows, m), 1.0 / m)
    done = np.zeros(rows, dtype=bool)
    result = alpha.copy()
    # FISTA state, for the rows still active
    active = np.arange(rows)
    y = alpha.copy()
    t = np.ones(rows)
    iteration = 0
    for iteration in range(1, MAX_ITERATIONS + 1):
        grad = 2.0 * (y @ q - b[active])
        new_alpha = project_rows_to_simplex(y - grad / lipschitz)
        # gradient-based adaptive restart (O'Donoghue & Candes): drop the momentum of rows
        # where it points uphill; costs no extra matrix product
        restart = np.einsum("ij,ij->i", y - new_alpha, new_alpha - alpha) > 0
        t_next = 0.5 * (1.0 + np.sqrt(1.0 + 4.0 * t * t))
        momentum = np.where(restart, 0.0, (t - 1.0) / t_next)[:, None]
        y = new_alpha + momentum * (new_alpha - alpha)
        t = np.where(restart, 1.0, t_next)
        alpha = new_alpha

        finished = np.zeros(len(active), dtype=bool)
        if iteration % 10 == 0:
            # absolute on the problem scaled to unit median diagonal
            finished = duality_gaps(alpha, q, b[active]) <= GAP_TOLERANCE
        if iteration in POLISH_AT:
            # exact solves cost O(support^3): wait until an iterate is sparse before trying
            support_sizes = _supports(alpha).sum(axis=1)
            open_rows = ~finished & (support_sizes <= max(MIN_POLISH_SUPPORT, m // 2))
            polished, certified = polish_rows(q, b[active[open_rows]], alpha[open_rows])
            alpha[open_rows] = polished
            finished[np.flatnonzero(open_rows)[certified]] = True
        if finished.any():
            result[active[finished]] = alpha[finished]
            done[active[finished]] = True
            keep = ~finished
            active, alpha, y, t = active[keep], alpha[keep], y[keep], t[keep]
        if len(active) == 0:
            break
    if len(active):  # out of iterations: one last, ungated attempt at certifying the rest
        polished, certified = polish_rows(q, b[active], alpha)
        result[active] = polished
        done[active] = certified
    return BatchSolution(alpha=result, converged=done, iterations=iteration)
