"""THE pipeline: the ordered stage list, and the driver that runs any model through it.

``run_pipeline(model, loss_fn, example_inputs, plan, mesh)`` runs :data:`STAGES` in order on one
rank's graphs (rank 0 of a fake world unless an entered world is given) and returns every
stage's graphs, its wall seconds and its report::

    joint                    trace: model + loss + plan -> per-rank joint graph (parallelize),
                             or, for plan="auto", lower the plan stage's plan (planner.lower)
    cleanup                  joint -> joint    structural clean-up          (partition.PLACEMENT_STEPS)
    fsdp_tagging             joint -> joint    FSDP recompute tags                    "
    first_partition          joint -> fw, bw   AOT partition, saves recorded          "
    second_compile           module -> fw, bw  torch.compile(autoparallel_backend), replay partition,
                                               bucketing tags on its joint graph
    fuse_chained_allgathers  fw, bw -> fw, bw  (passes.collective.COLLECTIVE_PASSES, in the order
    pre_overlap_bucketing    fw, bw -> fw, bw   autoparallel_backend runs them)
    topo_span_bucketing      fw, bw -> fw, bw

The sub-lists are owned by the code that also runs them outside the pipeline (``apply_placement``,
``bucket_fw_bw``), so the pipeline cannot show an order the product does not run. Each stage that
rewrites a graph is a graph-in/graph-out step with a name: ``run.stage(name).graphs`` is its
output and ``run.input_of(name)`` its input.

Nothing here is LLaMA-specific: the model, the loss function and the batch are inputs. The
stage list is data: a stage can be inserted (:func:`insert_stage`), and ``until=`` stops after a
stage. ``plan="auto"`` (``ParallelPlan.auto(...)``) runs :data:`PLANNED_STAGES`, which is
:data:`STAGES` with :data:`PLAN_STAGE` ahead of ``joint``::

    plan                     model + loss + mesh -> a Solution (planner: trace, ILP, alias round trips)

and ``joint`` then lowers that plan instead of tracing a hand plan; every later stage is the
same. Observers (``observers=[fn]``) see each :class:`StageResult` as soon as its stage ends
(an HTML report, stats on graphs too large to keep). One of them is always the structured trace
(``trace=``, default :class:`autoparallel.trace.StageTracer`): with ``TORCH_TRACE=dir`` every
stage's graphs, stats and report land in the trace, named in pipeline order, for ``tlparse``;
each stage's end is also logged at INFO (``TORCH_LOGS=autoparallel``).

Graphs are rank-specific after bucketing and are built on a fake world: they are for reading
(goldens, stats, reports) and, with ``keep_compiled``, the compiled module for parity runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn

from autoparallel import meta as M
from autoparallel import patches, roles
from autoparallel.aot_graph_text import PATCH as AOT_GRAPH_TEXT
from autoparallel.aot_graph_text import aot_graph_text_only_when_logged
from autoparallel.compile import OVERLAP_PATCH, SECOND_COMPILE, TANGENT_ROLES, Compiler, autoparallel_backend
from autoparallel.compiling_flag import PATCH as TRACE_AS_COMPILING
from autoparallel.defaults import DEFAULT_LOWERING
from autoparallel.eager_dropout import PATCH as EAGER_DROPOUT
from autoparallel.eager_dropout import PATCH_IN_PLACE as IN_PLACE_DROPOUT
from autoparallel.eager_kernels import PATCH as EAGER_KERNELS
from autoparallel.kernel_strides import PATCH as KERNEL_STRIDES
from autoparallel.kernel_strides import strides_as_kernels
from autoparallel.eager_kernels import RETRACE_PATCH as EAGER_KERNELS_RETRACE
from autoparallel.passes.pinned_layouts import PATCH as PINNED_LAYOUTS
from autoparallel.passes.value_guards import PATCH as VALUE_GUARDS
from autoparallel.passes.value_guards import ValueGuardError, counts_as_guarded
from autoparallel.parallelize.replicated_draws import PATCH as REPLICATED_DRAWS
from autoparallel.fx_utils import copy_graph_module
from autoparallel.gc_pauses import fewer_collections
from autoparallel.mesh import MeshSpec, ParallelMesh, attach_group_dims, fake_world
from autoparallel.parallelize import JointGraph, ParallelPlan, build_joint_graph, split_batch
from autoparallel.parallelize.program import LossFn
from autoparallel.partition import PLACEMENT_STEPS, PlacementState, PlacementStep, placement
from autoparallel.replay_partition import REPLAY_PATCH, UNREAD_SAVES_PATCH
from autoparallel.passes.collective import (
    COLLECTIVE_PASSES,
    CollectivePass,
    CollectivePassesConfig,
    bucket_fw_bw,
)
from autoparallel.planner.alias_round_trips import PATCH as ALIAS_ROUND_TRIPS_PATCH
from autoparallel.passes.permuted_split_cat import PATCH as SPLIT_CAT_PATCH
from autoparallel.planner.auto import local_inputs as planned_local_inputs
from autoparallel.planner.batch_local import PATCH as BATCH_LOCAL_PATCH
from autoparallel.planner.incumbent import PATCH as INCUMBENT_PATCH
from autoparallel.planner.layout_reads import PATCH as LAYOUT_BLIND_PATCH
from autoparallel.planner.moves import PATCH as DIRECT_MOVES_PATCH
from autoparallel.planner.side_effects import PATCH as SIDE_EFFECTS_PATCH
from autoparallel.planner.auto import local_values as planned_local_values
from autoparallel.planner.auto import plan_for_pipeline
from autoparallel.planner.lower import lower_plan
from autoparallel.planner.replay import check_lowering
from autoparallel.runtime.parallel_module import ParallelModule
from autoparallel.runtime.steps import ZERO_TANGENTS
from autoparallel.trace import StageTracer

log = logging.getLogger(__name__)

Graphs = fx.GraphModule | tuple[fx.GraphModule, fx.GraphModule]

JOINT = "joint"
PLAN = "plan"


# --- options, results -------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineOptions:
    """``collective``: which collective passes run and their knobs (default: every pass, as the
    backend runs them with overlap scheduling on); ``enable_ac``: the second compile runs the
    joint AC pass; ``keep_compiled``: run the compiled module's forward and keep it (parity runs;
    otherwise the second compile stops once it has partitioned: graphs only, nothing executes);
    ``compiler``: what the second compile's backend compiles the split graphs with (``"aot_eager"``:
    they run as traced, bitwise with eager; ``"inductor"``: Inductor, Triton on CUDA, fused and
    reordered, so not bitwise); ``alternatives``: also run each collective pass alone on ``second_compile``'s graphs (review:
    what one pass does by itself); ``snapshots``: each result holds its own copy of the graphs
    (off: results hold the live graphs, which later stages rewrite; observers still see each
    stage's graphs when it ends); ``reads_per_rank``: a model's reads are this rank's values, not
    compared between ranks (the caller traces a graph per rank: ``build_joint_graph``);
    ``gather_first``: parameters some ranks read and others do not, gathered first by every rank
    (``parallelize/gathered_first.py``; the caller agrees on them: ``verify.parity.retrace``);
    ``lowering``: how the joint stage lowers a plan="auto" plan (``"replay"``, the default: the ops
    the plan fully determines as their local op, ``autoparallel.planner.replay``; ``"dtensor"``:
    every op through DTensor's dispatch, the reference it is tested against)."""

    collective: CollectivePassesConfig = field(default_factory=lambda: CollectivePassesConfig(schedule_overlap=True))
    enable_ac: bool = False
    keep_compiled: bool = False
    compiler: Compiler = "aot_eager"
    alternatives: bool = False
    snapshots: bool = True
    reads_per_rank: bool = False
    gather_first: tuple[str, ...] = ()
    lowering: str = DEFAULT_LOWERING

    def __post_init__(self):
        check_lowering(self.lowering)


@dataclass
class StageResult:
    """One stage's output: ``graphs`` (one GraphModule, a (forward, backward) pair, or None for a
    stage that makes no graph), its wall ``seconds``, the stage that produced its input
    (``input``), its ``report`` (CleanupReport, FsdpTagReport, PartitionRecord, PipelineMetrics
    ...), ``acted``: how much the pass changed (its stage's ``acted`` count; None for a stage
    that is no pass, e.g. the trace), and ``alternative`` for a collective pass run alone on
    ``second_compile``'s graphs."""

    name: str
    graphs: Graphs | None
    seconds: float
    input: str | None = None
    report: Any = None
    alternative: bool = False
    acted: int | None = None

    @property
    def label(self) -> str:
        return f"{self.name} (alone)" if self.alternative else self.name

    def graph_rows(self) -> list[tuple[str, fx.GraphModule]]:
        """``(row label, graph)``: ``label`` for one graph, ``label fwd`` / ``label bwd`` for a pair."""
        if isinstance(self.graphs, tuple):
            fw, bw = self.graphs
            return [(f"{self.label} fwd", fw), (f"{self.label} bwd", bw)]
        return [] if self.graphs is None else [(self.label, self.graphs)]


Observer = Callable[[StageResult], None]


@dataclass
class PipelineState:
    """What the stages read and write, in order: the inputs, then (plan="auto") what the plan
    stage planned, the joint graph, the placement (module), the compiled module, and the current
    graphs (the last stage's output)."""

    model: nn.Module
    loss_fn: LossFn | None
    example_inputs: tuple[torch.Tensor, ...]
    plan: Any  # a ParallelPlan once the stages before "joint" are done
    mesh: ParallelMesh
    options: PipelineOptions
    planned: Any = None  # autoparallel.planner.auto.Planned, from the plan stage
    joint: JointGraph | None = None
    placement: PlacementState | None = None
    compiled: Any = None
    graphs: Graphs | None = None
    results: list[StageResult] = field(default_factory=list)

    @property
    def module(self) -> ParallelModule | None:
        return self.placement.module if self.placement is not None else None

    def local_inputs(self) -> tuple[torch.Tensor, ...]:
        """This rank's slice of the example inputs (for plan="auto": its piece under the plan)."""
        if self.planned is not None:
            return planned_local_inputs(self.planned.solution, self.example_inputs, self.mesh)
        return split_batch(self.example_inputs, self.plan, self.mesh.spec, self.mesh.coordinate())


def report_acted(graphs: Graphs | None, report: Any) -> int:
    """The ``acted`` count of a stage whose report carries one (CleanupReport, FsdpTagReport,
    PartitionRecord, PipelineMetrics)."""
    return report.acted


@dataclass(frozen=True)
class Stage:
    """A pipeline stage: ``run(state) -> (graphs, report)``; ``skip(state)``: not run this time
    (a collective pass its config switches off). ``patches``: registered patches it applies.
    ``acted(graphs, report) -> int``: what the stage changed (rewrites, tags, saves, merged
    collectives), so a pass that silently does nothing shows as 0; None for a stage that is no
    pass (the trace, a planner)."""

    name: str
    run: Callable[[PipelineState], tuple[Graphs | None, Any]]
    summary: str
    skip: Callable[[PipelineState], bool] = lambda state: False
    patches: tuple[str, ...] = ()
    acted: Callable[[Graphs | None, Any], int] | None = None


@dataclass
class PipelineRun:
    """The results of one run, in stage order, plus what later runs may reuse."""

    results: list[StageResult]
    alternatives: list[StageResult]
    joint: JointGraph | None
    module: ParallelModule | None
    compiled: Any
    group_dims: dict[str, str]
    planned: Any = None  # plan="auto": autoparallel.planner.auto.Planned (plan, planning graph)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.results]

    def stage(self, name: str) -> StageResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no stage {name!r} in this run; stages: {self.names}")

    def alternative(self, name: str) -> StageResult:
        for r in self.alternatives:
            if r.name == name:
                return r
        raise KeyError(f"no alternative {name!r} in this run; alternatives: {[r.name for r in self.alternatives]}")

    def input_of(self, name: str) -> StageResult | None:
        """The result a stage read (None for the first stage)."""
        src = self.stage(name).input
        return None if src is None else self.stage(src)


# --- the second compile -----------------------------------------------------------------------


class _StopAfterPartition(Exception):
    """Raised by the partition hook to end a graphs-only compile before anything executes."""


def _stop_without_failing(backend):
    """``backend``, except that the graphs-only stop ends its compile as a success.

    Raised inside the backend, the stop would reach Dynamo as a failed compile: Dynamo logs a
    ``dynamo_error`` artifact and ``compilation_metrics`` with a ``fail_type`` to the structured
    trace, and tlparse shows every graphs-only run as a failure. Instead the backend returns a
    compiled function that raises the stop when called: the compile succeeds, the frame's first
    call ends before any graph runs, and ``second_compile`` catches the stop there."""

    def compile_(gm, example_inputs):
        try:
            return backend(gm, example_inputs)
        except _StopAfterPartition:
            def stopped(*args):
                raise _StopAfterPartition

            return stopped

    return compile_


def _on_fake_world() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "fake"


def _caused_by(exc: BaseException | None, kind: type) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass
class SecondCompile:
    """The second compile's split graphs (labelled like the first partition's), the collective
    passes' metrics when it ran them, and the compiled module (``keep_compiled`` only)."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    compiled: Any = None
    metrics: Any = None


def second_compile(
    module: ParallelModule,
    mesh: ParallelMesh,
    local_inputs: Sequence[torch.Tensor],
    *,
    enable_ac: bool = False,
    keep_compiled: bool = False,
    collective_passes: CollectivePassesConfig | None = None,
    compiler: Compiler = "aot_eager",
) -> SecondCompile:
    """``torch.compile(module, backend=autoparallel_backend(...))`` on the world ``mesh`` (entered),
    called once on ``local_inputs``; the split graphs its partitioner made.

    Graphs only (default): the partition hook stops the call before anything executes (at 8B
    shapes the forward would compute real activations on this CPU), and Dynamo's cache is reset.
    ``keep_compiled``: the call runs, the compiled module is returned, and Dynamo's cache is left
    for the caller to reset (``torch._dynamo.reset()``); ``fw``/``bw`` are then copies of the
    graphs the module runs, so rewriting them leaves the module as compiled. ``collective_passes``: the backend also
    tags its joint graph and runs those passes; ``fw``/``bw`` are their output. A module traced on
    another world's group names is an error (re-trace on this world, or enter one built the same
    way: a fresh fake world names its groups as the first did)."""
    import torch._dynamo

    if module.group_dims != mesh.group_dims:
        raise ValueError(f"module was traced with groups {module.group_dims}, this world has {mesh.group_dims}")
    if keep_compiled and module.uninitialised:
        names = module.uninitialised
        raise ValueError(
            f"second compile with keep_compiled: {len(names)} local parameter(s)/buffer(s) of the module have no "
            f"values (e.g. {names[0]!r}; the model was built on meta), and running it would compute on memory "
            "nobody wrote. Build the model on a real device, or give apply_placement the local values")
    captured: dict[str, Any] = {}

    def stop_if_graphs_only():
        if not keep_compiled:
            raise _StopAfterPartition

    def on_partition(fw, bw):
        captured.update(fw=fw, bw=bw)
        if collective_passes is None:
            stop_if_graphs_only()

    def on_collective_passes(fw, bw, metrics):
        captured.update(fw=fw, bw=bw, metrics=metrics)
        stop_if_graphs_only()

    backend = autoparallel_backend(
        enable_ac=enable_ac,
        compiler=compiler,
        on_partition=on_partition,
        collective_passes=collective_passes,
        on_collective_passes=on_collective_passes,
        group_dims=mesh.group_dims,
    )
    if not keep_compiled:
        backend = _stop_without_failing(backend)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend)
    try:
        with aot_graph_text_only_when_logged(), strides_as_kernels(), counts_as_guarded():
            compiled(*local_inputs)
    except Exception as e:
        # On a fake world the collectives return memory nobody wrote: a value guard on gathered
        # parameters (an MoE router's token counts) checks garbage there. The compile is done by
        # then (the backend ran before the forward executes); a real world runs its guards.
        if not (_caused_by(e, _StopAfterPartition) or (_caused_by(e, ValueGuardError) and _on_fake_world())):
            raise
    finally:
        if not keep_compiled:
            torch._dynamo.reset()
    fw, bw = captured["fw"], captured["bw"]
    if keep_compiled:
        # The compiled module runs these very GraphModules (the backward compiles lazily, and a
        # lazy forward re-reads its graph): hand out copies, or the pipeline's collective stages,
        # which rewrite their input in place, would change what the module computes.
        fw, bw = copy_graph_module(fw), copy_graph_module(bw)
    for gm in (fw, bw):
        attach_group_dims(gm, mesh.group_dims)
    return SecondCompile(fw, bw, compiled if keep_compiled else None, captured.get("metrics"))


# --- the stages -------------------------------------------------------------------------------


def _is_auto(plan: Any) -> bool:
    return isinstance(plan, ParallelPlan) and plan.is_auto


def _plan(state: PipelineState) -> tuple[Graphs, Any]:
    if not _is_auto(state.plan):
        raise ValueError(f"the plan stage plans plan='auto' only, got {state.plan!r}")
    state.planned = plan_for_pipeline(state.model, state.loss_fn, state.example_inputs, state.mesh, state.plan)
    return None, state.planned.report


def _joint(state: PipelineState) -> tuple[Graphs, Any]:
    if not isinstance(state.plan, ParallelPlan):
        raise ValueError(
            f"plan={state.plan!r} is not a ParallelPlan: the joint stage needs one (a hand plan, or "
            "ParallelPlan.auto() with the plan stage ahead of 'joint': PLANNED_STAGES). A plan that "
            "something else decides needs a stage ahead of 'joint' that sets state.plan "
            "(insert_stage(STAGES, planner_stage, before='joint'))"
        )
    if state.plan.is_auto:
        if state.planned is None:
            raise ValueError("plan='auto' needs the plan stage ahead of 'joint': run PLANNED_STAGES (run_pipeline's default for it)")
        state.joint, report = lower_plan(state.planned.pg, state.planned.solution, state.plan,
                                           replay=state.options.lowering == "replay")
        params, buffers = planned_local_values(state.planned.solution, state.model, state.mesh)
        state.joint.local_params.update(params)
        state.joint.local_buffers.update(buffers)
    else:
        state.joint, report = build_joint_graph(state.model, state.plan, state.mesh, state.example_inputs, state.loss_fn,
                                                reads_per_rank=state.options.reads_per_rank,
                                                gather_first=state.options.gather_first), None
    state.placement = placement(state.joint)
    return state.joint.gm, report


def _placement_stage(step: PlacementStep) -> Stage:
    def run(state: PipelineState) -> tuple[Graphs, Any]:
        report = state.placement.run(step)
        if state.module is not None:  # the first partition made the module
            fp = state.module.first_partition
            return (fp.fw, fp.bw), report
        return state.joint.gm, report

    return Stage(step.name, run, step.summary, patches=step.patches, acted=report_acted)


def _tag_only(config: CollectivePassesConfig) -> CollectivePassesConfig:
    """The config with every pass switched off: the backend labels and tags its joint graph (so
    the split graphs carry the bucketing tags) and runs no pass."""
    return replace(config, fuse_chained_allgathers=False, pre_overlap_bucketing=False, schedule_overlap=False)


def _second_compile(state: PipelineState) -> tuple[Graphs, Any]:
    if state.module is None:
        raise ValueError("the second compile needs the first partition's module: run 'first_partition' first")
    sc = second_compile(
        state.module,
        state.mesh,
        state.local_inputs(),
        enable_ac=state.options.enable_ac,
        keep_compiled=state.options.keep_compiled,
        collective_passes=_tag_only(state.options.collective),
        compiler=state.options.compiler,
    )
    state.compiled = sc.compiled
    return (sc.fw, sc.bw), sc.metrics


def _saved_values(graphs: Graphs | None, report: Any) -> int:
    """The second compile's work is its partition: the values its forward saves for the backward."""
    fw, _ = graphs
    return sum(1 for label in fw.graph.output_node().meta.get(M.ROLE) or [] if roles.is_saved(label))


def _collective_stage(p: CollectivePass) -> Stage:
    def run(state: PipelineState) -> tuple[Graphs, Any]:
        fw, bw = state.graphs
        fw, bw, metrics = bucket_fw_bw(fw, bw, state.options.collective, only=(p.name,))
        return (fw, bw), metrics

    return Stage(
        p.name,
        run,
        p.summary,
        skip=lambda state: not p.enabled(state.options.collective),
        patches=p.patches,
        acted=report_acted,
    )


#: The stage list, in order (see the module docstring).
STAGES: tuple[Stage, ...] = (
    Stage(JOINT, _joint, "trace the per-rank joint graph (model, loss, plan, mesh)",
          patches=(TRACE_AS_COMPILING, EAGER_DROPOUT, EAGER_KERNELS, KERNEL_STRIDES, VALUE_GUARDS, REPLICATED_DRAWS,
                   PINNED_LAYOUTS, SPLIT_CAT_PATCH, BATCH_LOCAL_PATCH, DIRECT_MOVES_PATCH,
                   LAYOUT_BLIND_PATCH)),
    *(_placement_stage(s) for s in PLACEMENT_STEPS),
    Stage(
        SECOND_COMPILE,
        _second_compile,
        "torch.compile with autoparallel_backend: replay partition, bucketing tags",
        patches=(REPLAY_PATCH, UNREAD_SAVES_PATCH, EAGER_KERNELS_RETRACE, OVERLAP_PATCH, AOT_GRAPH_TEXT, KERNEL_STRIDES, VALUE_GUARDS,
                 TANGENT_ROLES, ZERO_TANGENTS),
        acted=_saved_values,
    ),
    *(_collective_stage(p) for p in COLLECTIVE_PASSES),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)


def insert_stage(stages: Sequence[Stage], stage: Stage, *, before: str) -> tuple[Stage, ...]:
    """``stages`` with ``stage`` ahead of the one named ``before`` (ValueError naming the stages
    if there is none)."""
    names = [s.name for s in stages]
    if before not in names:
        raise ValueError(f"no stage {before!r} to insert {stage.name!r} before; stages: {names}")
    if stage.name in names:
        raise ValueError(f"a stage named {stage.name!r} is already in the list")
    i = names.index(before)
    return (*stages[:i], stage, *stages[i:])


#: The planner's stage: plan="auto" -> a plan (autoparallel.planner.auto.plan_for_pipeline).
PLAN_STAGE = Stage(
    PLAN,
    _plan,
    "plan placements (unsharded trace, ILP), remove alias round trips",
    skip=lambda state: not _is_auto(state.plan),
    patches=(ALIAS_ROUND_TRIPS_PATCH, TRACE_AS_COMPILING, IN_PLACE_DROPOUT, INCUMBENT_PATCH, SIDE_EFFECTS_PATCH),
)
#: The stage list for plan="auto": the planner ahead of the trace, then every stage of STAGES.
PLANNED_STAGES: tuple[Stage, ...] = insert_stage(STAGES, PLAN_STAGE, before=JOINT)
PLANNED_STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in PLANNED_STAGES)


def stages_for(plan: Any) -> tuple[Stage, ...]:
    """The stage list a plan runs by default: PLANNED_STAGES for plan="auto", else STAGES."""
    return PLANNED_STAGES if _is_auto(plan) or plan == "auto" else STAGES


# --- the driver -------------------------------------------------------------------------------


def _snapshot(graphs: Graphs | None, label: str) -> Graphs | None:
    if graphs is None:
        return None
    if isinstance(graphs, tuple):
        fw, bw = (copy_graph_module(g) for g in graphs)
        fw.meta[M.GM_STAGE], bw.meta[M.GM_STAGE] = f"{label}/forward", f"{label}/backward"
        return fw, bw
    out = copy_graph_module(graphs)
    out.meta[M.GM_STAGE] = label
    return out


@contextlib.contextmanager
def _world(mesh: ParallelMesh | MeshSpec | str) -> Iterator[ParallelMesh]:
    if isinstance(mesh, ParallelMesh):
        yield mesh
    else:
        with fake_world(mesh) as m:
            yield m


def _alternatives(state: PipelineState, after: StageResult, observers: Sequence[Observer]) -> list[StageResult]:
    out = []
    for p in COLLECTIVE_PASSES:
        fw, bw = (copy_graph_module(g) for g in state.graphs)
        t0 = time.perf_counter()
        fw, bw, metrics = bucket_fw_bw(fw, bw, state.options.collective, only=(p.name,))
        result = StageResult(p.name, (fw, bw), time.perf_counter() - t0, after.name, metrics, alternative=True,
                             acted=metrics.acted)
        for observe in observers:
            observe(result)
        out.append(result)
    return out


def _log_stage(result: StageResult) -> None:
    nodes = "/".join(str(len(gm.graph.nodes)) for _, gm in result.graph_rows()) or "-"
    summary = getattr(result.report, "summary", None)
    log.info("stage %s: %.3fs, nodes %s", result.label, result.seconds, nodes)
    if callable(summary) and log.isEnabledFor(logging.DEBUG):
        log.debug("stage %s report: %s", result.label, summary())


def run_pipeline(
    model: nn.Module,
    loss_fn: LossFn | None,
    example_inputs: Sequence[torch.Tensor],
    plan: ParallelPlan | Any,
    mesh: ParallelMesh | MeshSpec | str,
    options: PipelineOptions | None = None,
    *,
    stages: Sequence[Stage] | None = None,
    until: str | None = None,
    observers: Sequence[Observer] = (),
    trace: Callable[[], Observer] | None = StageTracer,
) -> PipelineRun:
    """Run ``stages`` (default :data:`STAGES`) in order; see the module docstring.

    ``model`` (on meta, cpu or fake tensors), ``loss_fn(model(*inputs[:-1]), inputs[-1])``
    (None: token cross-entropy), ``example_inputs`` the global batch (model inputs, then the
    target; only shapes and dtypes are used), ``plan`` a ``ParallelPlan`` (``"auto"`` or
    ``ParallelPlan.auto(...)``: the planner decides; or whatever a stage ahead of ``joint`` turns
    into one), ``mesh`` an entered world or a mesh spec (a fake world is entered for the run).
    ``stages``: default :func:`stages_for` the plan. ``until``: the last stage to run. Raises
    ValueError naming an unknown ``until`` or a stage that cannot run. ``trace``: makes this
    run's structured-trace observer (called once per run; None: no trace)."""
    options = options if options is not None else PipelineOptions()
    observers = (*observers, _log_stage, *(() if trace is None else (trace(),)))
    if plan == "auto":
        plan = ParallelPlan.auto()
    patches.disabled_from_env()  # a misspelt $AUTOPARALLEL_DISABLE name stops the run before any stage
    stages = stages if stages is not None else stages_for(plan)
    names = [s.name for s in stages]
    if until is not None and until not in names:
        raise ValueError(f"until={until!r} is no stage; stages: {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"stage names repeat: {names}")
    alternatives: list[StageResult] = []
    with fewer_collections(), _world(mesh) as world, contextlib.ExitStack() as cleanup:
        state = PipelineState(model, loss_fn, tuple(example_inputs), plan, world, options)
        # The trace keeps its export context (a fake mode) entered until the first partition
        # compiles; a run that stops or fails before that must not leave it entered.
        cleanup.callback(lambda: state.joint is not None and state.joint.close())
        # Likewise the plan stage's trace (plan="auto") until the joint stage lowers onto it.
        cleanup.callback(lambda: state.planned is not None and state.planned.pg.joint is not None and state.planned.pg.joint.close())
        prev: str | None = None
        for stage in stages:
            if stage.skip(state):
                continue
            t0 = time.perf_counter()
            graphs, report = stage.run(state)
            seconds = time.perf_counter() - t0
            state.graphs = graphs if graphs is not None else state.graphs
            kept = _snapshot(graphs, stage.name) if options.snapshots else graphs
            acted = stage.acted(graphs, report) if stage.acted is not None else None
            result = StageResult(stage.name, kept, seconds, prev, report, acted=acted)
            state.results.append(result)
            for observe in observers:
                observe(result)
            if options.alternatives and stage.name == SECOND_COMPILE:
                alternatives = _alternatives(state, result, observers)
            prev = stage.name if graphs is not None else prev
            if stage.name == until:
                break
        group_dims = dict(world.group_dims)
    return PipelineRun(state.results, alternatives, state.joint, state.module, state.compiled, group_dims, state.planned)


__all__ = [
    "JOINT",
    "PLAN",
    "PLANNED_STAGES",
    "PLANNED_STAGE_NAMES",
    "PLAN_STAGE",
    "STAGES",
    "STAGE_NAMES",
    "Observer",
    "PipelineOptions",
    "PipelineRun",
    "PipelineState",
    "SecondCompile",
    "Stage",
    "StageResult",
    "insert_stage",
    "report_acted",
    "run_pipeline",
    "second_compile",
    "stages_for",
]
