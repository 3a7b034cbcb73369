"""An independent plan checker: is every placement valid, judged from the graph and the mesh alone?

The planner builds its candidate lists from DTensor's strategy registry and its own rules; a
checker that rereads those lists inherits their mistakes (a candidate kept that does not divide
on a 2-D mesh passes both). This module imports nothing of the planner but the plan's file
format (``autoparallel.planner.solution``): it re-derives each rule from the traced joint graph (shapes, dtypes, roles), the mesh and
the op itself.

Constraint groups (each ``Violation`` names one):

* ``structure``: every traced node (and graph output) is placed, with one placement per tensor
  output (none for a non-tensor one) and one per tensor input; placements parse and name dims
  the tensor has;
* ``divides``: every sharded dim divides by the product of the mesh dims that shard it; only a
  parameter's dim 0 (FSDP pads it), its gradient's and the dtype casts of the parameter may pad;
* ``flow``: each input's wanted placement can be reached from its producer's (a move into a
  ``Partial`` exists only from ``Replicate`` or the same ``Partial``); an alias and a graph output
  take the placement they get;
* ``multi_output``: a ``getitem`` is placed exactly as its producer's output of that index, and
  every tensor output a ``getitem`` reads has a placement;
* ``fwd_bwd``: a parameter and its gradient, an output and its tangent, a buffer and its new
  value (a model that updates it in place), are placed alike; the loss is replicated;
* ``grad_reduce_dtype``: nothing moves between a parameter and its narrowing cast, nor between a
  gradient's widening cast and its producer (mixed precision reduces in the wide dtype);
* ``param_memory``: per-rank parameter bytes (padded shards rounded up) recomputed from the
  placements equal the plan's figure and fit its budget;
* ``tables``, ``pins``: the plan's parameter and input tables, and pinned nodes, agree with the
  node placements;
* ``semantics``: the op, run on every simulated rank's shard of real values in its chosen input
  placements, gives outputs that reassemble (in its chosen output placements) into the
  unsharded op's output, and ranks that claim a replicated output agree
  (verify/parity/plan_semantics.py).

Random ops are not run (``PlanCheck.unchecked`` lists them). ``Solution`` objects made by the planner
carry their traced graph; a plan loaded from JSON needs the graph passed in.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _MaskPartial,
)

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.planner.solution import parse_placement
from verify.parity.plan_semantics import dropout_p, simulate, static_args, tensor_inputs, tensor_metas, unsharded_values
from verify.stages.pipeline_run import intra_op_threads

GROUPS = ("structure", "divides", "flow", "multi_output", "fwd_bwd", "grad_reduce_dtype", "param_memory", "tables", "pins", "semantics")


@dataclass(frozen=True)
class Violation:
    group: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.group}] {self.where}: {self.detail}"


@dataclass
class PlanCheck:
    """The violations, and what the semantic check ran and left out (and why)."""

    violations: list[Violation] = field(default_factory=list)
    ran: int = 0
    unchecked: dict[str, str] = field(default_factory=dict)  # node key -> why

    def groups(self) -> set[str]:
        return {v.group for v in self.violations}


# --- placements (the plan's file format is the one thing read from the planner's package) -----------

placement = parse_placement


def decode(d: Mapping[str, str] | None, names: Sequence[str]) -> tuple[Placement, ...] | None:
    if d is None:
        return None
    return tuple(parse_placement(d[n]) for n in names)


def _partial(p: Placement) -> bool:
    return isinstance(p, Partial)  # _MaskPartial is a Partial


def shard_counts(pl: Sequence[Placement], sizes: Sequence[int], ndim: int) -> list[int]:
    """Pieces per tensor dim: the product of the sizes of the mesh dims sharding it."""
    counts = [1] * ndim
    for p, n in zip(pl, sizes, strict=True):
        if isinstance(p, Shard):
            counts[p.dim] *= n
    return counts


def local_numel(shape: Sequence[int], pl: Sequence[Placement], sizes: Sequence[int]) -> int:
    """Elements of the largest shard (padded shards are rounded up)."""
    counts = shard_counts(pl, sizes, len(shape))
    return math.prod(-(-s // c) for s, c in zip(shape, counts, strict=True))


def can_move(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """A redistribution from ``src`` to ``dst`` exists: into a Partial only from Replicate or itself."""
    return all(not _partial(d) or d == s or isinstance(s, Replicate) for s, d in zip(src, dst, strict=True))


_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def _cast(node: fx.Node) -> tuple[torch.dtype, torch.dtype] | None:
    """(from, to) dtypes of a pure dtype cast, else None."""
    if node.op != "call_function" or node.target not in _CASTS:
        return None
    ins, out = tensor_inputs(node), node.meta.get(M.VAL)
    if len(ins) != 1 or not isinstance(out, torch.Tensor):
        return None
    src = ins[0].meta.get(M.VAL)
    if not isinstance(src, torch.Tensor) or src.shape != out.shape or src.dtype == out.dtype:
        return None
    return src.dtype, out.dtype


def _is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.aten.alias.default


def _through_alias(node: fx.Node) -> fx.Node:
    return node.args[0] if _is_alias(node) else node


# --- the checker -------------------------------------------------------------------------------------


class _Checker:
    def __init__(self, plan, gm: fx.GraphModule, output_roles, pins, semantics: bool, seed: int, max_numel: int):
        self.plan, self.gm = plan, gm
        self.names = plan.mesh_names
        self.sizes = [s for _, s in plan.mesh]
        self.result = PlanCheck()
        self.keys = {name: key for name, key in plan.node_names.items()}
        self.pins = pins or {}
        self.semantics, self.seed, self.max_numel = semantics, seed, max_numel
        self.out: dict[fx.Node, list] = {}  # node -> its output placements
        self.ins: dict[fx.Node, list] = {}
        self.output_roles = list(output_roles) if output_roles is not None else None

    def bad(self, group: str, where: str, detail: str) -> None:
        self.result.violations.append(Violation(group, where, detail))

    # structure, then divisibility of every placement
    def read(self) -> None:
        for node in self.gm.graph.nodes:
            if node.op not in ("placeholder", "call_function", "get_attr"):  # get_attr: a lifted tensor constant
                continue
            key = self.keys.get(node.name)
            entry = self.plan.nodes.get(key) if key is not None else None
            if entry is None:
                self.bad("structure", key or node.name, "the plan does not place this node")
                continue
            try:
                outs = [decode(o, self.names) for o in entry.out]
                ins = [decode(i, self.names) for i in entry.ins]
            except (KeyError, ValueError) as e:
                self.bad("structure", key, f"unreadable placement: {e}")
                continue
            metas = tensor_metas(node)
            if len(outs) != len(metas):
                self.bad("structure", key, f"{len(outs)} output placements for {len(metas)} outputs")
                continue
            for i, (pl, m) in enumerate(zip(outs, metas, strict=True)):
                if (pl is None) != (m is None) and not (pl is None and node.target is operator.getitem):
                    self.bad("structure", key, f"output {i}: placement {pl} for {'a tensor' if m is not None else 'no tensor'}")
            n_in = 0 if node.target is operator.getitem or node.op != "call_function" else len(tensor_inputs(node))
            if len(ins) != n_in:
                self.bad("structure", key, f"{len(ins)} input placements for {n_in} tensor inputs")
                continue
            self.out[node], self.ins[node] = outs, ins
            pad = self._may_pad(node)
            for what, pl, m in [*((f"output {i}", p, mm) for i, (p, mm) in enumerate(zip(outs, metas, strict=True))),
                                *((f"input {i}", p, a.meta.get(M.VAL)) for i, (p, a) in enumerate(zip(ins, tensor_inputs(node), strict=False)))]:
                if pl is not None and isinstance(m, torch.Tensor):
                    self._divides(key, what, pl, tuple(m.shape), pad)

    def _may_pad(self, node: fx.Node) -> bool:
        """A parameter, or a dtype cast of one: FSDP pads its dim 0."""
        if node.op == "placeholder":
            return roles.is_param(node.meta.get(M.ROLE))
        if _cast(node) is not None:
            src = _through_alias(tensor_inputs(node)[0])
            return src.op == "placeholder" and roles.is_param(src.meta.get(M.ROLE))
        return False

    def _divides(self, key: str, what: str, pl, shape, pad: bool) -> None:
        for p in pl:
            if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
                self.bad("structure", key, f"{what}: {p} on a {len(shape)}-d tensor")
                return
        for d, (s, c) in enumerate(zip(shape, shard_counts(pl, self.sizes, len(shape)), strict=True)):
            if s % c and not (pad and d == 0):
                self.bad("divides", key, f"{what}: dim {d} of {tuple(shape)} split {c} ways by {self._text(pl)}")

    def _text(self, pl) -> str:
        return " ".join(f"{n}:{p}" for n, p in zip(self.names, pl, strict=True))

    # producer -> consumer
    def flow(self) -> None:
        for node in self.gm.graph.nodes:
            if node not in self.out or node.op != "call_function":
                continue
            key = self.keys[node.name]
            if node.target is operator.getitem:
                prod, idx = node.args[0], node.args[1]
                if prod not in self.out:
                    continue
                src = self.out[prod][idx] if idx < len(self.out[prod]) else None
                if src is None:
                    self.bad("multi_output", key, f"reads output {idx} of {self.keys[prod.name]}, which has no placement")
                elif src != self.out[node][0]:
                    self.bad("multi_output", key, f"placed {self._text(self.out[node][0])}, its producer's output {idx} is {self._text(src)}")
                continue
            for a, (arg, want) in enumerate(zip(tensor_inputs(node), self.ins[node], strict=True)):
                if arg in self.out:
                    self._edge(f"{key} input {a} <- {self.keys[arg.name]}", self.out[arg][0], want)
            if _is_alias(node) and self.ins[node][0] != self.out[node][0]:
                self.bad("flow", key, f"an alias moves nothing: in {self._text(self.ins[node][0])}, out {self._text(self.out[node][0])}")
        out_node = self.gm.graph.output_node()
        labels = self.output_roles or out_node.meta.get(M.ROLE) or [None] * len(out_node.args[0])
        self.outputs: dict[str, tuple] = {}
        for i, (arg, role) in enumerate(zip(out_node.args[0], labels, strict=True)):
            if not isinstance(arg, fx.Node):
                continue
            key = f"out:{role or roles.user_output(i)}"
            entry = self.plan.nodes.get(key)
            if entry is None:
                self.bad("structure", key, "the plan does not place this graph output")
                continue
            o, ins = decode(entry.out[0], self.names), [decode(x, self.names) for x in entry.ins]
            if ins != [o]:
                self.bad("flow", key, f"a graph output is what it receives: in {entry.ins}, out {entry.out}")
            self._divides(key, "output", o, tuple(arg.meta[M.VAL].shape), self._may_pad(_through_alias(arg)) or roles.is_grad(role))
            if arg in self.out:
                self._edge(f"{key} <- {self.keys[arg.name]}", self.out[arg][0], o)
            self.outputs[role or roles.user_output(i)] = o

    def _edge(self, where: str, src, dst) -> None:
        if src is None or dst is None:
            self.bad("flow", where, f"no placement on one end: {src} -> {dst}")
        elif not can_move(src, dst):
            self.bad("flow", where, f"no redistribution from {self._text(src)} to {self._text(dst)}")

    def fwd_bwd(self) -> None:
        by_role = {n.meta.get(M.ROLE): n for n in self.gm.graph.find_nodes(op="placeholder")}
        for role, o in self.outputs.items():
            twin = None
            if roles.is_grad(role):
                name = roles.name(role)
                twin = by_role.get(roles.param(name)) or (by_role.get(roles.input_(int(name))) if name.isdigit() else None)
            elif roles.is_mutated(role):  # copied into the buffer's local piece
                twin = by_role.get(roles.buffer(roles.name(role)))
            elif roles.tangent(role) in by_role:
                twin = by_role[roles.tangent(role)]
            if twin is not None and twin in self.out and self.out[twin][0] != o:
                self.bad("fwd_bwd", f"out:{role} ~ {twin.meta[M.ROLE]}", f"{self._text(o)} != {self._text(self.out[twin][0])}")
            if role == roles.LOSS and not all(isinstance(p, Replicate) for p in o):
                self.bad("fwd_bwd", "out:loss", f"the loss must be replicated, placed {self._text(o)}")

    def grad_reduce_dtype(self) -> None:
        for node in self.gm.graph.nodes:
            dtypes = _cast(node)
            if dtypes is None or node not in self.ins:
                continue
            src = tensor_inputs(node)[0]
            origin = _through_alias(src)
            narrowing = dtypes[1].itemsize < dtypes[0].itemsize and origin.op == "placeholder" and roles.is_param(origin.meta.get(M.ROLE))
            widening = dtypes[1].itemsize > dtypes[0].itemsize and any(
                u.op == "output" or (_is_alias(u) and any(w.op == "output" for w in u.users)) for u in node.users)
            if not (narrowing or widening):
                continue
            chain = [(node, src)] + ([(src, origin)] if src is not origin else [])
            for consumer, producer in chain:
                if consumer in self.ins and producer in self.out and self.ins[consumer][0] != self.out[producer][0]:
                    self.bad("grad_reduce_dtype", self.keys[consumer.name],
                             f"moves {self._text(self.out[producer][0])} -> {self._text(self.ins[consumer][0])} across a mixed-precision cast")

    def memory_tables_pins(self) -> None:
        total = 0
        params = {}
        for ph in self.gm.graph.find_nodes(op="placeholder"):
            role = ph.meta.get(M.ROLE)
            if ph not in self.out:
                continue
            pl = self.out[ph][0]
            if roles.is_param(role):
                fqn = roles.name(role)
                params[fqn] = pl
                val = ph.meta[M.VAL]
                total += local_numel(val.shape, pl, self.sizes) * val.dtype.itemsize
                table = self.plan.params.get(fqn)
                if table is None or decode(table, self.names) != pl:
                    self.bad("tables", fqn, f"parameter table says {table}, its node {self._text(pl)}")
            elif isinstance(role, str):
                table = self.plan.inputs.get(role)
                if table is None or decode(table, self.names) != pl:
                    self.bad("tables", role, f"input table says {table}, its node {self._text(pl)}")
        whole = set(self.plan.params) == set(params)
        if not whole and not (set(params) < set(self.plan.params) and self.plan.stats.get("traced_blocks")):
            self.bad("tables", "params", f"the plan lists {len(self.plan.params)} parameters, the graph has {len(params)}")
        if whole:
            if total != self.plan.param_memory_bytes:
                self.bad("param_memory", "params", f"parameters take {total} bytes per rank, the plan says {self.plan.param_memory_bytes}")
            budget = self.plan.memory_budget_bytes
            if budget is not None and total > budget * (1 + 1e-9):
                self.bad("param_memory", "params", f"{total} bytes per rank exceed the budget of {budget}")
        for name, want in self.pins.items():
            key = name if name in self.plan.nodes else roles.param(name)
            got = decode(self.plan.nodes[key].out[0], self.names) if key in self.plan.nodes else None
            if got != tuple(want):
                self.bad("pins", name, f"pinned to {tuple(want)}, placed {got}")

    # --- semantics: run each op on the shards of simulated ranks --------------------------------

    def run_ops(self) -> None:
        biggest = max((m.numel() for n in self.gm.graph.nodes for m in tensor_metas(n) if m is not None), default=0)
        if biggest > self.max_numel:
            self.result.unchecked["*"] = f"a tensor of {biggest} elements exceeds max_numel={self.max_numel}: the graph is not run"
            return
        try:
            values = unsharded_values(self.gm, self.seed)
        except Exception as e:  # e.g. a mixed-precision trace: fp32 inputs meet bf16 weights
            self.result.unchecked["*"] = f"the unsharded graph does not run on real tensors: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            return
        coords = list(itertools.product(*[range(n) for n in self.sizes]))
        seen: set = set()
        for node in self.gm.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem or node not in self.out:
                continue
            key = self.keys[node.name]
            why = self._skip(node)
            if why:
                self.result.unchecked[key] = why
                continue
            # Identical blocks repeat the same claim: one run per op, shapes, arguments and placements.
            claim = (node.target, static_args(node), tuple(tuple(m.shape) if m is not None else None for m in tensor_metas(node)),
                     tuple(tuple(a.meta[M.VAL].shape) for a in tensor_inputs(node)), tuple(map(tuple, self.ins[node])),
                     tuple(tuple(o) if o is not None else None for o in self.out[node]))
            if claim in seen:
                continue
            seen.add(claim)
            self.result.ran += 1
            try:
                problem = simulate(node, values, self.ins[node], self.out[node], self.sizes, coords, self.seed)
            except Exception as e:  # the op refused its shards: the placement is not one it can run on
                problem = f"the op fails on its shards: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if problem:
                self.bad("semantics", key, problem)

    def _skip(self, node: fx.Node) -> str | None:
        if not isinstance(node.target, torch._ops.OpOverload):
            return f"not an aten op: {node.target}"
        if torch.Tag.nondeterministic_seeded in node.target.tags and dropout_p(node) != 0:
            return "random op"
        pls = [p for pl in [*self.ins[node], *self.out[node]] if pl is not None for p in pl]
        if sum(isinstance(p, _MaskPartial) for p in pls) and len({i for pl in self.ins[node] if pl for i, p in enumerate(pl) if isinstance(p, _MaskPartial)}) > 1:
            return "MaskPartial over several mesh dims"
        return None


def check_plan(plan, gm: fx.GraphModule, output_roles: Sequence[str | None] | None = None, *,
               pins: Mapping[str, Sequence[Placement]] | None = None, semantics: bool = True, seed: int = 0,
               max_numel: int = 1 << 22) -> PlanCheck:
    """Every violated constraint of ``plan`` on the traced joint graph ``gm`` (see the module
    docstring); ``semantics=False`` skips running the ops (a graph too big to run)."""
    c = _Checker(plan, gm, output_roles, pins, semantics, seed, max_numel)
    if list(c.names) != [n for n, _ in plan.mesh]:
        raise ValueError("malformed plan mesh")
    c.read()
    c.flow()
    c.fwd_bwd()
    c.grad_reduce_dtype()
    c.memory_tables_pins()
    if semantics:
        with intra_op_threads(1):  # tiny ops: a second thread only spins
            c.run_ops()
    return c.result


def traced_graph(plan):
    """(gm, output roles) the planner traced for ``plan`` (``ValueError`` for a plan loaded from JSON)."""
    ctx = plan._context
    if ctx is None or getattr(ctx, "traced", None) is None:
        raise ValueError("the plan carries no traced graph (loaded from JSON?): pass the traced joint graph")
    return ctx.traced.gm, ctx.traced.output_roles


def assert_plan_valid(plan, gm: fx.GraphModule | None = None, output_roles=None, **kw) -> PlanCheck:
    """Raise AssertionError listing every violation; the graph defaults to the one the plan was traced on."""
    if gm is None:
        gm, output_roles = traced_graph(plan)
    result = check_plan(plan, gm, output_roles, **kw)
    if result.violations:
        raise AssertionError(f"{len(result.violations)} constraint violation(s):\n" + "\n".join(str(v) for v in result.violations[:30]))
    return result
