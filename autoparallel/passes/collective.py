"""The collective passes of pipeline step 6, composed: what a compiler (and the report) calls.

* :func:`tag_joint` on the joint graph, before the partition (pre-overlap bucketing tags);
* :func:`bucket_fw_bw` on the split forward and backward graphs: chained all-gather fusion first
  (a merged all-gather would break the chains), then pre-overlap bucketing, then optionally
  Inductor's overlap scheduler with topo-span bucketing on CPU;
* :func:`bucket_joint` runs tagging and bucketing on a joint graph itself (for reports and tests
  that have no split graphs).

Each returns per-graph collective counts before/after so stage counts can be reported. Graphs are
mutated in place where the passes allow it (the overlap scheduler returns a new module). Merged
all-gathers are rank-specific: run this on each rank's graphs, in that rank's (fake) world.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import fx

from autoparallel import meta as M
from autoparallel.passes.bucket_plan import BucketingMetrics
from autoparallel.passes.fuse_chained_allgathers import fuse_chained_allgathers
from autoparallel.passes.overlap_estimator import RooflineConfig
from autoparallel.passes.overlap_scheduling import schedule_overlap_on_cpu
from autoparallel.passes.pre_overlap_bucketing import (
    PreOverlapConfig,
    PreOverlapResult,
    TagCounts,
    bucket_tagged_collectives,
    collective_counts,
    tag_collectives_for_bucketing,
)
from autoparallel.passes.topo_span_bucketing import TopoSpanConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollectivePassesConfig:
    pre_overlap: PreOverlapConfig = field(default_factory=PreOverlapConfig)
    topo_span: TopoSpanConfig = field(default_factory=TopoSpanConfig)
    fuse_chained_allgathers: bool = True
    pre_overlap_bucketing: bool = True
    schedule_overlap: bool = False  # run Inductor's overlap scheduler (CPU estimator) at the end
    roofline: RooflineConfig = field(default_factory=RooflineConfig)


@dataclass
class GraphPassMetrics:
    """What the passes did to one graph."""

    before: dict[str, int]
    after: dict[str, int] = field(default_factory=dict)
    fused_chains: int = 0
    pre_overlap: PreOverlapResult | None = None
    overlap_bucketing: list[BucketingMetrics] = field(default_factory=list)
    max_consec_compute_between_rs: int | None = None


@dataclass
class PipelineMetrics:
    graphs: dict[str, GraphPassMetrics] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, dict[str, tuple[int, int]]]:
        """``{"fw": {"all_gather": (before, after), ...}, "bw": {...}}``."""
        return {
            name: {k: (g.before[k], g.after[k]) for k in g.before}
            for name, g in self.graphs.items()
        }

    def summary(self) -> str:
        lines = []
        for name, g in self.graphs.items():
            parts = [f"{k} {g.before[k]}->{g.after[k]}" for k in g.before]
            lines.append(f"{name}: {', '.join(parts)}; fused chains {g.fused_chains}")
        return "\n".join(lines)


def tag_joint(gm: fx.GraphModule) -> TagCounts:
    """Tag the joint graph's bucketable collectives (before the partition)."""
    return tag_collectives_for_bucketing(gm)


def _run(
    name: str, gm: fx.GraphModule, config: CollectivePassesConfig
) -> tuple[fx.GraphModule, GraphPassMetrics]:
    m = GraphPassMetrics(before=collective_counts(gm))
    if config.fuse_chained_allgathers:
        m.fused_chains = fuse_chained_allgathers(gm, gm.meta.get(M.GM_GROUP_DIMS))
    if config.pre_overlap_bucketing:
        m.pre_overlap = bucket_tagged_collectives(gm, config.pre_overlap)
    if config.schedule_overlap:
        res = schedule_overlap_on_cpu(gm, config.topo_span, config.roofline)
        res.gm.meta.update(gm.meta)
        gm = res.gm
        m.overlap_bucketing = res.bucketing_calls
        m.max_consec_compute_between_rs = res.max_consec_compute_between_rs
    m.after = collective_counts(gm)
    log.info("collective passes on %s: %s", name, {k: (m.before[k], m.after[k]) for k in m.before})
    return gm, m


def bucket_fw_bw(
    fw: fx.GraphModule, bw: fx.GraphModule, config: CollectivePassesConfig | None = None
) -> tuple[fx.GraphModule, fx.GraphModule, PipelineMetrics]:
    """Run the collective passes on split graphs whose nodes carry the joint graph's tags."""
    config = config if config is not None else CollectivePassesConfig()
    metrics = PipelineMetrics()
    fw, metrics.graphs["fw"] = _run("fw", fw, config)
    bw, metrics.graphs["bw"] = _run("bw", bw, config)
    return fw, bw, metrics


def bucket_joint(
    gm: fx.GraphModule, config: CollectivePassesConfig | None = None
) -> tuple[fx.GraphModule, PipelineMetrics]:
    """Tag and run the collective passes on a joint graph (no partition)."""
    config = config if config is not None else CollectivePassesConfig()
    tag_joint(gm)
    metrics = PipelineMetrics()
    gm, metrics.graphs["joint"] = _run("joint", gm, config)
    return gm, metrics


__all__ = [
    "CollectivePassesConfig",
    "GraphPassMetrics",
    "PipelineMetrics",
    "bucket_fw_bw",
    "bucket_joint",
    "tag_joint",
]
