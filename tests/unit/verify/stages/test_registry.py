"""verify.stages.registry: every stage has one entry, and every verification surface reads it.

A toy stage added to a copy of the stage list is either picked up by each surface (parity
executors, conservation laws, golden slots, HTML sections, line-mutation tests) once it has an
entry, or makes that surface fail with an error naming the stage and what it lacks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autoparallel.compile import SECOND_COMPILE
from autoparallel.pipeline import PLANNED_STAGES, STAGES, Stage, insert_stage, report_acted
from verify.commands.html import records_from_pipeline_run
from verify.commands.mutation.lines import SHARED_TESTS, default_test_paths
from verify.goldens import catalog
from verify.graphs.invariants import unchanged
from verify.parity import planned, runs
from verify.stages import rank_context
from verify.stages import registry as R

TOY = Stage("toy_pass", lambda state: (state.graphs, None), "a toy pass", acted=report_acted)
TOY_STAGES = insert_stage(STAGES, TOY, before=SECOND_COMPILE)
TOY_TESTS = ("tests/unit/autoparallel/passes/test_toy_pass.py",)


def _toy_entry(**change) -> R.StageChecks:
    fields = dict(
        parity=R.ParityRun("toy_pass", rank_context.joint_graph, needs="toy_pass"),
        planned_parity=R.Exempt("a toy"),
        conservation=unchanged,
        golden=R.OWN,
        html=R.HTML_STAGE,
        mutation_tests=TOY_TESTS,
    )
    return R.StageChecks(TOY, **{**fields, **change})


def _with_toy(**change) -> dict[Stage, R.StageChecks]:
    return {**R.REGISTRY, TOY: _toy_entry(**change)}


def test_every_stage_of_the_pipeline_has_a_complete_entry():
    assert [e.stage for e in R.verification(PLANNED_STAGES)] == list(PLANNED_STAGES)
    assert set(R.REGISTRY) == set(PLANNED_STAGES), "an entry for a stage the pipeline does not run"
    assert [p for e in R.REGISTRY.values() for p in R.problems(e)] == []


# Each surface, asked about the toy stage without an entry: an error naming it.
SURFACES = {
    "parity": lambda stages, reg: R.parity_executors(stages, reg),
    "planned parity": lambda stages, reg: R.planned_executors(stages, reg),
    "conservation": lambda stages, reg: R.conservation_laws(stages, reg),
    "golden slot": lambda stages, reg: catalog.golden_stage_names(stages, reg),
    "html": lambda stages, reg: R.html_sections(stages, reg),
    "line mutation": lambda stages, reg: default_test_paths(stages, reg),
}


@pytest.mark.parametrize("surface", SURFACES)
def test_a_stage_without_an_entry_fails_every_surface_naming_it(surface):
    with pytest.raises(ValueError, match=r"stage 'toy_pass' has no entry in verify.stages.registry.REGISTRY"):
        SURFACES[surface](TOY_STAGES, R.REGISTRY)


def test_a_stage_with_an_entry_is_picked_up_by_every_surface():
    reg = _with_toy()
    assert [e.name for e in R.parity_executors(TOY_STAGES, reg)] == [
        "joint", "cleanup", "fsdp_tagging", "first_partition", "toy_pass", "second_compile", "collective_passes"]
    assert R.parity_executors(TOY_STAGES, reg)[4].build is rank_context.joint_graph
    planned_toy = insert_stage(PLANNED_STAGES, TOY, before=SECOND_COMPILE)
    assert R.planned_executors(planned_toy, reg) == planned.EXECUTORS
    at = planned.EXECUTORS.index(SECOND_COMPILE)
    assert R.planned_executors(planned_toy, _with_toy(planned_parity="toy_pass")) == (
        *planned.EXECUTORS[:at], "toy_pass", *planned.EXECUTORS[at:])
    assert R.conservation_laws(TOY_STAGES, reg)["toy_pass"] is unchanged
    assert catalog.golden_stage_names(TOY_STAGES, reg) == (*catalog.GRAPH_GOLDEN_STAGES[:4], "toy_pass",
                                                          *catalog.GRAPH_GOLDEN_STAGES[4:])
    assert R.html_sections(TOY_STAGES, reg)["toy_pass"] == R.HTML_STAGE
    assert TOY_TESTS[0] in default_test_paths(TOY_STAGES, reg) and TOY_TESTS[0] not in default_test_paths()
    assert default_test_paths(TOY_STAGES, reg)[-len(SHARED_TESTS):] == SHARED_TESTS


@pytest.mark.parametrize("field", ["parity", "planned_parity", "conservation", "golden", "html", "mutation_tests"])
def test_an_entry_missing_a_check_fails_naming_the_stage_and_the_check(field):
    with pytest.raises(ValueError, match=rf"stage 'toy_pass' has no {field} \(give one, or Exempt\(why\)\)"):
        R.verification(TOY_STAGES, _with_toy(**{field: None}))


def test_an_exemption_needs_a_reason_and_kinds_must_be_known():
    with pytest.raises(ValueError, match="stage 'toy_pass' has no conservation"):
        R.verification(TOY_STAGES, _with_toy(conservation=R.Exempt("")))
    with pytest.raises(ValueError, match="parity build 'joint graph' is not a builder"):
        R.verification(TOY_STAGES, _with_toy(parity=R.ParityRun("toy_pass", "joint graph", needs="toy_pass")))
    with pytest.raises(ValueError, match="golden 'own' is not one of"):
        R.verification(TOY_STAGES, _with_toy(golden="own"))
    with pytest.raises(ValueError, match="html 'page' is not one of"):
        R.verification(TOY_STAGES, _with_toy(html="page"))


def test_the_surfaces_read_the_registry():
    """What each consumer holds is what the registry gives for the pipeline's stages."""
    assert runs.STAGE_EXECUTORS == (R.EAGER, *(e.name for e in R.parity_executors(STAGES)))
    assert runs.COMPILE_EXECUTORS == (R.EAGER, *(e.name for e in R.parity_executors(STAGES) if e.module))
    assert planned.EXECUTORS == R.planned_executors(PLANNED_STAGES) and planned.EXECUTORS[0] == R.EAGER
    assert set(R.CONSERVATION) == {s.name for s in STAGES} - {"joint"}
    assert catalog.GRAPH_GOLDEN_STAGES == tuple(s.name for s in STAGES)
    assert set(default_test_paths()) >= {t for e in R.REGISTRY.values() if isinstance(e.mutation_tests, tuple)
                                         for t in e.mutation_tests}


def test_html_records_refuse_a_run_with_a_stage_the_registry_does_not_know():
    run = SimpleNamespace(names=["joint", "toy_pass"], results=[], alternatives=[])
    with pytest.raises(ValueError, match=r"stage\(s\) \['toy_pass'\] have no entry in verify.stages.registry"):
        records_from_pipeline_run(run, goldens=False)


def _toy_context(**kw) -> rank_context.RankContext:
    return rank_context.RankContext(mesh=None, params={}, buffers={}, batches=[], eager=lambda: "the reference", **kw)


def test_an_executor_is_built_by_its_entry_from_the_rank_context():
    """The registry dispatches: a name is the context's reference or its stage entry's build, and
    the toy stage's executor is what its entry's builder makes of the context and ``needs``."""
    seen = []
    reg = _with_toy(parity=R.ParityRun("toy_pass", lambda ctx, needs: seen.append((ctx, needs)) or "toy", needs="cleanup"))
    ctx = _toy_context()
    assert R.build_executor(R.EAGER, ctx, TOY_STAGES, reg) == "the reference"
    assert R.build_executor("toy_pass", ctx, TOY_STAGES, reg) == "toy" and seen == [(ctx, "cleanup")]
    with pytest.raises(ValueError, match=r"unknown executor 'nope'; executors: \['eager', 'joint'"):
        R.build_executor("nope", ctx, TOY_STAGES, reg)
    with pytest.raises(ValueError, match="stage 'toy_pass' has no entry"):
        R.build_executor("joint", ctx, TOY_STAGES, R.REGISTRY)
