"""Static peak memory of a forward/backward pair: a liveness walk over FakeTensor storages
(``static_peak_bytes``, ``static_liveness``), and which saved values are gathered parameters.
Split out of verify/graphs/stats.py, whose ``partition_stats`` reports the peak."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.fx_utils import node_val, resolve_attr
from verify.graphs.canon import canonical_names, graph_and_owner
from verify.graphs.classify import collective_kind, int_hint, is_wait, node_arg, tensors_of


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
        storages = [t.untyped_storage() for t in tensors_of(v)]  # repeats are folded in compute
        return [((node.graph, StorageWeakRef(st)), int_hint(st.nbytes(), node)) for st in storages]

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


def saved_placeholders(bw_graph: fx.Graph) -> list[fx.Node]:
    return [n for n in bw_graph.nodes if n.op == "placeholder" and not _is_tangent(n)]


def _output_values(graph: fx.Graph) -> list[Any]:
    out = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    v = out.args[0] if out is not None else ()
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _holds_tensor(node: fx.Node) -> bool:
    return bool(tensors_of(node.meta.get(M.VAL)))


def _fw_saved_outputs(fw_graph: fx.Graph, bw_graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """(bw placeholder, forward node it holds) for every saved tensor input of the backward.

    Matched by name when every saved placeholder is named like a forward output node (the AOT
    partitioner names backward inputs after the forward values). Otherwise by position over the
    tensor-valued ones: the backward's saved tensor placeholders are the last tensor-valued
    forward outputs, in order (AOT layout: user outputs, saved tensors, then saved symints).
    """
    saved = [n for n in saved_placeholders(bw_graph) if _holds_tensor(n) or M.VAL not in n.meta]
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
        value = node_arg(node, i, arg.name, None)  # (a kwarg-only argument is never in node.args)
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
