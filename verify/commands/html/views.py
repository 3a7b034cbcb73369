"""Stage records -> plain data the page draws: canonical texts, stats, liveness, buckets,
overlap timelines, golden comparison. Everything that touches FX graphs happens here; the SVG
and page modules only see the ``StageView`` this returns.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel.fx_utils import group_arg_index, group_of, group_size_of
from autoparallel.mesh import MeshSpec, group_dims_of
from autoparallel.passes.collective import GraphPassMetrics, bucketing_calls
from autoparallel.passes.overlap_estimator import RooflineEstimator
from verify.commands.html.records import Parity, StageRecord
from verify.commands.html.svg import BucketPanel, BucketView
from verify.commands.html.timeline import OverlapTimeline, overlap_timeline
from verify.graphs.canon import canonical_names, canonicalize
from verify.graphs.memory import with_fresh_vals
from verify.graphs.classify import collective_kind, collective_node_bytes
from verify.graphs.liveness import StaticLiveness, static_liveness
from verify.graphs.stats import format_stats_table, graph_stats, partition_stats

__all__ = ["StageView", "stage_view", "golden_sections", "stage_text"]

_SECTION_RE = re.compile(r"^== (.+) ==$")
_GRAPH_KEYS = {"fw": 0, "bw": 1}


@dataclass
class StageView:
    name: str
    texts: dict[str, str]  # graph label ("graph" / "forward" / "backward") -> canonical text
    stats: dict[str, Any]  # GraphStats / PartitionStats .to_dict()
    liveness: StaticLiveness
    collectives: dict[tuple[str, str], tuple[int, int]]  # (kind, dim) -> (count, bytes), all graphs
    timelines: dict[str, OverlapTimeline] = field(default_factory=dict)  # graphs with collectives
    buckets: list[BucketPanel] | None = None  # None: the stage bucketed nothing
    measured: Any = None  # verify.graphs.memory.MemoryTimeline
    golden: str | None = None  # the golden file's text
    golden_now: str | None = None  # the same golden with this run's stats and graphs
    parity: Parity | None = None
    bucket_summaries: list[str] = field(default_factory=list)
    previous: str | None = None  # the view the previous-stage diff compares with (None: the one before)

    @property
    def golden_status(self) -> str:
        if self.golden is None:
            return "none"
        return "matches" if self.golden == self.golden_now else "differs"

    @property
    def num_nodes(self) -> list[int]:
        if "fw" in self.stats:
            return [self.stats["fw"]["num_nodes"], self.stats["bw"]["num_nodes"]]
        return [self.stats["num_nodes"]]


def stage_text(view: StageView) -> str:
    """The stage's graphs as one text (``== forward ==`` / ``== backward ==`` sections when a
    pair), what the diff against the previous stage compares."""
    if list(view.texts) == ["graph"]:
        return view.texts["graph"]
    return "".join(f"== {label} ==\n{text}" for label, text in view.texts.items())


# --- goldens ------------------------------------------------------------------------------------


def golden_sections(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(lines before the first section, [(section name, body)]) of a golden file's text, the
    inverse of ``verify.goldens.text.render_golden``."""
    lines = text.split("\n")
    head: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    for i, line in enumerate(lines):
        m = _SECTION_RE.match(line)
        if m and (i == 0 or lines[i - 1] == ""):
            if sections:
                sections[-1][1].pop()  # the blank line before this header
            elif head and head[-1] == "":
                head.pop()
            sections.append((m.group(1), []))
        elif sections:
            sections[-1][1].append(line)
        else:
            head.append(line)
    return head, [(name, "\n".join(body)) for name, body in sections]


def golden_with_current(golden: str, current: Mapping[str, str]) -> str:
    """``golden`` with each section named in ``current`` (stats, graphs) replaced by this run's
    text (sections the file lacks are appended); the title and header stay as the file has
    them, so the result equals the file exactly when the stats and graphs still match."""
    head, sections = golden_sections(golden)
    lines = list(head)
    for name, body in sections:
        lines += ["", f"== {name} ==", current.get(name, body).rstrip("\n")]
    for name in current:
        if name not in dict(sections):
            lines += ["", f"== {name} ==", current[name].rstrip("\n")]
    return "\n".join(lines) + "\n"


# --- buckets ------------------------------------------------------------------------------------


def _role_label(node: fx.Node) -> str | None:
    """The parameter an all-gather gathers, or the gradient a reduction produces, if the graph
    says so through single-input chains."""
    if collective_kind(node) == "all_gather":
        x = node.args[0] if node.args else None
        while isinstance(x, fx.Node) and x.op != "placeholder" and len(x.all_input_nodes) == 1:
            x = x.all_input_nodes[0]
        role = x.meta.get(M.ROLE) if isinstance(x, fx.Node) and x.op == "placeholder" else None
        return role if isinstance(role, str) else None
    x = node
    while len(x.users) == 1:
        (user,) = x.users
        if user.op == "output":
            roles = user.meta.get(M.ROLE)
            leaves = pytree.tree_leaves(user.args[0])
            if isinstance(roles, (list, tuple)) and x in leaves:
                role = roles[leaves.index(x)] if leaves.index(x) < len(roles) else None
                return role if isinstance(role, str) else None
            return None
        x = user
    return None


def _kind_from_name(name: str) -> str:
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        if name.startswith(kind):
            return kind
    return "collective"


def _bucket_panels(record: StageRecord) -> tuple[list[BucketPanel] | None, list[str]]:
    metrics = record.metrics
    if metrics is None or not getattr(metrics, "graphs", None):
        return None, []
    inputs = record.inputs
    panels: list[BucketPanel] = []
    summaries: list[str] = []
    ran = False
    for gkey, gm_metrics in metrics.graphs.items():
        graph_label = {"fw": "forward", "bw": "backward"}.get(gkey, gkey)
        src = None
        if isinstance(inputs, tuple) and gkey in _GRAPH_KEYS:
            src = inputs[_GRAPH_KEYS[gkey]]
        elif isinstance(inputs, fx.GraphModule):
            src = inputs
        by_name = {n.name: n for n in src.graph.nodes} if src is not None else {}
        canon = canonical_names(src) if src is not None else {}
        dims = group_dims_of(src) if src is not None else {}
        calls = bucketing_calls(gm_metrics) if isinstance(gm_metrics, GraphPassMetrics) else []
        grouped: dict[tuple[str, str], list[BucketView]] = {}
        bounds: dict[tuple[str, str], int | None] = {}
        ran = ran or bool(calls)
        for kind, m in calls:
            if m.num_candidates:
                summaries.append(f"{graph_label} {kind or 'overlap scheduler'}: {m.summary()}")
            for rec in m.buckets:
                first = by_name.get(rec.members[0])
                k = kind or (collective_kind(first) if first is not None else _kind_from_name(rec.members[0]))
                dim = dims.get(rec.group, rec.group or "?")
                labels = []
                for member in rec.members:
                    node = by_name.get(member)
                    if node is None:
                        labels.append(member)
                        continue
                    role = _role_label(node)
                    labels.append(f"{role} ({canon[node]})" if role else canon[node])
                grouped.setdefault((k, dim), []).append(
                    BucketView(tuple(labels), rec.member_bytes, rec.cap_bytes, rec.span, rec.closed_by)
                )
                bounds[(k, dim)] = m.max_topo_span
        for (k, dim), views in grouped.items():
            panels.append(BucketPanel(graph_label, k, dim, tuple(views), bounds[(k, dim)]))
    return (panels if ran else None), summaries


# --- overlap ------------------------------------------------------------------------------------


def group_size_fn(mesh: MeshSpec | None, group_dims: Mapping[str, str]) -> Callable[[fx.Node], int]:
    """A collective's group size: its ``group_size`` argument, else the product of its mesh
    dims' sizes (``dp*tp`` -> dp * tp), else the running world's group."""

    def size(node: fx.Node) -> int:
        idx = group_arg_index(node)
        if idx is not None:
            for i, arg in enumerate(node.target._schema.arguments):
                if arg.name == "group_size":
                    return int(node.args[i] if i < len(node.args) else node.kwargs["group_size"])
        label = group_dims.get(group_of(node) or "")
        if mesh is not None and label is not None:
            n = 1
            for d in label.split("*"):
                n *= mesh.size(d)
            return n
        return group_size_of(node)

    return size


def _timeline(gm: fx.GraphModule, mesh: MeshSpec | None, roofline) -> OverlapTimeline:
    dims = group_dims_of(gm)
    est = RooflineEstimator(roofline, group_size=group_size_fn(mesh, dims))
    return overlap_timeline(
        gm,
        compute_ms=est.compute_ms,
        collective_ms=est.collective_ms,
        collective_bytes=collective_node_bytes,
        group_dims=dims,
    )


# --- the view -----------------------------------------------------------------------------------


def stage_view(record: StageRecord, *, mesh: MeshSpec | None = None, roofline=None) -> StageView:
    """Everything the page shows of one stage (see the module docstring)."""
    graphs = record.graph_list
    texts = {label: canonicalize(gm) for label, gm in graphs}
    if isinstance(record.graphs, tuple):
        fw, bw = record.graphs
        st = partition_stats(fw, bw)
        liveness = static_liveness(*(with_fresh_vals(g) for g in (fw, bw))) if record.refresh_vals else static_liveness(fw, bw)
        per_graph = [st.fw, st.bw]
    else:
        st = graph_stats(record.graphs)
        liveness = static_liveness(with_fresh_vals(record.graphs) if record.refresh_vals else record.graphs)
        per_graph = [st]
    collectives: dict[tuple[str, str], tuple[int, int]] = {}
    for g in per_graph:
        for kind, per in g.collectives.items():
            for dim, cs in per.items():
                c, b = collectives.get((kind, dim), (0, 0))
                collectives[(kind, dim)] = (c + cs.count, b + cs.bytes)
    timelines = {
        label: _timeline(gm, mesh, roofline)
        for (label, gm), g in zip(graphs, per_graph, strict=True)
        if g.categories["collective"]
    }
    panels, summaries = _bucket_panels(record)
    golden_now = None
    if record.golden is not None:
        current = {"stats": format_stats_table(st), **texts}
        golden_now = golden_with_current(record.golden, current)
    return StageView(
        name=record.name,
        texts=texts,
        stats=st.to_dict(),
        liveness=liveness,
        collectives=collectives,
        timelines=timelines,
        buckets=panels,
        measured=record.measured_memory,
        golden=record.golden,
        golden_now=golden_now,
        parity=record.parity,
        bucket_summaries=summaries,
        previous=record.previous,
    )
