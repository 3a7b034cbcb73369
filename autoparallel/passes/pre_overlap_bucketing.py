"""Pre-overlap bucketing: merge per-parameter FSDP/DDP collectives before overlap scheduling.

Inductor's overlap scheduler adds ordering dependencies between consecutive collectives of a
process group, after which its own bucketer can no longer merge collectives that were
independent. This pass merges them first, in two phases:

1. :func:`tag_collectives_for_bucketing` runs on the **joint** graph, where placeholders and
   outputs still say what they are (``meta[ROLE]``): an all-gather whose input derives only from
   parameters is tagged ``fsdp_ag``; a reduce-scatter / all-reduce whose result flows only into
   gradient outputs is tagged ``grad_rs`` / ``grad_ar`` (``meta.bucket_tag(node)``, inside ``custom`` so it survives re-traces). The partitioner
   copies node meta, so the tags reach the split forward and backward graphs (and the backward's
   recomputed all-gathers).
2. :func:`bucket_tagged_collectives` runs on the **split** graphs (or any graph carrying tags):
   tagged collectives are grouped by (group, reduce op, dtype), bucketed greedily under
   ``bucket_cap_mb`` without an adjacency requirement and never together with one of their own
   descendants (:func:`autoparallel.passes.bucket_plan.plan_buckets`), merged with
   PyTorch's ``merge_*_bucket`` functions, and the graph is stable-topologically sorted.

PyTorch's all-gather merge writes this rank's shard into a rank-dependent slice of the bucket, so
a graph with merged all-gathers is specific to the rank whose world it was bucketed in: bucket on
each rank (or on a fake world entered with that rank). Patch ``pre_overlap_bucketing``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel import patches, roles
from autoparallel.defaults import BUCKET_CAP_MB
from autoparallel.fx_utils import (
    ALL_GATHER,
    ALL_GATHER_OUT,
    ALL_REDUCE,
    REDUCE_SCATTER,
    group_of,
    node_val,
    resolve_group,
    wait_of,
)
from autoparallel.passes.bucket_plan import BucketingMetrics, check_cap_mb, plan_buckets
from autoparallel.passes.contiguous_gathered_shards import make_gathered_shards_contiguous

log = logging.getLogger(__name__)

PATCH = "pre_overlap_bucketing"

TAG_FSDP_AG = "fsdp_ag"
TAG_GRAD_RS = "grad_rs"
TAG_GRAD_AR = "grad_ar"
TAGS = (TAG_FSDP_AG, TAG_GRAD_RS, TAG_GRAD_AR)


@dataclass(frozen=True)
class PreOverlapConfig:
    """``bucket_cap_mb``: the byte cap of one bucket. ``max_topo_span``: optional topological
    span bound (see topo_span_bucketing; None: bytes only)."""

    bucket_cap_mb: float = BUCKET_CAP_MB
    max_topo_span: int | None = None

    def __post_init__(self) -> None:
        check_cap_mb(self.bucket_cap_mb, "bucket_cap_mb")
        span = self.max_topo_span
        if span is not None and (isinstance(span, bool) or not isinstance(span, int) or span < 0):
            raise ValueError(f"max_topo_span must be None or an int >= 0, got {span!r}")


@dataclass
class TagCounts:
    """Collectives tagged on the joint graph, per tag, and those left untagged."""

    tagged: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TAGS})
    untagged: int = 0

    @property
    def total(self) -> int:
        return sum(self.tagged.values())


# --- phase 1: tagging on the joint graph ---------------------------------------------------------


def _graph(gm: fx.GraphModule | fx.Graph) -> fx.Graph:
    return gm.graph if isinstance(gm, fx.GraphModule) else gm


def param_derived_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from parameter placeholders only (placeholders with a ``param:`` role)."""
    derived: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if roles.is_param(node.meta.get(M.ROLE)):
                derived.add(node)
        elif node.op == "call_function":
            inputs = node.all_input_nodes
            if inputs and all(i in derived for i in inputs):
                derived.add(node)
    return derived


def gradient_terminal_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value reaches only gradient outputs (roles ``grad:*``), through single-input
    ops (a cast, a view): the gradient itself, not something a gradient is computed from.

    Every backward node of a joint graph flows only into gradients; requiring single-input ops
    on the way keeps e.g. a TP activation-gradient all-reduce (which feeds the next backward
    matmul) out, as upstream's ``is_fsdp_reduce_scatter_wait`` does."""
    out = graph.output_node()
    labels = out.meta.get(M.ROLE)
    if labels is None:
        raise ValueError(
            f"output node {out.name!r} has no meta[{M.ROLE!r}]: tag on the joint graph from "
            "autoparallel.parallelize.build_joint_graph (it labels outputs loss / grad:<fqn>)"
        )
    leaves = pytree.tree_leaves(out.args[0])
    if len(leaves) != len(labels):
        raise ValueError(
            f"output node {out.name!r}: {len(leaves)} outputs but {len(labels)} roles in "
            f"meta[{M.ROLE!r}]; the labels do not describe this graph"
        )
    grad_only: dict[fx.Node, bool] = {}
    for leaf, role in zip(leaves, labels, strict=True):
        if isinstance(leaf, fx.Node):
            is_grad = roles.is_grad(role)
            grad_only[leaf] = grad_only.get(leaf, True) and is_grad
    terminal: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op in ("output", "placeholder") or not node.users:
            continue
        ok = True
        for user in node.users:
            if user is out:
                ok = grad_only.get(node, False)
            else:
                ok = user in terminal and len(user.all_input_nodes) == 1
            if not ok:
                break
        if ok:
            terminal.add(node)
    return terminal


def tag_collectives_for_bucketing(gm: fx.GraphModule | fx.Graph) -> TagCounts:
    """Tag bucketable collectives of a joint graph (``meta.set_bucket_tag``); return the counts.

    Re-tagging is idempotent (tags are recomputed from scratch for every collective).
    """
    graph = _graph(gm)
    params = param_derived_nodes(graph)
    terminal = gradient_terminal_nodes(graph)
    counts = TagCounts()
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (
            ALL_GATHER,
            REDUCE_SCATTER,
            ALL_REDUCE,
        ):
            continue
        tag = None
        if node.target is ALL_GATHER:
            src = node.args[0]
            if isinstance(src, fx.Node) and src in params:
                tag = TAG_FSDP_AG
        elif node in terminal:
            tag = TAG_GRAD_RS if node.target is REDUCE_SCATTER else TAG_GRAD_AR
        if tag is None:
            M.set_bucket_tag(node, None)
            counts.untagged += 1
        else:
            M.set_bucket_tag(node, tag)
            counts.tagged[tag] += 1
    log.info("pre_overlap_bucketing: tagged %s, untagged %d", counts.tagged, counts.untagged)
    return counts


# --- phase 2: bucketing on split graphs ---------------------------------------------------------


@dataclass
class PreOverlapResult:
    """Collective counts per kind before/after, and the bucketing metrics per kind."""

    enabled: bool
    before: dict[str, int]
    after: dict[str, int]
    metrics: dict[str, BucketingMetrics] = field(default_factory=dict)

    def summary(self) -> str:
        parts = [f"{k} {self.before[k]}->{self.after[k]}" for k in self.before]
        return ", ".join(parts) + ("" if self.enabled else " (patch disabled)")


def collective_counts(gm: fx.GraphModule | fx.Graph) -> dict[str, int]:
    """Launches per kind (all_gather counts the bucketed ``_out`` variant too)."""
    c = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for node in _graph(gm).nodes:
        if node.op != "call_function":
            continue
        if node.target in (ALL_GATHER, ALL_GATHER_OUT):
            c["all_gather"] += 1
        elif node.target is REDUCE_SCATTER:
            c["reduce_scatter"] += 1
        elif node.target is ALL_REDUCE:
            c["all_reduce"] += 1
    return c


def _ag_key(n: fx.Node):
    return (group_of(n), None, node_val(n, "its bucket key").dtype)


def _reduce_key(n: fx.Node):
    return (group_of(n), n.args[1], node_val(n, "its bucket key").dtype)


def _kinds() -> list[tuple[str, object, str, Callable, Callable]]:
    from torch._inductor.fx_passes import bucketing as B

    return [
        ("all_gather", ALL_GATHER, TAG_FSDP_AG, _ag_key, B.merge_all_gather_bucket),
        ("reduce_scatter", REDUCE_SCATTER, TAG_GRAD_RS, _reduce_key, B.merge_reduce_scatter_bucket),
        ("all_reduce", ALL_REDUCE, TAG_GRAD_AR, _reduce_key, B.merge_all_reduce_bucket),
    ]


def bucket_tagged_collectives(
    gm: fx.GraphModule, config: PreOverlapConfig | None = None
) -> PreOverlapResult:
    """Merge the tagged collectives of ``gm`` into buckets in place; see the module docstring.

    Raises ValueError naming the node for a tagged collective whose process group the running
    world does not know, or that has no FakeTensor ``val``.
    """
    from torch._inductor.pattern_matcher import stable_topological_sort

    config = config if config is not None else PreOverlapConfig()
    graph = gm.graph
    before = collective_counts(graph)
    if not patches.enabled(PATCH):
        log.info("pre_overlap_bucketing: disabled (AUTOPARALLEL_DISABLE); graph left as is")
        return PreOverlapResult(False, before, dict(before))
    result = PreOverlapResult(True, before, {})
    cap = config.bucket_cap_mb
    for kind, target, tag, key, merge in _kinds():
        cands = [
            n
            for n in graph.nodes
            if n.op == "call_function" and n.target is target and M.bucket_tag(n) == tag
        ]
        for n in cands:
            resolve_group(n)
            node_val(n, "bucketing")
            if wait_of(n) is None:
                raise ValueError(
                    f"tagged collective {n.name!r} must have exactly one user, a wait_tensor; "
                    f"it has {[u.name for u in n.users]}"
                )
        buckets = plan_buckets(graph, cands, key, lambda _idx: cap, config.max_topo_span)
        result.metrics[kind] = buckets.metrics
        for bucket in buckets:
            merge(graph, bucket)
        if buckets:
            try:
                stable_topological_sort(graph)
            except AssertionError:
                raise RuntimeError(
                    f"pre_overlap_bucketing: merging {kind} buckets "
                    f"{[[n.name for n in b] for b in buckets]} left a cycle in the graph"
                ) from None
        log.info("pre_overlap_bucketing %s: %s", kind, buckets.metrics.summary())
    make_gathered_shards_contiguous(gm)
    graph.lint()
    gm.recompile()
    result.after = collective_counts(graph)
    log.info("pre_overlap_bucketing: %s", result.summary())
    return result


__all__ = [
    "PATCH",
    "TAGS",
    "TAG_FSDP_AG",
    "TAG_GRAD_AR",
    "TAG_GRAD_RS",
    "PreOverlapConfig",
    "PreOverlapResult",
    "TagCounts",
    "bucket_tagged_collectives",
    "collective_counts",
    "gradient_terminal_nodes",
    "param_derived_nodes",
    "tag_collectives_for_bucketing",
]
