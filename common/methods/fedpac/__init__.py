"""FedPAC (Xu et al., ICLR 2023): feature alignment to the global class centroids, and classifier
collaboration (each client's head a QP-weighted mix of the others'); its ablations switch either
off (Table 2)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.methods.base import Alignment, Method, Rule


@dataclass(frozen=True)
class FedPAC(Method):
    """FedPAC's alternating routine, with feature alignment (``align``) and classifier
    collaboration (``collaborate``) on or off: without collaboration every client keeps its own
    head, without alignment no centroids travel."""

    align: bool = True
    collaborate: bool = True
    extractor: Rule = field(init=False, default=Rule.AVERAGE)
    head: Rule = field(init=False, default=Rule.MIX)
    alignment: Alignment = field(init=False, default=Alignment.CENTROIDS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "head", Rule.MIX if self.collaborate else Rule.LOCAL)
        object.__setattr__(self, "alignment", Alignment.CENTROIDS if self.align else Alignment.NONE)
        super().__post_init__()

    def aligns_at(self, weight: float) -> bool:
        """Whether a run with alignment weight ``weight`` (``common.config.alignment_weight``)
        aligns features: the variant does, with a weight above 0. At weight 0 (FedPAC's default
        under DP) no centroid travels, and a site running DP spends none of its budget on
        centroids nobody would align to."""
        return self.align and weight > 0
