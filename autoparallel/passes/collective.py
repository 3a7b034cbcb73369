"""The collective passes (the stages after second_compile), composed: what a compiler (and the report) calls.

* :func:`tag_joint` on the joint graph, before the partition (pre-overlap bucketing tags);
* :func:`bucket_fw_bw` on the split forward and backward graphs: the passes of
  :data:`COLLECTIVE_PASSES`, in that order, each where its config switch is on:
  chained all-gather fusion first (a merged all-gather would break the chains), then pre-overlap
  bucketing, then Inductor's overlap scheduler with topo-span bucketing (on CPU);
* :func:`bucket_joint` runs tagging and bucketing on a joint graph itself (for reports and tests
  that have no split graphs).

:data:`COLLECTIVE_PASSES` is the one list of these passes and their order: ``autoparallel_backend``
runs it through :func:`bucket_fw_bw`, and ``autoparallel.pipeline`` makes one stage of each entry
(so each pass has a name, an input graph and an output graph).

Every pass runs under two wrappers. ``run_with_shared_provenance`` shares the nodes' histories.
``run_keeping_random_order`` (``random_order.py``) puts the random ops back in the order they
drew in before the pass: on CPU that order decides which op gets which mask. The passes on one
graph run inside ``reusing_bucket_traces``: a bucket like an earlier one reuses its merge's trace.

Each returns per-graph collective counts before/after so stage counts can be reported. Graphs are
mutated in place where the passes allow it (the overlap scheduler returns a new module). Merged
all-gathers are rank-specific: run this on each rank's graphs, in that rank's (fake) world.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

from torch import fx

from autoparallel import meta as M
from autoparallel.passes.bucket_plan import BucketingMetrics
from autoparallel.passes.fuse_chained_allgathers import ChainReport, fuse_chained_allgathers
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
from autoparallel.passes.random_order import run_keeping_random_order
from autoparallel.passes.reused_bucket_traces import reusing_bucket_traces
from autoparallel.passes.shared_provenance import run_with_shared_provenance
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
    chains: ChainReport | None = None  # every chain fuse_chained_allgathers found, fused or why not
    pre_overlap: PreOverlapResult | None = None
    overlap_bucketing: list[BucketingMetrics] = field(default_factory=list)
    max_consec_compute_between_rs: int | None = None


Buckets = list[tuple[str | None, BucketingMetrics]]


@dataclass(frozen=True)
class MetricField:
    """One metric the collective passes report on each graph (a :class:`GraphPassMetrics`
    attribute), declared once: ``text`` its parts of the golden text (none: nothing to show),
    ``json`` its entries in ``python -m verify scale``'s JSON, ``buckets`` the bucketing calls it
    holds (collective kind, or None for the overlap scheduler's), which the HTML page draws."""

    name: str
    text: Callable[[GraphPassMetrics], list[str]]
    json: Callable[[GraphPassMetrics], dict]
    buckets: Callable[[GraphPassMetrics], Buckets] = lambda m: []


def _chains_json(m: GraphPassMetrics) -> dict:
    if m.chains is None:
        return {}
    return {"chains_found": m.chains.found, "chains_unfused": [{"chain": c, "reason": why} for c, why in m.chains.unfused]}


def _pre_overlap_buckets(m: GraphPassMetrics) -> Buckets:
    return [] if m.pre_overlap is None else list(m.pre_overlap.metrics.items())


#: Every per-graph metric, in the order each view lists them.
METRIC_FIELDS: tuple[MetricField, ...] = (
    MetricField("fused_chains", lambda m: [f"fused chains {m.fused_chains}"] if m.fused_chains else [],
                lambda m: {"fused_chains": m.fused_chains}),
    MetricField("chains", lambda m: [m.chains.summary()] if m.chains is not None and m.chains.unfused else [], _chains_json),
    MetricField("pre_overlap", lambda m: [f"{kind}: {b.summary()}" for kind, b in _pre_overlap_buckets(m) if b.num_candidates],
                lambda m: {} if m.pre_overlap is None else {"pre_overlap": {k: asdict(b) for k, b in _pre_overlap_buckets(m)}},
                _pre_overlap_buckets),
    MetricField("overlap_bucketing", lambda m: [f"overlap bucketing: {b.summary()}" for b in m.overlap_bucketing],
                lambda m: {"overlap_bucketing": [asdict(b) for b in m.overlap_bucketing]} if m.overlap_bucketing else {},
                lambda m: [(None, b) for b in m.overlap_bucketing]),
    MetricField("max_consec_compute_between_rs",
                lambda m: [] if m.max_consec_compute_between_rs is None else [f"max_consec_compute_between_rs={m.max_consec_compute_between_rs}"],
                # reported beside the overlap scheduler's buckets, as it measures the schedule they make
                lambda m: {"max_consec_compute_between_rs": m.max_consec_compute_between_rs} if m.overlap_bucketing else {}),
)


def metric_text(m: GraphPassMetrics) -> list[str]:
    """What the passes did to one graph, as the golden text's parts (every declared field in order)."""
    return [part for f in METRIC_FIELDS for part in f.text(m)]


def metric_json(m: GraphPassMetrics) -> dict:
    """One graph's collective counts before and after, and every declared field's JSON entries."""
    out: dict = {"before": m.before, "after": m.after}
    for f in METRIC_FIELDS:
        out.update(f.json(m))
    return out


def bucketing_calls(m: GraphPassMetrics) -> Buckets:
    """Every bucketing call of one graph, with its collective kind (None: the overlap scheduler's)."""
    return [call for f in METRIC_FIELDS for call in f.buckets(m)]


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

    @property
    def acted(self) -> int:
        """Collectives the passes rewrote, over all graphs: chains fused, collectives merged into
        pre-overlap buckets and into topo-span buckets. 0 means no pass did anything."""
        return sum(g.fused_chains + sum(b.num_bucketed for _, b in bucketing_calls(g)) for g in self.graphs.values())

    def summary(self) -> str:
        lines = []
        for name, g in self.graphs.items():
            parts = [f"{k} {g.before[k]}->{g.after[k]}" for k in g.before]
            lines.append(f"{name}: {', '.join(parts)}; fused chains {g.fused_chains}")
        return "\n".join(lines)


def tag_joint(gm: fx.GraphModule) -> TagCounts:
    """Tag the joint graph's bucketable collectives (before the partition)."""
    return tag_collectives_for_bucketing(gm)


def _fuse(gm: fx.GraphModule, config: CollectivePassesConfig, m: GraphPassMetrics) -> fx.GraphModule:
    m.chains = ChainReport()
    m.fused_chains = fuse_chained_allgathers(gm, gm.meta.get(M.GM_GROUP_DIMS), report=m.chains)
    return gm


def _pre_overlap(gm: fx.GraphModule, config: CollectivePassesConfig, m: GraphPassMetrics) -> fx.GraphModule:
    m.pre_overlap = bucket_tagged_collectives(gm, config.pre_overlap)
    return gm


def _schedule_overlap(gm: fx.GraphModule, config: CollectivePassesConfig, m: GraphPassMetrics) -> fx.GraphModule:
    res = schedule_overlap_on_cpu(gm, config.topo_span, config.roofline)
    res.gm.meta.update(gm.meta)
    m.overlap_bucketing = res.bucketing_calls
    m.max_consec_compute_between_rs = res.max_consec_compute_between_rs
    return res.gm


@dataclass(frozen=True)
class CollectivePass:
    """One collective pass on a split graph: ``run(gm, config, metrics) -> gm`` (it may return a
    new module), switched on by ``enabled(config)``; ``patches``: the registered patches it is."""

    name: str
    enabled: Callable[[CollectivePassesConfig], bool]
    run: Callable[[fx.GraphModule, CollectivePassesConfig, GraphPassMetrics], fx.GraphModule]
    summary: str
    patches: tuple[str, ...]


#: The collective passes in the order they run on each split graph.
COLLECTIVE_PASSES: tuple[CollectivePass, ...] = (
    CollectivePass(
        "fuse_chained_allgathers",
        lambda c: c.fuse_chained_allgathers,
        _fuse,
        "dp->tp all-gather chains -> one all-gather on the flattened group",
        ("fuse_chained_allgathers", "random_op_order"),
    ),
    CollectivePass(
        "pre_overlap_bucketing",
        lambda c: c.pre_overlap_bucketing,
        _pre_overlap,
        "merge the collectives tagged on the joint graph into byte-capped buckets",
        ("pre_overlap_bucketing", "canonical_bucket_layout", "contiguous_gathered_shards", "shared_provenance",
         "reused_bucket_traces", "random_op_order"),
    ),
    CollectivePass(
        "topo_span_bucketing",
        lambda c: c.schedule_overlap,
        _schedule_overlap,
        "Inductor's overlap scheduler (CPU roofline) with topo-span-bounded FSDP bucketing",
        ("primary_fsdp_group", "topo_span_bucketing", "canonical_bucket_layout", "estimation_tables_only_when_traced",
         "contiguous_gathered_shards", "shared_provenance", "reused_bucket_traces", "random_op_order"),
    ),
)
COLLECTIVE_PASS_NAMES: tuple[str, ...] = tuple(p.name for p in COLLECTIVE_PASSES)


def _selected(config: CollectivePassesConfig, only: Sequence[str] | None) -> list[CollectivePass]:
    if only is None:
        return [p for p in COLLECTIVE_PASSES if p.enabled(config)]
    unknown = sorted(set(only) - set(COLLECTIVE_PASS_NAMES))
    if unknown:
        raise ValueError(f"unknown collective pass(es) {unknown}; passes: {list(COLLECTIVE_PASS_NAMES)}")
    return [p for p in COLLECTIVE_PASSES if p.name in only]


# Upstream modules that set their own logger to INFO when imported, so every bucket they merge
# prints a line ("pre_bucket_fsdp_collectives: ...") on stderr, once per rank in a parity world.
UPSTREAM_INFO_LOGGERS = ("torch._inductor.fx_passes.bucketing", "torch._inductor.fx_passes.fsdp")
_upstream_info = contextvars.ContextVar("autoparallel_upstream_info_logs", default=False)


@contextlib.contextmanager
def upstream_info_logs(shown: bool = True) -> Iterator[None]:
    """Within the scope, the collective passes leave upstream's INFO lines on (``-v``); they are
    quiet by default."""
    token = _upstream_info.set(shown)
    try:
        yield
    finally:
        _upstream_info.reset(token)


@contextlib.contextmanager
def _upstream_quiet() -> Iterator[None]:
    """Upstream's INFO loggers at WARNING while a pass runs (unless :func:`upstream_info_logs`),
    their levels restored after. Imported first: their import sets INFO."""
    if _upstream_info.get():
        yield
        return
    loggers = [logging.getLogger(importlib.import_module(name).__name__) for name in UPSTREAM_INFO_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.level, logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _run(
    name: str, gm: fx.GraphModule, config: CollectivePassesConfig, only: Sequence[str] | None = None
) -> tuple[fx.GraphModule, GraphPassMetrics]:
    m = GraphPassMetrics(before=collective_counts(gm))
    with reusing_bucket_traces():
        for p in _selected(config, only):
            with _upstream_quiet():
                gm = run_keeping_random_order(
                    gm, lambda g, p=p: run_with_shared_provenance(g, lambda h: p.run(h, config, m)), f"{p.name} on {name}")
    m.after = collective_counts(gm)
    log.info("collective passes on %s: %s", name, {k: (m.before[k], m.after[k]) for k in m.before})
    return gm, m


def bucket_fw_bw(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    config: CollectivePassesConfig | None = None,
    *,
    only: Sequence[str] | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule, PipelineMetrics]:
    """Run the collective passes on split graphs whose nodes carry the joint graph's tags.

    The passes the config switches on run, in :data:`COLLECTIVE_PASSES` order; ``only`` (pass
    names) runs exactly those instead, whatever the switches say (one pipeline stage per pass)."""
    config = config if config is not None else CollectivePassesConfig()
    metrics = PipelineMetrics()
    fw, metrics.graphs["fw"] = _run("fw", fw, config, only)
    bw, metrics.graphs["bw"] = _run("bw", bw, config, only)
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
    "COLLECTIVE_PASSES",
    "COLLECTIVE_PASS_NAMES",
    "CollectivePass",
    "CollectivePassesConfig",
    "GraphPassMetrics",
    "METRIC_FIELDS",
    "MetricField",
    "PipelineMetrics",
    "bucket_fw_bw",
    "bucket_joint",
    "bucketing_calls",
    "metric_json",
    "metric_text",
    "tag_joint",
]
