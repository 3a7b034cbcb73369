"""Remove alias round trips from a plan: consumers that want an alias's producer's placement read
the producer itself.

The planner puts an ``aten.alias`` after every tensor with several users so that one
redistribution can feed some consumers while others read the tensor as it is
(``autoparallel.planner.graph``). When the ILP places an alias differently from its producer, a
consumer of the alias that wants the *producer's* placement gets a round trip: the value is moved
to the alias's placement and then back. LLaMA's backward hits this at every residual gradient
(seed 000: a gradient at ``S(0)S(1)`` feeds an alias placed ``S(0)R`` for two matmuls, and the
skip-add, which wants ``S(0)S(1)``, redistributes ``R -> S(1)`` back), and the producer must stay
alive until that last redistribution. The ILP prices the round trip, but cannot avoid it: the
alias's consumers all read the alias.

:func:`eliminate_alias_round_trips` runs on the plan and its (unsharded, planning) graph, before
lowering. For every alias placed differently from its producer:

* each tensor input of a consumer that wants the producer's placement is rewired to the producer
  (by position, so ``x + x`` with two different wishes keeps the one that differs);
* consumers that want the alias's placement, or a third one, keep reading the alias (a third
  placement is still reached from the alias: the move the ILP chose);
* an alias left without users is erased from the graph and from the plan.

The plan's predicted communication (per consumer input, per kind and mesh dim, and the objective)
is updated with the cost model the plan was made with, so it stays what the lowered graph does.

Patch ``eliminate_alias_round_trips``; disabled, the pass finds the round trips, reports them and
changes nothing (the anchor's behaviour before the pass: every round trip runs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import fx
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel import patches, roles
from autoparallel.planner.graph import ALIAS, tensor_args
from autoparallel.planner.solution import NodePlacement, Solution, parse_placement

log = logging.getLogger(__name__)

PATCH = "eliminate_alias_round_trips"

Placements = tuple
# (global value of the moved tensor, from placements, to placements) -> Redistribution-like with
# ``.us`` and ``.steps`` (each with ``kind``, ``mesh_dim``, ``nbytes``): CostModel.redistribute.
Redistribute = Callable[[object, Placements, Placements], object]


@dataclass
class AliasRoundTripReport:
    """What the pass found and did. ``round_trips``: consumer inputs that wanted the producer's
    placement (``consumer key[position] <- alias key``); ``rewired``: those it rewired (all of them
    unless the patch is disabled); ``erased``: aliases left without users and removed;
    ``saved_us``: the predicted communication time the rewiring saves (the plan's cost model)."""

    aliases_checked: int = 0
    round_trips: list[str] = field(default_factory=list)
    rewired: list[str] = field(default_factory=list)
    erased: list[str] = field(default_factory=list)
    saved_us: float = 0.0

    @property
    def removed(self) -> int:
        return len(self.rewired)

    def summary(self) -> str:
        return (
            f"{self.aliases_checked} aliases placed apart from their producer: {len(self.round_trips)} "
            f"round trips, {self.removed} rewired to the producer, {len(self.erased)} aliases erased, "
            f"{self.saved_us:.3f} us of predicted communication saved"
        )


def _decode(d: Mapping[str, str] | None, names: Sequence[str]) -> Placements | None:
    return None if d is None else tuple(parse_placement(d[n]) for n in names)


def _rewire_positions(node: fx.Node, old: fx.Node, new: fx.Node, positions: set[int]) -> None:
    """Replace ``old`` by ``new`` at the given tensor-input positions of ``node`` (the order of
    :func:`tensor_args`), leaving other occurrences of ``old`` alone."""
    k = -1

    def swap(leaf):
        nonlocal k
        if not isinstance(leaf, fx.Node):
            return leaf
        k += 1
        return new if k in positions and leaf is old else leaf

    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    args, kwargs = pytree.tree_unflatten([swap(x) for x in flat], spec)
    node.args, node.kwargs = tuple(args), dict(kwargs)


def _wanted(consumer: fx.Node, plan: Solution, keys: Mapping[str, str], names, output_keys: Sequence[str | None]) -> list[Placements | None]:
    """The placement ``consumer`` wants for each of its tensor inputs (None where the plan has none)."""
    if consumer.op == "output":
        return [_decode(plan.nodes[k].out[0], names) if k in plan.nodes else None for k in output_keys]
    entry = plan.nodes.get(keys.get(consumer.name, ""))
    if entry is None:
        return []
    return [_decode(i, names) for i in entry.ins]


def _clear_move(entry: NodePlacement, pos: int) -> None:
    if entry.comm and pos < len(entry.comm):
        entry.comm[pos] = []
        if not any(entry.comm):
            entry.comm = []


def _uncount(plan: Solution, redistribution) -> None:
    for step in redistribution.steps:
        slot = plan.comm.get(step.kind, {}).get(step.mesh_dim)
        if slot is None:
            continue
        slot["count"] -= 1
        slot["bytes"] -= step.nbytes
        if slot["count"] == 0:
            del plan.comm[step.kind][step.mesh_dim]
            if not plan.comm[step.kind]:
                del plan.comm[step.kind]
    plan.comm_us -= redistribution.us
    plan.objective_us -= redistribution.us


def eliminate_alias_round_trips(
    graph: fx.Graph,
    keys: Mapping[str, str],
    plan: Solution,
    *,
    output_roles: Sequence[str | None] = (),
    redistribute: Redistribute | None = None,
) -> AliasRoundTripReport:
    """Rewire alias round trips of ``plan`` on ``graph`` (in place, both); see the module docstring.

    ``keys``: FX node name -> the plan's canonical key (``PlanningGraph.keys``); ``output_roles``:
    the role of each graph output (its placement is the plan's ``out:<role>``); ``redistribute``:
    the plan's cost model (``CostModel.redistribute``) to take the saved moves off the plan's
    predicted communication (None: the prediction is left as it was). Raises ValueError naming an
    alias or consumer the plan does not place.
    """
    names = plan.mesh_names
    report = AliasRoundTripReport()
    enabled = patches.enabled(PATCH)
    out_node = graph.output_node()
    output_keys = [
        f"out:{role or roles.user_output(i)}" if isinstance(a, fx.Node) else None
        for i, (a, role) in enumerate(zip(out_node.args[0], list(output_roles) or [None] * len(out_node.args[0]), strict=True))
    ]
    for alias in list(graph.find_nodes(op="call_function", target=ALIAS)):
        a_key = keys.get(alias.name)
        producer = alias.args[0]
        if a_key not in plan.nodes or keys.get(producer.name) not in plan.nodes:
            raise ValueError(f"alias {alias.name!r} (key {a_key!r}) or its producer {producer.name!r} has no placement in the plan")
        x_pl = _decode(plan.nodes[keys[producer.name]].out[0], names)
        a_pl = _decode(plan.nodes[a_key].out[0], names)
        if x_pl == a_pl:
            continue
        report.aliases_checked += 1
        for consumer in list(alias.users):
            wanted = _wanted(consumer, plan, keys, names, output_keys)
            inputs = tensor_args(consumer) if consumer.op != "output" else list(consumer.args[0])
            positions = {k for k, a in enumerate(inputs) if a is alias and k < len(wanted) and wanted[k] == x_pl}
            if not positions:
                continue
            c_key = keys.get(consumer.name, "output")
            report.round_trips += [f"{c_key}[{k}] <- {a_key}" for k in sorted(positions)]
            if not enabled:
                continue
            if consumer.op == "output":
                outs = list(consumer.args[0])
                for k in positions:
                    outs[k] = producer
                consumer.args = (type(consumer.args[0])(outs), *consumer.args[1:])
            else:
                _rewire_positions(consumer, alias, producer, positions)
            for k in sorted(positions):
                entry = plan.nodes[output_keys[k]] if consumer.op == "output" else plan.nodes[c_key]
                _clear_move(entry, 0 if consumer.op == "output" else k)
                if redistribute is not None:
                    moved = redistribute(alias.meta[M.VAL], a_pl, x_pl)
                    _uncount(plan, moved)
                    report.saved_us += moved.us
                report.rewired.append(f"{c_key}[{k}] <- {a_key}")
        if enabled and not alias.users:
            graph.erase_node(alias)
            del plan.nodes[a_key]
            for name in [n for n, k in plan.node_names.items() if k == a_key]:
                del plan.node_names[name]
            report.erased.append(a_key)
    if enabled and report.rewired:
        graph.lint()
    log.info("eliminate_alias_round_trips: %s", report.summary())
    return report


__all__ = ["PATCH", "AliasRoundTripReport", "eliminate_alias_round_trips"]
