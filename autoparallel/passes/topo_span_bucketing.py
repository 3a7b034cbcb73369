"""Topo-span-bounded FSDP bucketing: the bucketing Inductor's overlap scheduler runs, replaced.

Inductor's overlap scheduler pre-buckets FSDP collectives through two module-level functions:
``torch._inductor.fx_passes.fsdp.identify_fsdp_groups`` (which process groups are FSDP groups) and
``torch._inductor.fx_passes.bucketing.greedy_bucket_collective_by_mb`` (which collectives share a
bucket). This module provides replacements for both (same signatures);
``autoparallel.passes.overlap_scheduling`` installs them only for the scope of a scheduler run:

* :func:`identify_fsdp_groups` returns only the *primary* group (the most FSDP all-gathers; a tie
  goes to the group whose first FSDP all-gather comes first). Minority groups (a TP all-gather,
  norms gathered on the flattened group) would otherwise join the bucketing pool. Patch
  ``primary_fsdp_group``.
* :func:`greedy_bucket_collective_by_mb` groups collectives by key with no adjacency requirement
  and closes a bucket when the next collective would exceed the byte cap or when its topological
  rank minus the bucket's first rank would exceed ``max_topo_span`` (ranks are taken before
  anything is mutated; ``None`` disables the bound). Merging far-apart collectives rewires
  dependencies, and the topological sort that follows can then pull many matmuls ahead of the
  first reduce-scatter; the span bound limits how far one merge reaches. Dependent collectives
  never share a bucket (:func:`autoparallel.passes.bucket_plan.plan_buckets`). Patch
  ``topo_span_bucketing``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx

from autoparallel.fx_utils import (
    ALL_GATHER,
    ALL_GATHER_OUT,
    WAIT,
    group_of,
    resolve_group,
    schema_arg,
)
from autoparallel.passes.bucket_plan import Buckets, check_cap_mb, plan_buckets, topological_order

log = logging.getLogger(__name__)

PRIMARY_FSDP_GROUP = "primary_fsdp_group"
TOPO_SPAN_BUCKETING = "topo_span_bucketing"

@dataclass(frozen=True)
class TopoSpanConfig:
    """Knobs of topo-span bucketing and of the overlap scheduling run around it.

    ``max_topo_span``: the largest ``rank(member) - rank(first member)`` a bucket may reach, in
    topological positions of the graph before bucketing (None: no bound, bytes only).
    ``max_compute_pre_fetch``: how many compute nodes the overlap scheduler may prefetch an
    all-gather ahead of its use (about 3 transformer layers; upstream's default elsewhere is 5).
    ``bucket_cap_mb``: the overlap scheduler's pre-bucketing cap (None: upstream computes one
    from its bandwidth-saturation model).
    """

    max_topo_span: int | None = 1500
    max_compute_pre_fetch: int = 50
    bucket_cap_mb: float | None = None

    def __post_init__(self) -> None:
        span = self.max_topo_span
        if span is not None and (isinstance(span, bool) or not isinstance(span, int) or span < 0):
            raise ValueError(f"max_topo_span must be None or an int >= 0, got {span!r}")
        pf = self.max_compute_pre_fetch
        if isinstance(pf, bool) or not isinstance(pf, int) or pf < 0:
            raise ValueError(f"max_compute_pre_fetch must be an int >= 0, got {pf!r}")
        if self.bucket_cap_mb is not None:
            check_cap_mb(self.bucket_cap_mb, "bucket_cap_mb")


def _check_groups(nodes: Sequence[fx.Node]) -> None:
    for n in nodes:
        resolve_group(n)


def greedy_bucket_collective_by_mb(
    gm: fx.GraphModule,
    bucket_cap_mb_by_bucket_idx: Callable[[int], float],
    filter_node: Callable[[fx.Node], bool],
    node_group_key: Callable[[fx.Node], Any],
    filter_wait_node: Callable[[fx.Node], bool] | None = None,
    *,
    max_topo_span: int | None = 1500,
) -> Buckets:
    """Upstream's signature; non-adjacent, byte- and topo-span-bounded, cycle-safe buckets.

    Candidates are the collectives ``c`` with a ``wait_tensor`` user ``w`` such that
    ``filter_node(c)`` and ``filter_wait_node(w)`` (if given) hold, and with no other user (the
    merge functions need exactly one wait). Returns the buckets (``.metrics`` says what happened)
    and logs the metrics at INFO.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    ranks = {n: i for i, n in enumerate(graph.nodes)}  # snapshot before anything mutates
    candidates: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not WAIT:
            continue
        coll = node.args[0]
        if not isinstance(coll, fx.Node) or coll in seen or not filter_node(coll):
            continue
        if filter_wait_node is not None and not filter_wait_node(node):
            continue
        seen.add(coll)
        if len(coll.users) == 1:
            candidates.append(coll)
    _check_groups(candidates)
    buckets = plan_buckets(
        graph, candidates, node_group_key, bucket_cap_mb_by_bucket_idx, max_topo_span, ranks
    )
    log.info("topo_span_bucketing: %s", buckets.metrics.summary())
    return buckets


# --- primary FSDP group -----------------------------------------------------------------------


def fsdp_all_gathers(graph: fx.Graph) -> list[fx.Node]:
    """All-gathers with exactly one placeholder among their ancestors (upstream's FSDP test),
    found with one pass of placeholder-ancestor bitsets instead of a BFS per all-gather; listed
    in graph order."""
    ph_bit: dict[fx.Node, int] = {}
    anc: dict[fx.Node, int] = {}
    for node in topological_order(graph):
        a = 0
        for inp in node.all_input_nodes:
            a |= anc[inp] | ph_bit.get(inp, 0)
        anc[node] = a
        if node.op == "placeholder":
            ph_bit[node] = 1 << len(ph_bit)
    return [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and n.target in (ALL_GATHER, ALL_GATHER_OUT)
        and anc[n].bit_count() == 1
    ]


def identify_fsdp_groups(gm: fx.GraphModule | fx.Graph):
    """``(OrderedSet([primary group name]), its group size)``, or ``(OrderedSet(), None)``.

    The primary group is the one with the most FSDP all-gathers; a tie goes to the group whose
    first FSDP all-gather comes first in the graph, so exactly one group is returned.
    """
    from torch.utils._ordered_set import OrderedSet

    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    counts: dict[str, int] = {}
    sizes: dict[str, int | None] = {}
    for ag in fsdp_all_gathers(graph):
        name = group_of(ag)
        counts[name] = counts.get(name, 0) + 1
        sizes.setdefault(name, schema_arg(ag, "group_size"))
    if not counts:
        log.debug("identify_fsdp_groups: no FSDP all-gather")
        return OrderedSet(), None
    primary = max(counts, key=counts.__getitem__)  # max keeps the first of equal counts
    log.info("identify_fsdp_groups: FSDP all-gathers per group %s; primary %r", counts, primary)
    return OrderedSet([primary]), sizes[primary]


__all__ = [
    "PRIMARY_FSDP_GROUP",
    "TOPO_SPAN_BUCKETING",
    "TopoSpanConfig",
    "fsdp_all_gathers",
    "greedy_bucket_collective_by_mb",
    "identify_fsdp_groups",
]
