"""Parity of ``plan="auto"`` on a real gloo world: the lowered planned program against eager
execution of the same placements, and against single-device eager.

**The reference** (``eager``): :class:`autoparallel.planner.lower.PlacedInterpreter` run eagerly
on real tensors of the real world. It executes the unsharded joint graph op by op exactly as the
plan says: every input redistributed by DTensor (real gloo collectives) to the placement the plan
gives it, every op run through DTensor's dispatch on the rank's local tensors. No tracing, no
clean-up, no partition, no compiler, no collective pass. Whatever the pipeline does after that
(make_fx of the interpreter, the placement steps, the first partition, Dynamo's re-trace in the
second compile and the replay partitioner) must not change a bit of the losses and gradients, so
the comparison is bitwise. What it cannot catch is a placement that computes something else than
the unsharded graph (the lowering's *semantics*): both sides run the same redistributions. That
is what the single-device comparison checks, independently (the unsharded model, one process,
plain autograd), within a tolerance.

Executors compared with ``eager`` on every rank, for ``steps`` AdamW steps (``train_steps``):
``joint`` (the lowered joint graph, after the placement steps), ``first_partition`` (the
``ParallelModule``), ``second_compile`` (``torch.compile`` with ``autoparallel_backend``). The plan
is made once, in this process, on a fake world of the same mesh; each rank lowers it for itself
(lowered graphs are rank-specific: a local split keeps the rank's piece) by running the pipeline
on the real world with ``ParallelPlan.auto(plan=<the solver's plan>)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch._dynamo
from torch import fx, nn

from autoparallel import roles
from autoparallel.compile import SECOND_COMPILE, autoparallel_backend
from autoparallel.fx_utils import copy_graph_module
from autoparallel.mesh import MeshSpec, build_mesh, fake_world
from autoparallel.parallelize import ParallelPlan, cross_entropy_loss
from autoparallel.partition import STEP_FIRST_PARTITION
from autoparallel.pipeline import JOINT, PipelineOptions, run_pipeline
from autoparallel.planner.auto import local_inputs, local_params, plan_for_pipeline
from autoparallel.planner.lower import PlacedInterpreter, decode, node_placements, shard_tensor
from autoparallel.planner.plan import Plan
from autoparallel.runtime import run_on_world
from autoparallel.runtime.steps import (
    Executor,
    StepTrace,
    compiled_module_executor,
    joint_graph_executor,
    parallel_module_executor,
    primals_by_role,
    train_steps,
)

EAGER = "eager"
EXECUTORS = (EAGER, JOINT, STEP_FIRST_PARTITION, SECOND_COMPILE)

# Single-device comparison until the "any model" issue's oracle (a per-dtype tolerance derived
# from the reduction depth) lands: then switch single_device_report to it. fp32 only here.
SINGLE_DEVICE_RTOL = 1e-4
SINGLE_DEVICE_ATOL = 1e-5


@dataclass(frozen=True)
class PlannedCase:
    """A model to plan and run: ``model(device)`` builds it with deterministic parameters
    (``"meta"`` for shapes), ``loss_fn`` (None: token cross-entropy), ``batches(steps)`` the
    global batches (model inputs, then the target), ``mesh`` the mesh spec."""

    name: str
    model: Callable[[str], nn.Module]
    batches: Callable[[int], list[tuple[torch.Tensor, ...]]]
    mesh: str
    loss_fn: Callable | None = None

    @property
    def spec(self) -> MeshSpec:
        return MeshSpec.parse(self.mesh)


@dataclass
class PlannedRank:
    """One rank's traces per executor, and where its gradient pieces sit in the full tensors
    (``offsets[fqn]``: the piece's offset per dim, for reassembling; Replicate pieces are whole)."""

    coord: tuple[int, ...]
    traces: dict[str, StepTrace]
    offsets: dict[str, tuple[int, ...]] = field(default_factory=dict)


def planned_case(scenario) -> PlannedCase:
    """The LLaMA ``verify.scenario.Scenario`` (plan="auto") as a PlannedCase: its model, seed and
    batches (``batch_per_rank`` rows per rank of the whole world)."""
    return PlannedCase(
        name=f"{scenario.preset}-{scenario.mesh_spec}",
        model=lambda device: scenario.model(device=device),
        batches=scenario.batches,
        mesh=str(scenario.mesh_spec),
    )


def solve(case: PlannedCase) -> Plan:
    """The solver's plan for ``case``, made on a fake world of its mesh (what every rank lowers)."""
    with fake_world(case.spec) as mesh:
        planned = plan_for_pipeline(case.model("meta"), case.loss_fn, case.batches(1)[0], mesh, ParallelPlan.auto())
        planned.pg.joint.close()
    return planned.solved


def _primals(pg, params, buffers, inputs) -> list[torch.Tensor]:
    """The planning graph's placeholders in order, picked by role; the loss's tangent is a 1."""
    tangents = [torch.ones((), dtype=torch.float32) for r in pg.input_roles if roles.is_tangent(r)]
    return primals_by_role(pg.input_roles, params, buffers, inputs) + tangents


def eager_executor(planned, mesh, buffers) -> Executor:
    """The reference: the plan's interpreter, eagerly, on this rank's real local tensors."""
    pg, plan = planned.pg, planned.plan
    placed = node_placements(pg, plan)
    grad_fqns = [(i, roles.name(r)) for i, r in enumerate(pg.output_roles) if roles.is_grad(r)]

    def run(params, inputs):
        with torch.no_grad():
            outs = PlacedInterpreter(pg.gm, placed, mesh, pg.keys).run(*_primals(pg, params, buffers, inputs), enable_io_processing=False)
        return outs[0].detach(), {fqn: outs[i] for i, fqn in grad_fqns}

    return run


def _rank(rank, world_size, case: PlannedCase, solved: Plan, batches, steps_executors):
    spec = case.spec
    mesh = build_mesh(spec)
    torch._dynamo.reset()
    options = PipelineOptions(snapshots=False)
    lowered: dict[str, fx.GraphModule] = {}

    def keep_lowered(result):  # the joint stage's graph, before the placement steps rewrite it
        if result.name == JOINT:
            lowered[JOINT] = copy_graph_module(result.graphs)

    run = run_pipeline(
        case.model("meta"), case.loss_fn, batches[0], ParallelPlan.auto(plan=solved), mesh, options,
        until=STEP_FIRST_PARTITION, observers=[keep_lowered],
    )
    plan = run.planned.plan
    model = case.model("cpu")
    full = {fqn: p.detach() for fqn, p in model.named_parameters()}
    init = local_params(plan, full, mesh)
    buffers = {}
    for fqn, b in model.named_buffers():
        placement = plan.inputs.get(roles.buffer(fqn))
        if placement is not None:
            buffers[fqn] = shard_tensor(b, decode(placement, plan.mesh_names), mesh)
    local_batches = [local_inputs(plan, b, mesh) for b in batches]
    fresh = lambda: {k: v.clone() for k, v in init.items()}  # noqa: E731
    mod = run.module
    for fqn, b in buffers.items():
        mod.model.get_buffer(fqn).copy_(b)
    executors: dict[str, Executor] = {
        EAGER: eager_executor(run.planned, mesh, buffers),
        JOINT: joint_graph_executor(lowered[JOINT], run.joint.input_roles, run.joint.output_roles, buffers),
        STEP_FIRST_PARTITION: parallel_module_executor(mod),
    }
    if SECOND_COMPILE in steps_executors:
        executors[SECOND_COMPILE] = compiled_module_executor(mod, torch.compile(mod, backend=autoparallel_backend()))
    traces = {name: train_steps(ex, fresh(), local_batches) for name, ex in executors.items() if name in steps_executors}
    torch._dynamo.reset()
    coord = mesh.coordinate()
    offsets = {}
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for fqn, placement in plan.params.items():
        _, off = compute_local_shape_and_global_offset(full[fqn].shape, mesh.device_mesh, decode(placement, plan.mesh_names))
        offsets[fqn] = tuple(off)
    return PlannedRank(tuple(coord[d] for d in spec.names), traces, offsets)


def run_planned_parity(
    case: PlannedCase,
    steps: int = 3,
    *,
    executors: Sequence[str] = EXECUTORS,
    solved: Plan | None = None,
    timeout_s: float = 300.0,
) -> tuple[Plan, list[PlannedRank]]:
    """Plan ``case`` (unless ``solved`` is given), then train ``steps`` steps with each of
    ``executors`` on every rank of a gloo world of its mesh; (the solver's plan, per-rank traces)."""
    unknown = sorted(set(executors) - set(EXECUTORS))
    if unknown or EAGER not in executors:
        raise ValueError(f"executors must include {EAGER!r} and come from {EXECUTORS}; got {list(executors)}")
    solved = solved if solved is not None else solve(case)
    batches = case.batches(steps)
    ranks = run_on_world(_rank, case.spec.world_size, args=(case, solved, batches, tuple(executors)), timeout_s=timeout_s)
    return solved, ranks


def full_grads(case: PlannedCase, ranks: Sequence[PlannedRank], executor: str, step: int) -> dict[str, torch.Tensor]:
    """Each parameter's full gradient at ``step``, reassembled from the ranks' pieces."""
    model = case.model("meta")
    out = {}
    for fqn, p in model.named_parameters():
        full = torch.zeros(p.shape, dtype=p.dtype)
        for r in ranks:
            piece = r.traces[executor].grads[step][fqn]
            index = tuple(slice(o, o + s) for o, s in zip(r.offsets[fqn], piece.shape, strict=True))
            full[index] = piece
        out[fqn] = full
    return out


def single_device_trace(case: PlannedCase, steps: int) -> StepTrace:
    """The unsharded model in one process (plain autograd), ``steps`` AdamW steps on the global
    batches: the independent oracle."""
    model = case.model("cpu")
    loss_fn = case.loss_fn or cross_entropy_loss
    named = dict(model.named_parameters())

    def run(params, inputs):
        for fqn, p in named.items():
            p.grad = None
            with torch.no_grad():
                p.copy_(params[fqn])
        *xs, target = inputs
        loss = loss_fn(model(*xs), target)
        loss.backward()
        return loss.detach(), {fqn: p.grad for fqn, p in named.items()}

    init = {k: v.detach().clone() for k, v in named.items()}
    return train_steps(run, init, case.batches(steps))


__all__ = [
    "EAGER",
    "EXECUTORS",
    "SINGLE_DEVICE_ATOL",
    "SINGLE_DEVICE_RTOL",
    "PlannedCase",
    "PlannedRank",
    "full_grads",
    "planned_case",
    "run_planned_parity",
    "single_device_trace",
    "solve",
]
