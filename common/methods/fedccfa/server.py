"""FedCCFA's server step: the extractor averaged by sample count, then every class's balanced
heads clustered (DBSCAN on the MADD distance) and, within each cluster, the trained head rows and
the local anchors merged; each client gets its merged head and its clusters' anchors."""

from __future__ import annotations

import dataclasses
from logging import WARNING
from typing import Any

import numpy as np
from flwr.supercore import log

from common import protocol as p
from common.methods.fedccfa.clustering import Clustering, clustered_heads
from common.config import FedPACConfig
from common.methods.fedccfa import FedCCFA
from common.methods.fedccfa.charts import clusters_chart, clusters_per_class, has_clusters
from common.methods.outputs import Chart, Outputs, RoundColumn, RoundData, Table, reply_metric
from common.methods.server import EXTRACTOR, HEAD, ServerPart, ServerState, StepResult, Update, weighted_class_counts
from common.validation import class_counts, finite_as

ANCHORS = "anchors"  # the state's section: each client's cluster anchors (K, d) and their mask (K,)
GLOBAL_ANCHORS = -1  # the anchors key of the one global anchor set (``clustered-anchors = false``)


def cluster_rows(record: RoundData) -> list[dict[str, object]]:
    """clusters.csv's rows of a round: every client's cluster for every class (-1: the class is
    absent on that client). The record's ``clusters[c][i]`` is the cluster of client
    ``cluster_partitions[i]`` for class c."""
    return [{"round": record.round, "class": c, "partition_id": pid, "cluster": label}
            for c, labels in enumerate(record.method.get("clusters", []))
            for pid, label in zip(record.method.get("cluster_partitions", []), labels)]


def mean_clusters_per_class(record: RoundData) -> object:
    clusters = record.method.get("clusters")
    return float(np.mean(clusters_per_class(clusters))) if clusters else ""


def _log(record: RoundData) -> str:
    clusters = record.method.get("clusters")
    return f" | clusters per class {clusters_per_class(clusters)}" if clusters else ""


# What FedCCFA adds to the outputs: the clusters per class (per round, clusters.csv and its chart)
# and its clients' reply metrics.
OUTPUTS = Outputs(
    round_columns=(RoundColumn("mean_clusters_per_class", mean_clusters_per_class),),
    client_columns=(reply_metric("head_loss", "head-loss"), reply_metric("align_loss", "align-loss"),
                    reply_metric("align_weight", "align-weight")),
    tables=(Table("clusters.csv", ("round", "class", "partition_id", "cluster"), cluster_rows),),
    charts=(Chart("clusters.png", clusters_chart, has_clusters),),
    log=_log,
)


class Server(ServerPart):
    """FedCCFA's server part: global extractor, a merged head and anchors per client."""

    method: FedCCFA
    outputs = OUTPUTS

    def __init__(self, method: FedCCFA, cfg: FedPACConfig, extractor: p.NDArrays, head: p.NDArrays) -> None:
        super().__init__(method, cfg, extractor, head)
        self.num_classes, self.dim = head[p.HEAD_WEIGHT].shape
        self.clustering = Clustering(cfg.cluster_eps, cfg.cluster_weights, cfg.clustered_anchors)

    def summary(self) -> list[str]:
        return [*super().summary(), f"Class-level clustering: MADD radius {self.clustering.eps:g}, "
                f"{self.clustering.weights} member weights, "
                f"{'clustered' if self.clustering.clustered_anchors else 'global'} anchors"]

    def train_sections(self, state: ServerState, partition_id: int | None) -> tuple[p.Sections, dict[str, Any]]:
        """The client's anchors (none before its first reply), the fixed initial head phi^0 its
        balanced head starts from, and whether the head sent is its own yet."""
        no_anchors = {p.CENTROID_VALUES: np.zeros((self.num_classes, self.dim), np.float32),
                      p.CENTROID_MASK: np.zeros(self.num_classes, bool)}
        owner = partition_id if self.clustering.clustered_anchors else GLOBAL_ANCHORS
        anchors = no_anchors if owner is None else state.personal_part(ANCHORS, owner, no_anchors)
        sections = {p.CENTROIDS: {p.CENTROID_VALUES: anchors[p.CENTROID_VALUES],
                                  p.CENTROID_MASK: anchors[p.CENTROID_MASK].astype(np.uint8)},
                    p.INITIAL_HEAD: self.initial_head}
        return sections, {p.HAS_PERSONAL_HEAD: partition_id in state.personal.get(HEAD, {})}

    def statistics_shapes(self) -> dict[str, tuple[int, ...]]:
        """The local anchors (class means), the class counts, and the balanced head."""
        return {p.CENTROID_VALUES: (self.num_classes, self.dim), p.CLASS_COUNTS: (self.num_classes,),
                p.BALANCED_WEIGHT: (self.num_classes, self.dim), p.BALANCED_BIAS: (self.num_classes,)}

    def check(self, update: Update) -> Update:
        """Anchors in the model's dtype, finite there; counts that sum to n_i; the balanced head
        under the model's own head keys, finite in its dtype."""
        stats = update.statistics
        weight_dtype, bias_dtype = (self.head_template[key].dtype for key in (p.HEAD_WEIGHT, p.HEAD_BIAS))
        parsed = {
            "centroids": finite_as(stats[p.CENTROID_VALUES], weight_dtype,
                                   f"statistics '{p.CENTROID_VALUES}'").astype(np.float64),
            "class_counts": class_counts(stats, p.CLASS_COUNTS, update.num_examples),
            "balanced_head": {p.HEAD_WEIGHT: finite_as(stats[p.BALANCED_WEIGHT], weight_dtype, "balanced head"),
                              p.HEAD_BIAS: finite_as(stats[p.BALANCED_BIAS], bias_dtype, "balanced head")},
        }
        return dataclasses.replace(update, parsed=parsed)

    def step(self, state: ServerState, updates: list[Update], weights: np.ndarray, server_round: int) -> StepResult:
        counts = weighted_class_counts(updates, weights)
        state.shared[EXTRACTOR] = self.average([u.extractor for u in updates], weights)
        # the local class means are FedCCFA's local anchors a_k
        heads, clusters = clustered_heads([u.head for u in updates], [u.parsed["balanced_head"] for u in updates],
                                          self.class_means(updates, server_round), counts, self.clustering)
        for update, head in zip(updates, heads):
            state.keep(HEAD, update.partition_id, head)
        # anchors that are not all finite are not kept: the client would align to them next round
        anchors, mask = clusters.anchors, clusters.anchor_mask
        finite = np.isfinite(anchors).all(axis=(1, 2))
        if not finite.all():
            log(WARNING, "Round %d: the merged anchors of partitions %s are not all finite; their previous "
                "ones are kept", server_round, [updates[i].partition_id for i in np.flatnonzero(~finite)])
        for i, update in enumerate(updates):
            if finite[i]:
                state.keep(ANCHORS, update.partition_id, {p.CENTROID_VALUES: anchors[i], p.CENTROID_MASK: mask[i]})
        if not self.clustering.clustered_anchors and finite[0]:  # the round's mean, for every client
            state.keep(ANCHORS, GLOBAL_ANCHORS, {p.CENTROID_VALUES: anchors[0], p.CENTROID_MASK: mask[0]})
        return StepResult(record={"cluster_partitions": [u.partition_id for u in updates],
                                  "clusters": clusters.labels.tolist()})
