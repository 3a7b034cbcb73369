"""``plan="auto"`` in the pipeline: plan the model, remove alias round trips, lower, feed the ranks.

The pipeline's ``plan`` stage (``autoparallel.pipeline.PLAN_STAGE``) calls :func:`plan_for_pipeline`:

1. trace the unsharded joint graph once, every block, and keep its export open
   (``trace_planning_graph(..., keep_joint=True)``): the planner plans on it and the lowering
   swaps the per-rank graph into that same export, so a planned pipeline traces once, like a
   hand-planned one;
2. solve (``Planner.plan``), unless the plan was given (``ParallelPlan.auto(solution=...)``: a plan
   made earlier for the same model and inputs, e.g. loaded from JSON or shared between tests);
3. :func:`~autoparallel.planner.alias_round_trips.eliminate_alias_round_trips` on plan + graph.

The ``joint`` stage then lowers it (:func:`~autoparallel.planner.lower.lower_plan`). At run time
the ranks need their local pieces of the inputs and parameters under the plan:
:func:`local_inputs`, :func:`local_params`, :func:`local_values`.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from autoparallel import roles
from autoparallel.mesh import ParallelMesh
from autoparallel.parallelize.plan import ParallelPlan
from autoparallel.planner.alias_round_trips import AliasRoundTripReport, eliminate_alias_round_trips
from autoparallel.planner.api import Planner, PlannerConfig
from autoparallel.planner.costs import CostModel
from autoparallel.planner.graph import PlanningGraph, trace_planning_graph
from autoparallel.planner.lower import decode, shard_tensor
from autoparallel.planner.profile import get_profile
from autoparallel.planner.solution import Solution

log = logging.getLogger(__name__)

GIVEN_SOLUTION = "solution"  # ParallelPlan.auto(solution=...): lower this plan instead of solving


@dataclass
class PlanningReport:
    """The plan stage, for reports and goldens: the plan's objective (after removing round trips),
    what the solver did (``solver``: the plan's solve statistics; empty for a given plan), the
    alias round trips removed, and where the seconds went."""

    objective_us: float
    compute_us: float
    comm_us: float
    proven_optimal: bool
    given: bool
    aliases: AliasRoundTripReport
    seconds: dict[str, float] = field(default_factory=dict)
    solver: dict = field(default_factory=dict)
    solution: Solution | None = field(default=None, repr=False)  # the stage's output (round trips removed)

    def summary(self) -> str:
        how = "given plan" if self.given else ("optimal" if self.proven_optimal else "NOT proven optimal (time limit)")
        return (
            f"objective {self.objective_us:.3f} us (compute {self.compute_us:.3f}, communication {self.comm_us:.3f}), "
            f"{how}; alias round trips removed: {self.aliases.removed} ({len(self.aliases.erased)} aliases erased)"
        )


@dataclass
class Planned:
    """What the plan stage hands the ``joint`` stage: the plan (alias round trips removed), the
    planning graph (its export still open), the stage's report, and ``solved``: the plan as the
    solver returned it (what ``ParallelPlan.auto(solution=...)`` takes to plan the same model again
    elsewhere, e.g. on each rank of a real world)."""

    solution: Solution
    pg: PlanningGraph
    report: PlanningReport
    solved: Solution


def planner_config(parallel_plan: ParallelPlan) -> PlannerConfig:
    """The PlannerConfig of an auto plan; ValueError naming an option PlannerConfig lacks or a
    reduce dtype the planner cannot honour."""
    opts = {k: v for k, v in (parallel_plan.planner or {}).items() if k != GIVEN_SOLUTION}
    known = {f.name for f in fields(PlannerConfig)}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"plan 'auto': unknown planner option(s) {unknown}; options: {sorted(known)} (or solution=<Solution>)")
    if parallel_plan.param_dtype is not None:
        opts.setdefault("param_dtype", parallel_plan.param_dtype)
    return PlannerConfig(**opts)


def _check_reduce_dtype(parallel_plan: ParallelPlan, model: nn.Module) -> None:
    """The planner reduces gradients in the parameters' own dtype (its grad-reduce constraint):
    a different reduce dtype is an error, never silently ignored."""
    want = parallel_plan.reduce_dtype
    if want is None:
        return
    for fqn, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != want:
            raise ValueError(
                f"plan 'auto' with reduce_dtype={want}: parameter {fqn!r} is {p.dtype}, and the planner "
                "reduces gradients in the parameters' dtype; drop reduce_dtype or store the parameters in it"
            )


def plan_for_pipeline(
    model: nn.Module,
    loss_fn: Callable | None,
    example_inputs: Sequence[torch.Tensor],
    mesh: ParallelMesh,
    parallel_plan: ParallelPlan,
    *,
    progress: Callable[[str], None] | None = None,
) -> Planned:
    """Steps 1-3 of the module docstring for ``parallel_plan`` (an auto plan) on ``mesh``."""
    if not parallel_plan.is_auto:
        raise ValueError(f"plan_for_pipeline takes plan='auto', got plan {parallel_plan.name!r}")
    say = progress or (lambda msg: log.info("%s", msg))
    config = planner_config(parallel_plan)
    _check_reduce_dtype(parallel_plan, model)
    # A given plan is a solver's plan (Planned.solved): its aliases are removed here, on this trace.
    given = (parallel_plan.planner or {}).get(GIVEN_SOLUTION)
    if given is not None and not isinstance(given, Solution):
        raise ValueError(f"plan 'auto': solution= takes an autoparallel.planner.Solution, got {type(given).__name__}")
    t0 = time.perf_counter()
    pg = trace_planning_graph(
        model, mesh, example_inputs, loss_fn, param_dtype=config.param_dtype, block_container=config.block_container, keep_joint=True
    )
    seconds = {"trace": time.perf_counter() - t0}
    try:
        say(f"traced the unsharded joint graph: {len(pg.graph.nodes)} nodes in {seconds['trace']:.2f}s")
        profile = get_profile(config.profile if given is None else given.profile)
        if given is None:
            planner = Planner(pg, type(model).__name__, seconds["trace"])
            plan = planner.plan(mesh, config, progress=say)
            costs = plan._context.costs
            seconds.update(
                strategies=plan.stats.get("strategy_seconds", 0.0),
                problem=plan.stats.get("problem_seconds", 0.0),
                solve=plan.stats.get("lp_seconds", 0.0) + plan.stats.get("solve_seconds", 0.0),
            )
        else:
            if [tuple(d) for d in given.mesh] != list(mesh.spec.dims):
                raise ValueError(f"plan 'auto': the given plan is for mesh {given.mesh}, this world is {mesh.spec}")
            plan = _copy(given)  # the pass edits its plan
            costs = CostModel(profile, mesh.spec, mesh.device_mesh)
        solved = _copy(plan)
        t1 = time.perf_counter()
        aliases = eliminate_alias_round_trips(pg.graph, pg.keys, plan, output_roles=pg.output_roles, redistribute=costs.redistribute)
        pg.gm.recompile()
        seconds["alias_round_trips"] = time.perf_counter() - t1
    except BaseException:
        pg.joint.close()
        raise
    say(f"alias round trips: {aliases.summary()}")
    report = PlanningReport(
        objective_us=plan.objective_us,
        compute_us=plan.compute_us,
        comm_us=plan.comm_us,
        proven_optimal=plan.proven_optimal,
        given=given is not None,
        aliases=aliases,
        seconds=seconds,
        solver={} if given is not None else dict(plan.stats),
        solution=plan,
    )
    return Planned(plan, pg, report, solved)


def _copy(plan: Solution) -> Solution:
    """A copy of ``plan``'s placements and predictions (not its solver context)."""
    return Solution.from_json(copy.deepcopy(plan.to_json()))


def local_inputs(plan: Solution, inputs: Sequence[torch.Tensor], mesh: ParallelMesh) -> tuple[torch.Tensor, ...]:
    """This rank's pieces of the global ``inputs`` (model inputs, then the target) under ``plan``."""
    out = []
    for i, t in enumerate(inputs):
        placement = plan.inputs.get(roles.input_(i))
        if placement is None:
            raise ValueError(f"the plan places no {roles.input_(i)}; it was made for {len(plan.inputs)} inputs and buffers")
        out.append(shard_tensor(t, decode(placement, plan.mesh_names), mesh))
    return tuple(out)


def local_params(plan: Solution, full: Mapping[str, torch.Tensor], mesh: ParallelMesh) -> dict[str, torch.Tensor]:
    """This rank's pieces of full parameters (by FQN) under ``plan``."""
    missing = sorted(set(plan.params) - set(full))
    if missing:
        raise ValueError(f"no full value given for planned parameter(s) {missing}")
    return {fqn: shard_tensor(full[fqn], decode(plan.params[fqn], plan.mesh_names), mesh) for fqn in plan.params}


def local_values(plan: Solution, model: nn.Module, mesh: ParallelMesh) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(params, buffers): this rank's pieces of ``model``'s parameters and of the buffers the plan
    places, by FQN, where every parameter and buffer of ``model`` is a real tensor; nothing for a
    model on meta or fake tensors (graph work only). The lowered module runs on these: a second
    compile that runs it (``keep_compiled``) would otherwise compute on memory nobody wrote. Runs
    outside any fake mode (the lowering's export keeps one open)."""
    with unset_fake_temporarily():
        params = {fqn: p.detach() for fqn, p in model.named_parameters()}
        buffers = {fqn: b.detach() for fqn, b in model.named_buffers()}
        if not all(not t.is_meta and not is_fake(t) for t in (*params.values(), *buffers.values())):
            return {}, {}
        placed_buffers = {}
        for fqn, b in buffers.items():
            placement = plan.inputs.get(roles.buffer(fqn))
            if placement is not None:
                placed_buffers[fqn] = shard_tensor(b, decode(placement, plan.mesh_names), mesh)
        return local_params(plan, params, mesh), placed_buffers


__all__ = [
    "GIVEN_SOLUTION",
    "Planned",
    "PlanningReport",
    "local_inputs",
    "local_params",
    "local_values",
    "plan_for_pipeline",
    "planner_config",
]
