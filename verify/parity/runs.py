"""Parity runs built from a scenario: the same plan on a real gloo world, executor by executor.

:func:`run_stage_parity` is one gloo world per (model, plan) that trains the same steps with
every form of the program the pipeline makes, each from the same initial parameters and buffers
(one executor per stage, named in ``verify.stages.registry``; the collective passes share one):

=====================  =========================================================================
``eager``              the eager parallel program (the reference every executor is compared with)
``joint``              the traced joint graph (``joint_graph_executor``)
``cleanup``            the joint graph after the clean-up step
``fsdp_tagging``       ... after the FSDP recompute tags (tags change no value; checked anyway)
``first_partition``    the first partition's ``ParallelModule`` (autograd drives the backward)
``second_compile``     its ``torch.compile``'d version (``autoparallel_backend``)
``collective_passes``  the second compile's forward/backward after every collective pass,
                       composed as the backend runs them (bucketed on each rank: merged
                       all-gathers are rank-specific), run by ``split_graph_executor``
=====================  =========================================================================

The graphs are traced, partitioned and compiled once, in this process on a fake world of the same
mesh (graphs are rank-agnostic; compiling on fake tensors does not communicate); the forked ranks
inherit them. A rank whose process groups are named otherwise (the sub-meshes of an N-D mesh)
runs the pipeline for itself. So does every rank of a model whose values read into Python (an MoE
router's token counts) differ between the ranks' slices or steps: a graph per rank and step,
their collectives compared before any runs (``verify.parity.retrace``). :func:`run_joint_parity` /
:func:`run_compile_parity` are subsets.

:func:`single_device_reference` is the independent oracle's side: the unsharded model on one
process (see ``verify.parity.compare.oracle_report``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from autoparallel import patches, roles
from autoparallel.compiling_flag import tracing_as_compiling
from autoparallel.mesh import build_mesh, fake_world
from autoparallel.parallelize import ParallelProgram, split_batch
from autoparallel.parallelize.program import cast_forward_inputs
from autoparallel.parallelize.replicated_draws import PATCH as REPLICATED_DRAWS
from autoparallel.parallelize.replicated_draws import first_slice_draws
from autoparallel.passes.collective import CollectivePassesConfig
from autoparallel.pipeline import (
    JOINT,
    STAGES,
    PipelineOptions,
    PipelineRun,
    run_pipeline,
)
from autoparallel.runtime.steps import Executor, StepTrace, seeded, step_seed
from verify.parity import calibration
from verify.parity.buffer_scales import buffer_scales, owner_input_scales, written_buffers
from verify.parity.collective_check import agree_on_collectives
from verify.parity.compare import (
    OracleReport,
    ParityReport,
    check_within,
    compare_traces,
    merge_reports,
    module_scales,
    never_stepped,
    oracle_tolerance,
)
from verify.parity.ordered_collectives import run_parity_world
from verify.parity.rank_explain import explain_own_graphs
from verify.parity.retrace import StepGraphs, on_every_rank, per_step
from verify.parity.random_ops import (
    DROPOUT_OFF,
    executor_without_random_ops,
    random_nodes,
    random_ops_disabled,
)
from verify.stages.pipeline_run import intra_op_threads, pipeline_options
from verify.stages.rank_context import RankContext
from verify.stages.registry import (
    COLLECTIVE_PASSES_EXECUTOR,
    EAGER,
    build_executor,
    last_needed,
    parity_executors,
)
from verify.stages.scenario import Scenario, dtype_name

# The executors, one per stage (the collective passes composed share one), from the stage registry.
_EXECUTORS = {e.name: e for e in parity_executors(STAGES)}
COLLECTIVE = COLLECTIVE_PASSES_EXECUTOR
COMPILE_EXECUTORS = (EAGER, *(name for name, e in _EXECUTORS.items() if e.module))  # the pipeline's module, as is and compiled
STAGE_EXECUTORS = (EAGER, *_EXECUTORS)
_MODULE_EXECUTORS = frozenset(COMPILE_EXECUTORS[1:])  # they run the pipeline's module (kept compiled)
_RANK_THREADS = 1
#: The eager program run with ``torch.compiler.is_compiling()`` true, as the joint trace runs the
#: model (patch ``trace_as_compiling``). A rank runs it where the model's code asked the flag during
#: the trace (``JointGraph.compiling_queries``): a stage bitwise with it but not with eager differs
#: because the model branches on the flag (another program), not because of a pass.
AS_TRACED = "eager as traced (is_compiling() true)"
RNG_SEED = 20_261_126  # base of the ranks' generator seeds (rank_seed)


@dataclass
class RankParity:
    """What one rank computed with each executor, plus its mesh coordinate."""

    coord: tuple[int, ...]
    traces: dict[str, StepTrace]
    seconds: dict[str, float] = field(default_factory=dict)
    # A model traced per rank (verify.parity.retrace): per stage not bitwise on this rank, why,
    # from the rank's own graphs (verify.parity.rank_explain).
    explanations: dict[str, str] = field(default_factory=dict)


def _options(enable_ac: bool = False, collective: CollectivePassesConfig | None = None) -> PipelineOptions:
    # The second compile keeps its compiled module (parity runs it) and every stage's graphs are
    # snapshots (each stage is run as it was, not as later stages left it).
    options = pipeline_options(enable_ac=enable_ac, keep_compiled=True, snapshots=True, alternatives=False)
    return options if collective is None else replace(options, collective=collective)


def _pipeline(scenario: Scenario, mesh, enable_ac: bool, collective: CollectivePassesConfig, until: str | None,
              model=None, batch=None, observers=(), gather_first: tuple[str, ...] = ()) -> PipelineRun:
    """The run's pipeline on ``mesh``; ``model`` / ``batch``: another model (the step's
    parameters) and global batch than the scenario's first; ``gather_first``: the parameters
    some ranks read and others do not (``verify.parity.retrace``)."""
    options = replace(_options(enable_ac, collective), gather_first=gather_first)
    # The module runs (keep_compiled): a model with values, never meta (verify.stages.pipeline_run.run_scenario).
    own_model, loss_fn, own_batch, plan = scenario.pipeline_inputs("cpu")[:4] if model is None else (None, *scenario.pipeline_inputs("meta")[1:4])
    return run_pipeline(model if model is not None else own_model, loss_fn, batch if batch is not None else own_batch,
                        plan, mesh, options, until=until or JOINT, observers=observers)


def parity_pipeline(
    scenario: Scenario,
    executors: tuple[str, ...] = STAGE_EXECUTORS,
    *,
    enable_ac: bool = False,
    collective: CollectivePassesConfig | None = None,
) -> PipelineRun:
    """The pipeline run :func:`run_stage_parity` makes for ``executors``: on a fake world of the
    scenario's mesh, with one intra-op thread (the ranks' count, which Dynamo guards on), up to
    the last stage they need, every stage's graphs a snapshot, the compiled module kept."""
    collective = collective if collective is not None else pipeline_options().collective
    with intra_op_threads(_RANK_THREADS), fake_world(scenario.mesh_spec) as mesh:
        return _pipeline(scenario, mesh, enable_ac, collective, last_needed(executors, STAGES))


def _rank_stages(rank, world_size, scenario: Scenario, batches, run: PipelineRun, executors, enable_ac, collective):
    spec = scenario.mesh_spec
    mesh = build_mesh(spec)
    program = ParallelProgram(scenario.model(), scenario.plan_obj(), mesh, scenario.loss_fn)
    coord = mesh.coordinate()
    ctx = RankContext.for_program(program, mesh, batches, seed=rank_seed(scenario, coord), collective=collective,
                                  on_bucketed=agree_on_collectives)
    # Sub-mesh groups get rank-dependent names on a real world (every rank numbers only the
    # groups it belongs to), so the inherited module may name other groups: then every rank
    # builds its own (together: the compile's first call runs on this world).
    inherited = on_every_rank(mesh.group_dims == run.group_dims)
    if _MODULE_EXECUTORS & set(executors) and not inherited:
        torch._dynamo.reset()
        run = _pipeline(scenario, mesh, enable_ac, collective, last_needed(executors, STAGES))
    ctx.run = run
    # Every rank's graphs must issue the same collectives before any runs (a rank that re-ran
    # the pipeline made its own): a mismatch is a named error on every rank, not a gloo abort.
    agree_on_collectives([row for r in run.results for row in r.graph_rows()])

    if EAGER in executors and dropout_off_in_oracle(scenario, run):
        executors = (*executors, DROPOUT_OFF)
    if EAGER in executors and run.joint is not None and run.joint.compiling_queries:
        executors = (*executors, AS_TRACED)
    references = {DROPOUT_OFF: executor_without_random_ops, AS_TRACED: executor_as_traced}

    # A model whose reads (MoE token counts) may differ per rank and step: a graph per rank and step.
    # Not where a read is a (replicated) random draw's (a layer drop): every rank takes rank 0's
    # draw in the program, which a rank's own record of its reads does not (verify.parity.retrace).
    reads = run.joint.traced_reads if run.joint is not None else ()
    retrace = EAGER in executors and bool(reads) and not any(r.random for r in reads)
    steps: list[PipelineRun] | None = None
    graphs: StepGraphs | None = None
    traces, seconds = {}, {}
    for name in executors:
        t0 = time.perf_counter()
        if name in references:
            executor = references[name](ctx.eager() if graphs is None else graphs.gathering(ctx.eager()))
        elif steps is not None:
            executor = per_step(_per_run(steps, lambda r: build_executor(name, replace(ctx, run=r), STAGES)))
        else:
            executor = build_executor(name, ctx, STAGES)
        if name == EAGER and retrace:
            until = last_needed(executors, STAGES)
            graphs = StepGraphs(run, scenario, mesh, batches, seed=ctx.seed, program=program,
                                pipeline=lambda m, b, obs, first: _pipeline(scenario, mesh, enable_ac, collective, until, m, b, obs, first))
            executor = graphs.ahead_of(executor)
        kept = name in _EXECUTORS and _EXECUTORS[name].compiled and inherited and steps is None
        with no_recompile("the graphs compiled (and captured) on the fake world") if kept else contextlib.nullcontext():
            traces[name] = ctx.train(executor)
        if name == EAGER and retrace:
            steps = None if all(r is run for r in graphs.runs) else graphs.runs  # None: every step's values are the traced ones
        seconds[name] = time.perf_counter() - t0
    explanations = {}
    if graphs is not None and graphs.runs:
        stages = [n for n in traces if n != EAGER and n not in references]
        explanations = explain_own_graphs(traces, stages, EAGER, runs=graphs.runs, values=graphs.values, scenario=scenario,
                                          mesh=mesh, batches=batches, as_traced=AS_TRACED if AS_TRACED in traces else None,
                                          seed=ctx.seed)
    return RankParity(tuple(coord[d] for d in spec.names), traces, seconds, explanations)


def _per_run(runs: Sequence[PipelineRun], build) -> list[Executor]:
    """``build(run)`` per step, one executor per distinct run."""
    made: dict[int, Executor] = {}
    for r in runs:
        if id(r) not in made:
            made[id(r)] = build(r)
    return [made[id(r)] for r in runs]


def executor_as_traced(executor: Executor) -> Executor:
    """``executor`` (the eager program's) with every step run as the trace ran the model:
    ``torch.compiler.is_compiling()`` true (``autoparallel.compiling_flag``)."""

    def run(params, inputs):
        with tracing_as_compiling():
            return executor.step(params, inputs)

    return Executor(run, executor.buffers)


@contextlib.contextmanager
def no_recompile(what: str) -> Iterator[None]:
    """A compiled module kept from the pipeline must run as compiled: a recompile inside would
    test other graphs than ``what``."""
    before = counters["stats"]["unique_graphs"]
    yield
    if counters["stats"]["unique_graphs"] != before:
        raise RuntimeError(f"torch.compile recompiled the module in the rank: the parity run would not test {what}; "
                           "check Dynamo's recompile reasons")


def dropout_off_in_oracle(scenario: Scenario, run: PipelineRun) -> bool:
    """Whether the oracle compares with dropout off on both sides (``verify.parity.random_ops``): the
    model draws random numbers and the plan shards activations over a TP dim, where a rank's mask
    of its shard is no slice of the one the single-device model draws. Under FSDP/DDP a rank's
    activations are its batch slice's, and the reference draws each slice's masks instead."""
    plan, spec = scenario.plan_obj(), scenario.mesh_spec
    sharded = plan.tp_dim is not None and spec.size(plan.tp_dim) > 1
    return sharded and bool(random_nodes(run.stage(JOINT).graphs))


def oracle_executor(ranks: Sequence[RankParity]) -> str:
    """The executor the oracle compares: the eager program, or its dropout-off form where the
    rank ran one (:func:`dropout_off_in_oracle`)."""
    return DROPOUT_OFF if DROPOUT_OFF in ranks[0].traces else EAGER


def rank_seed(scenario: Scenario, coord: dict[str, int]) -> int:
    """The generator seed of the rank at ``coord`` (``train_steps``' ``seed``): one per
    data-parallel slice, so its dropout masks are the ones the single-device reference draws for
    that slice (the oracle), and the ranks of a TP group draw alike (replicated activations)."""
    plan, spec = scenario.plan_obj(), scenario.mesh_spec
    index = 0
    for d in plan.data_dims:
        index = index * spec.size(d) + coord.get(d, 0)
    return RNG_SEED + 1000 * scenario.seed + index


def run_stage_parity(
    scenario: Scenario,
    steps: int = 3,
    *,
    executors: tuple[str, ...] = STAGE_EXECUTORS,
    run: PipelineRun | None = None,
    collective: CollectivePassesConfig | None = None,
    enable_ac: bool = False,
    timeout_s: float = 180.0,
) -> list[RankParity]:
    """Train ``steps`` steps (AdamW between) on a gloo world of the scenario's mesh with each of
    ``executors`` (default: every stage, see the module docstring); per-rank traces by name.

    ``run``: a pipeline run of this scenario to take the graphs and the compiled module from (made
    with ``keep_compiled`` and one intra-op thread, as ``verify.stages.pipeline_run.run_scenario`` makes
    it); default: :func:`parity_pipeline`, up to the last stage the executors need. ``collective``: the collective
    passes' configuration (default: the pipeline's, as the report and goldens use it)."""
    unknown = sorted(set(executors) - set(STAGE_EXECUTORS))
    if unknown:
        raise ValueError(f"unknown executors {unknown}; executors: {list(STAGE_EXECUTORS)}")
    collective = collective if collective is not None else pipeline_options().collective
    if run is None:
        run = parity_pipeline(scenario, executors, enable_ac=enable_ac, collective=collective)
    elif run.compiled is None and _MODULE_EXECUTORS & set(executors):
        raise ValueError("run_stage_parity: the given pipeline run kept no compiled module; make it with keep_compiled=True")
    try:
        return run_parity_world(
            _rank_stages,
            scenario.mesh_spec.world_size,
            args=(scenario, scenario.batches(steps), run, tuple(executors), enable_ac, collective),
            timeout_s=timeout_s,
            num_threads=_RANK_THREADS,
        )
    finally:
        torch._dynamo.reset()
        run.compiled = None  # consumed: the reset invalidates it (a later parity run recompiles)


def compare_with_eager(ranks: Sequence[RankParity], executor: str, reference: str = EAGER) -> ParityReport:
    """``executor`` against the eager parallel program (or another ``reference`` executor, e.g.
    :data:`AS_TRACED`), bitwise, every rank (names ``rank<i>/``). Planned ranks
    (``verify.parity.planned.PlannedRank``, whose reference is also ``eager``) too."""
    return merge_reports(
        [compare_traces(r.traces[reference], r.traces[executor], a_name=reference, b_name=executor) for r in ranks],
        [f"rank{i}" for i in range(len(ranks))],
    )


def run_joint_parity(scenario: Scenario, steps: int = 1, timeout_s: float = 120.0) -> list[RankParity]:
    """The eager program and the traced joint graph on a gloo world of the scenario's mesh."""
    return run_stage_parity(scenario, steps, executors=(EAGER, JOINT), timeout_s=timeout_s)


def run_compile_parity(
    scenario: Scenario, steps: int = 1, *, enable_ac: bool = False, timeout_s: float = 180.0
) -> list[RankParity]:
    """The eager program, the first partition's ParallelModule and its torch.compile'd version
    (aot_eager-style autoparallel_backend); per-rank traces keyed by ``COMPILE_EXECUTORS``."""
    return run_stage_parity(scenario, steps, executors=COMPILE_EXECUTORS, enable_ac=enable_ac, timeout_s=timeout_s)


# --- the single-device side of the oracle --------------------------------------------------------


@dataclass
class SingleDeviceReference:
    """The unsharded model on one process, one training step from the same initial weights, on
    each data-parallel slice of the first batch: the mean of the slices' losses and gradients
    (what data parallelism computes), and the buffers each slice leaves (keyed by the slice's
    data-parallel coordinate, in ``plan.data_dims`` order); ``input_scales``: per module owning
    buffers, the largest floating input entry it saw, and ``updated``: the buffers the step wrote
    (a buffer's scale, ``verify.parity.buffer_scales``)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[tuple[int, ...], dict[str, torch.Tensor]]
    input_scales: dict[str, float] = field(default_factory=dict)
    updated: frozenset[str] | None = None  # the buffers the step wrote (on any slice)


def data_coordinates(scenario: Scenario) -> list[dict[str, int]]:
    """Every data-parallel coordinate of the scenario's mesh (the batch's slices), in order."""
    spec, dims = scenario.mesh_spec, scenario.plan_obj().data_dims
    coords = [{}]
    for d in dims:
        coords = [{**c, d: i} for c in coords for i in range(spec.size(d))]
    return coords


def rounded_like_the_program(inputs, param_dtype: torch.dtype | None):
    """The model inputs as the parallel program sees them, in their own dtype: a floating input it
    casts to ``param_dtype`` (``cast_forward_inputs``, FSDP2's ``MixedPrecisionPolicy``) rounded
    through that dtype and back, so the unsharded reference computes in its own precision on the
    same input values (the cast is the program's semantics, not parallelism's rounding)."""
    from torch.utils import _pytree as pytree

    def rounded(x):
        return cast_forward_inputs(x, param_dtype).to(x.dtype) if isinstance(x, torch.Tensor) else x

    return pytree.tree_map(rounded, list(inputs))


def rank_inputs(scenario: Scenario) -> dict[str, tuple]:
    """Per input role (``input:0`` ...), each rank's slice of the scenario's first batch, rank
    order: what the differential run feeds the graphs (token ids and masks keep their range)."""
    plan, spec = scenario.plan_obj(), scenario.mesh_spec
    batch = scenario.batches(1)[0]
    per_rank = [split_batch(batch, plan, spec, spec.coordinate(r)) for r in range(spec.world_size)]
    return {roles.input_(i): tuple(pieces[i] for pieces in per_rank) for i in range(len(batch))}


def single_device_reference(
    scenario: Scenario, *, dropout_off: bool = False, dtype: torch.dtype | None = None
) -> SingleDeviceReference:
    """:class:`SingleDeviceReference` for ``scenario``: each slice draws its rank's masks, or with
    ``dropout_off`` every dropout is off (``verify.parity.random_ops``). ``dtype``: the model,
    its floating inputs and target cast to it (the oracle's fp64 calibration,
    ``verify.parity.calibration``). Each slice runs on a model
    built afresh, as each rank's program runs its first step on its own fresh model: a model whose
    first forward changes it (swaps in submodules, drawing their initial weights from the generator
    its dropout then draws from; flips a mode in its config) would otherwise run slice 1 as the
    second call of one object, which no rank does (docs/oracle-failures.md)."""
    plan, spec = scenario.plan_obj(), scenario.mesh_spec
    batch = scenario.batches(1)[0]
    coords = data_coordinates(scenario)
    losses, buffers = [], {}
    grads: dict[str, torch.Tensor] = {}
    input_scales: dict[str, float] = {}
    updated: set[str] = set()
    # a scalar draw is one for the whole batch: every slice takes the first slice's (replicated_draws)
    one_slice = first_slice_draws() if patches.enabled(REPLICATED_DRAWS) else contextlib.nullcontext
    for coord in coords:
        model = scenario.model()
        *inputs, target = split_batch(batch, plan, spec, {d: coord.get(d, 0) for d in spec.names})
        inputs = rounded_like_the_program(inputs, plan.param_dtype)
        if dtype is not None:
            model, inputs, target = cast_floating((model.to(dtype), inputs, target), dtype)
        # the slice's rank draws these masks (or none, dropout off)
        draws = random_ops_disabled() if dropout_off else seeded(step_seed(rank_seed(scenario, coord), 0))
        with draws, one_slice(), owner_input_scales(model, input_scales), written_buffers(model) as written:
            loss = scenario.loss_fn(model(*inputs), target)
            loss.backward()
        updated |= written
        losses.append(loss.detach())
        for fqn, p in model.named_parameters():
            grads[fqn] = _add_grad(grads.get(fqn), p.grad)
        buffers[tuple(coord[d] for d in plan.data_dims)] = {k: b.detach().clone() for k, b in model.named_buffers()}
    n = len(coords)
    return SingleDeviceReference(
        torch.stack(losses).sum() / n, {k: None if g is None else g / n for k, g in grads.items()}, buffers,
        input_scales, frozenset(updated),
    )


def cast_floating(tree, dtype: torch.dtype):
    """Every floating tensor in ``tree`` cast to ``dtype`` (the oracle's fp64 calibration); the rest as is."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def _add_grad(total: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor | None:
    """One more slice's gradient into the sum; None adds nothing (frozen, the loss does not reach
    it, or no token of the slice reaches it: an MoE expert). None on every slice stays None: the
    whole batch gives it no gradient, as one forward over the whole batch would."""
    if grad is None:
        return total
    return grad.clone() if total is None else total + grad


def single_device_step(scenario: Scenario) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of the unsharded model on the first batch (mean over its slices)."""
    ref = single_device_reference(scenario)
    return ref.loss, ref.grads


# Single-device eager sums in another order than the ranks: the bound on the max |diff| of the
# gathered gradients, per parameter dtype. What the reduction-order noise measured on the tiny
# preset (fp32: ~1e-7, bf16 params: ~3e-3), with a margin of ~10x.
SINGLE_DEVICE_ATOL = {torch.float32: 2e-6, torch.bfloat16: 3e-2}


def single_device_tolerance(scenario: Scenario) -> float:
    """The oracle's tolerance for ``scenario``: by the dtype its plan computes in."""
    dtype = scenario.plan_obj().param_dtype or torch.float32
    if dtype not in SINGLE_DEVICE_ATOL:
        raise ValueError(f"no single-device tolerance for param dtype {dtype}; known: {sorted(map(str, SINGLE_DEVICE_ATOL))}")
    return SINGLE_DEVICE_ATOL[dtype]


def gather_full_grads(scenario: Scenario, ranks: list[RankParity], executor: str, step: int = 0) -> dict[str, torch.Tensor]:
    """Reassemble each parameter's full gradient from the ranks' shards."""
    shardings = scenario.plan_obj().resolve(scenario.model(device="meta"), scenario.mesh_spec)
    out = {}
    for fqn, sharding in shardings.items():
        pieces = {r.coord: r.traces[executor].grads[step][fqn] for r in ranks}
        out[fqn] = _unshard_or_none(sharding, pieces, scenario.mesh_spec)
    return out


def _unshard_or_none(sharding, pieces: dict, spec) -> torch.Tensor | None:
    """The full tensor from the ranks' pieces; None where every rank has None (no gradient). A
    rank with None among ranks with a piece is a parallel program that disagrees with itself."""
    nones = sorted(c for c, t in pieces.items() if t is None)
    if len(nones) == len(pieces):
        return None
    if nones:
        raise ValueError(f"{sharding.fqn}: ranks {nones} have no gradient but the others have one")
    return sharding.unshard(pieces, spec)


def unchanged_checks(
    scenario: Scenario, ranks: Sequence[RankParity], executor: str, reference: SingleDeviceReference
) -> list:
    """Every parameter without a gradient (single-device eager gives it none, or no rank stepped
    it at any step: frozen, or the loss does not reach it) must end the run bitwise where it
    started: its final value, reassembled from the ranks' shards, against the model's initial one
    (one oracle check each, bound 0, named ``unchanged:<fqn>``)."""
    shardings = scenario.plan_obj().resolve(scenario.model(device="meta"), scenario.mesh_spec)
    stale = {fqn for fqn, g in reference.grads.items() if g is None}
    if ranks:
        stale |= set.intersection(*(set(never_stepped(r.traces[executor])) for r in ranks))
    initial = dict(scenario.model().named_parameters())
    out = []
    for fqn in sorted(stale):
        final = shardings[fqn].unshard({r.coord: r.traces[executor].params[fqn] for r in ranks}, scenario.mesh_spec)
        out.append(check_within(f"unchanged:{fqn}", initial[fqn].detach(), final, 0.0, 0.0))
    return out


def loss_in_reference_dtype(loss: torch.Tensor, ref: torch.Tensor, param_dtype: torch.dtype | None) -> tuple:
    """``(check name, reference, loss)``: a loss the parallel program computed in the plan's
    ``param_dtype`` (a bf16 model's loss under mixed precision, as FSDP2 leaves it: no output cast)
    is compared in the single-device reference's dtype, and the check's name says so. Any other
    dtype difference is left for ``check_within`` to fail."""
    if param_dtype is not None and loss.dtype == param_dtype and ref.dtype != param_dtype and ref.is_floating_point():
        return f"loss ({dtype_name(param_dtype)} under param_dtype, compared in {dtype_name(ref.dtype)})", ref, loss.to(ref.dtype)
    return "loss", ref, loss


def oracle_check(
    scenario: Scenario, ranks: list[RankParity], executor: str | None = None, reference: SingleDeviceReference | None = None
) -> OracleReport:
    """The independent oracle (``verify.parity.compare``): ``executor``'s first step on the ranks (loss
    averaged over the data-parallel slices, gradients reassembled from shards, each rank's
    buffers) against single-device eager, within the tolerance the dtype and the reduction depth
    give. Default: :func:`oracle_executor` (the eager program, which every other executor is
    compared with bitwise, or its dropout-off form; the reference then runs with dropout off)."""
    executor = executor if executor is not None else oracle_executor(ranks)
    ref = reference if reference is not None else single_device_reference(scenario, dropout_off=executor == DROPOUT_OFF)
    plan, spec = scenario.plan_obj(), scenario.mesh_spec
    coords = data_coordinates(scenario)
    slice0 = split_batch(scenario.batches(1)[0], plan, spec, {d: coords[0].get(d, 0) for d in spec.names})
    tolerance = oracle_tolerance(scenario.model(device="meta"), slice0[:-1], len(coords), compute_dtype=plan.param_dtype)
    report = OracleReport(tolerance, parallel=executor)
    data_index = [spec.names.index(d) for d in plan.data_dims]

    def slice_of(r: RankParity) -> tuple[int, ...]:
        return tuple(r.coord[i] for i in data_index)

    per_slice: dict[tuple[int, ...], torch.Tensor] = {}
    for r in ranks:
        per_slice.setdefault(slice_of(r), r.traces[executor].losses[0])
    loss = torch.stack([per_slice[k] for k in sorted(per_slice)]).sum() / len(per_slice)
    loss_name, ref_loss, loss = loss_in_reference_dtype(loss, ref.loss, plan.param_dtype)
    report.checks.append(check_within(loss_name, ref_loss, loss, tolerance.rtol))
    grads = gather_full_grads(scenario, ranks, executor)
    scales = module_scales(ref.grads)
    for fqn in sorted(set(ref.grads) | set(grads)):
        report.checks.append(check_within(roles.grad(fqn), ref.grads.get(fqn), grads.get(fqn), tolerance.rtol, scales.get(fqn)))
    report.checks.extend(unchanged_checks(scenario, ranks, executor, ref))
    for i, r in enumerate(ranks):
        trace = r.traces[executor]
        got = trace.buffers[0] if trace.buffers else {}
        want = ref.buffers[slice_of(r)]
        sizes = buffer_scales(want, ref.input_scales, ref.updated)
        for name in sorted(set(got) | set(want)):
            report.checks.append(check_within(f"rank{i}/{roles.buffer(name)}", want.get(name), got.get(name), tolerance.rtol, sizes.get(name)))
    if not report.passed and calibration.applies(tolerance, plan.param_dtype):

        def named(reference: SingleDeviceReference) -> dict[str, torch.Tensor | None]:
            out: dict[str, torch.Tensor | None] = {loss_name: reference.loss}
            out.update((roles.grad(fqn), g) for fqn, g in reference.grads.items())
            for i, r in enumerate(ranks):
                out.update((f"rank{i}/{roles.buffer(k)}", b) for k, b in reference.buffers[slice_of(r)].items())
            return out

        def in_dtype(dropout_off: bool):
            return lambda dtype: named(single_device_reference(scenario, dropout_off=dropout_off, dtype=dtype))

        # the program the oracle compared: with the ranks' masks unless it ran with dropout off
        draws = executor != DROPOUT_OFF
        report = calibration.calibrated(report, in_dtype(not draws), in_dtype(True) if draws else None)
    return report
