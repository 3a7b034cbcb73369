"""What overlaps what: a graph replayed on a compute stream and one stream per process group.

The overlap scheduler decides an order; this shows what that order buys under the same CPU
roofline estimator (``autoparallel.passes.overlap_estimator.RooflineEstimator``). The model,
deliberately simple so a reviewer can check a picture by hand:

* nodes run in graph order on one compute stream; a compute node takes the estimator's time
  (views, getitems and other free nodes take none);
* a collective launch is issued when the compute stream reaches it and runs on its process
  group's stream, after the previous collective of that group (one NCCL stream per
  communicator); it costs the compute stream nothing;
* a ``wait_tensor`` blocks the compute stream until its collective ends: the blocked time is the
  collective's *exposed* time; the compute it ran beside is what it *hides behind*.

The result is plain data (milliseconds, names from the canonical text) for the SVG renderer.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import fx

from autoparallel.fx_utils import group_of
from verify.graphs.canon import canonical_names
from verify.graphs.classify import collective_kind, is_wait

__all__ = ["CollectiveSpan", "ComputeSpan", "OverlapTimeline", "overlap_timeline"]

_TOP_HIDDEN = 3


@dataclass(frozen=True)
class ComputeSpan:
    name: str
    start: float
    end: float


@dataclass
class CollectiveSpan:
    """One collective: issued at ``issue``, running ``start``..``end`` on its group's stream.

    ``waited_at``: when the compute stream reached its wait (None: never waited in this graph);
    ``exposed``: compute-stream time blocked on it; ``hidden``: the compute nodes it ran beside
    with the overlapping milliseconds, largest first (at most three), ``hidden_count`` all of them.
    """

    name: str
    kind: str
    dim: str
    nbytes: int
    issue: float
    start: float
    end: float
    waited_at: float | None = None
    exposed: float = 0.0
    hidden: list[tuple[str, float]] = field(default_factory=list)
    hidden_count: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class OverlapTimeline:
    compute: list[ComputeSpan]
    collectives: list[CollectiveSpan]
    total: float  # ms until the compute stream and every collective stream are done
    compute_total: float  # ms of compute

    @property
    def exposed(self) -> float:
        return sum(c.exposed for c in self.collectives)

    @property
    def dims(self) -> list[str]:
        return sorted({c.dim for c in self.collectives})


def _launch_of(node: fx.Node) -> fx.Node | None:
    """The collective a ``wait_tensor`` waits on (through a getitem of a coalesced launch)."""
    src = node.args[0] if node.args else None
    while isinstance(src, fx.Node) and collective_kind(src) is None and src.op == "call_function":
        ins = src.all_input_nodes
        if len(ins) != 1:
            return None
        src = ins[0]
    return src if isinstance(src, fx.Node) and collective_kind(src) is not None else None


def overlap_timeline(
    gm: fx.GraphModule,
    *,
    compute_ms: Callable[[fx.Node], float],
    collective_ms: Callable[[fx.Node], float],
    collective_bytes: Callable[[fx.Node], int],
    group_dims: Mapping[str, str],
) -> OverlapTimeline:
    """Replay ``gm`` (see the module docstring); estimator functions are passed in so tests can
    use round numbers. ``group_dims``: process-group name -> mesh-dim label."""
    names = canonical_names(gm)
    t = 0.0
    stream_free: dict[str, float] = {}
    compute: list[ComputeSpan] = []
    spans: dict[fx.Node, CollectiveSpan] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        kind = collective_kind(node)
        if kind is not None:
            group = group_of(node)
            dim = group_dims.get(group, group or "?") if group is not None else "?"
            start = max(t, stream_free.get(dim, 0.0))
            end = start + collective_ms(node)
            stream_free[dim] = end
            spans[node] = CollectiveSpan(names[node], kind, dim, collective_bytes(node), t, start, end)
            continue
        if is_wait(node):
            launch = _launch_of(node)
            span = spans.get(launch) if launch is not None else None
            if span is not None and span.waited_at is None:
                span.waited_at = t
                if span.end > t:
                    span.exposed = span.end - t
                    t = span.end
            continue
        d = compute_ms(node)
        if d > 0:
            compute.append(ComputeSpan(names[node], t, t + d))
            t += d
    starts = [c.start for c in compute]
    for span in spans.values():
        lo = max(bisect.bisect_right(starts, span.start) - 1, 0)
        overlaps = []
        for c in compute[lo:]:
            if c.start >= span.end:
                break
            ov = min(c.end, span.end) - max(c.start, span.start)
            if ov > 0:
                overlaps.append((c.name, ov))
        overlaps.sort(key=lambda x: -x[1])
        span.hidden = overlaps[:_TOP_HIDDEN]
        span.hidden_count = len(overlaps)
    total = max([t, *stream_free.values()])
    return OverlapTimeline(compute, list(spans.values()), total, sum(c.end - c.start for c in compute))
