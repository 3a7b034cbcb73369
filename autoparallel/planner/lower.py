"""Lower a plan: the unsharded joint graph + planned placements -> one rank's joint graph.

The planner places every node of the *unsharded* joint forward+loss+backward graph. A plan only
runs once it is a per-rank program with explicit collectives, the same kind of graph the hand
plans trace (``autoparallel.parallelize``), so every later stage runs on it unchanged. This
module makes it:

* :class:`PlacedInterpreter` runs the unsharded graph on *local* tensors. Before each op it
  moves each tensor input from its producer's planned output placement to the placement the
  op's planned candidate wants, following DTensor's own transform plan (the one the planner
  priced, one collective per mesh dim: DTensor's merging of same-kind steps into one
  flattened-mesh collective is switched off while lowering, so an ``S(0)S(0) -> RR`` parameter
  becomes a tp all-gather then a dp all-gather, the chain that ``fuse_chained_allgathers`` fuses
  later and that the plan's predicted bytes count per dim). Each step is written directly
  (``autoparallel.planner.moves``: the functional collective and, for a dim other than 0, one
  permuted copy); the pairs that module leaves (``Shard -> Shard``, ``Replicate -> Partial``,
  placement subclasses) are DTensor's ``redistribute_local_tensor``, counted by reason.
  The op then runs through DTensor's dispatch on the redistributed inputs, so shape arguments of
  views and reductions are localized by DTensor's own rules; ops with no DTensor strategy (the
  planner's own rules: CPU SDPA) run on the local tensors directly, and so, with
  ``lower_plan(..., replay=True)`` (``PipelineOptions(lowering="replay")``), do the ops the plan fully determines
  (``autoparallel.planner.replay``: elementwise ops in their output's placement, matmuls,
  transpositions), and, under either lowering, a convolution planned with the batch dim on
  several mesh dims, which DTensor's convolution handler refuses (``autoparallel.planner.batch_local``,
  a patch: the call that handler makes on a batch-only placement). So do the plan's replicated
  fallbacks (``Solution.fallbacks``: an op with no strategy, a random op that is not a dropout) on
  inputs gathered to ``Replicate``: the whole op on every rank, its output then split to the
  plan's placement; a plan that feeds one a sharded input is refused (a random op would draw on a
  shard, no slice of the single-device draw). So does a call run only for its side effect (an
  assert, a print: ``autoparallel.planner.side_effects``), on inputs gathered to ``Replicate``,
  with no output to place. A lifted tensor constant (``get_attr``) is whole on every rank. An
  output whose DTensor placement is not the planned one is redistributed to the plan and reported.
* :func:`lower_plan` traces that interpreter with ``make_fx`` (under ``preserve_node_meta``, so
  every new node carries its unsharded node's phase and module path, and a redistribution the
  phase of the op that needed it), makes each non-zero-dim gather and scatter DTensor still
  traced (split -> W getitems -> cat around a dim-0 collective) one permuted copy
  (``autoparallel.passes.permuted_split_cat``), gives the placeholders the export's names and descriptors,
  and swaps the graph into the export the planner traced (``JointWithDescriptors``) with the
  local shapes as its inputs: the first partition (``aot_compile_joint_with_descriptors``)
  compiles it like any traced joint graph.

The same interpreter runs eagerly on real tensors of a real world (no tracing): that is the
reference the lowered graphs are compared with bitwise (``verify.parity.runs``).

Rank-specific: a local split (``Replicate -> Shard``, ``Replicate -> Partial``) keeps this rank's
piece, so the lowered graph bakes in the rank's mesh coordinate. Like bucketed graphs, lowered
graphs are per rank: lower on each rank (a fake world's rank 0 for goldens and reports).
"""

from __future__ import annotations

import copy
import logging
import operator
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import fx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, Replicate
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.mesh import ParallelMesh, attach_group_dims
from autoparallel.parallelize.joint import JointGraph, label_roles, params_without_grad
from autoparallel.parallelize.plan import ParallelPlan
from autoparallel.passes.permuted_split_cat import permuted_split_cat
from autoparallel.passes.value_guards import counts_as_guarded
from autoparallel.planner.batch_local import runs_batch_local
from autoparallel.planner.graph import ALIAS, PlanningGraph, module_of
from autoparallel.planner.layout_reads import reads_layout
from autoparallel.planner.moves import direct_move, pair_name
from autoparallel.planner.side_effects import is_side_effect
from autoparallel.planner.solution import Solution, parse_placement
from autoparallel.planner.replay import replays
from autoparallel.planner.strategies import PLANNER_RULES, divides, is_undroppable_random, planned_by_decomposition
from autoparallel.planner.strided import has_strided, piece, sharded_dim

log = logging.getLogger(__name__)

Placements = tuple[Placement, ...]


class LoweringError(ValueError):
    """A plan that does not fit the graph it is lowered onto (names the node)."""


@dataclass
class NodePlacements:
    """One node's planned placements, decoded: per output, and per tensor input."""

    out: list[Placements | None]
    ins: list[Placements]


@dataclass
class LoweringReport:
    """What lowering did: how many inputs it moved, the outputs whose DTensor placement differed
    from the plan (redistributed to the plan, listed by canonical key), and its wall seconds."""

    moved_inputs: int = 0
    fixed_outputs: list[str] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0
    split_cats: int = 0  # split -> getitems -> cat moves made one permuted copy (passes/permuted_split_cat.py)
    replayed: int = 0  # ops run as their local op, not through DTensor (planner/replay.py, lowering="replay")
    batch_local: int = 0  # convolutions with the batch on several mesh dims, run as their local op (planner/batch_local.py)
    direct_moves: int = 0  # moves written as their own collectives (planner/moves.py)
    dtensor_moves: dict[str, int] = field(default_factory=dict)  # "<src> -> <dst>: <why>" -> moves left to DTensor
    layout_blind: int = 0  # moved pieces left in the collective's layout: nothing downstream reads it (planner/layout_reads.py)

    def summary(self) -> str:
        fixed = f", {len(self.fixed_outputs)} outputs redistributed to the plan" if self.fixed_outputs else ""
        copies = f", {self.split_cats} split -> cat moves as permuted copies" if self.split_cats else ""
        replayed = f", {self.replayed} ops replayed locally" if self.replayed else ""
        batch = f", {self.batch_local} convolutions on a batch split over several mesh dims run locally" if self.batch_local else ""
        left = sum(self.dtensor_moves.values())
        moves = f" ({self.direct_moves} written directly, {left} by DTensor)" if self.direct_moves or left else ""
        blind = f", {self.layout_blind} moved pieces left in their collective's layout" if self.layout_blind else ""
        return (f"{self.nodes_before} unsharded nodes -> {self.nodes_after} per-rank nodes; "
                f"{self.moved_inputs} inputs redistributed{moves}{fixed}{copies}{replayed}{batch}{blind}")


def decode(d: Mapping[str, str] | None, names: Sequence[str]) -> Placements | None:
    if d is None:
        return None
    return tuple(parse_placement(d[n]) for n in names)


def node_placements(pg: PlanningGraph, plan: Solution) -> dict[fx.Node, NodePlacements]:
    """Every node's (and the output node's) planned placements; LoweringError naming a node the
    plan does not place, or a plan made for another mesh."""
    names = list(pg.mesh.spec.names)
    if plan.mesh_names != names:
        raise LoweringError(f"the plan is for mesh dims {plan.mesh_names}, the graph's world has {names}")
    out: dict[fx.Node, NodePlacements] = {}
    for node in pg.graph.nodes:
        if node.op == "output":
            continue
        key = pg.keys.get(node.name)
        got = plan.nodes.get(key) if key is not None else None
        if got is None:
            raise LoweringError(
                f"node {node.name!r} (key {key!r}, {node.format_node()}) has no placement in the plan; "
                "plan the same model with the same inputs (canonical keys must match)"
            )
        out[node] = NodePlacements([decode(o, names) for o in got.out], [decode(i, names) for i in got.ins])
        _check_even(node, key, out[node].out, pg.mesh)
    output = pg.graph.output_node()
    outs: list[Placements | None] = []
    for i, (arg, role) in enumerate(zip(output.args[0], pg.output_roles, strict=True)):
        if not isinstance(arg, fx.Node):
            outs.append(None)
            continue
        key = f"out:{role or roles.user_output(i)}"
        if key not in plan.nodes:
            raise LoweringError(f"graph output {i} ({key}) has no placement in the plan")
        outs.append(decode(plan.nodes[key].out[0], names))
    out[output] = NodePlacements(outs, [])
    return out


def _check_even(node: fx.Node, key: str, outs: Sequence[Placements | None], mesh: ParallelMesh) -> None:
    """LoweringError naming ``node`` if a planned output does not divide its shape evenly: DTensor
    pads only the short pieces, so the ranks' lowered graphs would issue different collectives
    (``autoparallel.planner.even_shards`` says why; the planner keeps such candidates out)."""
    val = node.meta.get(M.VAL)
    vals = val if isinstance(val, list | tuple) else [val]
    sizes = tuple(int(s) for s in mesh.device_mesh.shape)
    for pl, v in zip(outs, vals, strict=False):
        if pl is not None and isinstance(v, torch.Tensor) and not divides(pl, v.shape, sizes):
            raise LoweringError(
                f"node {node.name!r} ({key}): placement {pl} does not divide its shape {tuple(v.shape)} evenly "
                f"on mesh {dict(zip(mesh.spec.names, sizes, strict=True))}; uneven shards lower to different "
                "collectives on different ranks. Plan with PlannerConfig(even_shards=True) (the default) or pin "
                "an even placement"
            )


def _meta(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(val.shape, val.stride(), val.dtype)


def local_shape(val: torch.Tensor, placements: Placements, mesh: ParallelMesh) -> tuple[int, ...]:
    """This rank's shape of a tensor of ``val``'s (global) shape under ``placements``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with unset_fake_temporarily():  # the mesh computes offsets with real tensors
        shape, _ = compute_local_shape_and_global_offset(val.shape, mesh.device_mesh, placements)
    return tuple(shape)


def shard_tensor(full: torch.Tensor, placements: Placements, mesh: ParallelMesh) -> torch.Tensor:
    """This rank's piece of ``full`` under ``placements`` (Replicate/Shard, or the strided shards of
    ``autoparallel.planner.strided``; no communication)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(not (p.is_replicate() or p.is_shard() or sharded_dim(p) is not None) for p in placements):
        raise ValueError(f"shard_tensor takes Replicate/Shard placements, got {placements}")
    if has_strided(placements):
        dm = mesh.device_mesh
        return piece(full, placements, tuple(int(s) for s in dm.shape), dm.get_coordinate()).contiguous().clone()
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh.device_mesh, placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return full[index].contiguous().clone()


class PlacedInterpreter(fx.Interpreter):
    """Runs the unsharded joint graph on local tensors under a plan (see the module docstring).

    ``placed``: :func:`node_placements`. Call ``run(*local_placeholders)``; it returns the graph's
    outputs as local tensors in their planned placements.
    """

    def __init__(self, gm: fx.GraphModule, placed: Mapping[fx.Node, NodePlacements], mesh: ParallelMesh, keys: Mapping[str, str],
                 fallbacks: Collection[str] = (), *, replay: bool = False):
        super().__init__(gm, garbage_collect_values=True)
        self.placed = placed
        self.mesh = mesh
        self.keys = keys
        self.fallbacks = frozenset(fallbacks)  # canonical keys of the plan's replicated fallbacks
        self.replay = replay  # ops that autoparallel.planner.replay names run as their local op, not through DTensor
        self.report = LoweringReport(nodes_before=len(gm.graph.nodes))
        self._node: fx.Node | None = None
        self._layout_memo: dict[fx.Node, bool] = {}

    def run(self, *args, **kwargs) -> Any:
        from torch.distributed.tensor._redistribute import (
            disable_redistribute_transform_optimization,
        )

        # One collective per mesh dim, as planned and priced (see the module docstring), whether
        # traced or run eagerly: a merged all-reduce would also sum in another order. DTensor's
        # constructor wants detached inputs (a warning otherwise); detaching would trace a node
        # per op, and nothing here records autograd (the graph is the backward already).
        with disable_redistribute_transform_optimization(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="To construct DTensor from torch.Tensor")
            return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        self._node = n
        return super().run_node(n)

    def _out_of(self, producer: fx.Node) -> Placements:
        pl = self.placed[producer].out[0]
        if pl is None:
            raise LoweringError(f"node {producer.name!r} feeds a tensor input but has no planned tensor output")
        return pl

    def move(self, value: torch.Tensor, val: torch.Tensor, src: Placements, dst: Placements, *, layout: bool = True) -> torch.Tensor:
        """``value`` (local, placed ``src``) redistributed to ``dst``; ``val`` the global value;
        ``layout``: in ``val``'s memory layout (False where nothing reads it, ``layout_reads``)."""
        if src == dst:
            return value
        self.report.moved_inputs += 1
        return move_local(value, val, src, dst, self.mesh.device_mesh, self.report, layout=layout)

    def _moved_inputs(self, node: fx.Node, args, kwargs):
        """(args, kwargs) with each tensor input moved to the placement ``node`` wants, and the
        list of (value, global val, placement) per tensor input."""
        want = self.placed[node].ins
        flat, spec = pytree.tree_flatten((args, kwargs))
        nodes = pytree.tree_leaves((node.args, node.kwargs))
        if len(flat) != len(nodes):
            raise LoweringError(f"node {node.name!r}: its arguments do not flatten like the graph's")
        tensors = []
        k = 0
        for i, (value, src_node) in enumerate(zip(flat, nodes, strict=True)):
            if not isinstance(src_node, fx.Node):
                continue
            if k >= len(want):
                raise LoweringError(f"node {node.name!r} ({self.keys.get(node.name)}): the plan lists {len(want)} tensor inputs, the graph has more")
            val = src_node.meta[M.VAL]
            flat[i] = self.move(value, val, self._out_of(src_node), want[k], layout=reads_layout(node, self._layout_memo))
            tensors.append((flat[i], val, want[k]))
            k += 1
        if k != len(want):
            raise LoweringError(f"node {node.name!r} ({self.keys.get(node.name)}): the plan lists {len(want)} tensor inputs, the graph has {k}")
        args, kwargs = pytree.tree_unflatten(flat, spec)
        return args, kwargs, tensors

    def call_function(self, target, args, kwargs):
        node = self._node
        if target is operator.getitem:
            return args[0][args[1]]  # a getitem follows its producer's candidate: nothing moves
        args, kwargs, tensors = self._moved_inputs(node, args, kwargs)
        planned = self.placed[node].out
        if target is ALIAS:
            return tensors[0][0]
        if is_side_effect(node):
            # An assert or a print (planner/side_effects.py): on its whole inputs, as planned, so
            # every rank checks the value the single-device program checks; no output to place.
            refuse_sharded_inputs(node, self.keys.get(node.name), [pl for _, _, pl in tensors])
            return super().call_function(target, args, kwargs)
        if not tensors:
            # A factory op: make the global value, keep this rank's piece of it.
            out = super().call_function(target, args, kwargs)
            return self.move(out, node.meta[M.VAL], tuple(Replicate() for _ in self.mesh.spec.names), planned[0])
        if target in PLANNER_RULES or planned_by_decomposition(target):
            # No DTensor strategy: the planner's rule shards dims the op treats independently, or
            # DTensor's decomposition placed it where its ops run on local pieces, no collective.
            return super().call_function(target, args, kwargs)
        if self.keys.get(node.name) in self.fallbacks or is_undroppable_random(target):
            return self._replicated(node, target, args, kwargs, tensors, planned)
        if runs_batch_local(target, [pl for _, _, pl in tensors], planned):
            # DTensor's convolution handler reads dim_map, which refuses the batch on two mesh
            # dims; on a batch-only placement it runs this very call (planner/batch_local.py).
            self.report.batch_local += 1
            return super().call_function(target, args, kwargs)
        if self.replay and replays(node, [v for _, v, _ in tensors], [pl for _, _, pl in tensors], planned):
            self.report.replayed += 1
            return super().call_function(target, args, kwargs)
        return self._via_dtensor(node, target, args, kwargs, planned)

    def get_attr(self, target, args, kwargs):
        # A lifted tensor constant: every rank holds the whole of it (the planner replicates it).
        value = super().get_attr(target, args, kwargs)
        node = self._node
        if not isinstance(value, torch.Tensor):
            return value
        rep = tuple(Replicate() for _ in self.mesh.spec.names)
        return self.move(value, node.meta[M.VAL], rep, self.placed[node].out[0])

    def _replicated(self, node, target, args, kwargs, tensors, planned):
        """The replicated fallback: the unsharded op on inputs gathered to Replicate (local is
        global), its outputs split to the plan's placements."""
        refuse_sharded_inputs(node, self.keys.get(node.name), [pl for _, _, pl in tensors])
        out = super().call_function(target, args, kwargs)
        rep = tuple(Replicate() for _ in self.mesh.spec.names)
        vals = node.meta[M.VAL]
        if isinstance(out, torch.Tensor):
            return self.move(out, vals, rep, planned[0])
        return type(out)(
            self.move(o, vals[i], rep, planned[i]) if isinstance(o, torch.Tensor) and planned[i] is not None else o
            for i, o in enumerate(out))

    def _via_dtensor(self, node, target, args, kwargs, planned):
        dm = self.mesh.device_mesh
        it = iter(pytree.tree_leaves((node.args, node.kwargs)))
        want = iter(self.placed[node].ins)

        def wrap(x):
            src = next(it)
            if not isinstance(src, fx.Node):
                return x
            val = src.meta[M.VAL]
            # The constructor, not DTensor.from_local: no autograd wrapper, so no view_as node
            # per wrapped input in the lowered graph.
            spec = DTensorSpec(dm, next(want), tensor_meta=_meta(val))
            return DTensor(x, spec, requires_grad=False)

        flat, spec = pytree.tree_flatten((args, kwargs))
        args, kwargs = pytree.tree_unflatten([wrap(x) for x in flat], spec)
        out = target(*args, **kwargs)
        vals = node.meta[M.VAL]
        if isinstance(out, DTensor):
            return self._to_local(node, out, planned[0], vals)
        if isinstance(out, tuple | list):
            vals = vals if isinstance(vals, tuple | list) else [vals] * len(out)
            return type(out)(
                self._to_local(node, o, planned[i] if i < len(planned) else None, vals[i]) if isinstance(o, DTensor) else o
                for i, o in enumerate(out)
            )
        return out

    def _to_local(self, node: fx.Node, out: DTensor, planned: Placements | None, val) -> torch.Tensor:
        local = out._local_tensor  # not to_local(): no view node
        if planned is not None and tuple(out.placements) != planned:
            self.report.fixed_outputs.append(self.keys.get(node.name, node.name))
            return self.move(local, val, tuple(out.placements), planned)
        return local

    def output(self, target, args, kwargs):
        node = self._node
        values = list(args[0])
        planned = self.placed[node].out
        for i, (value, src) in enumerate(zip(values, node.args[0], strict=True)):
            if isinstance(src, fx.Node) and planned[i] is not None:
                values[i] = self.move(value, src.meta[M.VAL], self._out_of(src), planned[i], layout=reads_layout(node))
        return values


def move_local(value: torch.Tensor, val: torch.Tensor, src: Placements, dst: Placements, device_mesh,
               report: LoweringReport | None = None, *, layout: bool = True) -> torch.Tensor:
    """One move of the lowering: ``value`` (this rank's piece of a tensor like ``val``, placed
    ``src``) as its piece under ``dst``, in ``val``'s layout: written directly
    (``autoparallel.planner.moves``: one collective per mesh dim and at most one permuted copy),
    or, for the pairs that module leaves (counted in ``report.dtensor_moves`` with the reason), by
    DTensor's redistribution of local tensors (one collective per mesh dim inside
    :class:`PlacedInterpreter`'s run)."""
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    meta = _meta(val)
    moved, why = direct_move(value, src, dst, meta, device_mesh)
    if moved is None:
        moved = redistribute_local_tensor(value, DTensorSpec(device_mesh, src, tensor_meta=meta), DTensorSpec(device_mesh, dst, tensor_meta=meta))
    if report is not None:
        if why is None:
            report.direct_moves += 1
        else:
            key = f"{pair_name(src, dst)}: {why}"
            report.dtensor_moves[key] = report.dtensor_moves.get(key, 0) + 1
    if not layout:
        if report is not None and not in_traced_layout(moved, val):
            report.layout_blind += 1
        return moved
    return in_layout_of(moved, val)


def refuse_sharded_inputs(node: fx.Node, key: str | None, ins: Sequence[Placements]) -> None:
    """LoweringError naming the module and the op when a replicated fallback (an op with no
    strategy, a random op that is not a dropout) is planned with an input that is not Replicate."""
    for i, pl in enumerate(ins):
        if any(not p.is_replicate() for p in pl):
            random = is_undroppable_random(node.target)
            what = "a random op that is not a dropout" if random else "a replicated fallback"
            raise LoweringError(
                f"{what}, {node.target} at node {node.name!r} ({key}) in module {module_of(node)}, is planned with "
                f"input {i} {pl}: a rank would run it on its shard"
                + (", drawing numbers that are no slice of what the single-device model draws" if random else "")
                + ". Its inputs must be Replicate (the planner's replicated fallback); plan again instead of editing the plan")


def check_replicated_fallbacks(pg: PlanningGraph, plan: Solution) -> None:
    """Before any rank runs: every replicated fallback of ``plan`` (and every random op that is
    not a dropout) takes its inputs Replicate (:func:`refuse_sharded_inputs`)."""
    placed = node_placements(pg, plan)
    for node in pg.graph.nodes:
        if node.op != "call_function" or node not in placed:
            continue
        key = pg.keys.get(node.name)
        if key in plan.fallbacks or is_undroppable_random(node.target):
            refuse_sharded_inputs(node, key, placed[node].ins)


def _dim_order(t: torch.Tensor) -> list[int]:
    """``t``'s dims from outermost to innermost in memory (ties: in dim order)."""
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


def in_layout_of(local: torch.Tensor, val: Any) -> torch.Tensor:
    """``local`` (a moved piece) laid out in memory like the traced value ``val``: dense, dims in
    ``val``'s memory order.

    A redistribution returns its pieces in its own layout (an all-gather's chunk, a contiguous
    result where the traced value was a transposed view of a kernel's output), and the traced
    graph's views assume the traced value's strides: ``view`` of a piece laid out otherwise
    fails ("Cannot view a tensor with shape ... and strides ..."). A copy in the traced dim order
    restores them (values unchanged)."""
    if in_traced_layout(local, val):  # from sizes and strides: no op here, so nothing is traced
        return local
    order = _dim_order(val)
    if order == sorted(order):
        return local.contiguous()
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return local.permute(order).contiguous().permute(inverse)


def in_traced_layout(local: torch.Tensor, val: Any) -> bool:
    """Whether ``local`` is laid out like ``val`` already (or no layout applies: ``val`` no tensor,
    another number of dims, fewer than 2), so that :func:`in_layout_of` copies nothing."""
    if not isinstance(val, torch.Tensor) or local.dim() != val.dim() or local.dim() < 2:
        return True
    return _dense_in(local, _dim_order(val))


def _dense_in(t: torch.Tensor, order: list[int]) -> bool:
    """Whether ``t`` is dense with its dims laid out in ``order`` (outermost first); dims of size
    1 may have any stride, as for ``is_contiguous``."""
    expected = 1
    for d in reversed(order):
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def local_placeholders(pg: PlanningGraph, placed: Mapping[fx.Node, NodePlacements], make: Callable[[fx.Node, tuple[int, ...]], torch.Tensor]) -> list:
    """One local value per placeholder: ``make(node, local shape)`` (non-tensors as traced)."""
    out = []
    for ph in pg.graph.find_nodes(op="placeholder"):
        val = ph.meta.get(M.VAL)
        if not isinstance(val, torch.Tensor):
            out.append(val)
            continue
        out.append(make(ph, local_shape(val, placed[ph].out[0], pg.mesh)))
    return out


def _rename_placeholders_like(source: fx.GraphModule, target: fx.GraphModule) -> None:
    """Give ``target``'s placeholders ``source``'s names and descriptors (the partitioner finds
    tangents by name), and its output node ``source``'s output descriptors."""
    src = list(source.graph.find_nodes(op="placeholder"))
    dst = list(target.graph.find_nodes(op="placeholder"))
    if len(src) != len(dst):
        raise LoweringError(f"the lowered graph has {len(dst)} placeholders, the traced graph {len(src)}")
    for a, b in zip(src, dst, strict=True):
        if M.DESC in a.meta:
            b.meta[M.DESC] = a.meta[M.DESC]
        b.target = a.target
        b.name = a.name
    out_a, out_b = source.graph.output_node(), target.graph.output_node()
    if M.DESC in out_a.meta:
        out_b.meta[M.DESC] = out_a.meta[M.DESC]
    # Called like the traced joint graph: gm(primals, tangents) (the export's pytree codegen);
    # the caller recompiles (lower_plan: once, after its last edit).
    target.graph._codegen = copy.copy(source.graph._codegen)


def _swap_into_export(jd, gm: fx.GraphModule) -> None:
    """Make the export ``jd`` compile ``gm``: its graph module and its example inputs (now this
    rank's local shapes; parameters stay Parameters, tangents follow)."""
    from torch._functorch._aot_autograd.subclass_utils import create_subclass_meta

    vals = [ph.meta[M.VAL] for ph in gm.graph.find_nodes(op="placeholder")]
    state = jd._aot_state
    n = len(state.flat_args)
    flat = [torch.nn.Parameter(v, requires_grad=o.requires_grad) if isinstance(o, torch.nn.Parameter) else v for o, v in zip(state.flat_args, vals[:n], strict=False)]
    tangents = vals[n:]
    jd.graph_module = gm
    jd._aot_graph_capture.updated_flat_args = (flat, tangents) if tangents else flat
    state.flat_args = flat
    state.fw_metadata.traced_tangents = tangents
    state.fw_metadata.subclass_tangent_meta = create_subclass_meta(tangents, count_symints=False, with_memory_format=True)


def lower_plan(pg: PlanningGraph, plan: Solution, parallel_plan: ParallelPlan, *, replay: bool = False) -> tuple[JointGraph, LoweringReport]:
    """The per-rank joint graph of ``plan`` on ``pg`` (traced with ``keep_joint=True``), as a
    :class:`JointGraph` every later stage takes; consumes ``pg.joint`` (its export now compiles
    the lowered graph). ``replay``: the ops ``autoparallel.planner.replay`` names run as their
    local op (the pipeline passes ``PipelineOptions.lowering == "replay"``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    jg = pg.joint
    if jg is None:
        raise ValueError("lower_plan needs the planning trace's export: trace with trace_planning_graph(..., keep_joint=True)")
    t0 = time.perf_counter()
    placed = node_placements(pg, plan)
    check_replicated_fallbacks(pg, plan)
    fake_mode = jg.fake_mode

    def fake_local(ph: fx.Node, shape: tuple[int, ...]) -> torch.Tensor:
        val = ph.meta[M.VAL]
        with fake_mode:
            return torch.empty(shape, dtype=val.dtype, device=val.device)

    args = local_placeholders(pg, placed, fake_local)
    sink_placeholder_aliases(pg.graph)
    _mark_planned_nodes(pg)
    interp = PlacedInterpreter(pg.gm, placed, pg.mesh, pg.keys, plan.fallbacks, replay=replay)

    def run(*a):
        return interp.run(*a, enable_io_processing=False)

    # counts_as_guarded: a mask's count (x[mask] after its value guard) is the guard's, as traced
    with fake_mode, fx_traceback.preserve_node_meta(), torch.no_grad(), counts_as_guarded():
        gm = make_fx(run, tracing_mode="real")(*args)
    # The edits below leave the code to one recompile: at 8B shapes (8 layers, ~3,800 nodes) each
    # recompile is ~1.4 s loaded, and three of them were a tenth of the lowering (docs/lean-planned.md).
    _rename_placeholders_like(pg.gm, gm)
    _drop_unused_getitems(gm)
    interp.report.split_cats = permuted_split_cat(gm).acted
    if not interp.report.split_cats:
        gm.recompile()  # else the pass recompiled after its rewrites
    _drop_block_labels(gm)
    input_roles, output_roles, num_fwd = label_roles(gm)
    attach_group_dims(gm, pg.mesh.group_dims)
    gm.meta[M.GM_STAGE] = "joint"
    _swap_into_export(jg.jd, gm)
    interp.report.nodes_after = len(gm.graph.nodes)
    interp.report.seconds = time.perf_counter() - t0
    log.info("lowered the plan: %s (%.2fs)", interp.report.summary(), interp.report.seconds)
    lowered = JointGraph(
        gm=gm,
        jd=jg.jd,
        plan=parallel_plan,
        mesh=pg.mesh,
        shardings={},
        input_roles=input_roles,
        output_roles=output_roles,
        num_fwd_outputs=num_fwd,
        trace_seconds=pg.trace_seconds + interp.report.seconds,
        fake_mode=fake_mode,
        frozen_params=jg.frozen_params,
        params_without_grad=tuple(params_without_grad(gm, input_roles, output_roles)),
        specialised_reads=jg.specialised_reads,  # each guarded in the planning graph, lowered with it
        _stack=jg._stack,
        # the trace's fake mode, held off the dispatch stack until the first partition resumes it
        # (left with the planning trace, only its garbage collection would put it back)
        _suspended=jg._suspended,
    )
    pg.joint = None  # the export now belongs to the lowered graph
    return lowered, interp.report


OUTPUT_KEY = "output"


def sink_placeholder_aliases(graph: fx.Graph) -> int:
    """Move each alias of a placeholder to just before its first user; the number moved.

    The planner puts them right after the placeholders (FX keeps placeholders first), and the
    lowering redistributes where the alias runs: a parameter gathered by its alias would be
    gathered at the top of the forward and held until its first use. At the first user it is
    gathered when needed, like an FSDP all-gather.

    An alias takes its first user's phase (AOT's ``partitioner_tag``): it copied its
    placeholder's ``is_forward``, but when every user it has left is in the backward (the
    forward's were rewired to the placeholder by ``eliminate_alias_round_trips``: mobilebert's
    NoNorm weight), it runs in the backward, and so do the collectives lowered for it. Tagged
    forward there, AOT's default partitioner would count every node up to it as forward and save
    backward values that read the tangents ("Node ... was invalid, but is output").
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for alias in list(graph.find_nodes(op="call_function", target=ALIAS)):
        if alias.args[0].op != "placeholder" or not alias.users:
            continue
        first = min(alias.users, key=order.__getitem__)
        if first.op == "output":
            continue
        if M.PARTITIONER_TAG in first.meta:
            alias.meta[M.PARTITIONER_TAG] = first.meta[M.PARTITIONER_TAG]
        if first.prev is not alias:
            first.prepend(alias)
            moved += 1
    return moved


def _mark_planned_nodes(pg: PlanningGraph) -> None:
    """``custom[PLANNED_NODE]`` on every node of the planning graph: make_fx under
    preserve_node_meta copies it onto every node traced while interpreting that node (its op and
    the collectives moving its inputs), so each lowered collective says which planned node it
    serves."""
    for node in pg.graph.nodes:
        if node.op == "output":
            M.custom_meta(node)[M.PLANNED_NODE] = OUTPUT_KEY
        elif node.name in pg.keys:
            M.custom_meta(node)[M.PLANNED_NODE] = pg.keys[node.name]


def _drop_unused_getitems(gm: fx.GraphModule) -> None:
    """make_fx reads every output of a multi-output op through a getitem, the ``None`` ones
    (outputs an op's mask switched off) too: those have no value and no user."""
    for node in list(gm.graph.find_nodes(op="call_function", target=operator.getitem)):
        if not node.users and node.meta.get(M.VAL) is None:
            gm.graph.erase_node(node)


def _drop_block_labels(gm: fx.GraphModule) -> None:
    """The planner labels blocks through AC-region annotations (to merge identical blocks); they
    are no activation checkpointing the user asked for, so the per-rank graph does not carry them."""
    for node in gm.graph.nodes:
        custom = node.meta.get(M.CUSTOM)
        if custom and M.AC_REGION in custom:
            node.meta[M.CUSTOM] = {k: v for k, v in custom.items() if k != M.AC_REGION}


__all__ = [
    "OUTPUT_KEY",
    "LoweringError",
    "check_replicated_fallbacks",
    "refuse_sharded_inputs",
    "LoweringReport",
    "NodePlacements",
    "PlacedInterpreter",
    "local_placeholders",
    "local_shape",
    "lower_plan",
    "move_local",
    "node_placements",
    "shard_tensor",
]
