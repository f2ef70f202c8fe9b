"""FedPAC's server step (Section 4): the extractor averaged by sample count (eq. 18), the global
class centroids by class counts (eq. 19), and each replying client's head replaced by the mix of
the replying clients' heads its collaboration QP weighs (eq. 11); the ablations switch either off."""

from __future__ import annotations

import dataclasses
from logging import WARNING
from typing import Any

import numpy as np
from flwr.supercore import log

from common import protocol as p
from common.methods.fedpac.centroids import aggregate_centroids
from common.methods.fedpac.collaboration import PrivateStatistics, collaboration_weights, mix_heads
from common.config import FedPACConfig, alignment_weight
from common.methods.fedpac import FedPAC
from common.methods.fedpac.charts import alpha_chart, has_alpha
from common.methods.outputs import Chart, ClientColumn, Outputs, RoundColumn, RoundData, reply_metric
from common.methods.server import EXTRACTOR, HEAD, ServerPart, ServerState, StepResult, Update, weighted_class_counts
from common.robust import agreeing_mix, stacked_updates
from common.methods.fedpac.simplex_qp import FAR_DIAGONAL
from common.validation import class_counts, finite_as, metric, metric_at_least, variance_metric

CENTROIDS = "centroids"  # the state's section: the global class centroids and their mask


def qp_fallbacks(record: RoundData) -> int:
    """Clients whose QP no solver could do (they kept their own head)."""
    return sum(status.startswith("fallback") for status in record.method.get("solver_status", []))


def solver_status(record: RoundData, partition_id: int) -> str:
    """How the client's collaboration QP was solved this round ("": it had none)."""
    status = dict(zip(record.method.get("alpha_partitions", []), record.method.get("solver_status", [])))
    return status.get(partition_id, "")


# What FedPAC adds to the outputs: the QPs that fell back and the classes with a global centroid
# per round; the clients' reply metrics and the solver's status per client; the alpha chart.
OUTPUTS = Outputs(
    round_columns=(RoundColumn("qp_fallbacks", qp_fallbacks),
                   RoundColumn("centroid_classes", lambda r: r.method.get("centroid_classes", 0))),
    client_columns=(reply_metric("v", p.V), reply_metric("h_noise", p.H_NOISE),
                    reply_metric("v_inflation", p.V_INFLATION), reply_metric("head_loss", "head-loss"),
                    reply_metric("align_loss", "align-loss"), ClientColumn("solver_status", solver_status)),
    charts=(Chart("alpha.png", alpha_chart, has_alpha),),
    log=lambda r: f" | QP fallbacks {qp_fallbacks(r)}",
)


class Server(ServerPart):
    """FedPAC's server part: global extractor and centroids, a personalized head per client."""

    method: FedPAC
    outputs = OUTPUTS

    def __init__(self, method: FedPAC, cfg: FedPACConfig, extractor: p.NDArrays, head: p.NDArrays) -> None:
        super().__init__(method, cfg, extractor, head)
        self.num_classes, self.dim = head[p.HEAD_WEIGHT].shape
        self.aligns = method.aligns_at(alignment_weight(cfg))

    def initial_state(self) -> ServerState:
        state = super().initial_state()
        if self.aligns:  # no centroid before the first round: every class masked out
            state.shared[CENTROIDS] = {p.CENTROID_VALUES: np.zeros((self.num_classes, self.dim), dtype=np.float32),
                                       p.CENTROID_MASK: np.zeros(self.num_classes, dtype=bool)}
        return state

    def summary(self) -> list[str]:
        lines = super().summary()
        if self.method.collaborate:
            lines.append(f"Collaboration: {self.cfg.qp_solver} QP solver, weights below {self.cfg.alpha_threshold:g} "
                         "dropped")
        return lines

    def train_sections(self, state: ServerState, partition_id: int | None) -> tuple[p.Sections, dict[str, Any]]:
        """The global centroids (feature alignment's targets) and their mask."""
        if not self.aligns:
            return {}, {}
        centroids = state.shared[CENTROIDS]
        return {p.CENTROIDS: {p.CENTROID_VALUES: centroids[p.CENTROID_VALUES],
                              p.CENTROID_MASK: centroids[p.CENTROID_MASK].astype(np.uint8)}}, {}

    def statistics_shapes(self) -> dict[str, tuple[int, ...]]:
        """Local centroids with alignment, h with collaboration, class counts with either."""
        shapes: dict[str, tuple[int, ...]] = {}
        if self.aligns:
            shapes[p.CENTROID_VALUES] = (self.num_classes, self.dim)
        if self.aligns or self.method.collaborate:
            shapes[p.CLASS_COUNTS] = (self.num_classes,)
        if self.method.collaborate:
            shapes[p.H] = (self.num_classes, self.dim)
        return shapes

    def check(self, update: Update) -> Update:
        """Centroids and h in the model's dtype, all finite there (the server's averages of them
        are cast to it, and a float64 value that is finite but overflows it would make every
        client's targets Inf); class counts that sum to n_i; V >= 0 up to rounding; the noise in h
        finite and >= 0 (0 where a client reports none), the head's variance inflation finite and
        >= 1 (1 where none)."""
        stats = update.statistics
        parsed: dict[str, Any] = {}
        dtype = self.head_template[p.HEAD_WEIGHT].dtype
        if self.aligns:
            parsed["centroids"] = finite_as(stats[p.CENTROID_VALUES], dtype,
                                            f"statistics '{p.CENTROID_VALUES}'").astype(np.float64)
        h = finite_as(stats[p.H], dtype, f"statistics '{p.H}'") if self.method.collaborate else None
        if p.CLASS_COUNTS in stats:
            parsed["class_counts"] = class_counts(stats, p.CLASS_COUNTS, update.num_examples)
        if h is not None:
            parsed["v"] = variance_metric(metric(update.metrics, p.V), h)
            parsed["h"] = h.astype(np.float64)
            parsed["h_noise"] = metric_at_least(update.metrics, p.H_NOISE, 0.0, default=0.0)
            parsed["v_inflation"] = metric_at_least(update.metrics, p.V_INFLATION, 1.0, default=1.0)
        return dataclasses.replace(update, parsed=parsed)

    def step(self, state: ServerState, updates: list[Update], weights: np.ndarray, server_round: int) -> StepResult:
        """Eq. 19, the collaboration QPs, eq. 18 and the head mixing, over ``updates`` in
        partition order (row i of alpha, h_i, V_i, n_i and head i all belong to the same client)."""
        result = StepResult()
        if self.aligns:
            previous = state.shared[CENTROIDS]
            centroids, mask = aggregate_centroids(self.class_means(updates, server_round),
                                                  weighted_class_counts(updates, weights),
                                                  previous[p.CENTROID_VALUES], previous[p.CENTROID_MASK])
            # alignment targets that are not all finite are not kept: every client would align to
            # them next round. Reply validation lets none through; this is the second guard,
            # should an average overflow the model's dtype after all
            if np.isfinite(centroids).all():
                state.shared[CENTROIDS] = {p.CENTROID_VALUES: centroids, p.CENTROID_MASK: mask}
            else:
                log(WARNING, "Round %d: the aggregated centroids are not all finite; the previous ones are kept",
                    server_round)
        collaboration = None
        if self.method.collaborate:
            collaboration = collaboration_weights(np.stack([u.parsed["h"] for u in updates]),
                                                  np.array([u.parsed["v"] for u in updates]), weights,
                                                  self.cfg.alpha_threshold, self.cfg.qp_solver,
                                                  self.private_statistics(updates))
        state.shared[EXTRACTOR] = self.average([u.extractor for u in updates], weights)
        if collaboration is not None:  # without it each head stays at its site (Rule.LOCAL)
            alpha = self.agreeing(state, updates, collaboration.alpha, server_round)
            new_heads = mix_heads([u.head for u in updates], alpha)
            for update, head in zip(updates, new_heads):
                state.keep(HEAD, update.partition_id, head)
            result.record.update(alpha_partitions=[u.partition_id for u in updates],
                                 alpha=alpha.tolist(), solver_status=collaboration.status)
            if collaboration.far_off:
                log(WARNING, "Round %d: partitions %s report feature statistics (||h||^2 + V/n) over %g times a "
                    "typical client's; no other client mixes their heads. Diverged, or not honest?", server_round,
                    [updates[i].partition_id for i in collaboration.far_off], FAR_DIAGONAL)
        return result

    def private_statistics(self, updates: list[Update]) -> PrivateStatistics:
        """What the sites reported of their DP noise, with the entries of each h that carry it
        (d for every class with a count above 0) and each site's own n."""
        return PrivateStatistics(
            h_noise=np.array([u.parsed["h_noise"] for u in updates]),
            entries=np.array([self.dim * int(np.count_nonzero(u.parsed["class_counts"])) for u in updates]),
            records=np.array([u.num_examples for u in updates], dtype=np.float64),
            v_inflation=np.array([u.parsed["v_inflation"] for u in updates]))

    def agreeing(self, state: ServerState, updates: list[Update], alpha: np.ndarray, server_round: int) -> np.ndarray:
        """The QP's mixing weights less, with ``agreeing-heads``, the heads whose update points
        away from the mixing client's own (``common.robust.agreeing_mix``), logged."""
        if not self.cfg.agreeing_heads or len(updates) < 2:
            return alpha
        sent = [self.model_for(state, u.partition_id) for u in updates]
        agreeing, dropped = agreeing_mix(alpha, stacked_updates([u.head for u in updates], sent))
        if dropped:
            pids = [u.partition_id for u in updates]
            log(WARNING, "Round %d: heads left out of a mix, their update pointing away from the mixing client's "
                "own (client <- head: QP weight): %s", server_round,
                ", ".join(f"{pids[i]} <- {pids[j]}: {alpha[i, j]:.3f}" for i, j in dropped))
        return agreeing

    def closing_record(self, state: ServerState) -> dict[str, Any]:
        """How many classes have a global centroid."""
        mask = state.shared.get(CENTROIDS, {}).get(p.CENTROID_MASK)
        return {"centroid_classes": 0 if mask is None else int(mask.sum())}
