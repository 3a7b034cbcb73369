"""autoparallel.gc_pauses: the collector's thresholds raised inside, restored after, a caller's
own choice kept; the pipeline, the planner and the graph trainer build their graphs inside."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoparallel import pipeline as P
from autoparallel.gc_pauses import GRAPH_BUILDING_THRESHOLDS, fewer_collections
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.planner import plan_model
from autoparallel.trainer import trace_train_step


@pytest.fixture
def thresholds():
    """The process's thresholds, put back whatever a test does. Automatic collection is off
    meanwhile (only the thresholds are under test): at CPython's defaults, which these tests set
    as a caller's, the first allocations started a full collection of the session's heap, every
    shared pipeline run included (1.4 s of a one-process run of the tier, profiled)."""
    old, enabled = gc.get_threshold(), gc.isenabled()
    gc.disable()
    yield old
    gc.set_threshold(*old)
    if enabled:
        gc.enable()


def test_raised_inside_and_restored_after_also_on_error(thresholds):
    gc.set_threshold(700, 10, 10)
    with fewer_collections():
        assert gc.get_threshold() == GRAPH_BUILDING_THRESHOLDS
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(RuntimeError, match="boom"), fewer_collections():
        raise RuntimeError("boom")
    assert gc.get_threshold() == (700, 10, 10)


def test_a_callers_higher_thresholds_and_a_switched_off_collector_are_kept(thresholds):
    gc.set_threshold(50_000, 5, 1_000)
    with fewer_collections():
        assert gc.get_threshold() == (50_000, 10, 1_000)
        with fewer_collections((1, 1, 1)):  # nests: never lowers
            assert gc.get_threshold() == (50_000, 10, 1_000)
    assert gc.get_threshold() == (50_000, 5, 1_000)
    gc.set_threshold(0, 10, 10)  # threshold 0 switches automatic collection off
    with fewer_collections():
        assert gc.get_threshold()[0] == 0
    assert gc.get_threshold() == (0, 10, 10)


def test_the_pipeline_builds_every_stage_with_fewer_collections(thresholds, mlp):
    gc.set_threshold(700, 10, 10)
    make_model, loss = mlp
    seen = []
    g = torch.Generator().manual_seed(0)
    P.run_pipeline(make_model(), loss, (torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)),
                   ParallelPlan.fsdp("dp"), "dp=2", until=P.STAGE_NAMES[1],
                   observers=[lambda r: seen.append((r.name, gc.get_threshold()))])
    assert seen == [(name, GRAPH_BUILDING_THRESHOLDS) for name in P.STAGE_NAMES[:2]]
    assert gc.get_threshold() == (700, 10, 10)


class _SeesThresholds(nn.Module):
    """Records the collector's thresholds in ``seen`` each time its forward runs (tracing runs
    it; the list is shared with the copies the planner traces)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.seen = _Shared()

    def forward(self, x):
        self.seen.append(gc.get_threshold())
        return self.lin(x)


class _Shared(list):
    def __deepcopy__(self, memo):
        return self


def test_the_graph_trainer_traces_with_fewer_collections(thresholds):
    gc.set_threshold(700, 10, 10)
    model = _SeesThresholds()
    trace_train_step(model, F.mse_loss, (torch.randn(3, 4), torch.randn(3, 2)))
    assert model.seen and set(model.seen) == {GRAPH_BUILDING_THRESHOLDS}
    assert gc.get_threshold() == (700, 10, 10)


def test_the_planner_traces_and_solves_with_fewer_collections(thresholds):
    gc.set_threshold(700, 10, 10)
    model = _SeesThresholds()
    with fake_world("dp=2") as mesh:
        plan_model(model, mesh, (torch.randn(4, 4), torch.randn(4, 2)), F.mse_loss)
    assert model.seen and set(model.seen) == {GRAPH_BUILDING_THRESHOLDS}
    assert gc.get_threshold() == (700, 10, 10)
