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
* **Static peak** (``static_peak_bytes``): a liveness walk over FakeTensor storages, see its
  docstring.

A node whose ``meta["val"]`` is needed for a byte count and missing raises ``ValueError`` naming
the node.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols
from torch.multiprocessing.reductions import StorageWeakRef

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.fx_utils import (
    group_arg,
    group_arg_name,
    max_consec_compute_between_rs,
    node_val,
    resolve_attr,
    size_hint,
)
from autoparallel.mesh import dim_label, group_dims_of
from verify.graphs.canon import canonical_names, graph_and_owner

__all__ = [
    "CATEGORIES",
    "COLLECTIVE_KINDS",
    "CollectiveStat",
    "GraphStats",
    "PartitionStats",
    "collective_kind",
    "collective_node_bytes",
    "group_label",
    "node_category",
    "graph_stats",
    "partition_stats",
    "static_peak_bytes",
    "is_gathered_value",
    "saved_gathered_values",
    "static_liveness",
    "StaticLiveness",
    "Contributor",
    "node_phase",
    "format_stats_table",
    "human_bytes",
]

CATEGORIES = ("placeholder", "output", "collective", "wait", "view", "compute", "other")
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
_KIND_OF_OPNAME = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
_NOT_COLLECTIVE = {"wait_tensor"}
_VIEW_LIKE = {"_unsafe_view", "reshape"}
_SCALAR_MODULES = {"_operator", "operator", "math", "builtins"}


# --- classification -----------------------------------------------------------------------------


def _is_c10d_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace in _COLLECTIVE_NAMESPACES


def collective_kind(node: fx.Node) -> str | None:
    """``all_gather`` / ``reduce_scatter`` / ``all_reduce`` / ``all_to_all`` / ... or None."""
    if node.op != "call_function" or not _is_c10d_op(node.target):
        return None
    name = node.target._opname
    if name in _NOT_COLLECTIVE:
        return None
    if name in ("isend", "irecv", "batch_p2p_ops"):
        return "p2p"
    return _KIND_OF_OPNAME.get(name, name)


def is_wait(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and _is_c10d_op(node.target)
        and node.target._opname == "wait_tensor"
    )


def _returns_tensor(op: torch._ops.OpOverload) -> bool:
    return any("Tensor" in str(r.type) for r in op._schema.returns)


def node_category(node: fx.Node) -> str:
    """One of ``CATEGORIES`` (see the module docstring)."""
    if node.op in ("placeholder", "output"):
        return node.op
    if node.op == "get_attr":
        return "other"
    t = node.target  # call_method / call_module: a string, "compute" at the end
    if is_wait(node):
        return "wait"
    if collective_kind(node) is not None:
        return "collective"
    if t is operator.getitem:
        return "other"
    if isinstance(t, torch._ops.OpOverload):
        if t.is_view or t._opname in _VIEW_LIKE:
            return "view"
        return "compute" if _returns_tensor(t) else "other"
    if isinstance(t, torch._ops.HigherOrderOperator):
        return "compute"
    if getattr(t, "__module__", None) in _SCALAR_MODULES or str(
        getattr(t, "__name__", "")
    ).startswith("sym_"):
        return "other"
    return "compute"


# --- sizes --------------------------------------------------------------------------------------


def _hint(x: Any, node: fx.Node) -> int:
    """``x`` as an int: a symbolic size's trace-time hint. A data-dependent (unbacked) size has
    none: torch's ``optimization_hint`` would make one up (8192), so it is refused instead."""
    if isinstance(x, torch.SymInt):
        if has_free_unbacked_symbols(x):
            raise ValueError(
                f"node {node.name!r}: size {x} is data-dependent (an unbacked symbol, no trace-time "
                "hint); cannot count its bytes"
            )
        return size_hint(x)  # torch 2.11 (the GPU machines' CUDA build) has no optimization_hint
    return int(x)


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _tensor_bytes(t: torch.Tensor, node: fx.Node) -> int:
    return _hint(t.numel(), node) * t.element_size()


def _value_bytes(v: Any, node: fx.Node) -> int:
    return sum(_tensor_bytes(t, node) for t in _tensors(v))


def _collective_bytes(node: fx.Node, kind: str) -> int:
    if kind == "all_gather":
        return _value_bytes(node_val(node, f"the bytes of collective {node.name!r}"), node)
    i, arg = next((i, a) for i, a in enumerate(node.target._schema.arguments) if "Tensor" in str(a.type))
    src = _arg(node, i, arg.name, None)
    srcs = src if isinstance(src, (list, tuple)) else [src]
    total = 0
    for s in srcs:
        if isinstance(s, fx.Node):
            total += _value_bytes(node_val(s, f"the bytes of collective {node.name!r}"), s)
    return total


def collective_node_bytes(node: fx.Node) -> int:
    """Bytes of one collective launch, by the module's convention (0 for a non-collective)."""
    kind = collective_kind(node)
    return _collective_bytes(node, kind) if kind is not None else 0


def group_label(node: fx.Node, group_dims: Mapping[str, str]) -> str:
    """Mesh-dim label of a collective's group ("?" for a node that names none)."""
    g = group_arg(node)
    if g is None:
        return "?"
    try:
        return dim_label(group_arg_name(g), group_dims, where=f"node {node.name!r} ({node.target})")
    except ValueError as e:
        raise ValueError(f"{e}, or pass group_dims={{name: label}}") from None


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
            cs.bytes += _collective_bytes(node, kind)
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


def _arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _narrowed_all_gather(node: fx.Node) -> fx.Node | None:
    """The all-gather whose gathered rows the dim-0 narrow ``node`` cuts short, if it is one."""
    src = node.args[0]
    dim, start, step = _arg(node, 1, "dim", 0), _arg(node, 2, "start", None), _arg(node, 4, "step", 1)
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
    pads = list(_arg(node, 1, "pad", ()))
    value = _arg(node, 2, "value", 0)
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
    nbytes = _value_bytes(node_val(big, what), big) - _value_bytes(node_val(small, what), small)
    return (coll, nbytes) if nbytes > 0 else None


# --- static peak memory -------------------------------------------------------------------------


_INF = float("inf")


def _constant(node: fx.Node) -> Any:
    """The attribute a ``get_attr`` node without a ``val`` reads (a missing one: the missing-val
    error, naming the node)."""
    obj = resolve_attr(node.graph.owning_module, node.target)
    if obj is None:
        node_val(node, "static peak memory")  # raises, naming the node
    return obj


class _Storages:
    """Tensor storages held by each node, with aliases folded onto one canonical storage.

    Views share their base's FakeTensor storage already. ``wait_tensor`` (which returns its input
    at runtime) and a backward placeholder holding a saved forward value get fresh fake storages
    from tracing; those are mapped onto the storage they really are. Storages are told apart per
    graph: a partitioner copies a recomputed forward node into the backward together with its
    ``meta["val"]``, so the two share a fake storage, but the copy allocates its own buffer at
    run time (only saved placeholders carry a forward buffer into the backward).
    """

    def __init__(self) -> None:
        self.alias: dict[Any, Any] = {}
        self.size: dict[Any, int] = {}
        self.keys: dict[fx.Node, list] = {}

    def canon(self, ref: Any) -> Any:
        while ref in self.alias:
            ref = self.alias[ref]
        return ref

    def _raw(self, node: fx.Node) -> list[tuple[Any, int]]:
        if node.op == "get_attr" and M.VAL not in node.meta:  # a constant: use the attribute
            v = _constant(node)
        else:
            v = node_val(node, "static peak memory")
        storages = [t.untyped_storage() for t in _tensors(v)]  # repeats are folded in compute
        return [((node.graph, StorageWeakRef(st)), _hint(st.nbytes(), node)) for st in storages]

    def compute(self, node: fx.Node, alias_of: list | None = None) -> list:
        if node.op == "output":  # holds nothing; its inputs' uses are counted by the walk
            return []
        if alias_of is not None and M.VAL not in node.meta:
            self.keys[node] = list(alias_of)
            return self.keys[node]
        raw = self._raw(node)
        if alias_of is not None:
            for (ref, _), target in zip(raw, alias_of, strict=False):
                if self.canon(target) != ref:
                    self.alias[ref] = target
        keys: list = []
        for ref, nbytes in raw:
            key = self.canon(ref)
            self.size.setdefault(key, nbytes)
            if key not in keys:
                keys.append(key)
        if alias_of is not None:
            keys += [k for k in alias_of if k not in keys]
        self.keys[node] = keys
        return keys


def _is_tangent(node: fx.Node) -> bool:
    role = node.meta.get(M.ROLE)
    if isinstance(role, str):
        return roles.is_tangent(role)
    return roles.is_aot_tangent_name(node.name)


def _saved_placeholders(bw_graph: fx.Graph) -> list[fx.Node]:
    return [n for n in bw_graph.nodes if n.op == "placeholder" and not _is_tangent(n)]


def _output_values(graph: fx.Graph) -> list[Any]:
    out = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    v = out.args[0] if out is not None else ()
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _holds_tensor(node: fx.Node) -> bool:
    return bool(_tensors(node.meta.get(M.VAL)))


def _fw_saved_outputs(fw_graph: fx.Graph, bw_graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """(bw placeholder, forward node it holds) for every saved tensor input of the backward.

    Matched by name when every saved placeholder is named like a forward output node (the AOT
    partitioner names backward inputs after the forward values). Otherwise by position over the
    tensor-valued ones: the backward's saved tensor placeholders are the last tensor-valued
    forward outputs, in order (AOT layout: user outputs, saved tensors, then saved symints).
    """
    saved = [n for n in _saved_placeholders(bw_graph) if _holds_tensor(n) or M.VAL not in n.meta]
    outs = _output_values(fw_graph)
    out_nodes = [o for o in outs if isinstance(o, fx.Node)]
    by_name = {o.name: o for o in out_nodes}
    if saved and all(ph.name in by_name for ph in saved):
        return [(ph, by_name[ph.name]) for ph in saved]
    tensor_outs = [o for o in out_nodes if _holds_tensor(o)]
    if len(saved) > len(tensor_outs):
        raise ValueError(
            f"the backward graph has {len(saved)} saved tensor inputs but the forward graph only "
            f"{len(tensor_outs)} tensor outputs: is this a matching forward/backward pair?"
        )
    return list(zip(saved, tensor_outs[len(tensor_outs) - len(saved) :], strict=True))


def is_gathered_value(node: fx.Node) -> bool:
    """Whether ``node`` holds an all-gathered value: an all-gather, its wait, or a node reached
    from such a wait through single-input nodes (a transpose, a view, the narrow of a padded
    FSDP shard, a cast): what ``reshard_after_forward`` forbids keeping for backward."""
    while node.op == "call_function":
        if collective_kind(node) == "all_gather":
            return True
        if is_wait(node):
            src = node.args[0]
            return isinstance(src, fx.Node) and collective_kind(src) == "all_gather"
        if len(node.all_input_nodes) != 1:
            return False
        node = node.all_input_nodes[0]
    return False


def saved_gathered_values(fw_gm: fx.GraphModule | fx.Graph, bw_gm: fx.GraphModule | fx.Graph) -> list[fx.Node]:
    """The forward nodes a forward/backward pair saves for backward that hold all-gathered
    values (:func:`is_gathered_value`); empty when every gathered weight is recomputed."""
    fw_graph, bw_graph = graph_and_owner(fw_gm)[0], graph_and_owner(bw_gm)[0]
    return [fw_node for _, fw_node in _fw_saved_outputs(fw_graph, bw_graph) if is_gathered_value(fw_node)]


@dataclass
class _Walk:
    """The storage-level liveness walk shared by ``static_peak_bytes`` and ``static_liveness``."""

    steps: list[fx.Node]
    bw_graph: fx.Graph | None
    size: dict[Any, int]
    alloc_at: dict[Any, int]
    last_use: dict[Any, float]
    origin: dict[Any, fx.Node]  # the first node holding each storage

    def series(self) -> list[int]:
        """Live bytes after each step's allocations, before its frees (where the peak is taken)."""
        frees: dict[int, int] = {}
        allocs: dict[int, int] = {}
        for key, s in self.alloc_at.items():
            allocs[s] = allocs.get(s, 0) + self.size[key]
            end = self.last_use[key]
            if end != _INF:
                frees[int(end)] = frees.get(int(end), 0) + self.size[key]
        out = []
        mem = 0
        for s in range(len(self.steps)):
            mem += allocs.get(s, 0)
            out.append(mem)
            mem -= frees.get(s, 0)
        return out


def _written_alias_args(node: fx.Node) -> list[fx.Node]:
    """The arguments whose buffers an op returns, by its schema (``Tensor(a!) out -> Tensor(a!)``:
    ``all_gather_into_tensor_out``, in-place ops; ``Tensor[](a!) inputs -> Tensor[](a!)``:
    ``all_reduce_coalesced_``), in the order of the returned tensors. A re-trace may give the
    result fake storages of its own; at run time they are the arguments' buffers."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    rets = target._schema.returns
    if len(rets) != 1 or rets[0].alias_info is None or not rets[0].alias_info.is_write:
        return []
    sets = rets[0].alias_info.before_set
    for i, arg in enumerate(target._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write or not (info.before_set & sets):
            continue
        value = _arg(node, i, arg.name, None)  # (a kwarg-only argument is never in node.args)
        values = value if isinstance(value, (list, tuple)) else [value]
        return [v for v in values if isinstance(v, fx.Node)]
    return []


def _liveness_walk(
    fw_gm: fx.GraphModule | fx.Graph, bw_gm: fx.GraphModule | fx.Graph | None
) -> _Walk:
    fw_graph, _ = graph_and_owner(fw_gm)
    bw_graph = graph_and_owner(bw_gm)[0] if bw_gm is not None else None
    steps: list[fx.Node] = list(fw_graph.nodes) + (
        list(bw_graph.nodes) if bw_graph is not None else []
    )
    saved_of: dict[fx.Node, list[fx.Node]] = {}
    if bw_graph is not None:
        for ph, fw_node in _fw_saved_outputs(fw_graph, bw_graph):
            saved_of[ph] = [fw_node]
    stor = _Storages()
    alloc_at: dict[Any, int] = {}
    last_use: dict[Any, float] = {}
    origin: dict[Any, fx.Node] = {}

    def use(keys: Iterable, s: float) -> None:
        for key in keys:
            last_use[key] = max(last_use[key], s)

    for s, node in enumerate(steps):
        alias_of = None
        if node in saved_of:  # a saved placeholder is the forward value it was saved from
            alias_of = [k for a in saved_of[node] for k in stor.keys[a]]
        elif is_wait(node) and node.args and isinstance(node.args[0], fx.Node):
            alias_of = stor.keys[node.args[0]]  # wait_tensor returns its input
        elif written := _written_alias_args(node):  # an out= / in-place op returns its arguments' buffers
            alias_of = [k for a in written for k in stor.keys[a]]
        keys = stor.compute(node, alias_of)
        resident = node.op in ("placeholder", "get_attr") and node.graph is fw_graph
        for key in keys:
            if key not in alloc_at:
                alloc_at[key] = 0 if resident else s  # parameters/inputs/constants: from the start
                last_use[key] = s
                origin[key] = node
        use(keys, _INF if resident else s)
        for inp in node.all_input_nodes:  # (a graph's output node is its last step: what the
            use(stor.keys[inp], s)  # last output holds stays live to the end)
    return _Walk(steps, bw_graph, stor.size, alloc_at, last_use, origin)


def static_peak_bytes(
    fw_gm: fx.GraphModule | fx.Graph, bw_gm: fx.GraphModule | fx.Graph | None = None
) -> int:
    """Static peak memory (bytes) of running ``fw_gm`` then ``bw_gm``, from FakeTensor vals.

    Model: memory is counted per tensor storage (``untyped_storage().nbytes()``), so views and
    other aliases of one storage count once; ``wait_tensor`` returns its input's storage, an op
    whose schema returns a written argument (``out=``, in-place, the list of an in-place
    coalesced all-reduce) returns that argument's storages; a
    backward node holding a forward node's fake storage (a recompute copied with its
    ``meta["val"]``) is a buffer of its own, only saved placeholders alias the forward. Nodes
    run in graph order. A storage is allocated when the first node holding it runs and freed
    after the last node that uses any node holding it; the peak is taken after each node's
    allocations, before that node's frees. Forward placeholders (parameters, inputs) and
    ``get_attr`` constants are live for the whole run. Forward outputs consumed by the backward
    (the values behind its non-tangent placeholders, matched by name, else by position, see
    ``_fw_saved_outputs``) stay live until their last use in the backward; other forward outputs are released
    when the forward ends. Tangents are allocated when the backward starts; backward outputs stay
    live to the end. With ``bw_gm=None`` the graph's outputs stay live to the end.
    """
    return max(_liveness_walk(fw_gm, bw_gm).series(), default=0)


def node_phase(node: fx.Node) -> str:
    """``backward`` for a node tagged as backward (graph trainer phase, AOT joint graphs'
    partitioner tag), else ``forward``."""
    if (node.meta.get(M.CUSTOM) or {}).get(M.PHASE) == M.PHASE_BACKWARD:
        return "backward"
    return "backward" if node.meta.get(M.PARTITIONER_TAG) == "is_backward" else "forward"


@dataclass
class Contributor:
    """A storage live at the peak: the node that first holds it (canonical name), its phase and
    size."""

    name: str
    phase: str
    bytes: int


@dataclass
class StaticLiveness:
    """Static live bytes through a forward (and backward) run, per node, on the model of
    :func:`static_peak_bytes` (``max(live) == static_peak_bytes``).

    ``names``/``phases``/``live``: one entry per node in run order (canonical names, as the
    graph text prints them; names restart in the backward, hence the phases). ``peak_step``: the
    first step reaching the peak. ``at_peak``: every storage live there, largest first; their
    bytes sum to the peak.
    """

    names: list[str]
    phases: list[str]
    live: list[int]
    peak_bytes: int
    peak_step: int
    at_peak: list[Contributor]

    def to_dict(self) -> dict[str, Any]:
        return {
            "at_peak": [c.__dict__ for c in self.at_peak],
            "live": self.live,
            "names": self.names,
            "peak_bytes": self.peak_bytes,
            "peak_step": self.peak_step,
            "phases": self.phases,
        }


def static_liveness(
    fw_gm: fx.GraphModule | fx.Graph, bw_gm: fx.GraphModule | fx.Graph | None = None
) -> StaticLiveness:
    """The series behind :func:`static_peak_bytes`, with the storages live at the peak named."""

    walk = _liveness_walk(fw_gm, bw_gm)
    live = walk.series()
    names = dict(canonical_names(fw_gm))
    bw_names = canonical_names(bw_gm) if bw_gm is not None else {}

    def name(node: fx.Node) -> str:
        if node.graph is walk.bw_graph:
            return bw_names.get(node, "return")
        return names.get(node, "return")

    def phase(node: fx.Node) -> str:
        return "backward" if node.graph is walk.bw_graph else node_phase(node)

    peak = max(live, default=0)
    peak_step = live.index(peak) if live else 0
    at_peak = [
        Contributor(name(walk.origin[key]), phase(walk.origin[key]), walk.size[key])
        for key, s in walk.alloc_at.items()
        if s <= peak_step <= walk.last_use[key]
    ]
    at_peak.sort(key=lambda c: (-c.bytes, c.phase, c.name))
    return StaticLiveness(
        [name(n) for n in walk.steps], [phase(n) for n in walk.steps], live, peak, peak_step, at_peak
    )


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
    for ph in _saved_placeholders(graph_and_owner(bw_gm)[0]):
        v = node_val(ph, "the saved-tensor bytes")
        if isinstance(v, torch.Tensor):
            count += 1
            nbytes += _tensor_bytes(v, ph)
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
