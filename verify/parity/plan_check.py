"""An independent plan checker: is every placement valid, judged from the graph and the mesh alone?

The planner builds its candidate lists from DTensor's strategy registry and its own rules; a
checker that rereads those lists inherits their mistakes (a candidate kept that does not divide
on a 2-D mesh passes both). This module imports nothing of the planner but the plan's file
format (``autoparallel.planner.plan``): it re-derives each rule from the traced joint graph (shapes, dtypes, roles), the mesh and
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
  unsharded op's output, and ranks that claim a replicated output agree.

Random ops are not run (``PlanCheck.unchecked`` lists them). ``Plan`` objects made by the planner
carry their traced graph; a plan loaded from JSON needs the graph passed in.
"""

from __future__ import annotations

import itertools
import math
import operator
import zlib
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
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.planner.plan import parse_placement
from verify.parity.differential import Feeds
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


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]


def _metas(node: fx.Node) -> list[torch.Tensor | None]:
    val = node.meta.get(M.VAL)
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, list | tuple):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


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
            metas = _metas(node)
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
        biggest = max((m.numel() for n in self.gm.graph.nodes for m in _metas(n) if m is not None), default=0)
        if biggest > self.max_numel:
            self.result.unchecked["*"] = f"a tensor of {biggest} elements exceeds max_numel={self.max_numel}: the graph is not run"
            return
        try:
            values = _unsharded_values(self.gm, self.seed)
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
            claim = (node.target, _static(node), tuple(tuple(m.shape) if m is not None else None for m in _metas(node)),
                     tuple(tuple(a.meta[M.VAL].shape) for a in tensor_inputs(node)), tuple(map(tuple, self.ins[node])),
                     tuple(tuple(o) if o is not None else None for o in self.out[node]))
            if claim in seen:
                continue
            seen.add(claim)
            self.result.ran += 1
            try:
                problem = _simulate(node, values, self.ins[node], self.out[node], self.sizes, coords, self.seed)
            except Exception as e:  # the op refused its shards: the placement is not one it can run on
                problem = f"the op fails on its shards: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if problem:
                self.bad("semantics", key, problem)

    def _skip(self, node: fx.Node) -> str | None:
        if not isinstance(node.target, torch._ops.OpOverload):
            return f"not an aten op: {node.target}"
        if torch.Tag.nondeterministic_seeded in node.target.tags and _dropout_p(node) != 0:
            return "random op"
        pls = [p for pl in [*self.ins[node], *self.out[node]] if pl is not None for p in pl]
        if sum(isinstance(p, _MaskPartial) for p in pls) and len({i for pl in self.ins[node] if pl for i, p in enumerate(pl) if isinstance(p, _MaskPartial)}) > 1:
            return "MaskPartial over several mesh dims"
        return None


def _dropout_p(node: fx.Node) -> float | None:
    """The op's ``dropout_p`` (its schema default when not given), None for an op without one."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == "dropout_p":
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get("dropout_p", a.default_value)
    return None


def _static(node: fx.Node) -> str:
    return repr(pytree.tree_map(lambda x: "T" if isinstance(x, fx.Node) else x, (node.args, node.kwargs)))


def _unsharded_values(gm: fx.GraphModule, seed: int) -> dict[fx.Node, object]:
    """Every node's value on one device, from deterministic random inputs (token ids and labels in
    the range their uses allow)."""
    feeds = Feeds(1, seed)
    values: dict[fx.Node, object] = {}

    class _Record(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n] = out
            return out

    def value(ph: fx.Node) -> torch.Tensor:
        val = ph.meta[M.VAL]
        if roles.is_tangent(ph.meta.get(M.ROLE)):
            return torch.ones(tuple(val.shape), dtype=val.dtype)
        try:
            return feeds.value(ph)[0]
        except ValueError:  # an integer whose range its uses do not tell (read through an alias): 0 or 1
            return torch.randint(0, 2, tuple(val.shape), generator=torch.Generator().manual_seed(seed), dtype=val.dtype)

    args = [value(ph) for ph in gm.graph.find_nodes(op="placeholder")]
    with torch.no_grad():
        _Record(gm).run(*args, enable_io_processing=False)
    return values


_SIZE_ARGS = {"size", "shape", "input_sizes"}


def _simulate(node, values, ins, outs, sizes, coords, seed) -> str | None:
    """Run ``node`` on every rank's shards; a description of the first disagreement, or None."""
    g = torch.Generator().manual_seed(seed * 7919 + zlib_key(node.name))
    args = tensor_inputs(node)
    pieces = [_split(values[a], pl, sizes, coords, g) for a, pl in zip(args, ins, strict=True)]
    masks = [next((m[r] for _, m in pieces if m[r] is not None), None) for r in range(len(coords))]
    local_outs = []
    schema = node.target._schema
    size_names = {i: a.name for i, a in enumerate(schema.arguments) if a.name in _SIZE_ARGS}
    metas = _metas(node)
    for r, c in enumerate(coords):
        it = iter([p[0][r] for p in pieces])  # tensor inputs in tensor_inputs' order
        new_args = pytree.tree_map(lambda x, it=it: next(it) if isinstance(x, fx.Node) else x, (node.args, node.kwargs))
        call_args, call_kwargs = list(new_args[0]), dict(new_args[1])
        if outs and outs[0] is not None and metas and metas[0] is not None:
            local = _local_shape(tuple(metas[0].shape), outs[0], sizes, c)
            for i, name in size_names.items():
                if i < len(call_args) and isinstance(call_args[i], list | tuple):
                    call_args[i] = [-1 if v == -1 else s for v, s in zip(call_args[i], local, strict=False)]
                elif name in call_kwargs and isinstance(call_kwargs[name], list | tuple):
                    call_kwargs[name] = [-1 if v == -1 else s for v, s in zip(call_kwargs[name], local, strict=False)]
        got = node.target(*call_args, **call_kwargs)
        local_outs.append(list(got) if isinstance(got, list | tuple) else [got])
    want = values[node]
    wants = list(want) if isinstance(want, list | tuple) else [want]
    for k, (pl, ref) in enumerate(zip(outs, wants, strict=True)):
        if pl is None or not isinstance(ref, torch.Tensor):
            continue
        try:
            full = _combine([o[k] for o in local_outs], pl, sizes, coords, masks)
        except _Disagree as e:
            return f"output {k}: {e}"
        except RuntimeError as e:
            return f"output {k}: the shards do not reassemble under {pl}: {str(e).splitlines()[0][:160]}"
        problem = _differs(full, ref)
        if problem:
            return f"output {k} ({pl}) reassembled from the ranks differs from the unsharded op: {problem}"
    return None


def zlib_key(name: str) -> int:
    return zlib.crc32(name.encode()) % (2**31)


def _local_shape(shape, pl, sizes, coord) -> list[int]:
    shape = list(shape)
    for p, n, c in zip(pl, sizes, coord, strict=True):
        if isinstance(p, Shard):
            chunk = -(-shape[p.dim] // n) if shape[p.dim] else 0
            shape[p.dim] = max(0, min(chunk, shape[p.dim] - c * chunk))
    return shape


def _split(full, pl, sizes, coords, g):
    """Each rank's local value of ``full`` under ``pl`` (mesh dims outer first), and each rank's
    mask where a MaskPartial input hides rows (None otherwise)."""
    locals_, masks = [], []
    noise: dict = {}  # (mesh dim, outer coordinate) -> the summands' noise, shared by its ranks
    for c in coords:
        x, mask = full, None
        for i, (p, n) in enumerate(zip(pl, sizes, strict=True)):
            j = c[i]
            if isinstance(p, Shard):
                x = _chunk(x, p.dim, n, j)
            elif isinstance(p, _MaskPartial):
                span = -(-p.offset_shape[p.offset_dim] // n)
                lo = j * span
                mask = (x < lo) | (x >= lo + span)
                x = (x - lo).masked_fill(mask, 0)
            elif isinstance(p, Partial):
                x = _partial_piece(x, p.reduce_op, n, j, g, noise.setdefault((i, c[:i]), {}))
        locals_.append(x)
        masks.append(mask)
    return locals_, masks


def _partial_piece(x, op, n, j, g, noise: dict):
    """Rank j's summand: pieces of ``x`` that reduce (sum, avg, max, min) to ``x``, with noise of
    its own magnitude, so that a non-linear op on them cannot pass by homogeneity."""
    if not x.is_floating_point():
        raise ValueError(f"a Partial({op}) of a {x.dtype} tensor")
    if "noise" not in noise:
        scale = float(x.abs().mean()) + 1.0 if x.numel() else 1.0
        drawn = torch.randn((n, *x.shape), generator=g, dtype=torch.float64) * scale
        noise["noise"] = drawn - drawn.mean(0, keepdim=True)
    e = noise["noise"][j].to(x.dtype)
    if op == "sum":
        return x / n + e
    if op == "avg":
        return x + e
    if op in ("max", "min"):
        lower = e.abs() + 1.0
        return x if j == 0 else (x - lower if op == "max" else x + lower)
    raise ValueError(f"Partial({op}) is not simulated")


def _chunk(x, dim, n, j):
    chunk = -(-x.shape[dim] // n) if x.shape[dim] else 0
    start = min(j * chunk, x.shape[dim])
    return x.narrow(dim, start, max(0, min(chunk, x.shape[dim] - start)))


class _Disagree(Exception):
    pass


def _combine(local, pl, sizes, coords, masks):
    """The full value from every rank's output under ``pl`` (innermost mesh dim first);
    ``masks``: per rank, the rows a MaskPartial input hid (its output rows there are dropped)."""
    pieces = dict(zip(coords, local, strict=True))
    for i in reversed(range(len(pl))):
        p = pl[i]
        grouped: dict[tuple, list] = {}
        for c, t in sorted(pieces.items()):
            grouped.setdefault(c[:i], []).append((c, t))
        new = {}
        for head, members in grouped.items():
            ts = [t for _, t in members]
            if isinstance(p, Shard):
                new[head] = torch.cat(ts, dim=p.dim)
            elif isinstance(p, Replicate):
                for c, t in members[1:]:
                    problem = _differs(t, ts[0])
                    if problem:
                        raise _Disagree(f"ranks at {members[0][0]} and {c} disagree on a replicated value: {problem}")
                new[head] = ts[0]
            elif isinstance(p, _MaskPartial):
                acc = None
                for c, t in members:
                    m = next((mm for cc, mm in zip(coords, masks, strict=True) if cc[: len(c)] == c and mm is not None), None)
                    if m is not None:
                        t = t.masked_fill(m.reshape(*m.shape, *([1] * (t.dim() - m.dim()))), 0)
                    acc = t if acc is None else acc + t
                new[head] = acc
            elif isinstance(p, Partial):
                stack = torch.stack(ts)
                new[head] = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.amax(0), "min": stack.amin(0)}[p.reduce_op]
            else:
                raise _Disagree(f"placement {p} is not simulated")
        pieces = new
    return pieces[()]


def _differs(got, want) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"got {type(got).__name__}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    if got.is_complex():
        got, want = torch.view_as_real(got), torch.view_as_real(want)
    if not got.is_floating_point():
        n = int((got != want).sum())
        return f"{n} of {got.numel()} elements differ" if n else None
    a, b = got.double(), want.double()
    if bool(((torch.isnan(a) != torch.isnan(b))).any()):
        return "NaN on one side"
    a, b = a.nan_to_num(), b.nan_to_num()
    scale = float(b.abs().max()) if b.numel() else 0.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    tol = (1e-3 if want.dtype.itemsize >= 4 else 3e-2) * scale + 1e-6
    return f"max |diff| {err:.3e} > {tol:.3e} (scale {scale:.3e})" if err > tol else None


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
