"""Graph statistics for goldens and checks: collectives per mesh dim, saved tensors, static peak.

Conventions (stable; goldens depend on them):

* **Node categories** (every node gets exactly one): ``placeholder``, ``output``, ``collective``
  (a ``_c10d_functional`` / ``_c10d_functional_autograd`` collective launch), ``wait``
  (``wait_tensor``), ``view`` (aten ops whose schema says they alias their input, plus
  ``_unsafe_view`` and ``reshape``), ``compute`` (any other call that produces tensors, including
  ``call_method``/``call_module`` and higher-order ops), ``other`` (``getitem``, ``get_attr``,
  symbolic-size arithmetic and other ops returning no tensor).
* **Collective kinds**: ``all_gather`` (``all_gather_into_tensor``, ``_out``, ``_coalesced``),
  ``reduce_scatter`` (``reduce_scatter_tensor``, ``_out``, ``_coalesced``), ``all_reduce``
  (``all_reduce``, ``all_reduce_``, ``_coalesced``, ``_coalesced_``), ``all_to_all``
  (``all_to_all_single``), ``broadcast`` (``broadcast``, ``broadcast_``), ``p2p`` (``isend``,
  ``irecv``, ``batch_p2p_ops``); any other op of those namespaces keeps its op name (a collective
  added upstream shows up under its own name instead of vanishing). Each is counted per mesh-dim
  label of its ``group_name`` argument (``?`` for an op without one).
* **Collective bytes** are the bytes of the full (unsharded) buffer, ``numel * element_size`` of
  a FakeTensor: the OUTPUT of an all-gather; for every other kind the INPUT, i.e. the op's first
  tensor argument by its schema (``input`` of a reduce-scatter, all-reduce, all-to-all and
  broadcast, ``tensor`` of ``isend``/``irecv``, ``tensors`` of ``batch_p2p_ops``), passed by
  position or by keyword. Coalesced variants sum over their tensors. Symbolic sizes use the
  trace-time hint (``optimization_hint``); a data-dependent (unbacked) size has none and raises
  ``ValueError`` naming the node.
* **Padding** (uneven FSDP shards, ``autoparallel.parallelize.plan``): the collective bytes
  above count the padded buffers, which is what goes on the wire; the padding part of them is
  counted per collective kind and mesh dim, as count (padded tensors) and bytes. An all-gather's
  padding is what a dim-0 narrow (``aten.slice`` on dim 0 from 0, the only reader of its input)
  drops from the gathered tensor, found walking up single-input nodes (views, a bucket's split)
  to the wait of an all-gather; a reduce-scatter's padding is what a trailing dim-0
  ``aten.constant_pad_nd`` adds, found walking down single-user nodes (views, a bucket's
  concatenation) to a reduce-scatter. Bytes are the difference of the two ``val`` sizes.
* ``max_consec_compute_between_rs``: for each pair of consecutive reduce-scatter launches in graph
  order, the number of FLOP-counted compute nodes between them (mm, bmm, addmm, SDPA, ...:
  ``autoparallel.fx_utils.is_flop_compute``, what Inductor's overlap scheduler calls a
  compute node and what the seeds' telemetry counts); the maximum over pairs (0 with fewer than
  two reduce-scatters). One definition, shared with the overlap pass's own log line.
* **Saved tensors** of a forward/backward pair: the backward graph's placeholders that are not
  tangents (role ``tangent:*`` if the placeholder has a ``ROLE``, else a name starting with
  ``tangents``) and whose ``val`` is a tensor; bytes are ``numel * element_size``.
* **Static peak** (``verify.graphs.liveness.static_peak_bytes``): a liveness walk over FakeTensor storages, see its
  docstring.

A node whose ``meta["val"]`` is needed for a byte count and missing raises ``ValueError`` naming
the node.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autoparallel import meta as M
from autoparallel.fx_utils import max_consec_compute_between_rs, node_val
from autoparallel.mesh import group_dims_of
from verify.graphs.canon import graph_and_owner
from verify.graphs.classify import (
    CATEGORIES,
    COLLECTIVE_KINDS,
    collective_bytes,
    collective_kind,
    group_label,
    is_wait,
    node_arg,
    node_category,
    tensor_bytes,
    value_bytes,
)
from verify.graphs.liveness import saved_placeholders, static_peak_bytes

__all__ = [
    "CollectiveStat",
    "GraphStats",
    "PartitionStats",
    "graph_stats",
    "partition_stats",
    "format_stats_table",
    "human_bytes",
]

# --- GraphStats ---------------------------------------------------------------------------------


@dataclass
class CollectiveStat:
    count: int = 0
    bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"bytes": self.bytes, "count": self.count}


def _kind_order(kind: str) -> tuple[int, str]:
    return (
        COLLECTIVE_KINDS.index(kind) if kind in COLLECTIVE_KINDS else len(COLLECTIVE_KINDS),
        kind,
    )


@dataclass
class GraphStats:
    num_nodes: int = 0
    categories: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    collectives: dict[str, dict[str, CollectiveStat]] = field(
        default_factory=dict
    )  # kind -> dim -> stat
    waits: int = 0
    recompute: dict[str, int] = field(default_factory=dict)  # CheckpointPolicy name -> node count
    must_save: int = 0  # nodes tagged custom.ap_must_save
    max_consec_compute_between_rs: int = 0
    padding: dict[str, dict[str, CollectiveStat]] = field(default_factory=dict)  # kind -> dim -> stat

    def padding_bytes(self, kind: str | None = None, dim: str | None = None) -> int:
        """Bytes of FSDP padding moved by collectives of ``kind`` on mesh dim ``dim`` (None: all)."""
        return sum(
            s.bytes
            for k, per in self.padding.items()
            if kind is None or k == kind
            for d, s in per.items()
            if dim is None or d == dim
        )

    def collective_count(self, kind: str, dim: str | None = None) -> int:
        per = self.collectives.get(kind, {})
        return sum(s.count for d, s in per.items() if dim is None or d == dim)

    def collective_bytes(self, kind: str, dim: str | None = None) -> int:
        per = self.collectives.get(kind, {})
        return sum(s.bytes for d, s in per.items() if dim is None or d == dim)

    def to_dict(self) -> dict[str, Any]:
        return {
            "categories": {k: self.categories[k] for k in sorted(self.categories)},
            "collectives": {
                kind: {
                    d: self.collectives[kind][d].to_dict() for d in sorted(self.collectives[kind])
                }
                for kind in sorted(self.collectives)
            },
            "max_consec_compute_between_rs": self.max_consec_compute_between_rs,
            "must_save": self.must_save,
            "num_nodes": self.num_nodes,
            "recompute": {k: self.recompute[k] for k in sorted(self.recompute)},
            "waits": self.waits,
            # only when there is padding: reports of evenly sharded graphs stay as they were
            **({"padding": _per_kind_dict(self.padding)} if self.padding else {}),
        }


def _per_kind_dict(table: dict[str, dict[str, CollectiveStat]]) -> dict[str, dict[str, dict[str, int]]]:
    return {kind: {d: table[kind][d].to_dict() for d in sorted(table[kind])} for kind in sorted(table)}


def _group_dims(gm: Any, group_dims: Mapping[str, str] | None) -> Mapping[str, str]:
    if group_dims is not None:
        return group_dims
    _, owner = graph_and_owner(gm)
    return group_dims_of(owner) if owner is not None else {}


def graph_stats(
    gm: fx.GraphModule | fx.Graph, *, group_dims: Mapping[str, str] | None = None
) -> GraphStats:
    """Counts of one graph; see the module docstring for the conventions."""
    graph, _ = graph_and_owner(gm)
    dims = _group_dims(gm, group_dims)
    st = GraphStats()
    for node in graph.nodes:
        st.num_nodes += 1
        cat = node_category(node)
        st.categories[cat] += 1
        if cat == "wait":
            st.waits += 1
        elif cat == "collective":
            kind = collective_kind(node)
            label = group_label(node, dims)
            cs = st.collectives.setdefault(kind, {}).setdefault(label, CollectiveStat())
            cs.count += 1
            cs.bytes += collective_bytes(node, kind)
        padded = _padding_of(node)
        if padded is not None:
            collective, nbytes = padded
            ps = st.padding.setdefault(collective_kind(collective), {}).setdefault(group_label(collective, dims), CollectiveStat())
            ps.count += 1
            ps.bytes += nbytes
        pol = node.meta.get(M.RECOMPUTE)
        if pol is not None:
            name = getattr(pol, "name", str(pol))
            st.recompute[name] = st.recompute.get(name, 0) + 1
        if (node.meta.get(M.CUSTOM) or {}).get(M.AP_MUST_SAVE):
            st.must_save += 1
    st.max_consec_compute_between_rs = max_consec_compute_between_rs(graph)
    return st


# --- padding of uneven FSDP shards -------------------------------------------------------------

_SLICE = torch.ops.aten.slice.Tensor
_PAD = torch.ops.aten.constant_pad_nd.default


def _narrowed_all_gather(node: fx.Node) -> fx.Node | None:
    """The all-gather whose gathered rows the dim-0 narrow ``node`` cuts short, if it is one."""
    src = node.args[0]
    dim, start, step = node_arg(node, 1, "dim", 0), node_arg(node, 2, "start", None), node_arg(node, 4, "step", 1)
    if not isinstance(src, fx.Node) or dim != 0 or start not in (0, None) or step != 1 or len(src.users) != 1:
        return None
    cur = src
    while not is_wait(cur):
        if len(cur.all_input_nodes) != 1:
            return None
        cur = cur.all_input_nodes[0]
    coll = cur.args[0]
    if isinstance(coll, fx.Node) and coll.target is operator.getitem:
        coll = coll.args[0]  # one output of a coalesced all-gather
    return coll if isinstance(coll, fx.Node) and collective_kind(coll) == "all_gather" else None


def _padded_reduce_scatter(node: fx.Node) -> fx.Node | None:
    """The reduce-scatter the trailing dim-0 zero padding ``node`` (constant_pad_nd) feeds, if any."""
    pads = list(node_arg(node, 1, "pad", ()))
    value = node_arg(node, 2, "value", 0)
    if len(pads) < 2 or value != 0 or any(pads[:-1]):
        return None  # (a pad that adds no rows is dropped by _padding_of: it moves no padding bytes)
    val = node.meta.get(M.VAL)
    if isinstance(val, torch.Tensor) and 2 * val.dim() != len(pads):
        return None  # pads list the dims from the last one: the final pair is not dim 0
    cur = node
    while len(cur.users) == 1:
        (cur,) = cur.users
        if collective_kind(cur) == "reduce_scatter":
            return cur
    return None


def _padding_of(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(collective, padding bytes) for a narrow after an all-gather or a pad before a
    reduce-scatter (the module docstring's rule); None for any other node."""
    if node.op != "call_function" or node.target not in (_SLICE, _PAD):
        return None
    coll = _narrowed_all_gather(node) if node.target is _SLICE else _padded_reduce_scatter(node)
    if coll is None:
        return None
    src = node.args[0]
    what = f"the padding bytes of {coll.name!r}"
    big, small = (src, node) if node.target is _SLICE else (node, src)
    nbytes = value_bytes(node_val(big, what), big) - value_bytes(node_val(small, what), small)
    return (coll, nbytes) if nbytes > 0 else None


# --- PartitionStats -----------------------------------------------------------------------------


@dataclass
class PartitionStats:
    fw: GraphStats
    bw: GraphStats
    saved_count: int
    saved_bytes: int
    static_peak_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "bw": self.bw.to_dict(),
            "fw": self.fw.to_dict(),
            "saved_bytes": self.saved_bytes,
            "saved_count": self.saved_count,
            "static_peak_bytes": self.static_peak_bytes,
        }


def partition_stats(
    fw_gm: fx.GraphModule | fx.Graph,
    bw_gm: fx.GraphModule | fx.Graph,
    *,
    group_dims: Mapping[str, str] | None = None,
) -> PartitionStats:
    """Stats of a forward/backward pair: per-graph stats, saved tensors, static peak."""
    fw = graph_stats(fw_gm, group_dims=group_dims)
    bw = graph_stats(bw_gm, group_dims=group_dims)
    count = nbytes = 0
    for ph in saved_placeholders(graph_and_owner(bw_gm)[0]):
        v = node_val(ph, "the saved-tensor bytes")
        if isinstance(v, torch.Tensor):
            count += 1
            nbytes += tensor_bytes(v, ph)
    return PartitionStats(fw, bw, count, nbytes, static_peak_bytes(fw_gm, bw_gm))


# --- table --------------------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    """``4096`` -> ``4.0 KiB`` (``512 B`` below 1 KiB)."""
    if abs(n) < 1024:
        return f"{n} B"
    value = n / 1024.0
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024.0
    return f"{value:.1f} TiB"


def _bytes_cell(n: int) -> str:
    return f"{n} ({human_bytes(n)})" if n else "0"


_Row = tuple[str, str, list[tuple[str, str]]]  # (stat, detail, [(count, bytes)] per graph)


def _per_dim_rows(tables: list[dict[str, dict[str, CollectiveStat]]], suffix: str) -> list[_Row]:
    """One row per (kind, mesh dim) any graph has, kinds in ``COLLECTIVE_KINDS`` order; a graph
    without that kind or dim gets 0."""
    keys = sorted({(kind, dim) for t in tables for kind, per in t.items() for dim in per},
                  key=lambda kd: (_kind_order(kd[0]), kd[1]))
    rows = []
    for kind, dim in keys:
        stats = [t.get(kind, {}).get(dim, CollectiveStat()) for t in tables]
        rows.append((kind + suffix, dim, [(str(s.count), _bytes_cell(s.bytes)) for s in stats]))
    return rows


def format_stats_table(stats: GraphStats | PartitionStats) -> str:
    """Fixed-width text table of ``stats`` (one column pair per graph), ending with a newline."""
    if isinstance(stats, PartitionStats):
        graphs = [("forward", stats.fw), ("backward", stats.bw)]
    elif isinstance(stats, GraphStats):
        graphs = [("graph", stats)]
    else:
        raise TypeError(f"expected GraphStats or PartitionStats, got {type(stats).__name__}")

    rows = _per_dim_rows([g.collectives for _, g in graphs], "")
    # rows only where shards are uneven: even goldens keep their table
    rows += _per_dim_rows([g.padding for _, g in graphs], " padding")
    rows.append(("wait_tensor", "", [(str(g.waits), "") for _, g in graphs]))
    policies = sorted({p for _, g in graphs for p in g.recompute})
    for p in policies:
        rows.append(("recompute", p, [(str(g.recompute.get(p, 0)), "") for _, g in graphs]))
    if any(g.must_save for _, g in graphs):
        rows.append(("ap_must_save", "", [(str(g.must_save), "") for _, g in graphs]))
    rows.append(
        (
            "max_consec_compute_between_rs",
            "",
            [(str(g.max_consec_compute_between_rs), "") for _, g in graphs],
        )
    )
    rows.append(("nodes", "", [(str(g.num_nodes), "") for _, g in graphs]))
    for cat in CATEGORIES:
        rows.append(("nodes", cat, [(str(g.categories[cat]), "") for _, g in graphs]))

    extra: list[tuple[str, str, str]] = []
    if isinstance(stats, PartitionStats):
        extra.append(("saved for backward", str(stats.saved_count), _bytes_cell(stats.saved_bytes)))
        extra.append(("static peak", "", _bytes_cell(stats.static_peak_bytes)))

    w_stat = max(len(r[0]) for r in rows)  # wider than "stat" and "dim": the rows always
    w_detail = max(len(r[1]) for r in rows)  # include max_consec_compute_between_rs, placeholder
    w_count = max([len(c) for r in rows for c, _ in r[2]] + [5])
    w_bytes = max([len(b) for r in rows for _, b in r[2]] + [5])
    left = w_stat + 2 + w_detail
    col = w_count + 2 + w_bytes

    def line(a: str, cells: list[str]) -> str:
        return (a.ljust(left) + "".join("  " + c.ljust(col) for c in cells)).rstrip()

    out = [line("", [name for name, _ in graphs])]
    out.append(
        line("stat".ljust(w_stat) + "  dim", ["count".rjust(w_count) + "  bytes" for _ in graphs])
    )
    for stat, detail, cells in rows:
        out.append(
            line(
                stat.ljust(w_stat) + "  " + detail,
                [c.rjust(w_count) + "  " + b for c, b in cells],
            )
        )
    if extra:
        out.append("")
        w_e = max(len(e[0]) for e in extra)
        for name, count, nbytes in extra:
            out.append(f"{name.ljust(w_e)}  {count.rjust(w_count)}  {nbytes}")
    return "\n".join(out) + "\n"
