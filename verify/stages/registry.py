"""How each pipeline stage is verified: one entry per ``autoparallel.pipeline`` Stage.

Every verification surface reads its per-stage knowledge from here, so a new stage is one entry
beside the stage list, and a stage without one fails the surfaces that need it, naming it:

* ``parity``: how a parity rank runs the stage (:class:`ParityRun`): its executor, built from the
  rank's :class:`verify.stages.rank_context.RankContext` (hand plans, ``verify.parity.runs``;
  device worlds; ``plan="auto"``, ``verify.parity.planned``, by the name ``planned_parity`` gives);
* ``planned_parity``: the name of the executor of a ``plan="auto"`` parity world (``verify.parity.planned``);
* ``conservation``: the stage's law for collectives (``verify.graphs.invariants``), run by
  :func:`check_conservation` on every golden scenario;
* ``golden``: which graphs the stage's golden slot shows (``verify.goldens.catalog``);
* ``html``: how the HTML page shows the stage (``verify.commands.html.records``);
* ``mutation_tests``: the tests ``python -m verify mutate --lines`` runs against the stage's code
  (``verify.commands.mutation.lines``).

A check that does not apply is an :class:`Exempt` with its reason, never a silent gap. The
checks every stage gets without an entry's help (the structured trace, ``acted`` counters,
differential execution of each stage against its input) read ``autoparallel.pipeline`` directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

from torch import fx

from autoparallel.compile import SECOND_COMPILE
from autoparallel.partition import STEP_CLEANUP, STEP_FIRST_PARTITION, STEP_FSDP_TAGS
from autoparallel.pipeline import JOINT, PLAN, PLANNED_STAGES, Stage
from autoparallel.runtime.steps import Executor
from verify.graphs.invariants import merged, partitioned, regrouped, unchanged
from verify.stages import rank_context
from verify.stages.rank_context import RankContext

Graphs = fx.GraphModule | tuple[fx.GraphModule, fx.GraphModule]
Law = Callable[[str, Graphs, Graphs], list[str]]

EAGER = "eager"  # the reference executor of a parity world: every other executor is compared with it
Build = Callable[[RankContext, str], Executor]
# What a stage's golden slot shows (verify.goldens.catalog.golden_result).
OWN, ALONE, PLAN_TEXT = "own graphs", "the pass alone", "plan text"
GOLDENS = (OWN, ALONE, PLAN_TEXT)
# How the HTML page shows a stage (verify.commands.html.records.records_from_pipeline_run).
HTML_STAGE = "stage"  # one record: its graphs, golden and parity
HTML_PASS = "collective pass"  # a composed record (parity of the sequence on the last pass) and one "(alone)" with the golden
HTML_PLANNING = "plan section"  # no graphs: the plan's own section ahead of the stages (commands/html/plan_section.py)
HTML_SECTIONS = (HTML_STAGE, HTML_PASS, HTML_PLANNING)
COLLECTIVE_PASSES_EXECUTOR = "collective_passes"  # the collective passes composed, one executor

PASS_TESTS = "tests/unit/autoparallel/passes"


@dataclass(frozen=True)
class Exempt:
    """A check that does not apply to a stage, and why."""

    why: str


@dataclass(frozen=True)
class ParityRun:
    """How a parity rank runs a stage: ``name`` (what parity results are keyed by), ``build`` (a
    builder of ``verify.stages.rank_context``: the executor, from the rank's context and ``needs``),
    ``needs`` (the last pipeline stage whose graphs it takes); ``module``: it runs the pipeline's
    module, not graphs (a rank whose groups the module does not name re-runs the pipeline);
    ``compiled``: it runs the module the pipeline compiled (a recompile would test other graphs)."""

    name: str
    build: Build
    needs: str
    module: bool = False
    compiled: bool = False

    def executor(self, ctx: RankContext) -> Executor:
        return self.build(ctx, self.needs)


@dataclass(frozen=True)
class StageChecks:
    """How one stage is verified (see the module docstring)."""

    stage: Stage
    parity: ParityRun | Exempt
    planned_parity: str | Exempt
    conservation: Law | Exempt
    golden: str
    html: str
    mutation_tests: tuple[str, ...] | Exempt


def problems(entry: StageChecks) -> list[str]:
    """What ``entry`` is missing or gets wrong, each naming the stage and the field."""
    name = entry.stage.name
    out = []
    for f in fields(StageChecks):
        value = getattr(entry, f.name)
        if value is None or value == () or value == "" or (isinstance(value, Exempt) and not value.why):
            out.append(f"stage {name!r} has no {f.name} (give one, or Exempt(why))")
    if isinstance(entry.parity, ParityRun) and not callable(entry.parity.build):
        out.append(f"stage {name!r}: parity build {entry.parity.build!r} is not a builder (verify.stages.rank_context)")
    if entry.golden and entry.golden not in GOLDENS:
        out.append(f"stage {name!r}: golden {entry.golden!r} is not one of {GOLDENS}")
    if entry.html and entry.html not in HTML_SECTIONS:
        out.append(f"stage {name!r}: html {entry.html!r} is not one of {HTML_SECTIONS}")
    return out


def _stage(name: str) -> Stage:
    return next(s for s in PLANNED_STAGES if s.name == name)


def _collective_pass(name: str, law: Law, tests: tuple[str, ...]) -> StageChecks:
    return StageChecks(
        _stage(name),
        parity=ParityRun(COLLECTIVE_PASSES_EXECUTOR, rank_context.collective_passes, needs=SECOND_COMPILE),
        planned_parity=COLLECTIVE_PASSES_EXECUTOR,
        conservation=law,
        golden=ALONE,
        html=HTML_PASS,
        mutation_tests=(*tests, f"{PASS_TESTS}/test_random_order.py"),  # every pass runs keeping random order
    )


_NOT_A_LINES_TARGET = "its code is outside autoparallel/passes and autoparallel/planner, the --lines targets of the compile stack"
# The plan stage's code is a --lines target of its own, with its own tests: listed here, they would
# join the passes' run (mutation_tests of every stage) and re-run the planner per pass mutant.
_PLANNER_TARGET = "its code is autoparallel/planner: --target planner runs it against its own tests (lines.PLANNER_TESTS)"
_BUCKETING_PATCHES = (f"{PASS_TESTS}/test_contiguous_gathered_shards.py", f"{PASS_TESTS}/test_shared_provenance.py",
                      f"{PASS_TESTS}/test_reused_bucket_traces.py")

_ENTRIES = (
    StageChecks(
        _stage(PLAN),
        parity=Exempt("no graphs: a plan; hand-plan worlds have none"),
        planned_parity=EAGER,  # the plan's placements run eagerly are the planned world's reference
        conservation=Exempt("no graphs: its output is a plan"),
        golden=PLAN_TEXT,
        html=HTML_PLANNING,
        mutation_tests=Exempt(_PLANNER_TARGET),
    ),
    StageChecks(
        _stage(JOINT),
        parity=ParityRun(JOINT, rank_context.joint_graph, needs=JOINT),
        planned_parity=JOINT,
        conservation=Exempt("the trace: its input is the model, not a graph"),
        golden=OWN,
        html=HTML_STAGE,
        mutation_tests=Exempt(_NOT_A_LINES_TARGET),
    ),
    StageChecks(
        _stage(STEP_CLEANUP),
        parity=ParityRun(STEP_CLEANUP, rank_context.joint_graph, needs=STEP_CLEANUP),
        planned_parity=STEP_CLEANUP,
        conservation=unchanged,
        golden=OWN,
        html=HTML_STAGE,
        mutation_tests=(f"{PASS_TESTS}/test_cleanup.py",),
    ),
    StageChecks(
        _stage(STEP_FSDP_TAGS),
        parity=ParityRun(STEP_FSDP_TAGS, rank_context.joint_graph, needs=STEP_FSDP_TAGS),
        planned_parity=STEP_FSDP_TAGS,
        conservation=unchanged,
        golden=OWN,
        html=HTML_STAGE,
        mutation_tests=(f"{PASS_TESTS}/test_fsdp_recompute.py",),
    ),
    StageChecks(
        _stage(STEP_FIRST_PARTITION),
        parity=ParityRun(STEP_FIRST_PARTITION, rank_context.parallel_module, needs=STEP_FIRST_PARTITION, module=True),
        planned_parity=STEP_FIRST_PARTITION,
        conservation=partitioned,
        golden=OWN,
        html=HTML_STAGE,
        mutation_tests=Exempt(_NOT_A_LINES_TARGET),
    ),
    StageChecks(
        _stage(SECOND_COMPILE),
        parity=ParityRun(SECOND_COMPILE, rank_context.compiled_module, needs=SECOND_COMPILE, module=True, compiled=True),
        planned_parity=SECOND_COMPILE,
        conservation=unchanged,
        golden=OWN,
        html=HTML_STAGE,
        # the AC joint pass and the overlap-scheduling settings it installs live in passes/
        mutation_tests=(f"{PASS_TESTS}/test_ac_joint.py", f"{PASS_TESTS}/test_overlap_scheduling.py"),
    ),
    _collective_pass("fuse_chained_allgathers", regrouped, (f"{PASS_TESTS}/test_fuse_chained_allgathers.py",)),
    _collective_pass(
        "pre_overlap_bucketing",
        merged,
        (f"{PASS_TESTS}/test_pre_overlap_bucketing.py", f"{PASS_TESTS}/test_bucket_plan.py", *_BUCKETING_PATCHES),
    ),
    _collective_pass(
        "topo_span_bucketing",
        merged,
        (f"{PASS_TESTS}/test_topo_span_bucketing.py", f"{PASS_TESTS}/test_overlap_scheduling.py", *_BUCKETING_PATCHES),
    ),
)
#: Stage -> how it is verified, for every stage of PLANNED_STAGES (STAGES and the plan stage).
REGISTRY: Mapping[Stage, StageChecks] = {e.stage: e for e in _ENTRIES}


def is_joint(name: str) -> bool:
    """Whether ``name`` is the joint trace's stage: the first graph every rank makes, where a
    per-rank re-trace (verify.parity.retrace) compares the ranks' collectives before the rest."""
    return name == JOINT


def verification(stages: Sequence[Stage] = PLANNED_STAGES, registry: Mapping[Stage, StageChecks] = REGISTRY) -> tuple[StageChecks, ...]:
    """The entries of ``stages``, in order; ValueError naming every stage without an entry or
    with an incomplete one."""
    found = []
    for s in stages:
        if s not in registry:
            found.append(f"stage {s.name!r} has no entry in verify.stages.registry.REGISTRY (how it is verified: "
                         f"{', '.join(f.name for f in fields(StageChecks)[1:])})")
        else:
            found += problems(registry[s])
    if found:
        raise ValueError("; ".join(found))
    return tuple(registry[s] for s in stages)


def checks_named(name: str, stages: Sequence[Stage] = PLANNED_STAGES,
                 registry: Mapping[Stage, StageChecks] = REGISTRY) -> StageChecks:
    """The entry of the stage called ``name`` (results and goldens carry names); ValueError naming it."""
    for entry in verification(stages, registry):
        if entry.stage.name == name:
            return entry
    raise ValueError(f"no stage {name!r} in {[s.name for s in stages]}")


# --- what each surface reads ------------------------------------------------------------------------


def parity_executors(stages: Sequence[Stage], registry: Mapping[Stage, StageChecks] = REGISTRY) -> tuple[ParityRun, ...]:
    """The hand-plan executors of ``stages``, in stage order, each once (the collective passes share one)."""
    out: dict[str, ParityRun] = {}
    for e in verification(stages, registry):
        if isinstance(e.parity, ParityRun):
            out.setdefault(e.parity.name, e.parity)
    return tuple(out.values())


def last_needed(executors: Sequence[str], stages: Sequence[Stage] = PLANNED_STAGES,
                registry: Mapping[Stage, StageChecks] = REGISTRY) -> str | None:
    """The last stage of ``stages`` whose graphs one of ``executors`` takes (how far a parity
    world's pipeline must run); None where none takes any (the reference only)."""
    needs = {r.name: r.needs for r in parity_executors(stages, registry)}
    order = [s.name for s in stages]
    needed = [needs[e] for e in executors if e in needs]
    return max(needed, key=order.index) if needed else None


def build_executor(name: str, ctx: RankContext, stages: Sequence[Stage] = PLANNED_STAGES,
                   registry: Mapping[Stage, StageChecks] = REGISTRY) -> Executor:
    """The executor called ``name`` on the rank of ``ctx``: :data:`EAGER` (the context's
    reference) or a stage's; ValueError naming the known ones."""
    if name == EAGER:
        return ctx.eager()
    runs = {r.name: r for r in parity_executors(stages, registry)}
    if name not in runs:
        raise ValueError(f"unknown executor {name!r}; executors: {[EAGER, *runs]}")
    return runs[name].executor(ctx)


def planned_executors(stages: Sequence[Stage], registry: Mapping[Stage, StageChecks] = REGISTRY) -> tuple[str, ...]:
    """The executors of a ``plan="auto"`` parity world for ``stages``, in stage order, each once
    (the plan stage's, :data:`EAGER`, first; the collective passes share one)."""
    names = (e.planned_parity for e in verification(stages, registry) if not isinstance(e.planned_parity, Exempt))
    return tuple(dict.fromkeys(names))


def conservation_laws(stages: Sequence[Stage] = PLANNED_STAGES, registry: Mapping[Stage, StageChecks] = REGISTRY) -> dict[str, Law]:
    """Stage name -> its conservation law, for every stage of ``stages`` that has one."""
    return {e.stage.name: e.conservation for e in verification(stages, registry) if not isinstance(e.conservation, Exempt)}


#: The conservation law of each graph-in/graph-out stage (see verify.graphs.invariants).
CONSERVATION: dict[str, Law] = conservation_laws()
#: The stages whose input is no graph (the plan, the trace): no pass to run against its input.
WITHOUT_GRAPH_INPUT = frozenset(s.name for s in PLANNED_STAGES) - set(CONSERVATION)
#: The stages whose output is a plan, not graphs (their golden slot shows plan text).
PLANNING = frozenset(e.stage.name for e in _ENTRIES if e.golden == PLAN_TEXT)


def check_conservation(stage: str, before: Graphs, after: Graphs) -> list[str]:
    """Problems with stage ``stage``'s conservation law (ValueError for a stage without one)."""
    try:
        law = CONSERVATION[stage]
    except KeyError:
        raise ValueError(f"no conservation law for stage {stage!r}; laws: {sorted(CONSERVATION)}") from None
    return law(stage, before, after)


def golden_kinds(stages: Sequence[Stage], registry: Mapping[Stage, StageChecks] = REGISTRY) -> dict[str, str]:
    """Stage name -> what its golden slot shows (:data:`GOLDENS`), for every stage of ``stages``."""
    return {e.stage.name: e.golden for e in verification(stages, registry)}


def html_sections(stages: Sequence[Stage] = PLANNED_STAGES, registry: Mapping[Stage, StageChecks] = REGISTRY) -> dict[str, str]:
    """Stage name -> how the HTML page shows it (:data:`HTML_SECTIONS`)."""
    return {e.stage.name: e.html for e in verification(stages, registry)}


def mutation_tests(stages: Sequence[Stage] = PLANNED_STAGES, registry: Mapping[Stage, StageChecks] = REGISTRY) -> tuple[str, ...]:
    """The line-mutation tests of ``stages``' code, in stage order, each once."""
    out: dict[str, None] = {}
    for e in verification(stages, registry):
        if not isinstance(e.mutation_tests, Exempt):
            out.update(dict.fromkeys(e.mutation_tests))
    return tuple(out)
