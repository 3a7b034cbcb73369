"""Topo-span-bounded FSDP bucketing: the bucketing Inductor's overlap scheduler runs, replaced.

Inductor's overlap scheduler pre-buckets FSDP collectives through two module-level functions:
``torch._inductor.fx_passes.fsdp.identify_fsdp_groups`` (which process groups are FSDP groups) and
``torch._inductor.fx_passes.bucketing.greedy_bucket_collective_by_mb`` (which collectives share a
bucket). This module provides replacements for both and installs them only inside
:func:`topo_span_bucketing_installed`, a context manager that restores upstream on exit:

* :func:`identify_fsdp_groups` returns only the *primary* group (the most FSDP all-gathers; a tie
  goes to the group whose first FSDP all-gather comes first). Minority groups (a TP all-gather,
  norms gathered on the flattened group) would otherwise join the bucketing pool. Patch
  ``primary_fsdp_group``.
* :func:`greedy_bucket_collective_by_mb` (upstream's signature) groups collectives by key with no
  adjacency requirement and closes a bucket when the next collective would exceed the byte cap or
  when its topological rank minus the bucket's first rank would exceed ``max_topo_span`` (ranks
  are taken before anything is mutated; ``None`` disables the bound). Merging far-apart
  collectives rewires dependencies, and the topological sort that follows can then pull many
  matmuls ahead of the first reduce-scatter; the span bound limits how far one merge reaches.
  Patch ``topo_span_bucketing``.

Dependent collectives never share a bucket. The check runs on the graph *as it will be after
merging*: every bucket formed so far is treated as contracted into one node, so two buckets of
different keys cannot close a cycle through each other (which a per-bucket descendant test
misses). Reachability between candidate collectives is kept as Python ints used as bitsets,
computed in one pass over the graph (graphs reach ~30k nodes at LLaMA-3 8B scale).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from autoparallel import patches
from autoparallel.fx_utils import (
    ALL_GATHER,
    ALL_GATHER_OUT,
    WAIT,
    collective_bytes,
    group_arg_index,
    group_of,
    resolve_group,
)

log = logging.getLogger(__name__)

PRIMARY_FSDP_GROUP = "primary_fsdp_group"
TOPO_SPAN_BUCKETING = "topo_span_bucketing"

_MB = 1024 * 1024


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


def check_cap_mb(cap_mb: Any, what: str = "bucket cap") -> float:
    """``cap_mb`` as a float, or a ValueError that names the bad value."""
    if isinstance(cap_mb, bool) or not isinstance(cap_mb, int | float) or not cap_mb > 0:
        raise ValueError(f"{what} must be a number of MB > 0, got {cap_mb!r}")
    return float(cap_mb)


@dataclass(frozen=True)
class BucketRecord:
    """One bucket of two or more collectives, as planned (before merging renames anything).

    ``members``: the collectives' node names in graph order, with their bytes; ``group``: their
    process group name; ``cap_bytes``: the byte cap of this bucket's index; ``span``: topological
    rank of the last member minus the first's; ``closed_by``: why the bucket ended (``bytes``:
    the next collective would exceed the cap, ``span``: it would exceed ``max_topo_span``,
    ``end``: no collective of its key was left). Reports draw buckets from these.
    """

    group: str | None
    members: tuple[str, ...]
    member_bytes: tuple[int, ...]
    cap_bytes: int
    span: int
    closed_by: str

    @property
    def nbytes(self) -> int:
        return sum(self.member_bytes)


@dataclass
class BucketingMetrics:
    """What one bucketing call did (logged at INFO, returned to the caller)."""

    num_candidates: int = 0
    num_buckets: int = 0  # buckets of two or more collectives (the ones that get merged)
    num_bucketed: int = 0  # collectives inside those buckets
    max_observed_span: int = 0  # largest rank(last member) - rank(first member) of a bucket
    closed_by_bytes: int = 0
    closed_by_span: int = 0
    skipped_dependent: int = 0  # collectives left alone: dependent on their key's open bucket
    max_topo_span: int | None = None
    buckets: list[BucketRecord] = field(default_factory=list)  # in graph order of first members

    def summary(self) -> str:
        return (
            f"{self.num_buckets} buckets ({self.num_bucketed} of {self.num_candidates} collectives), "
            f"max_span={self.max_observed_span}, closed (bytes={self.closed_by_bytes}, "
            f"span={self.closed_by_span}), skipped dependent={self.skipped_dependent}, "
            f"max_topo_span={self.max_topo_span}"
        )


class Buckets(list):
    """``list[list[fx.Node]]``, upstream's return type, that also carries the call's metrics."""

    def __init__(self, buckets=(), metrics: BucketingMetrics | None = None):
        super().__init__(buckets)
        self.metrics = metrics if metrics is not None else BucketingMetrics()


# --- reachability between candidate collectives ----------------------------------------------


def _bits(x: int) -> Iterator[int]:
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low


def topological_order(graph: fx.Graph) -> list[fx.Node]:
    """The graph's nodes in a dependency order, whatever their list order (upstream's merge
    functions leave a graph unsorted until the next stable topological sort)."""
    from collections import deque

    indeg = {n: len(n.all_input_nodes) for n in graph.nodes}
    ready = deque(n for n in graph.nodes if indeg[n] == 0)
    order = []
    while ready:
        n = ready.popleft()
        order.append(n)
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if len(order) != len(indeg):
        stuck = [n.name for n in graph.nodes if indeg[n] > 0][:5]
        raise ValueError(f"the graph has a cycle (nodes {stuck} never become ready)")
    return order


class CandidateReachability:
    """Transitive reachability among ``candidates``, kept up to date as buckets are contracted.

    ``anc[i]`` / ``desc[i]`` are bitsets (ints) over candidate indices: the candidates that reach
    candidate ``i`` / that ``i`` reaches, through any nodes of the graph. ``contract(bits)`` folds
    a set of candidates into one node (what merging them into one collective does to the
    dependency graph); reachability stays transitively closed.
    """

    def __init__(self, graph: fx.Graph, candidates: Sequence[fx.Node]):
        index = {c: i for i, c in enumerate(candidates)}
        reach: dict[fx.Node, int] = {}
        for node in topological_order(graph):
            a = 0
            for inp in node.all_input_nodes:
                a |= reach[inp]
                j = index.get(inp)
                if j is not None:
                    a |= 1 << j
            reach[node] = a
        self.anc = [reach[c] for c in candidates]
        self.desc = [0] * len(candidates)
        for i, a in enumerate(self.anc):
            for j in _bits(a):
                self.desc[j] |= 1 << i

    def dependent(self, i: int, members: int, rep: int) -> bool:
        """Whether candidate ``i`` and the contracted group ``members`` (with representative
        ``rep``) reach one another, i.e. merging them would close a cycle."""
        return bool((self.desc[rep] >> i) & 1) or bool(self.desc[i] & members)

    def contract(self, members: int) -> None:
        into = members
        out = members
        for m in _bits(members):
            into |= self.anc[m]
            out |= self.desc[m]
        for y in _bits(into):
            self.desc[y] |= out
        for x in _bits(out):
            self.anc[x] |= into


@dataclass
class _OpenBucket:
    members: list[int]
    bits: int
    nbytes: int
    first_rank: int
    idx: int


def plan_buckets(
    graph: fx.Graph,
    candidates: Sequence[fx.Node],
    node_group_key: Callable[[fx.Node], Any],
    bucket_cap_mb_by_bucket_idx: Callable[[int], float],
    max_topo_span: int | None,
    ranks: dict[fx.Node, int] | None = None,
) -> Buckets:
    """Greedy bucketing of ``candidates`` (collective launches of ``graph``).

    One open bucket per key; candidates are visited in graph order. A candidate closes
    its key's open bucket and starts a new one when the bytes would exceed the cap of that
    bucket's index, or when its rank minus the bucket's first rank would exceed
    ``max_topo_span``. Otherwise, if it depends on the open bucket or the bucket depends on it
    (counting the buckets formed so far as merged), it is left out of every bucket; else it
    joins. Buckets of one collective are dropped (nothing to merge). The dependency test is
    exact whatever the visiting order (the graph need not be sorted: upstream's merges leave it
    unsorted between calls).
    """
    if max_topo_span is not None and (
        isinstance(max_topo_span, bool) or not isinstance(max_topo_span, int) or max_topo_span < 0
    ):
        raise ValueError(f"max_topo_span must be None or an int >= 0, got {max_topo_span!r}")
    if ranks is None:
        ranks = {n: i for i, n in enumerate(graph.nodes)}
    cands = sorted(dict.fromkeys(candidates), key=ranks.__getitem__)
    metrics = BucketingMetrics(num_candidates=len(cands), max_topo_span=max_topo_span)
    out = Buckets(metrics=metrics)
    if len(cands) < 2:
        return out
    sizes = [collective_bytes(c) for c in cands]
    keys = [node_group_key(c) for c in cands]
    reach = CandidateReachability(graph, cands)
    cap_cache: dict[int, int] = {}

    def cap_bytes(idx: int) -> int:
        if idx not in cap_cache:
            mb = check_cap_mb(bucket_cap_mb_by_bucket_idx(idx), f"bucket cap of bucket {idx}")
            cap_cache[idx] = int(mb * _MB)
        return cap_cache[idx]

    def close(b: _OpenBucket, closed_by: str) -> None:
        if len(b.members) > 1:
            bucket = [cands[i] for i in b.members]
            out.append(bucket)
            metrics.num_buckets += 1
            metrics.num_bucketed += len(bucket)
            span = ranks[bucket[-1]] - ranks[bucket[0]]
            metrics.max_observed_span = max(metrics.max_observed_span, span)
            metrics.buckets.append(
                BucketRecord(
                    group_of(bucket[0]),
                    tuple(n.name for n in bucket),
                    tuple(sizes[i] for i in b.members),
                    cap_bytes(b.idx),
                    span,
                    closed_by,
                )
            )

    open_buckets: dict[Any, _OpenBucket] = {}
    for i, c in enumerate(cands):
        key, size, rank = keys[i], sizes[i], ranks[c]
        b = open_buckets.get(key)
        if b is None:
            open_buckets[key] = _OpenBucket([i], 1 << i, size, rank, 0)
            continue
        if b.nbytes + size > cap_bytes(b.idx):
            metrics.closed_by_bytes += 1
            reason = "bytes"
        elif max_topo_span is not None and rank - b.first_rank > max_topo_span:
            metrics.closed_by_span += 1
            reason = "span"
        elif reach.dependent(i, b.bits, b.members[0]):
            metrics.skipped_dependent += 1
            continue
        else:
            b.members.append(i)
            b.bits |= 1 << i
            b.nbytes += size
            reach.contract(b.bits)
            continue
        close(b, reason)
        open_buckets[key] = _OpenBucket([i], 1 << i, size, rank, b.idx + 1)
    for b in open_buckets.values():
        close(b, "end")
    out.sort(key=lambda bucket: ranks[bucket[0]])
    order = {bucket[0].name: k for k, bucket in enumerate(out)}
    metrics.buckets.sort(key=lambda rec: order[rec.members[0]])
    return out


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


def _int_arg(node: fx.Node, name: str) -> int | None:
    target = node.target
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


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
        sizes.setdefault(name, _int_arg(ag, "group_size"))
    if not counts:
        log.debug("identify_fsdp_groups: no FSDP all-gather")
        return OrderedSet(), None
    primary = max(counts, key=counts.__getitem__)  # max keeps the first of equal counts
    log.info("identify_fsdp_groups: FSDP all-gathers per group %s; primary %r", counts, primary)
    return OrderedSet([primary]), sizes[primary]


# --- scoped installation into Inductor ----------------------------------------------------------


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


def group_size_of(node: fx.Node) -> int:
    """Group size of a collective: its ``group_size`` argument, else its live group's size."""
    size = _int_arg(node, "group_size") if group_arg_index(node) is not None else None
    if size is None:
        size = resolve_group(node).size()
    return int(size)


__all__ = [
    "BucketRecord",
    "BucketingMetrics",
    "Buckets",
    "CandidateReachability",
    "Installation",
    "TopoSpanConfig",
    "check_cap_mb",
    "fsdp_all_gathers",
    "greedy_bucket_collective_by_mb",
    "group_size_of",
    "identify_fsdp_groups",
    "plan_buckets",
    "topo_span_bucketing_installed",
    "topological_order",
]
