"""Classifier collaboration (Section 4.2; eq. 11 and Appendix A.3 of the paper).

For every participating client i, the server finds combination weights alpha_i on the
probability simplex minimizing alpha^T P_i alpha, where

    P_i[j, l] = delta_jl * V_j / n_j + < h_i - h_j , h_i - h_l >      (Frobenius, K x d)

and mixes the heads: phi^_i = sum_j alpha_ij phi_j. All inner products come from one Gram
matrix G = H H^T of the flattened h's: < h_i - h_j , h_i - h_l > = G_ii - G_ij - G_il + G_jl.

Under differential privacy every h_j carries independent noise e_j of known expected squared
norm s_j^2, and E[G~] = G + diag(s^2): each squared distance ||h_i - h_j||^2 comes out s_i^2 +
s_j^2 too large. On Fashion-MNIST at epsilon 3 that is 2.4, far above any V_j / n_j, and every
client keeps its own head. The QPs therefore use G~ - diag(s^2), projected on the PSD cone
(:func:`debiased_gram`), with each client's s_j^2 at most what a typical client's report makes
credible (:func:`credible_noise`): over-reporting would pull a site towards everyone.

DP-SGD also makes each head noisier than its n_j records alone would: the variance term V_j / n_j
is taken times the inflation the site reports (``common.privacy.variance_inflation``), at least
the lower median site's (:func:`credible_inflation`): the QPs then weigh a head as if trained on that
many times fewer records, and mix alike sites' heads, whose noise averages out.
The default solver handles all clients at once (``common.methods.fedpac.simplex_qp``); cvxpy is the reference
and the fallback. Pure numpy + cvxpy; nothing here knows about Flower.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import cvxpy as cp
import numpy as np
from threadpoolctl import threadpool_limits

from common.averaging import lower_median
from common.cpu import others_running
from common.methods.fedpac.simplex_qp import far_off_scale, problem_scale, solve_simplex_qps

log = logging.getLogger(__name__)

# CLARABEL (interior point) is cvxpy's default QP solver and needs no licence; pinning it keeps
# results independent of which optional solvers happen to be installed.
QP_SOLVER = "CLARABEL"
# Relative ridge added to P: P is PSD in exact arithmetic, but float noise can make it
# slightly indefinite, which convex solvers reject.
RIDGE = 1e-10
# BLAS threads of the collaboration step (see collaboration_weights): None picks them per call.
SOLVER_BLAS_THREADS: int | None = None
# Below this many clients one thread is as fast as several even on an idle machine.
_THREADED_FROM_CLIENTS = 300


def solver_blas_threads(num_clients: int) -> int | None:
    """BLAS threads for ``num_clients`` clients' QPs: one, unless the problem is large and no
    other process wants a core right now (then None: the library's default, all cores)."""
    if SOLVER_BLAS_THREADS is not None:
        return SOLVER_BLAS_THREADS
    if num_clients < _THREADED_FROM_CLIENTS or others_running():
        return 1
    return None


@dataclass(frozen=True)
class CollaborationResult:
    """Combination weights (row i = alpha_i over the clients), each row's solver status, and the
    rows whose statistics are far off the others' scale (:func:`common.methods.fedpac.simplex_qp.far_off_scale`:
    nobody else mixes their heads, which an operator wants to hear of)."""

    alpha: np.ndarray  # (m, m), rows on the simplex
    status: list[str]  # per row: "optimal" (vectorized), "cvxpy", or "fallback: <reason>"
    far_off: list[int] = field(default_factory=list)


def gram_matrix(h: np.ndarray) -> np.ndarray:
    """G = H H^T over the flattened h's: every inner product the QPs need, in one product."""
    flat = np.asarray(h, dtype=np.float64).reshape(len(h), -1)
    return flat @ flat.T


@dataclass(frozen=True)
class PrivateStatistics:
    """What the sites running DP report beside their statistics, one entry per client in row
    order (``collaboration_weights``)."""

    h_noise: np.ndarray  # E||noise of h_j||^2 (0: exact statistics)
    entries: np.ndarray  # the entries of h_j that carry noise: classes with a count above 0, x d
    records: np.ndarray  # n_j, the site's training records: h_j is its noisy class sums over n_j
    v_inflation: np.ndarray  # how many times DP-SGD inflates the variance of head j (1: none)


def credible_noise(private: PrivateStatistics) -> np.ndarray:
    """The noise s_j^2 taken off client j's Gram diagonal: its report, at most what the lower
    median client's noise per entry of the sums makes of j's entries and n_j.

    s_j^2 = entries_j (sigma_j / n_j)^2, sigma_j the std of the noise on each entry of the
    site's class sums: its statistics' noise multiplier times the feature clip, the same for
    every site of a run up to the calibration to a target epsilon, which varies it a little with
    n_j and with what the site spent before. A site that reports a larger sigma than the lower
    median's is not believed past it: the more noise the server takes off a client's diagonal,
    the closer it looks to every other client, and the more of its head they mix. A site that
    truly adds more noise is then taken to be further from the others than it is, which costs
    it collaboration, and nobody else.
    """
    reported = np.asarray(private.h_noise, dtype=np.float64)
    entries = np.asarray(private.entries, dtype=np.float64)
    scale = np.asarray(private.records, dtype=np.float64) ** 2
    noisy = entries > 0  # a client with no noisy entry has exact statistics
    with np.errstate(over="ignore"):  # a report near the float64 maximum: its bound is Inf, and stays out
        sigma2 = np.where(noisy, reported * scale / np.where(noisy, entries, 1.0), 0.0)
        bound = lower_median(sigma2) * entries / scale
    return np.where(noisy, np.minimum(reported, bound), 0.0)


def credible_inflation(reported: np.ndarray) -> np.ndarray:
    """Each client's variance inflation as the QPs take it: its report, at least the lower
    median report. The smaller a client's variance term, the more of its head the others mix: a
    site that claims less DP noise than it added is believed no further than the lower median
    site, and one that truly adds more (a stricter policy, budget spent before) is believed."""
    reported = np.asarray(reported, dtype=np.float64)
    return np.maximum(reported, lower_median(reported))


def debiased_gram(gram: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """G~ - diag(noise), the nearest PSD matrix to it (eigenvalues below 0 set to 0): every P_i
    built from it is PSD, as the QP solvers need, and no squared distance comes out negative."""
    eigenvalues, vectors = np.linalg.eigh(gram - np.diag(noise))
    projected = (vectors * np.clip(eigenvalues, 0.0, None)) @ vectors.T
    return 0.5 * projected + 0.5 * projected.T


def variance_terms(v: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The diagonal V_j / n_j of every P_i."""
    return np.asarray(v, dtype=np.float64) / np.asarray(n, dtype=np.float64)


def collaboration_matrix(gram: np.ndarray, variance: np.ndarray, i: int) -> np.ndarray:
    """P_i from the Gram identity: P_i[j, l] = G_ii - G_ij - G_il + G_jl + delta_jl V_j / n_j."""
    return gram[i, i] - gram[i][:, None] - gram[i][None, :] + gram + np.diag(variance)


def collaboration_matrix_direct(h: np.ndarray, v: np.ndarray, n: np.ndarray, i: int) -> np.ndarray:
    """P_i straight from its definition (reference for tests; O(m^2 K d))."""
    h = np.asarray(h, dtype=np.float64)
    m = len(h)
    p = np.empty((m, m))
    for j in range(m):
        for k in range(m):
            p[j, k] = np.sum((h[i] - h[j]) * (h[i] - h[k]))
        p[j, j] += v[j] / n[j]
    return p


def _stabilize(p: np.ndarray) -> np.ndarray:
    """Symmetrize, scale (:func:`common.methods.fedpac.simplex_qp.problem_scale`) and add a ridge."""
    # halves first: p + p.T overflows for entries past half the float64 range (a V_j / n_j of
    # 1e308 is a valid reply)
    p = 0.5 * p + 0.5 * p.T
    if not np.isfinite(p).all():
        raise ValueError("P has non-finite entries")
    return p / problem_scale(np.diag(p)) + RIDGE * np.eye(len(p))


def solve_simplex_qp(p: np.ndarray) -> np.ndarray:
    """argmin_{alpha >= 0, sum alpha = 1} alpha^T P alpha, by cvxpy with the pinned solver.

    Raises ``RuntimeError`` when the solver does not reach an optimal solution.
    """
    m = len(p)
    if m == 1:
        return np.ones(1)
    p = _stabilize(p)
    alpha = cp.Variable(m)
    problem = cp.Problem(
        cp.Minimize(cp.quad_form(alpha, cp.psd_wrap(p))), [alpha >= 0, cp.sum(alpha) == 1]
    )
    try:
        problem.solve(solver=QP_SOLVER)
    except cp.error.SolverError as err:
        raise RuntimeError(f"{QP_SOLVER} failed: {err}") from err
    if problem.status != cp.OPTIMAL or alpha.value is None:
        raise RuntimeError(f"{QP_SOLVER} ended with status {problem.status}")
    return np.asarray(alpha.value, dtype=np.float64)


def sparsify(alpha: np.ndarray, threshold: float) -> np.ndarray:
    """Clip solver noise below 0, zero weights under ``threshold`` and renormalize (authors' code)."""
    alpha = np.clip(alpha, 0.0, None)
    kept = np.where(alpha >= threshold, alpha, 0.0)
    if kept.sum() <= 0:  # every weight under the threshold: keep the largest
        kept = np.zeros_like(alpha)
        kept[np.argmax(alpha)] = 1.0
    return kept / kept.sum()


def collaboration_weights(
    h: np.ndarray,
    v: np.ndarray,
    n: np.ndarray,
    threshold: float = 1e-3,
    solver: str = "vectorized",
    private: PrivateStatistics | None = None,
) -> CollaborationResult:
    """Solve every client's QP; row i of the result is alpha_i.

    ``private``: what sites running DP report; each h_j's noise is taken off the Gram matrix
    within what is credible (:func:`credible_noise`, :func:`debiased_gram`), and each V_j / n_j
    multiplied by its head's variance inflation (:func:`credible_inflation`). None: the
    statistics are exact and the heads trained without noise.

    ``solver="vectorized"`` solves all rows together (``common.methods.fedpac.simplex_qp``) and hands any row
    it cannot certify to cvxpy; ``solver="cvxpy"`` solves row by row with cvxpy (the reference).
    A row no solver can do falls back to alpha_i = e_i (the client keeps its own head).
    """
    # The solver is many medium-sized matrix products. On a machine where another process holds
    # a core, OpenBLAS's threads wait on each other at every product (31x slower at m = 1000 with
    # one of two cores taken); on one thread the loaded time stays near the idle one, and only
    # large problems on an idle machine gain from more (docs/PERFORMANCE.md,
    # bench/server_aggregation.py --busy).
    with threadpool_limits(limits=solver_blas_threads(len(h)), user_api="blas"):
        return _collaboration_weights(h, v, n, threshold, solver, private)


def _collaboration_weights(h: np.ndarray, v: np.ndarray, n: np.ndarray, threshold: float,
                           solver: str, private: PrivateStatistics | None) -> CollaborationResult:
    m = len(h)
    gram = gram_matrix(h)
    if private is not None and np.any(private.h_noise) and np.isfinite(gram).all():
        gram = debiased_gram(gram, credible_noise(private))
    variance = variance_terms(v, n)
    if private is not None:
        variance = variance * credible_inflation(private.v_inflation)
    alpha = np.zeros((m, m))
    status = ["cvxpy"] * m
    if solver == "vectorized" and np.isfinite(gram).all() and np.isfinite(variance).all():
        try:
            batch = solve_simplex_qps(gram + np.diag(variance), gram)
        except Exception as err:  # pylint: disable=broad-exception-caught  # cvxpy is the fallback for any
            log.warning("vectorized collaboration QPs failed (%s: %s); solving every row with cvxpy",
                        type(err).__name__, err)
        else:
            for row in np.flatnonzero(batch.converged):
                alpha[row], status[row] = sparsify(batch.alpha[row], threshold), "optimal"
    for i in (row for row in range(m) if status[row] == "cvxpy"):
        try:
            alpha[i] = sparsify(solve_simplex_qp(collaboration_matrix(gram, variance, i)), threshold)
        except (RuntimeError, ValueError) as err:
            log.warning("collaboration QP of client row %d failed (%s); it keeps its own head", i, err)
            alpha[i] = np.eye(m)[i]
            status[i] = f"fallback: {err}"
    return CollaborationResult(alpha=alpha, status=status, far_off=_far_off_rows(np.diag(gram) + variance))


def _far_off_rows(diagonal: np.ndarray) -> list[int]:
    """Rows far off the others' scale; an overflowed (infinite) diagonal entry is as far as any."""
    finite = np.isfinite(diagonal)
    far = ~finite
    if finite.any():
        far[finite] = far_off_scale(diagonal[finite])
    return np.flatnonzero(far).tolist()


def qp_objective(p: np.ndarray, alpha: np.ndarray) -> float:
    return float(alpha @ p @ alpha)


def mix_heads(heads: list[dict[str, np.ndarray]], alpha: np.ndarray) -> list[dict[str, np.ndarray]]:
    """phi^_i = sum_j alpha_ij phi_j for every row i (weight and bias alike), as one product."""
    mixed = {}
    # on the QPs' BLAS threads, for the same reason (collaboration_weights)
    with threadpool_limits(limits=solver_blas_threads(len(heads)), user_api="blas"):
        for key in heads[0]:
            stacked = np.stack([head[key] for head in heads])
            mixed[key] = (alpha @ stacked.reshape(len(heads), -1).astype(np.float64)).reshape(
                (len(alpha),) + stacked.shape[1:]
            ).astype(stacked.dtype)
    return [{key: values[i] for key, values in mixed.items()} for i in range(len(alpha))]
