"""``plan_model``: model + mesh + example inputs -> :class:`~autoparallel.planner.solution.Solution`.

Trace the unsharded joint graph, enumerate candidates, price them for a device profile, merge
identical blocks, solve the ILP, and write the plan: per node, per parameter, per input, with
predicted collectives. ``evaluate_hand_plan`` prices a hand ``ParallelPlan`` under the same cost
model (its parameter and input layouts pinned, the rest chosen at best), so automatic and hand
plans can be compared on one scale.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from autoparallel import roles
from autoparallel.gc_pauses import fewer_collections
from autoparallel.mesh import MeshSpec, ParallelMesh
from autoparallel.planner.blocks import (
    MIN_TRACE_BLOCKS,
    NotPeriodic,
    expand_graph,
    num_blocks,
    truncated,
)
from autoparallel.planner.costs import CostModel
from autoparallel.planner.even_shards import param_bytes_floor, with_even_shards
from autoparallel.planner.graph import PlanningGraph, find_block_container, trace_planning_graph
from autoparallel.planner.ilp import IlpResult, solve
from autoparallel.planner.memory import peak_of, peak_rows
from autoparallel.planner.problem import (
    CONSTANT,
    GETITEM,
    LOSS_ROLE,
    OUTPUT,
    PLACEHOLDER,
    Clustering,
    Graph,
    PNode,
    Problem,
    build_nodes,
    build_problem,
    cluster,
    min_param_bytes,
    param_bytes,
    param_local_bytes,
)
from autoparallel.planner.profile import DeviceProfile, get_profile
from autoparallel.planner.solution import NodePlacement, Solution, by_dim, natural_key, parse_placement
from autoparallel.planner.strategies import StrategyEnumerator, placements_str
from autoparallel.planner.strided import has_strided, strided_variants

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
PinSpec = str | Sequence[Placement] | Mapping[str, str]


@dataclass
class PlannerConfig:
    """What to plan for. ``memory_budget`` is per-rank parameter bytes (None: fully sharded, i.e.
    every parameter at its smallest candidate); ``peak_memory_budget`` bounds per-rank live bytes
    (parameters, activations, gradients) at every point of the step (None: no bound;
    ``planner/memory.py``); ``pins`` map a parameter FQN, a role
    (``input:0``) or a canonical node key to placements (``"dp:S(0),tp:R"``, ``"S(0),R"``, a
    mapping mesh dim -> placement, or a tuple of Placements)."""

    profile: str | DeviceProfile | None = None
    memory_budget: float | None = None
    peak_memory_budget: float | None = None
    pins: Mapping[str, PinSpec] = field(default_factory=dict)
    param_dtype: torch.dtype | None = None
    cluster: bool = True
    time_limit: float = 120.0
    lp_bound: bool = True
    block_container: str | bool | None = True
    # Trace only this many blocks of a deep model and expand (autoparallel.planner.blocks):
    # None = 4 when the model has at least AUTO_TRACE_BLOCKS_FROM blocks, 0 = trace every block.
    trace_blocks: int | None = None
    # Only candidates whose shards divide evenly (autoparallel.planner.even_shards): a plan that
    # runs. False: padded Shard(0) of parameters too (pricing a hand FSDP plan, never lowered).
    even_shards: bool = True


AUTO_TRACE_BLOCKS_FROM = 8


def plan_model(
    model: nn.Module,
    mesh: ParallelMesh,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: Callable | None = None,
    config: PlannerConfig | None = None,
    *,
    description: str | None = None,
    progress: Progress | None = None,
) -> Solution:
    """Plan ``loss_fn(model(*inputs[:-1]), inputs[-1])`` on ``mesh`` (a fake world is fine)."""
    config = config or PlannerConfig()
    with fewer_collections():
        planner = Planner.for_config(model, mesh, example_inputs, loss_fn, config, description=description, progress=progress)
        return planner.plan(mesh, config, progress=progress)


class Planner:
    """One traced joint graph, planned for any mesh (of the traced world), profile, budget or pins.

    Tracing is the expensive step; candidates and costs are cached per (mesh, profile).
    """

    def __init__(self, pg: PlanningGraph, description: str, trace_seconds: float = 0.0, *, expansion=None, retrace=None):
        self.pg = pg
        self.description = description
        self.trace_seconds = trace_seconds
        self.expansion = expansion  # (container, traced blocks, total blocks) when pg holds a subset
        self._retrace = retrace  # () -> PlanningGraph of every block, if the expansion fails
        self._graphs: dict[tuple, tuple[Graph, CostModel, float]] = {}

    @classmethod
    def trace(
        cls,
        model: nn.Module,
        mesh: ParallelMesh,
        example_inputs: Sequence[torch.Tensor],
        loss_fn: Callable | None = None,
        *,
        param_dtype: torch.dtype | None = None,
        block_container: str | bool | None = True,
        trace_blocks: int | None = None,
        description: str | None = None,
        progress: Progress | None = None,
    ) -> Planner:

        say = progress or (lambda msg: log.info("%s", msg))
        container = find_block_container(model) if block_container is True else (block_container or None)
        total = num_blocks(model, container) if container else 0
        keep = trace_blocks if trace_blocks is not None else (MIN_TRACE_BLOCKS if total >= AUTO_TRACE_BLOCKS_FROM else 0)
        if keep and keep < MIN_TRACE_BLOCKS:
            raise ValueError(f"trace_blocks must be 0 (trace every block) or >= {MIN_TRACE_BLOCKS}, got {keep}")

        def full() -> PlanningGraph:
            return trace_planning_graph(model, mesh, example_inputs, loss_fn, param_dtype=param_dtype, block_container=container or None)

        t0 = time.perf_counter()
        expansion = None
        if container and keep and total > keep:
            say(f"tracing the unsharded joint graph with {keep} of its {total} blocks ({container})")
            pg = trace_planning_graph(truncated(model, container, keep), mesh, example_inputs, loss_fn, param_dtype=param_dtype, block_container=container)
            expansion = (container, keep, total)
        else:
            say("tracing the unsharded joint graph")
            pg = full()
        seconds = time.perf_counter() - t0
        say(f"traced {len(pg.graph.nodes)} nodes ({pg.num_aliases} aliases) in {seconds:.2f}s")
        return cls(pg, description or type(model).__name__, seconds, expansion=expansion, retrace=full)

    @classmethod
    def for_config(cls, model, mesh, example_inputs, loss_fn, config: PlannerConfig, *, description=None, progress=None) -> Planner:
        """``trace`` with the trace-time settings of ``config``."""
        return cls.trace(
            model,
            mesh,
            example_inputs,
            loss_fn,
            param_dtype=config.param_dtype,
            block_container=config.block_container,
            # a peak over the step needs every block's activations: a truncated trace would undercount them
            trace_blocks=0 if config.peak_memory_budget is not None and config.trace_blocks is None else config.trace_blocks,
            description=description,
            progress=progress,
        )

    def graph(self, mesh: ParallelMesh, profile: DeviceProfile, say: Progress, *, local_loss: bool = False,
              strided: bool = False) -> tuple[Graph, CostModel, float]:
        import json

        key = (mesh.spec, json.dumps(profile.to_json(), sort_keys=True), local_loss, strided)
        if key not in self._graphs:
            t0 = time.perf_counter()
            costs = CostModel(profile, mesh.spec, mesh.device_mesh)
            enumerator = StrategyEnumerator(mesh.device_mesh)
            graph = build_nodes(self.pg, costs, enumerator, local_loss=local_loss, strided=strided)
            if self.expansion is not None:
                container, keep, total = self.expansion
                try:
                    graph = expand_graph(graph, container, keep, total)
                    say(f"expanded {keep} traced blocks to {total}: {len(graph.nodes)} nodes")
                except NotPeriodic as e:
                    say(f"the traced blocks do not repeat ({e}); tracing all {total} blocks")
                    t1 = time.perf_counter()
                    self.pg = self._retrace()
                    self.trace_seconds += time.perf_counter() - t1
                    self.expansion = None
                    self._graphs.clear()
                    return self.graph(mesh, profile, say, local_loss=local_loss, strided=strided)
            seconds = time.perf_counter() - t0
            say(f"strategies for {len(graph.nodes)} nodes in {seconds:.2f}s ({enumerator.calls - enumerator.hits} distinct ops)")
            self._graphs[key] = (graph, costs, seconds)
        return self._graphs[key]

    def plan(self, mesh: ParallelMesh | None = None, config: PlannerConfig | None = None, *, progress: Progress | None = None) -> Solution:
        config = config or PlannerConfig()
        mesh = mesh or self.pg.mesh
        say = progress or (lambda msg: log.info("%s", msg))
        profile = get_profile(config.profile)
        strided = any(has_strided(_parse_pin(spec, mesh.spec.names, name)) for name, spec in config.pins.items())
        graph, costs, strat_s = self.graph(mesh, profile, say, local_loss=LOSS_KEY in config.pins, strided=strided)
        t1 = time.perf_counter()
        pins = resolve_pins(graph, config.pins)
        if config.even_shards:
            pins = with_even_shards(graph, pins)
        floor = param_bytes_floor(graph, pins) if config.even_shards else min_param_bytes(graph)
        budget = float(config.memory_budget) if config.memory_budget is not None else float(floor)
        if not budget >= 0:
            raise ValueError(f"memory budget must be >= 0 bytes, got {config.memory_budget!r}")
        bounded = budget if np.isfinite(budget) else None
        clustering = cluster(graph, enabled=config.cluster, pins=pins)
        problem = build_problem(graph, costs, clustering, budget=bounded, pins=pins)
        if config.peak_memory_budget is not None:
            if not config.peak_memory_budget >= 0:
                raise ValueError(f"peak memory budget must be >= 0 bytes, got {config.peak_memory_budget!r}")
            problem.peak = peak_rows(graph, clustering.class_of)
            problem.peak_budget = float(config.peak_memory_budget)
        problem_s = time.perf_counter() - t1
        say(f"problem: {problem.num_classes} choice classes, {len(problem.edges)} edge tables in {problem_s:.2f}s")
        solution = solve(problem, time_limit=config.time_limit, lp_bound=config.lp_bound)
        st = solution.stats
        say(
            f"solved in {st.solve_seconds:.2f}s (+ LP {st.lp_seconds:.2f}s): {st.variables_before} -> "
            f"{st.variables_after} variables, {st.constraints_before} -> {st.constraints_after} constraints"
        )
        choice = np.array([solution.choice[c] for c in clustering.class_of], dtype=np.int64)
        plan = make_plan(graph, costs, choice, solution, bounded, self.description, profile)
        plan.peak["budget_bytes"] = None if config.peak_memory_budget is None else float(config.peak_memory_budget)
        plan.stats.update(
            {
                "trace_seconds": self.trace_seconds,
                "strategy_seconds": strat_s,
                "problem_seconds": problem_s,
                "graph_nodes": len(graph.nodes),
                "graph_edges": sum(len(n.inputs) for n in graph.nodes),
                "aliases": sum(1 for n in graph.nodes if n.kind == "alias"),
                "traced_blocks": None if self.expansion is None else self.expansion[1],
            }
        )
        plan._context = PlanContext(graph, costs, choice, clustering, problem, pins, self.pg)
        return plan


LOSS_KEY = f"out:{LOSS_ROLE}"  # pin it to P(avg) over data dims for a hand plan's local-mean loss


def resolve_pins(graph: Graph, pins: Mapping[str, PinSpec]) -> dict[int, np.ndarray]:
    """Pins by FQN / role / key -> allowed-candidate masks, or an error naming the pin."""
    out: dict[int, np.ndarray] = {}
    by_key = {n.key: n for n in graph.nodes}
    for name in sorted(pins):
        pn = by_key.get(name) or by_key.get(roles.param(name))
        if pn is None:
            raise ValueError(f"pin {name!r}: no parameter, input or node of that name in the graph (keys look like 'param:<fqn>', 'input:0', 'layers.0/fwd/aten.mm.default#0')")
        want = _parse_pin(pins[name], graph.mesh_names, name)
        mask = np.array([c.outs[0] == want for c in pn.candidates])
        if not mask.any():
            opts = sorted({placements_str(c.outs[0], graph.mesh_names) for c in pn.candidates})
            raise ValueError(f"pin {name!r}: {placements_str(want, graph.mesh_names)} is not a candidate of {pn.key}; candidates: {opts}")
        out[pn.index] = mask
    return out


def _parse_pin(spec: PinSpec, names: Sequence[str], what: str) -> tuple[Placement, ...]:
    if isinstance(spec, Mapping):
        unknown = set(spec) - set(names)
        if unknown:
            raise ValueError(f"pin {what!r}: unknown mesh dims {sorted(unknown)}; mesh dims: {list(names)}")
        return tuple(parse_placement(spec[n]) if n in spec else Replicate() for n in names)
    if isinstance(spec, str):
        parts = [p for p in (x.strip() for x in _split_top(spec)) if p]
        if all(":" in p for p in parts):
            return _parse_pin({p.split(":", 1)[0].strip(): p.split(":", 1)[1] for p in parts}, names, what)
        if len(parts) != len(names):
            raise ValueError(f"pin {what!r}: {spec!r} has {len(parts)} placements for a {len(names)}-d mesh {list(names)}")
        return tuple(parse_placement(p) for p in parts)
    spec = tuple(spec)
    if len(spec) != len(names) or not all(isinstance(p, Placement) for p in spec):
        raise ValueError(f"pin {what!r}: expected {len(names)} Placements, got {spec!r}")
    return spec


def _split_top(text: str) -> list[str]:
    """Split on commas and spaces outside parentheses."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch in ", " and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def make_plan(graph: Graph, costs: CostModel, choice: np.ndarray, solution: IlpResult | None, budget: float | None, description: str, profile: DeviceProfile) -> Solution:
    names = list(graph.mesh_names)
    nodes = graph.nodes
    params, inputs, placed = {}, {}, {}
    comm: dict[str, dict[str, dict[str, int]]] = {}
    compute = 0.0
    comm_us = 0.0
    for pn in nodes:
        cand = pn.candidates[choice[pn.index]]
        compute += float(pn.compute_us[choice[pn.index]])
        moves: list[list[str]] = []
        for a, p in enumerate(pn.inputs):
            prod = nodes[p]
            if pn.kind == GETITEM:
                moves.append([])
                continue
            src = prod.candidates[choice[p]].outs[0]
            r = costs.redistribute(prod.meta, src, cand.ins[a])
            comm_us += r.us
            moves.append([f"{s.kind}({s.mesh_dim})" for s in r.steps])
            for s in r.steps:
                slot = comm.setdefault(s.kind, {}).setdefault(s.mesh_dim, {"count": 0, "bytes": 0})
                slot["count"] += 1
                slot["bytes"] += s.nbytes
        placed[pn.key] = NodePlacement(
            op=pn.op,
            out=[by_dim(o, names) for o in cand.outs],
            ins=[by_dim(i, names) for i in cand.ins] if pn.kind != GETITEM else [],
            comm=moves if any(moves) else [],
        )
        if pn.kind == PLACEHOLDER:
            role = pn.role or pn.name
            if roles.is_param(role):
                params[role.partition(":")[2]] = by_dim(cand.outs[0], names)
            else:
                inputs[role] = by_dim(cand.outs[0], names)
    objective = compute + comm_us
    if solution is not None and abs(objective - solution.objective_us) > 1e-6 * max(1.0, objective):
        raise AssertionError(f"plan cost {objective} us differs from the solver's objective {solution.objective_us} us")
    stats = {}
    if solution is not None:
        st = solution.stats
        stats = {k: getattr(st, k) for k in st.__dataclass_fields__}
        stats["gap"] = solution.gap
    return Solution(
        model=description,
        mesh=[(n, s) for n, s in zip(names, graph.mesh_sizes, strict=True)],
        profile=profile.name,
        memory_budget_bytes=budget,
        param_memory_bytes=param_bytes(graph, choice),
        objective_us=objective,
        compute_us=compute,
        comm_us=comm_us,
        lp_bound_us=solution.stats.lp_bound_us if solution is not None else None,
        proven_optimal=bool(solution is not None and solution.stats.proven_optimal),
        params=dict(sorted(params.items(), key=lambda kv: natural_key(kv[0]))),
        inputs=dict(sorted(inputs.items(), key=lambda kv: natural_key(kv[0]))),
        nodes=placed,
        node_names={pn.name: pn.key for pn in nodes if pn.name and pn.kind != OUTPUT},
        comm={k: dict(sorted(v.items())) for k, v in sorted(comm.items())},
        stats=stats,
        peak=dict(zip(("bytes", "at"), peak_of(graph, choice), strict=True)),
        fallbacks={pn.key: pn.fallback for pn in nodes if pn.fallback},
        constants={pn.key: pn.op.removeprefix("constant ") for pn in nodes if pn.kind == CONSTANT},
    )


# --- explain ---------------------------------------------------------------------------------------


@dataclass
class PlanContext:
    """What ``Solution.explain`` needs: the planned graph, its cost model and the solution."""

    graph: Graph
    costs: CostModel
    choice: np.ndarray
    clustering: Clustering
    problem: Problem
    pins: dict[int, np.ndarray]
    # The traced joint graph (every block, or the traced subset of an expanded plan): what an
    # independent checker re-derives the placements' validity from (verify.parity.plan_check).
    traced: PlanningGraph | None = None

    def _consumers(self) -> dict[int, list[tuple[PNode, int]]]:
        out: dict[int, list[tuple[PNode, int]]] = {}
        for pn in self.graph.nodes:
            for a, p in enumerate(pn.inputs):
                out.setdefault(p, []).append((pn, a))
        return out

    def local_costs(self, pn: PNode) -> list[tuple[float, float, float]]:
        """(compute, incoming, outgoing) microseconds of every candidate, neighbours as planned."""
        nodes, choice = self.graph.nodes, self.choice
        consumers = self._consumers().get(pn.index, [])
        rows = []
        for j, cand in enumerate(pn.candidates):
            inc = 0.0
            for a, p in enumerate(pn.inputs):
                prod = nodes[p]
                if pn.kind == GETITEM:
                    inc += 0.0 if j == choice[p] else float("inf")
                else:
                    inc += self.costs.redistribute(prod.meta, prod.candidates[choice[p]].outs[0], cand.ins[a]).us
            out = 0.0
            for cons, a in consumers:
                if cons.kind == GETITEM:
                    out += 0.0 if choice[cons.index] == j else float("inf")
                else:
                    out += self.costs.redistribute(pn.meta, cand.outs[0], cons.candidates[choice[cons.index]].ins[a]).us
            rows.append((float(pn.compute_us[j]), inc, out))
        return rows

    def chosen_cost(self, pn: PNode) -> float:
        """Microseconds the chosen candidate of ``pn`` costs: its compute plus the moves into it."""
        nodes, choice = self.graph.nodes, self.choice
        cand = pn.candidates[choice[pn.index]]
        total = float(pn.compute_us[choice[pn.index]])
        if pn.kind != GETITEM:
            for a, p in enumerate(pn.inputs):
                prod = nodes[p]
                total += self.costs.redistribute(prod.meta, prod.candidates[choice[p]].outs[0], cand.ins[a]).us
        return total

    def costliest(self, n: int) -> list[tuple[str, float]]:
        """The ``n`` nodes whose chosen placements cost the most (compute plus incoming moves)."""
        costs = [(pn.key, self.chosen_cost(pn)) for pn in self.graph.nodes if pn.kind != OUTPUT]
        return sorted(costs, key=lambda kc: (-kc[1], kc[0]))[:n]

    def explain(self, key: str) -> str:
        pn = next(n for n in self.graph.nodes if n.key == key)
        names = self.graph.mesh_names
        chosen = int(self.choice[pn.index])
        rows = self.local_costs(pn)
        totals = [sum(r) for r in rows]
        shapes = ", ".join(str(tuple(m.shape)) for m in pn.metas if m is not None)
        lines = [f"{pn.key} ({pn.name}): {pn.op} -> {shapes}, {len(pn.candidates)} candidates", ""]
        lines.append(f"  {'':1} {'#':>3}  {'total us':>12} {'compute':>11} {'in-moves':>11} {'out-moves':>11}  placement")
        order = sorted(range(len(rows)), key=lambda j: (totals[j], j))
        for j in order:
            c, i, o = rows[j]
            cand = pn.candidates[j]
            mark = "*" if j == chosen else " "
            desc = "out " + ", ".join(placements_str(x, names) for x in cand.outs)
            if cand.ins and pn.kind not in (PLACEHOLDER, GETITEM, OUTPUT):
                desc += " <- " + "; ".join(placements_str(x, names) for x in cand.ins)
            lines.append(f"  {mark} {j:>3}  {_us(totals[j]):>12} {_us(c):>11} {_us(i):>11} {_us(o):>11}  {desc}")
        lines.append("")
        lines.append("why: " + self._why(pn, chosen, totals))
        return "\n".join(lines) + "\n"

    def _why(self, pn: PNode, chosen: int, totals: list[float]) -> str:
        if pn.fallback is not None:
            return f"its only candidate, the replicated fallback: {pn.fallback}"
        if pn.kind == CONSTANT:
            return "its only candidate: a tensor constant lifted from forward, whole on every rank"
        best = min(totals)
        if totals[chosen] <= best + 1e-9 * max(1.0, abs(best)):
            ties = [j for j, t in enumerate(totals) if t <= best + 1e-9 * max(1.0, abs(best))]
            tie = ""
            if len(ties) > 1:
                tie = (
                    f" ({len(ties)} candidates tie here; among equal-cost plans the solver prefers earlier "
                    "candidates, parameters and inputs first, summed over the whole plan)"
                )
            return "the cheapest of its candidates given where its producers and consumers are placed" + tie
        reasons = []
        if pn.index in self.pins:
            reasons.append("it is pinned")
        if pn.kind == PLACEHOLDER and roles.is_param(pn.role):

            mine = param_local_bytes(pn.meta, pn.candidates[chosen].outs[0], self.graph.mesh_sizes)
            cheaper = [j for j, t in enumerate(totals) if t < totals[chosen]]
            more = [j for j in cheaper if param_local_bytes(pn.meta, pn.candidates[j].outs[0], self.graph.mesh_sizes) > mine]
            if more:
                reasons.append(f"the {len(more)} cheaper candidate(s) hold more parameter bytes per rank than the memory budget allows")
        partners = [self.graph.nodes[b if a == pn.index else a].key for a, b, _ in self.graph.equal if pn.index in (a, b)]
        if partners:
            reasons.append(f"it must match {', '.join(partners)} (forward/backward consistency), whose own costs count too")
        members = self.clustering.members[self.clustering.class_of[pn.index]]
        if len(members) > 1:
            reasons.append(f"it shares one choice with {len(members) - 1} identical node(s) of other blocks; the sum over them decides")
        if pn.locked_inputs:
            reasons.append("a mixed-precision cast forbids redistributing around it (grad-reduce dtype)")
        if not reasons:
            reasons.append("changing it alone is cheaper locally, yet the solver proved this plan optimal; this should not happen: report it")
        return "; ".join(reasons)


def _us(v: float) -> str:
    return "inf" if not np.isfinite(v) else f"{v:.3f}"


# --- hand plans under the same cost model ------------------------------------------------------------


def hand_plan_pins(hand, model: nn.Module, spec: MeshSpec, *, strided: bool = False) -> dict[str, tuple[Placement, ...]]:
    """Placements a hand ``ParallelPlan`` gives every parameter, and the batch split of inputs.

    TP shards dim 0 (colwise) or 1 (rowwise) over the TP dim, FSDP shards dim 0 over its dim,
    DDP replicates. Where both shard dim 0 and the FSDP dim precedes the TP dim in the mesh, plain
    ``Shard(0)`` on both means DTensor's mesh order (the TP shard of the FSDP shard); ``strided``
    gives the hand plan's own layout there, the FSDP shard of the TP shard as FSDP2 + TP lay it
    out: ``_StridedShard(0, split_factor=tp size)`` on the FSDP dim (``autoparallel.planner.strided``),
    where dim 0 divides evenly (the strided candidates are even only). ``evaluate_hand_plan`` prices
    the plain form: the plan checker and unpinned plans know no strided shard.
    """
    spec = MeshSpec.parse(spec)
    shardings = hand.resolve(model, spec)
    names = spec.names
    pins: dict[str, tuple[Placement, ...]] = {}
    for fqn, sh in shardings.items():
        pl: list[Placement] = [Replicate() for _ in names]
        if sh.tp_style is not None:
            pl[names.index(sh.tp_dim)] = Shard(0 if sh.tp_style == "colwise" else 1)
        if sh.fsdp_dim is not None:
            pl[names.index(sh.fsdp_dim)] = Shard(0)
        pins[fqn] = tuple(pl)
        if strided and sh.tp_style is not None and sh.fsdp_dim is not None and names.index(sh.fsdp_dim) < names.index(sh.tp_dim):
            rows = model.get_parameter(fqn).shape[0]
            if rows % (spec.shape[names.index(sh.fsdp_dim)] * spec.shape[names.index(sh.tp_dim)]) == 0:
                pins[fqn] = next(iter(strided_variants(pins[fqn], spec.shape)), pins[fqn])
    return pins


def evaluate_hand_plan(
    model: nn.Module,
    mesh: ParallelMesh,
    example_inputs: Sequence[torch.Tensor],
    hand,
    loss_fn: Callable | None = None,
    config: PlannerConfig | None = None,
    *,
    planner: Planner | None = None,
    description: str | None = None,
    progress: Progress | None = None,
) -> Solution:
    """The cost of a hand ``ParallelPlan``: its parameter placements and batch split pinned,
    every other placement chosen at best under the same cost model, with no memory budget
    (the hand plan's own parameter bytes are what they are). ``planner`` reuses a trace of the
    same model and inputs."""
    from dataclasses import replace

    config = config or PlannerConfig()
    pins: dict[str, PinSpec] = dict(hand_plan_pins(hand, model, mesh.spec))
    names = mesh.spec.names
    for i, _ in enumerate(example_inputs):
        pins[roles.input_(i)] = tuple(Shard(0) if n in hand.data_dims else Replicate() for n in names)
    pins.update(config.pins)
    hand_config = replace(config, pins=pins, even_shards=False, memory_budget=float("inf") if config.memory_budget is None else config.memory_budget)
    if planner is None:
        planner = Planner.for_config(model, mesh, example_inputs, loss_fn, config, progress=progress)
    plan = planner.plan(mesh, hand_config, progress=progress)
    plan.model = description or f"{planner.description} [hand plan {hand.describe()}]"
    return plan
