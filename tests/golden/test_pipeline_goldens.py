"""Goldens of every pipeline stage: a change to tracing or a pass shows up as a text diff.

Scenarios and golden slots come from verify.goldens.catalog, the stage list from
autoparallel.pipeline; the report uses both too. Regenerate with `python -m verify goldens --update`
and review the diff.
"""

import pytest

from verify.goldens.catalog import (
    ALL_SCENARIOS,
    GOLDEN_SCENARIOS,
    counts_text,
    golden_result,
    golden_run,
    golden_slots,
    order_text,
    stage_text,
)


def _grouped(sids):
    # One xdist worker per scenario (the report test joins its group): the pipeline is built
    # once per process (the shared_pipeline_runs fixture).
    return [pytest.param(sid, marks=pytest.mark.xdist_group(sid)) for sid in sorted(sids)]


@pytest.mark.parametrize(
    ("sid", "stage"),
    [pytest.param(sid, stage, id=f"{sid}-{stage}", marks=pytest.mark.xdist_group(sid)) for sid, stage in golden_slots()],
)
def test_stage_graph(sid, stage, golden, shared_pipeline_runs):
    golden.check_text(stage_text(sid, golden_result(golden_run(sid), stage)))


@pytest.mark.parametrize("sid", _grouped(GOLDEN_SCENARIOS))
def test_collective_pass_order(sid, golden, shared_pipeline_runs):
    golden.check_text(order_text(sid, golden_run(sid)))


@pytest.mark.parametrize("sid", _grouped(ALL_SCENARIOS))
def test_collective_counts(sid, golden, shared_pipeline_runs):
    golden.check_text(counts_text(sid, golden_run(sid)))
