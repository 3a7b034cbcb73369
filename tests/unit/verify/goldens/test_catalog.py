"""Every pipeline stage has its golden slots, and the golden files for them exist.

A stage added to autoparallel.pipeline.STAGES without goldens fails here (and its golden test
fails "missing"): the checklist in ARCHITECTURE.md asks for a golden per stage.
"""

from pathlib import Path

from autoparallel.passes.collective import COLLECTIVE_PASS_NAMES
from autoparallel.pipeline import STAGE_NAMES
from verify.goldens import catalog

ROOT = Path(__file__).resolve().parents[4]


def missing_goldens(stages) -> list[str]:
    """Golden files the catalog's slots need for ``stages`` that do not exist (relative paths)."""
    want = [(catalog.STAGE_TEST, f"{sid}-{s}") for sid in catalog.GOLDEN_SCENARIOS for s in stages]
    want += [(catalog.ORDER_TEST, sid) for sid in catalog.GOLDEN_SCENARIOS]
    want += [(catalog.COUNTS_TEST, sid) for sid in catalog.ALL_SCENARIOS]
    paths = [catalog.golden_path(ROOT, test, pid) for test, pid in want]
    return [str(p.relative_to(ROOT)) for p in paths if not p.is_file()]


def test_every_stage_has_a_graph_golden_slot():
    assert catalog.GRAPH_GOLDEN_STAGES == STAGE_NAMES


def test_every_golden_file_exists():
    assert missing_goldens(STAGE_NAMES) == []


def test_a_stage_without_golden_files_is_reported():
    assert missing_goldens(["a_new_pass"]) == [
        f"goldens/golden/test_pipeline_goldens/test_stage_graph[{sid}-a_new_pass].txt"
        for sid in catalog.GOLDEN_SCENARIOS
    ]


def test_collective_pass_graph_goldens_show_the_pass_alone():
    class Run:
        def alternative(self, name):
            return ("alone", name)

        def stage(self, name):
            return ("stage", name)

    assert catalog.golden_result(Run(), COLLECTIVE_PASS_NAMES[0]) == ("alone", COLLECTIVE_PASS_NAMES[0])
    assert catalog.golden_result(Run(), STAGE_NAMES[0]) == ("stage", STAGE_NAMES[0])
