"""Candidate placements per node, from DTensor's op-strategy registry.

For every node of the planning graph: a list of :class:`Candidate` (the placements of its
outputs and the placements it needs its tensor inputs in), in a deterministic order.

* Ops: DTensor's registry (``torch.distributed.tensor._ops``), in the order DTensor itself
  consults it (``ShardingPropagator.propagate_op_sharding_non_cached``): single-mesh-dim
  strategies, expanded here over the whole mesh (DTensor's own expansion wants one input
  placement per input, the runtime case; a planner wants them all); full strategy functions,
  called with every distinct placement of each producer; DTensor's decomposition strategies.
  Ops DTensor has no strategy for get a rule from :data:`PLANNER_RULES` (the CPU SDPA ops);
  an op with no tensor input that DTensor does not cover (a factory: ``arange`` for a model's
  positions) is replicated; any other op with neither takes the *replicated fallback*: its one
  candidate gathers every input to ``Replicate`` and replicates its outputs (always correct:
  every rank runs the unsharded op; the edges into it price the gathers, the op's compute is
  the whole op's). So does a random op that is not a dropout (``torch.rand``, ``bernoulli`` of
  a drop path): every rank draws the whole tensor, the single-device draw, and keeps its piece.
  So does an op that reads its input's data (:func:`reads_data`: a value guard, a mask's count),
  and a call run only for its side effect (``autoparallel.planner.side_effects``: an assert, a
  print), with no output: every rank runs it on the whole inputs, as the single-device program does.
  :attr:`StrategyEnumerator.fallbacks` names every node that took it, and why.
* Tensor constants (``get_attr``: a tensor the model makes from Python data in forward, lifted
  into the graph): replicated, as every rank holds the whole constant.
* Placeholders: every tuple of ``Replicate``/``Shard(d)`` over the mesh. Parameters also get
  *padded* ``Shard(0)`` where dim 0 does not divide (FSDP2 pads dim 0 to a multiple of the mesh
  dim), priced by its real, padded bytes.
* Candidates that do not divide are dropped, as are ``_StridedShard`` and mixed partial types
  (a parameter may be offered its FSDP-order strided layout, ``strided=True``, when a pin asks).
* ``getitem`` follows its producer candidate by candidate; ``aten.alias`` (inserted before
  multi-user nodes) may take any placement; graph outputs take the placements of the
  parameter (gradients) or ``Replicate`` (the loss).
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

from autoparallel import meta as M
from autoparallel.ac import is_random
from autoparallel.parallelize.traced_values import MASK_OPS, NONZERO
from autoparallel.passes.value_guards import GUARD, GUARD_ROWS
from autoparallel.planner.graph import ALIAS, module_of, tensor_args
from autoparallel.planner.side_effects import is_side_effect
from autoparallel.planner.strided import sharded_dim, strided_variants

log = logging.getLogger(__name__)

aten = torch.ops.aten

Placements = tuple[Placement, ...]  # one entry per mesh dim


@dataclass(frozen=True)
class Candidate:
    """One way to run a node: placements of its outputs and of its tensor inputs."""

    outs: tuple[Placements | None, ...]
    ins: tuple[Placements, ...]


class NoStrategyError(ValueError):
    """An op that neither DTensor nor the planner knows how to shard."""


class _NoRule(NoStrategyError):
    """Neither DTensor's registry nor PLANNER_RULES lists the op (the replicated fallback's case)."""


# Why a node took the replicated fallback (``StrategyEnumerator.fallbacks``, ``Solution.fallbacks``).
NO_STRATEGY = "no sharding strategy: inputs gathered to Replicate, the whole op on every rank"
RANDOM_OP = "random op, not a dropout: every rank draws the whole tensor (the single-device draw)"
DATA_DEPENDENT = ("reads its input's data (a value guard, or a mask's count as the output's size): inputs gathered "
                  "to Replicate, the whole op on every rank, as the trace read it on the whole batch")
SIDE_EFFECT = ("runs only for its side effect (an assert, a print; no output): inputs gathered to Replicate, so every "
               "rank runs it on the whole value, as the single-device program does")


def is_dropout(op) -> bool:
    """A dropout: ``native_dropout`` or an op with a ``dropout_p`` argument (the attention kernels)."""
    if op is aten.native_dropout.default:
        return True
    return isinstance(op, torch._ops.OpOverload) and any(a.name == "dropout_p" for a in op._schema.arguments)


def is_undroppable_random(op) -> bool:
    """A random op that is not a dropout: nothing switches it off, so a rank must draw exactly what
    the unsharded program draws (the replicated fallback; the lowering refuses any other placement)."""
    return is_random(op) and not is_dropout(op)


def reads_data(node: fx.Node) -> bool:
    """A value guard, or an op whose output size is a mask's count (``nonzero``, ``x[mask]``,
    ``masked_select``, ``x[mask] = v``): the trace answered the read with the value or count of the
    whole, unsharded tensor (patch value_guards) and the guard checks that, so a shard of it would
    compute another size (or fail its guard) on each rank. Replicated, whatever DTensor offers."""
    op = node.target
    if op in (GUARD, GUARD_ROWS, NONZERO):
        return True
    if op not in MASK_OPS:
        return False
    masks = [node.args[1]] if op is aten.masked_select.default else list(node.args[1])
    return any(isinstance(m, fx.Node) and m.meta[M.VAL].dtype in (torch.bool, torch.uint8) for m in masks)


def planned_by_decomposition(op) -> bool:
    """The planner takes ``op``'s candidates from DTensor's decomposition strategy (no registered
    strategy, no planner rule): each is a placement under which the decomposition's ops run on
    the local pieces with no collective (one that would need a redistribution is left out), so a
    rank runs the op itself on its pieces. DTensor's own dispatch does not always find those
    placements at run time (``log_sigmoid_forward``, ``polar``: "does not have a sharding strategy
    registered"), so the lowering runs the op locally instead (``lower.PlacedInterpreter``)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    prop = DTensor._op_dispatcher.sharding_propagator
    return (isinstance(op, torch._ops.OpOverload) and op not in PLANNER_RULES and op not in prop.op_single_dim_strategy_funcs
            and op not in prop.op_strategy_funcs and DecompShardingStrategy.has_decomp(op))


def replicated(n: int) -> Placements:
    return tuple(Replicate() for _ in range(n))


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def out_metas(node: fx.Node) -> tuple[TensorMeta | None, ...]:
    """The node's tensor outputs (None for an output that is no tensor); none for a call run only
    for its side effect (``side_effects.is_side_effect``)."""
    val = node.meta.get(M.VAL)
    if isinstance(val, torch.Tensor):
        return (tensor_meta(val),)
    if isinstance(val, list | tuple):
        return tuple(tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in val)
    if is_side_effect(node):
        return ()
    raise ValueError(
        f"node {node.name!r} ({node.format_node()}) in module {module_of(node)} has no tensor meta['val'] and "
        f"{len(node.users)} users; the planner needs FakeTensor values on every node it places (trace with "
        "autoparallel.planner.trace_planning_graph)"
    )


# --- placement helpers ----------------------------------------------------------------------------


def shard_counts(placements: Placements, sizes: Sequence[int], ndim: int) -> list[int] | None:
    """Number of shards per tensor dim (None if a placement names a dim the tensor lacks)."""
    counts = [1] * ndim
    for p, n in zip(placements, sizes, strict=True):
        d = sharded_dim(p)
        if d is not None:
            if not 0 <= d < ndim:
                return None
            counts[d] *= n
    return counts


def divides(placements: Placements, shape: Sequence[int], sizes: Sequence[int], *, pad_dim0: bool = False) -> bool:
    counts = shard_counts(placements, sizes, len(shape))
    if counts is None:
        return False
    for d, (size, n) in enumerate(zip(shape, counts, strict=True)):
        if size % n:
            if d == 0 and pad_dim0 and size >= 1:
                continue
            return False
    return True


def _partial_kinds_ok(placements: Placements) -> bool:
    kinds = {(type(p), p.reduce_op) for p in placements if isinstance(p, Partial)}
    if len(kinds) <= 1:
        return True
    return {k[1] for k in kinds} <= {"sum", "avg"} and {k[0] for k in kinds} == {Partial}


def all_placements(ndim: int, mesh_ndim: int) -> list[Placements]:
    """Every tuple of Replicate / Shard(d) over the mesh, Replicate first, then by dim."""
    opts: list[Placement] = [Replicate()] + [Shard(d) for d in range(ndim)]
    return [tuple(c) for c in itertools.product(opts, repeat=mesh_ndim)]


def placements_str(placements: Placements | None, names: Sequence[str]) -> str:
    if placements is None:
        return "-"
    return " ".join(f"{n}:{p}" for n, p in zip(names, placements, strict=True))


# --- own rules for ops DTensor does not cover ----------------------------------------------------

SingleDimRule = list[Placement | None]  # [outputs..., tensor inputs...] on one mesh dim


def _sdpa_cpu_rules(node: fx.Node, num_outs: int, num_ins: int) -> list[SingleDimRule]:
    """Batch and heads shard (every tensor carries them as dims 0 and 1); sequence does not
    without context parallelism. An attention mask shards only where it has that dim."""
    ins = tensor_args(node)
    rules: list[SingleDimRule] = [[Replicate()] * (num_outs + num_ins)]
    q = ins[1] if node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default else ins[0]
    qshape = q.meta[M.VAL].shape
    for d in (0, 1):
        rule: SingleDimRule = [Shard(d)] * num_outs
        for a in ins:
            shape = a.meta[M.VAL].shape
            rule.append(Shard(d) if len(shape) > d and shape[d] == qshape[d] else Replicate())
        rules.append(rule)
    return rules


PLANNER_RULES: dict[object, Callable[[fx.Node, int, int], list[SingleDimRule]]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_cpu_rules,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_cpu_rules,
}


# --- the enumerator -------------------------------------------------------------------------------


class StrategyEnumerator:
    """Candidates of op nodes, cached by what they depend on (identical blocks hit the cache)."""

    def __init__(self, device_mesh):
        from torch.distributed.tensor import DTensor

        self.mesh = device_mesh
        self.sizes = tuple(int(s) for s in device_mesh.shape)
        self.prop = DTensor._op_dispatcher.sharding_propagator
        self._cache: dict[object, tuple[list[Candidate], str | None]] = {}
        self.calls = 0
        self.hits = 0
        self.fallbacks: dict[str, str] = {}  # node name -> why it took the replicated fallback

    # The expansion of single-mesh-dim rules (DTensor's ``expand_to_full_mesh_op_strategy``
    # without its redistribute-cost bookkeeping, which the planner prices itself).
    def _expand(self, rules: Sequence[SingleDimRule], num_outs: int, metas_out, metas_in) -> list[Candidate]:
        out: list[Candidate] = []
        seen: set[Candidate] = set()
        for combo in itertools.product(rules, repeat=len(self.sizes)):
            specs = list(zip(*combo, strict=True))
            cand = self._candidate([None if all(p is None for p in s) else tuple(s) for s in specs], num_outs, metas_out, metas_in)
            if cand is not None and cand not in seen:
                seen.add(cand)
                out.append(cand)
        return out

    def _candidate(self, specs, num_outs, metas_out, metas_in) -> Candidate | None:
        outs, ins = specs[:num_outs], specs[num_outs:]
        if any(pl is None for pl in ins):
            return None  # every tensor input needs a placement
        for pl, meta in itertools.chain(zip(outs, metas_out, strict=True), zip(ins, metas_in, strict=True)):
            if pl is None:
                continue
            if any(p is None or isinstance(p, _StridedShard) for p in pl):
                return None
            if not _partial_kinds_ok(pl):
                return None
            if meta is not None and not divides(pl, meta.shape, self.sizes):
                return None
        return Candidate(tuple(outs), tuple(ins))

    def op_candidates(self, node: fx.Node, producer_placements: Sequence[Sequence[Placements]]) -> list[Candidate]:
        """Candidates of a ``call_function`` op node given each tensor input's possible placements."""
        op = node.target
        metas_out = out_metas(node)
        in_nodes = tensor_args(node)
        metas_in = tuple(tensor_meta(a.meta[M.VAL]) for a in in_nodes)
        uses_inputs = op not in PLANNER_RULES and op not in self.prop.op_single_dim_strategy_funcs
        partials = tuple(_partials_offered(p) for p in producer_placements)
        key = (
            op,
            metas_out,
            metas_in,
            static_args(node),
            tuple(tuple(p) for p in producer_placements) if uses_inputs else partials,
        )
        self.calls += 1
        cached = self._cache.get(key)
        if cached is not None:
            self.hits += 1
        else:
            cached = self._candidates_or_fallback(node, producer_placements, metas_out, metas_in, partials)
            self._cache[key] = cached
        cands, why = cached
        if why is not None:
            self.fallbacks[node.name] = why
        return cands

    def _candidates_or_fallback(self, node, producer_placements, metas_out, metas_in, partials) -> tuple[list[Candidate], str | None]:
        op = node.target
        if is_side_effect(node):
            return [self.replicated_fallback(metas_out, metas_in)], SIDE_EFFECT
        if is_undroppable_random(op):
            return [self.replicated_fallback(metas_out, metas_in)], RANDOM_OP
        if reads_data(node):
            return [self.replicated_fallback(metas_out, metas_in)], DATA_DEPENDENT
        try:
            cands = self._op_candidates(node, producer_placements, metas_out, metas_in)
        except _NoRule:  # an op with tensor inputs (factories are replicated above)
            return [self.replicated_fallback(metas_out, metas_in)], NO_STRATEGY
        cands = [c for c in cands if _partials_reachable(c, partials)]
        if not cands:
            raise NoStrategyError(
                f"op {op} at node {node.name!r} has no sharding candidate that divides its shapes "
                f"{[tuple(m.shape) for m in metas_in]} on mesh {self.sizes}"
            )
        return cands, None

    def replicated_fallback(self, metas_out, metas_in) -> Candidate:
        """Every input gathered to Replicate, every tensor output Replicate: the unsharded op on every rank."""
        rep = replicated(len(self.sizes))
        return Candidate(tuple(rep if m is not None else None for m in metas_out), tuple(rep for _ in metas_in))

    def _op_candidates(self, node, producer_placements, metas_out, metas_in) -> list[Candidate]:
        op = node.target
        num_ins = len(metas_in)
        if op in PLANNER_RULES:
            rules = PLANNER_RULES[op](node, len(metas_out), num_ins)
            return self._expand(rules, len(metas_out), metas_out, metas_in)
        info = self.prop.op_single_dim_strategy_funcs.get(op)
        if info is not None:
            return self._single_dim(node, info, metas_out, metas_in)
        func = self.prop.op_strategy_funcs.get(op)
        if func is not None:
            return self._full_strategy(node, func, producer_placements, metas_out, metas_in)
        from torch.distributed.tensor._decompositions import DecompShardingStrategy

        if isinstance(op, torch._ops.OpOverload) and DecompShardingStrategy.has_decomp(op):
            cands = self._decomposed(node, metas_out, metas_in)
            if cands:
                return cands
        if num_ins == 0:  # a factory (arange, zeros, full, ...): every rank makes the whole tensor
            return self._expand([[Replicate()] * len(metas_out)], len(metas_out), metas_out, metas_in)
        raise _NoRule(
            f"op {op} at node {node.name!r} ({node.format_node()}) has no sharding strategy: DTensor's "
            "registry has none and the planner has no rule for it. Add a rule to "
            "autoparallel.planner.strategies.PLANNER_RULES (or register a DTensor strategy)."
        )

    def _single_dim(self, node, info, metas_out, metas_in) -> list[Candidate]:
        from torch.distributed.tensor._ops.single_dim_strategy import (
            _fill_single_dim_strategy_placeholders,
            _insert_single_dim_replication_strategy,
        )

        args_meta, kwargs_meta = _meta_args(node)
        func = getattr(info, "func", info)
        rules = [list(r) for r in func(node.target, args_meta, kwargs_meta)]
        num_outs = len(rules[0]) - len(metas_in) if rules else len(metas_out)
        rules = _insert_single_dim_replication_strategy(rules, num_outs, len(metas_in), metas_out if len(metas_out) > 1 else metas_out[0])
        rules = _fill_single_dim_strategy_placeholders({Shard(0)}, rules)
        return self._expand(rules, num_outs, metas_out[:num_outs] if num_outs <= len(metas_out) else metas_out, metas_in)

    # A strategy function written for the runtime expects one placement per input (and pairs
    # inputs by index, or returns only the placement that "follows" its first input, otherwise),
    # so it is called once per combination of input placements, up to this many; inputs of one
    # shape (stack, cat: their strategies follow one common placement), and combinations beyond
    # the limit, get each placement given to every input at the same time.
    MAX_INPUT_COMBINATIONS = 1024

    def _full_strategy(self, node, func, producer_placements, metas_out, metas_in) -> list[Candidate]:
        combos = 1
        for pls in producer_placements:
            combos *= len(pls)
        same_shape = len(metas_in) > 1 and len({(tuple(m.shape), m.dtype) for m in metas_in}) == 1
        if combos <= self.MAX_INPUT_COMBINATIONS and not same_shape:
            calls = itertools.product(*[[[p] for p in pls] for pls in producer_placements])
        else:
            union = list(dict.fromkeys(p for pls in producer_placements for p in pls))
            calls = [[[p]] * len(producer_placements) for p in union]
        out: list[Candidate] = []
        seen: set[Candidate] = set()
        errors: list[Exception] = []
        for call in calls:
            try:
                got = self._call_full_strategy(node, func, list(call), metas_out, metas_in)
            except Exception as e:  # runtime strategy functions raise on placements they reject
                errors.append(e)
                continue
            for c in got:
                if c not in seen:
                    seen.add(c)
                    out.append(c)
        if not out and errors:
            raise NoStrategyError(f"op {node.target} at node {node.name!r}: DTensor's strategy failed: {errors[0]}") from errors[0]
        return out

    def _call_full_strategy(self, node, func, producer_placements, metas_out, metas_in) -> list[Candidate]:
        it = iter(zip(producer_placements, metas_in, strict=True))

        def wrap(a):
            if isinstance(a, fx.Node):
                placements, meta = next(it)
                return OpStrategy([OpSpec(DTensorSpec(self.mesh, p, tensor_meta=meta)) for p in placements])
            if isinstance(a, list | tuple) and a and all(isinstance(x, fx.Node) for x in a):
                return TupleStrategy([wrap(x) for x in a])
            return a

        args = tuple(wrap(a) for a in node.args)
        kwargs = {k: wrap(v) for k, v in node.kwargs.items()}
        schema = OpSchema(node.target, args, kwargs, schema_info=self.prop.op_to_schema_info.get(node.target))
        strategy = func(schema)
        if not isinstance(strategy, OpStrategy):
            raise NoStrategyError(f"op {node.target} at node {node.name!r}: DTensor returned {type(strategy).__name__}, not an OpStrategy")
        return self._from_op_strategy(node, strategy, metas_out, metas_in)

    def _from_op_strategy(self, node, strategy: OpStrategy, metas_out, metas_in) -> list[Candidate]:
        out: list[Candidate] = []
        seen: set[Candidate] = set()
        for spec in strategy.strategies:
            outs_spec = spec.output_specs
            outs = [outs_spec.placements] if isinstance(outs_spec, DTensorSpec) else [s.placements if s is not None else None for s in outs_spec]
            if spec.input_specs is None:
                ins = [outs[0]] * len(metas_in)
            else:
                ins = [s.placements for s in spec.input_specs]
            if len(ins) != len(metas_in) or len(outs) != len(metas_out):
                raise NoStrategyError(
                    f"op {node.target} at node {node.name!r}: DTensor strategy lists {len(ins)} inputs / "
                    f"{len(outs)} outputs, the node has {len(metas_in)} / {len(metas_out)}"
                )
            cand = self._candidate(outs + ins, len(outs), metas_out, metas_in)
            if cand is not None and cand not in seen:
                seen.add(cand)
                out.append(cand)
        return out

    def _decomposed(self, node, metas_out, metas_in) -> list[Candidate]:
        it = iter(metas_in)
        rep = tuple(Replicate() for _ in self.sizes)

        def spec(a):
            if isinstance(a, fx.Node):
                return DTensorSpec(self.mesh, rep, tensor_meta=next(it))
            if isinstance(a, list | tuple) and a and all(isinstance(x, fx.Node) for x in a):
                return type(a)(spec(x) for x in a)
            return a

        schema = OpSchema(node.target, tuple(spec(a) for a in node.args), {k: spec(v) for k, v in node.kwargs.items()})
        try:
            strategy = self.prop.decomp_strategy.propagate_strategy(schema)
        except Exception as e:  # DTensor's decomposition path raises many kinds
            log.debug("decomposition strategy of %s failed: %s", node.target, e)
            return []
        if strategy is None:
            return []
        return self._from_op_strategy(node, strategy, metas_out, metas_in)


def _partials_offered(placements: Sequence[Placements]) -> frozenset:
    """(mesh dim, Partial) pairs a producer can output."""
    return frozenset((i, p) for pl in placements for i, p in enumerate(pl) if isinstance(p, Partial))


def _partials_reachable(cand: Candidate, offered: Sequence[frozenset]) -> bool:
    """Whether every Partial input of ``cand`` is one its producer can output.

    Redistributing into a Partial is only possible from Replicate (a local split, never a
    saving: the reduction it defers costs what reducing the producer would), so a candidate
    that needs a Partial its producer never makes is dropped before it becomes variables.
    """
    for pl, off in zip(cand.ins, offered, strict=True):
        for i, p in enumerate(pl):
            if isinstance(p, Partial) and (i, p) not in off:
                return False
    return True


def static_args(node: fx.Node) -> tuple:
    """The non-tensor arguments, as a hashable key."""

    def conv(a):
        if isinstance(a, fx.Node):
            return "T"
        if isinstance(a, list | tuple):
            return tuple(conv(x) for x in a)
        if isinstance(a, torch.dtype | torch.device | torch.memory_format | torch.layout):
            return str(a)
        return a

    return (conv(node.args), tuple(sorted((k, conv(v)) for k, v in node.kwargs.items())))


def _meta_args(node: fx.Node):
    def conv(a):
        if isinstance(a, fx.Node):
            return tensor_meta(a.meta[M.VAL])
        # a list of tensors, or of optional ones (aten.index's [None, idx]: the dims not indexed)
        if isinstance(a, list | tuple) and any(isinstance(x, fx.Node) for x in a) and all(x is None or isinstance(x, fx.Node) for x in a):
            return type(a)(conv(x) for x in a)
        return a

    return tuple(conv(a) for a in node.args), {k: conv(v) for k, v in node.kwargs.items()}


def constant_candidates(sizes: Sequence[int]) -> list[Candidate]:
    """A lifted tensor constant: every rank holds all of it (its consumers split it locally, for free)."""
    return [Candidate((replicated(len(sizes)),), ())]


def placeholder_candidates(meta: TensorMeta, sizes: Sequence[int], *, padded_dim0: bool, strided: bool = False) -> list[Candidate]:
    """Every Replicate/Shard tuple that divides (padded Shard(0) allowed for parameters); with
    ``strided``, after them the FSDP-order variant (``autoparallel.planner.strided``) of each
    tuple that divides evenly and shards a dim on two mesh dims."""
    out = []
    for pl in all_placements(len(meta.shape), len(sizes)):
        if divides(pl, meta.shape, sizes, pad_dim0=padded_dim0):
            out.append(Candidate((pl,), ()))
    if strided:
        out += [Candidate((v,), ()) for c in list(out) if divides(c.outs[0], meta.shape, sizes) for v in strided_variants(c.outs[0], sizes)]
    return out


def alias_candidates(meta: TensorMeta, sizes: Sequence[int], producer: Sequence[Placements]) -> list[Candidate]:
    """Any Replicate/Shard tuple that divides, plus the producer's partial placements."""
    base = [pl for pl in all_placements(len(meta.shape), len(sizes)) if divides(pl, meta.shape, sizes)]
    extra = [pl for pl in producer if pl not in base]
    return [Candidate((pl,), (pl,)) for pl in base + extra]


def getitem_candidates(producer: Sequence[Candidate], index: int) -> list[Candidate]:
    """One candidate per producer candidate: its ``index``-th output."""
    return [Candidate((c.outs[index],), (c.outs[index],)) for c in producer]


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is ALIAS
