"""Inductor's overlap scheduler, run on a CPU with our bucketing installed for its scope only.

The scheduler (``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing``)
reorders collectives against compute and pre-buckets FSDP collectives through module-level
functions of ``torch._inductor``. Replacing those for good would be an import-time patch, so
everything here is scoped: a context manager puts the replacement in place and restores upstream
on exit, exceptions included.

* :func:`topo_span_bucketing_installed`: ``identify_fsdp_groups`` and
  ``greedy_bucket_collective_by_mb`` become ``autoparallel.passes.topo_span_bucketing``'s (each
  only where its patch is enabled);
* :func:`cpu_runtime_estimation_installed`: the scheduler's built-in roofline
  (``estimate_roofline_runtime_ms``, which imports triton) goes through
  :class:`~autoparallel.passes.overlap_estimator.RooflineEstimator`;
* :func:`estimation_tables_only_when_traced`: the scheduler's table of compute estimates (a
  structured-trace artifact) is built only when a structured-trace handler listens: upstream
  builds it on every run, counting each compute node's FLOPs on fake tensors (a fifth of the
  pass at LLaMA-3 8B shapes) and then drops it when nobody listens;
* :func:`schedule_overlap_on_cpu`: the scheduler inside these scopes, with analytic compute and
  collective estimators (no benchmarking, no cross-rank alignment); logs
  ``max_consec_compute_between_rs`` of the result. This is the pass the collective-pass
  sequence calls ``topo_span_bucketing``.

The scheduler needs a running world (fake is fine) whose group names the graph uses, and
FakeTensor ``val`` on every node. The swaps are process-global module attributes: do not run
two differently configured scopes in parallel threads.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from autoparallel import patches
from autoparallel.fx_utils import max_consec_compute_between_rs
from autoparallel.passes.bucket_plan import BucketingMetrics
from autoparallel.passes.contiguous_gathered_shards import make_gathered_shards_contiguous
from autoparallel.passes.overlap_estimator import RooflineConfig, RooflineEstimator
from autoparallel.passes.topo_span_bucketing import (
    PRIMARY_FSDP_GROUP,
    TOPO_SPAN_BUCKETING,
    TopoSpanConfig,
    greedy_bucket_collective_by_mb,
    identify_fsdp_groups,
)
from autoparallel.trace import structured_trace_listens

log = logging.getLogger(__name__)

# The patch (autoparallel.patches) that estimation_tables_only_when_traced applies.
ESTIMATION_TABLES_PATCH = "estimation_tables_only_when_traced"


@dataclass
class Installation:
    """What :func:`topo_span_bucketing_installed` put in place, and what ran through it."""

    config: TopoSpanConfig
    patches: tuple[str, ...]  # the patch names in force inside the scope
    calls: list[BucketingMetrics] = field(default_factory=list)
    primary_groups: list[tuple[list[str], int | None]] = field(default_factory=list)


@contextlib.contextmanager
def topo_span_bucketing_installed(config: TopoSpanConfig | None = None) -> Iterator[Installation]:
    """Replace upstream ``identify_fsdp_groups`` / ``greedy_bucket_collective_by_mb`` in scope.

    Only the patches that are enabled (``AUTOPARALLEL_DISABLE``) are installed. The previous
    module attributes are restored on exit, exceptions included. This swaps process-global
    module attributes: do not run two differently configured scopes in parallel threads.
    """
    import torch._inductor.fx_passes.bucketing as bucketing_mod
    import torch._inductor.fx_passes.fsdp as fsdp_mod

    config = config if config is not None else TopoSpanConfig()
    in_force = tuple(p for p in (PRIMARY_FSDP_GROUP, TOPO_SPAN_BUCKETING) if patches.enabled(p))
    inst = Installation(config, in_force)

    def primary(gm):
        groups, size = identify_fsdp_groups(gm)
        inst.primary_groups.append((list(groups), size))
        return groups, size

    def greedy(gm, bucket_cap_mb_by_bucket_idx, filter_node, node_group_key, filter_wait_node=None):
        buckets = greedy_bucket_collective_by_mb(
            gm,
            bucket_cap_mb_by_bucket_idx,
            filter_node,
            node_group_key,
            filter_wait_node,
            max_topo_span=config.max_topo_span,
        )
        inst.calls.append(buckets.metrics)
        return buckets

    swaps = []
    if PRIMARY_FSDP_GROUP in in_force:
        swaps.append((fsdp_mod, "identify_fsdp_groups", primary))
    if TOPO_SPAN_BUCKETING in in_force:
        swaps.append((bucketing_mod, "greedy_bucket_collective_by_mb", greedy))
    saved = []
    try:
        for mod, name, new in swaps:
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, new)
        yield inst
    finally:
        for mod, name, old in reversed(saved):
            setattr(mod, name, old)


@contextlib.contextmanager
def cpu_runtime_estimation_installed(estimator: RooflineEstimator) -> Iterator[RooflineEstimator]:
    """Route the overlap scheduler's built-in roofline through ``estimator`` (no triton import)."""
    import torch._inductor.fx_passes.overlap_scheduling as sched

    saved = sched.estimate_roofline_runtime_ms
    sched.estimate_roofline_runtime_ms = estimator.compute_ms
    try:
        yield estimator
    finally:
        sched.estimate_roofline_runtime_ms = saved


@contextlib.contextmanager
def estimation_tables_only_when_traced() -> Iterator[None]:
    """Upstream ``_log_compute_estimations`` runs only when the structured trace has a handler
    (``TORCH_TRACE``, a test's capture): the artifact is then the same, and no table is built for
    nobody. The scheduler imports the function when it logs, so the module attribute is swapped.
    Nothing is swapped where the patch is disabled."""
    if not patches.enabled(ESTIMATION_TABLES_PATCH):
        yield
        return
    import torch._inductor.fx_passes.node_runtime_estimation as estimation

    upstream = estimation._log_compute_estimations

    def when_traced(*args, **kwargs):
        if structured_trace_listens():
            upstream(*args, **kwargs)

    estimation._log_compute_estimations = when_traced
    try:
        yield
    finally:
        estimation._log_compute_estimations = upstream


@dataclass
class OverlapResult:
    gm: fx.GraphModule
    bucketing_calls: list[BucketingMetrics]
    primary_groups: list[tuple[list[str], int | None]]
    max_consec_compute_between_rs: int
    patches: tuple[str, ...]


def schedule_overlap_on_cpu(
    gm: fx.GraphModule,
    config: TopoSpanConfig | None = None,
    roofline: RooflineConfig | None = None,
    **scheduler_kwargs: Any,
) -> OverlapResult:
    """Run upstream ``schedule_overlap_bucketing`` on ``gm`` without triton or a GPU.

    FSDP pre-bucketing inside it goes through topo-span bucketing (where enabled); extra keyword
    arguments are passed to the scheduler (e.g. ``collective_bucketing=True``).
    """
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    config = config if config is not None else TopoSpanConfig()
    estimator = RooflineEstimator(roofline)
    kwargs: dict[str, Any] = {
        "max_compute_pre_fetch": config.max_compute_pre_fetch,
        "custom_runtime_estimation": estimator,
        "compute_estimator": "analytical",
        "collective_estimator": "analytical",
        "pre_bucketing_fsdp_collectives": True,
        "pre_bucketing_fsdp_collectives_bucket_cap_mb": config.bucket_cap_mb,
    }
    kwargs.update(scheduler_kwargs)
    with (
        cpu_runtime_estimation_installed(estimator),
        estimation_tables_only_when_traced(),
        topo_span_bucketing_installed(config) as inst,
    ):
        new_gm = schedule_overlap_bucketing(gm, **kwargs)
    make_gathered_shards_contiguous(new_gm)
    new_gm.graph.lint()
    new_gm.recompile()
    metric = max_consec_compute_between_rs(new_gm.graph)
    log.info("overlap scheduling: max_consec_compute_between_rs=%d", metric)
    return OverlapResult(new_gm, inst.calls, inst.primary_groups, metric, inst.patches)


__all__ = [
    "ESTIMATION_TABLES_PATCH",
    "Installation",
    "OverlapResult",
    "cpu_runtime_estimation_installed",
    "estimation_tables_only_when_traced",
    "schedule_overlap_on_cpu",
    "topo_span_bucketing_installed",
]
