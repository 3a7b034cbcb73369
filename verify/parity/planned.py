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

Executors compared with ``eager`` on every rank, for ``steps`` AdamW steps (``train_steps``): one
per stage of ``PLANNED_STAGES`` after the plan, as the hand plans' parity runs them
(``verify.parity.runs``): ``joint`` (the lowered joint graph), ``cleanup`` and ``fsdp_tagging``
(the joint graph after each placement step), ``first_partition`` (the ``ParallelModule``),
``second_compile`` (``torch.compile`` with ``autoparallel_backend``) and ``collective_passes``
(the second compile's graphs through every collective pass, composed). The plan is made once, in
this process, on a fake world of the same mesh; each rank lowers it for itself (lowered graphs are
rank-specific: a local split keeps the rank's piece) by running the pipeline on the real world
with ``PlannedCase.plan(<the solver's plan>)`` (the case's dtypes kept: the program the solver
planned, casts included), every stage's graphs a snapshot; the second
compile keeps its compiled module, which the ``second_compile`` executor runs (a recompile there
is an error: it would test other graphs than the pipeline made).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
from torch import fx, nn
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.compile import SECOND_COMPILE
from autoparallel.defaults import DEFAULT_LOWERING
from autoparallel.mesh import MeshSpec, build_mesh, fake_world
from autoparallel.parallelize import ParallelPlan, cross_entropy_loss
from autoparallel.partition import STEP_FIRST_PARTITION
from autoparallel.pipeline import JOINT, PLANNED_STAGES, run_pipeline
from autoparallel.planner.auto import local_inputs, local_params, plan_for_pipeline
from autoparallel.planner.lower import (
    PlacedInterpreter,
    check_replicated_fallbacks,
    decode,
    node_placements,
    shard_tensor,
)
from autoparallel.planner.replay import check_lowering
from autoparallel.planner.solution import Solution
from autoparallel.runtime.steps import (
    Executor,
    StepTrace,
    loss_and_updates,
    primals_by_role,
    seeded,
    step_seed,
    tangent_value,
)
from verify.parity import calibration
from verify.parity.collective_check import agree_on_collectives
from verify.parity.compare import OracleReport, check_within, module_scales, never_stepped, oracle_tolerance
from verify.parity.ordered_collectives import run_parity_world
from verify.parity.random_ops import (
    DROPOUT_OFF,
    graph_without_random_ops,
    random_nodes,
    random_ops_disabled,
)
from verify.parity.runs import (
    COLLECTIVE,
    cast_floating,
    loss_in_reference_dtype,
    no_recompile,
    oracle_executor,
    rounded_like_the_program,
)
from verify.stages.pipeline_run import on_meta_else_real, pipeline_options
from verify.stages.rank_context import RankContext
from verify.stages.registry import EAGER, build_executor, last_needed, parity_executors, planned_executors

# Every rank's generator seed (each executor draws alike). One seed for the whole world: a random op
# that is not a dropout is replicated (every rank draws the whole tensor), so every rank, and the
# single-device replay seeded the same per step, draws exactly the same numbers.
PLANNED_RNG_SEED = 20_261_127
TRAIN_LR = 1e-2  # train_steps' AdamW learning rate (the replay uses the same)
EXECUTORS = planned_executors(PLANNED_STAGES)  # eager (the plan stage's), then one per stage after it
_COMPILED = frozenset(e.name for e in parity_executors(PLANNED_STAGES) if e.compiled)  # they run the kept compiled module

# Single-device comparison until the "any model" issue's oracle (a per-dtype tolerance derived
# from the reduction depth) lands: then switch single_device_report to it. fp32 only here.
SINGLE_DEVICE_RTOL = 1e-4
SINGLE_DEVICE_ATOL = 1e-5


@dataclass(frozen=True)
class PlannedCase:
    """A model to plan and run: ``model(device)`` builds it with deterministic parameters
    (``"meta"`` for shapes), ``loss_fn`` (None: token cross-entropy), ``batches(steps)`` the
    global batches (model inputs, then the target), ``mesh`` the mesh spec, ``planner`` what
    ``ParallelPlan.auto`` takes: PlannerConfig fields (a memory budget, a peak-memory budget, pins)
    and the plan's ``param_dtype`` / ``reduce_dtype``."""

    name: str
    model: Callable[[str], nn.Module]
    batches: Callable[[int], list[tuple[torch.Tensor, ...]]]
    mesh: str
    loss_fn: Callable | None = None
    planner: Mapping[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> MeshSpec:
        return MeshSpec.parse(self.mesh)

    def plan(self, solution: Solution | None = None) -> ParallelPlan:
        """The auto plan of this case: ``planner``'s options and mixed precision, and with
        ``solution`` the solver's plan given (what each rank lowers: the same program the solver
        planned, casts included)."""
        return ParallelPlan.auto(**self.planner, **({} if solution is None else {"solution": solution}))

    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.plan().param_dtype


@dataclass
class PlannedRank:
    """One rank's traces per executor, and where its gradient pieces sit in the full tensors
    (``offsets[fqn]``: the piece's offset per dim, for reassembling; Replicate pieces are whole);
    ``replayed``: how many ops this rank's lowering ran as their local op (``LoweringReport.replayed``:
    0 under ``lowering="dtensor"``), so a test can tell which lowering its run went through."""

    coord: tuple[int, ...]
    traces: dict[str, StepTrace]
    offsets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    replayed: int = 0


def planned_case(scenario) -> PlannedCase:
    """A ``verify.stages.scenario.Scenario`` (plan="auto": a LLaMA preset or any ``ModelCase``) as a
    PlannedCase: its model, seed, batches (``batch_per_rank`` rows per rank of the whole world)
    and its own loss, never a substitute."""
    return PlannedCase(
        name=f"{scenario.model_name}-{scenario.mesh_spec}",
        model=lambda device: scenario.model(device=device),
        batches=scenario.batches,
        mesh=str(scenario.mesh_spec),
        loss_fn=scenario.loss_fn,
        planner=_mixed_precision(scenario.plan_obj()),
    )


def _mixed_precision(plan: ParallelPlan) -> dict[str, torch.dtype]:
    return {k: v for k, v in (("param_dtype", plan.param_dtype), ("reduce_dtype", plan.reduce_dtype)) if v is not None}


def solve(case: PlannedCase) -> Solution:
    """The solver's plan for ``case``, made on a fake world of its mesh (what every rank lowers).
    A random op that is not a dropout placed on a shard (each rank would draw its own numbers, no
    slice of the single-device draw) is an error here, before any rank starts."""
    with fake_world(case.spec) as mesh:
        planned = on_meta_else_real(lambda device: plan_for_pipeline(case.model(device), case.loss_fn, case.batches(1)[0], mesh,
                                                                     case.plan()))
        planned.pg.joint.close()
    check_replicated_fallbacks(planned.pg, planned.solved)
    return planned.solved


def _tangents(gm: fx.GraphModule, input_roles, placed, mesh) -> list[torch.Tensor]:
    """The planning graph's tangents (``steps.tangent_value``: a 1 for the loss's, zeros for
    another output's), each this rank's piece under its planned placement (the graph's traced
    values are global)."""
    out = []
    for ph, role in zip(gm.graph.find_nodes(op="placeholder"), input_roles, strict=True):
        if roles.is_tangent(role):
            value = tangent_value(role, ph.meta.get(M.VAL))
            out.append(shard_tensor(value, placed[ph].out[0], mesh) if value.dim() else value)
    return out


def eager_executor(planned, mesh, buffers, gm: fx.GraphModule | None = None) -> Executor:
    """The reference: the plan's interpreter, eagerly, on this rank's real local tensors; the
    buffers a model updates in place (its ``mutated:<fqn>`` outputs) are written back, and recorded
    like every executor's. ``gm``: another form of the planning graph, with its node names (the
    oracle's, dropout off)."""
    pg, plan = planned.pg, planned.solution
    graph = pg.gm if gm is None else gm
    placed = node_placements(pg, plan)
    if gm is not None:  # the same placements, by node name
        by_name = {n.name: pl for n, pl in placed.items()}
        placed = {n: by_name[n.name] for n in gm.graph.nodes if n.name in by_name}
    grad_fqns = [(i, roles.name(r)) for i, r in enumerate(pg.output_roles) if roles.is_grad(r)]
    param_fqns = roles.names_of(pg.input_roles, roles.PARAM)
    tangents = _tangents(graph, pg.input_roles, placed, mesh)

    def run(params, inputs):
        primals = primals_by_role(pg.input_roles, params, buffers, inputs)
        with torch.no_grad():
            outs = PlacedInterpreter(graph, placed, mesh, pg.keys, plan.fallbacks).run(*primals, *tangents, enable_io_processing=False)
        # By role: a model that updates buffers (BatchNorm) returns their new values ahead of the
        # loss; they are copied into ``buffers``, as every stage's executor does.
        loss = loss_and_updates(outs, pg.output_roles, buffers, "the plan's eager placements", params)
        # None (or no output) for a parameter without a gradient: frozen, or the loss does not reach it
        return loss.detach(), {**dict.fromkeys(param_fqns), **{fqn: outs[i] for i, fqn in grad_fqns}}

    return Executor(run, buffers)


def _rank_case(case: PlannedCase, solved: Solution, batches, executors, mesh, lowering: str) -> PlannedRank:
    torch._dynamo.reset()
    # The second compile's executor runs the module the pipeline compiled (keep_compiled): a
    # second torch.compile here would re-trace and re-partition the same module. Running it in
    # the pipeline needs the model's real values.
    keep = bool(_COMPILED & set(executors))
    options = pipeline_options(snapshots=True, alternatives=False, keep_compiled=keep, lowering=lowering)
    # at least the first partition (its module is built there), further where an executor needs it
    until = last_needed((*executors, STEP_FIRST_PARTITION), PLANNED_STAGES)
    run = on_meta_else_real(lambda device: run_pipeline(case.model(device), case.loss_fn, batches[0], case.plan(solved),
                                                        mesh, options, until=until), real=keep)
    plan = run.planned.solution
    model = case.model("cpu")
    full = {fqn: p.detach() for fqn, p in model.named_parameters()}
    init = local_params(plan, full, mesh)
    buffers = {}
    for fqn, b in model.named_buffers():
        placement = plan.inputs.get(roles.buffer(fqn))
        if placement is not None:
            buffers[fqn] = shard_tensor(b, decode(placement, plan.mesh_names), mesh)
    local_batches = [local_inputs(plan, b, mesh) for b in batches]
    ctx = RankContext(mesh, init, buffers, local_batches, eager=lambda: eager_executor(run.planned, mesh, ctx.fresh_buffers()),
                      seed=PLANNED_RNG_SEED, run=run, collective=options.collective, rebind=False)
    graphs = [row for r in run.results for row in r.graph_rows()]
    if COLLECTIVE in executors:  # the rank's own second-compile graphs through every collective pass
        graphs += list(zip((f"{COLLECTIVE} fwd", f"{COLLECTIVE} bwd"), ctx.bucketed(SECOND_COMPILE), strict=True))
    # Lowered graphs are rank-specific: every rank's collectives must agree before any runs.
    agree_on_collectives(graphs)
    if EAGER in executors and random_nodes(run.planned.pg.gm):
        executors = (*executors, DROPOUT_OFF)
    traces = {}
    for name in executors:
        if name == DROPOUT_OFF:
            executor = eager_executor(run.planned, mesh, ctx.fresh_buffers(), graph_without_random_ops(run.planned.pg.gm, keep_others=True))
        else:
            executor = build_executor(name, ctx)
        compiled = name in _COMPILED
        with no_recompile("the graphs the pipeline's second compile made") if compiled else contextlib.nullcontext():
            traces[name] = ctx.train(executor)
    torch._dynamo.reset()
    coord = mesh.coordinate()
    offsets = {}
    for fqn, placement in plan.params.items():
        _, off = compute_local_shape_and_global_offset(full[fqn].shape, mesh.device_mesh, decode(placement, plan.mesh_names))
        offsets[fqn] = tuple(off)
    replayed = run.stage(JOINT).report.replayed
    return PlannedRank(tuple(coord[d] for d in case.spec.names), traces, offsets, replayed)


def _rank(rank, world_size, cases, solved, batches, executors, lowering) -> list[PlannedRank]:
    mesh = build_mesh(cases[0].spec)
    return [_rank_case(c, s, b, executors, mesh, lowering) for c, s, b in zip(cases, solved, batches, strict=True)]


def run_planned_parity(
    cases: PlannedCase | Sequence[PlannedCase],
    steps: int = 3,
    *,
    executors: Sequence[str] = EXECUTORS,
    timeout_s: float = 300.0,
    lowering: str = DEFAULT_LOWERING,
) -> list[tuple[Solution, list[PlannedRank]]]:
    """Plan each case, then train ``steps`` steps with each of ``executors`` on every rank of one
    gloo world of their (common) mesh; per case: (the solver's plan, per-rank traces). ``lowering``:
    how each rank's pipeline lowers the plan (``PipelineOptions.lowering``); the eager reference
    runs every op through DTensor's dispatch whichever it is."""
    cases = [cases] if isinstance(cases, PlannedCase) else list(cases)
    unknown = sorted(set(executors) - set(EXECUTORS))
    if unknown or EAGER not in executors:
        raise ValueError(f"executors must include {EAGER!r} and come from {EXECUTORS}; got {list(executors)}")
    meshes = {c.spec for c in cases}
    if len(meshes) != 1:
        raise ValueError(f"the cases of one parity world share its mesh; got {sorted(str(m) for m in meshes)}")
    check_lowering(lowering)  # before any rank starts
    solved = [solve(c) for c in cases]
    batches = [c.batches(steps) for c in cases]
    per_rank = run_parity_world(_rank, cases[0].spec.world_size, args=(cases, solved, batches, tuple(executors), lowering), timeout_s=timeout_s)
    return [(solved[i], [ranks[i] for ranks in per_rank]) for i in range(len(cases))]


def full_grads(case: PlannedCase, ranks: Sequence[PlannedRank], executor: str, step: int) -> dict[str, torch.Tensor | None]:
    """Each parameter's full gradient at ``step``, reassembled from the ranks' pieces; None for a
    parameter no rank has a gradient for (a rank without one among ranks with one is an error)."""
    return _assemble(case, ranks, lambda r: r.traces[executor].grads[step], "gradient")


def full_params(case: PlannedCase, ranks: Sequence[PlannedRank], executor: str) -> dict[str, torch.Tensor]:
    """Each parameter's final value after ``executor``'s run, reassembled from the ranks' pieces."""
    return _assemble(case, ranks, lambda r: r.traces[executor].params, "final value")


def _assemble(case: PlannedCase, ranks: Sequence[PlannedRank], pieces_of, what: str) -> dict[str, torch.Tensor | None]:
    model = case.model("meta")
    out = {}
    for fqn, p in model.named_parameters():
        pieces = [(r, pieces_of(r)[fqn]) for r in ranks]
        nones = [i for i, (_, piece) in enumerate(pieces) if piece is None]
        if len(nones) == len(pieces):
            out[fqn] = None
            continue
        if nones:
            raise ValueError(f"{fqn}: ranks {nones} have no {what} but the others have one")
        full = torch.zeros(p.shape, dtype=p.dtype)
        for r, piece in pieces:
            index = tuple(slice(o, o + s) for o, s in zip(r.offsets[fqn], piece.shape, strict=True))
            full[index] = piece
        out[fqn] = full
    return out


def single_device_replay(case: PlannedCase, ranks: Sequence[PlannedRank], executor: str | None = None) -> StepTrace:
    """The independent oracle, step by step: the unsharded model in one process (plain autograd)
    at the parameters the ranks had at each step, on that step's global batch.

    The parameters are the ranks' own trajectory: AdamW (as ``train_steps`` runs it) replayed on
    the ranks' reassembled gradients. Comparing from the same parameters keeps the comparison at
    one step's rounding: a free-running single-device run drifts apart through AdamW, which
    turns a last-bit difference of a near-zero gradient into a step of ``lr``. ``executor``:
    :func:`oracle_executor` by default; its dropout-off form runs the model with dropout off. Each
    step runs with the generator seeded as the ranks' (``PLANNED_RNG_SEED``): a random op that is
    not a dropout, which the plan replicates, draws here what every rank draws. Under a
    ``param_dtype`` the model stays in its own dtype and sees the floating inputs as the program
    does, rounded through the cast (``rounded_like_the_program``): the cast is the program's
    semantics, the rest of its rounding what the oracle's tolerance is for.
    """
    executor = executor if executor is not None else oracle_executor(ranks)
    random_off = (lambda: random_ops_disabled(keep_others=True)) if executor == DROPOUT_OFF else contextlib.nullcontext
    model = case.model("cpu")
    loss_fn = case.loss_fn or cross_entropy_loss
    named = dict(model.named_parameters())
    leaves = {k: nn.Parameter(v.detach().clone()) for k, v in named.items()}
    opt = torch.optim.AdamW(list(leaves.values()), lr=TRAIN_LR)
    steps = len(ranks[0].traces[executor].losses)
    out = StepTrace()
    for step, inputs in enumerate(case.batches(steps)):
        for fqn, p in named.items():
            p.grad = None
            with torch.no_grad():
                p.copy_(leaves[fqn])
        *xs, target = inputs
        xs = rounded_like_the_program(xs, case.param_dtype)
        with seeded(step_seed(PLANNED_RNG_SEED, step)), random_off():
            loss = loss_fn(model(*xs), target)
            loss.backward()
        out.losses.append(loss.detach().clone())
        out.grads.append({fqn: None if p.grad is None else p.grad.detach().clone() for fqn, p in named.items()})
        for fqn, g in full_grads(case, ranks, executor, step).items():
            leaves[fqn].grad = g  # None: AdamW skips it, as train_steps does
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def planned_oracle(case: PlannedCase, ranks: Sequence[PlannedRank], reference: StepTrace | None = None) -> OracleReport:
    """The independent oracle for a planned program, as ``verify.parity.runs.oracle_check`` for a
    hand plan: the eager placements' first step (the replicated loss, every gradient reassembled
    from its pieces) against the unsharded model (``single_device_replay``) within the tolerance
    the dtype and reduction depth give (every rank counted as a slice: the widest sum the plan
    may reorder). A graph that draws random numbers is compared with dropout off on both sides
    (:func:`oracle_executor`; the report says so): a rank's mask of its shard of an activation is
    no slice of any mask the unsharded model draws. A random op that is not a dropout stays on on
    both sides: the plan replicates it, so every rank draws the single-device numbers."""
    executor = oracle_executor(ranks)
    single = reference if reference is not None else single_device_replay(case, ranks, executor)
    inputs = case.batches(1)[0]
    param_dtype = case.param_dtype
    tolerance = oracle_tolerance(case.model("meta"), inputs[:-1], case.spec.world_size, compute_dtype=param_dtype)
    report = OracleReport(tolerance, parallel=executor)
    loss_name, ref_loss, loss = loss_in_reference_dtype(ranks[0].traces[executor].losses[0], single.losses[0], param_dtype)
    report.checks.append(check_within(loss_name, ref_loss, loss, tolerance.rtol))
    grads = full_grads(case, ranks, executor, 0)
    scales = module_scales(single.grads[0])
    for fqn in sorted(set(single.grads[0]) | set(grads)):
        report.checks.append(check_within(roles.grad(fqn), single.grads[0].get(fqn), grads.get(fqn), tolerance.rtol, scales.get(fqn)))
    # Every parameter without a gradient (single-device eager gives it none, or no rank stepped it)
    # ends bitwise where it started.
    stale = set(never_stepped(single)) | set.intersection(*(set(never_stepped(r.traces[executor])) for r in ranks))
    if stale:
        final, initial = full_params(case, ranks, executor), dict(case.model("cpu").named_parameters())
        for fqn in sorted(stale):
            report.checks.append(check_within(f"unchanged:{fqn}", initial[fqn].detach(), final[fqn], 0.0, 0.0))
    if not report.passed and calibration.applies(tolerance, param_dtype):
        report = calibration.calibrated(report, lambda dtype: _first_step_in(case, dtype))
    return report


def _first_step_in(case: PlannedCase, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    """The unsharded model's first step in ``dtype``, by oracle check name (the oracle's
    calibration, ``verify.parity.calibration``), as :func:`single_device_replay`'s dropout-off
    form runs it: dropout off, any other random op (which the plan replicates) drawing from the
    ranks' seed. The calibration checks that its fp32 and fp64 runs draw alike."""
    model = case.model("cpu").to(dtype)
    *xs, target = cast_floating(list(case.batches(1)[0]), dtype)
    with seeded(step_seed(PLANNED_RNG_SEED, 0)), random_ops_disabled(keep_others=True):
        loss = (case.loss_fn or cross_entropy_loss)(model(*xs), target)
        loss.backward()
    return {"loss": loss.detach(), **{roles.grad(fqn): p.grad for fqn, p in model.named_parameters()}}


__all__ = [
    "EAGER",
    "EXECUTORS",
    "SINGLE_DEVICE_ATOL",
    "SINGLE_DEVICE_RTOL",
    "PlannedCase",
    "PlannedRank",
    "full_grads",
    "full_params",
    "planned_case",
    "planned_oracle",
    "run_planned_parity",
    "single_device_replay",
    "solve",
]
