"""Memory over the step in the planner: parameters, activations and gradients, a peak budget.

The model is not LLaMA (conftest's ``layernorm_mlp``: LayerNorm, biased Linears, GELU, a residual,
MSE; a hidden layer of 256 so activations matter). The planner's count of live bytes is checked against
``verify.graphs.stats.static_peak_bytes``, which shares no code with it, on the all-replicated
assignment (every rank holds the whole program: the unsharded graph's own peak).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate

from autoparallel.mesh import MeshSpec, fake_world
from autoparallel.planner import InfeasiblePlanError, Planner, PlannerConfig, api, memory
from autoparallel.planner.memory import lifetimes, peak_of
from autoparallel.planner.profile import get_profile
from verify.graphs.stats import static_peak_bytes

pytestmark = pytest.mark.xdist_group("planner-peak")
UNBOUNDED = float("inf")  # parameters may stay replicated: only the peak budget bounds memory
HIDDEN = 256


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)


@pytest.fixture(scope="module")
def planned(layernorm_mlp):
    """(planner, mesh spec, unbudgeted plan) on a fake dp=2 world."""
    make_model, mse = layernorm_mlp
    spec = MeshSpec.parse("dp=2")
    with fake_world(spec) as mesh:
        planner = Planner.for_config(make_model(hidden=HIDDEN), mesh, inputs(), mse, PlannerConfig(), description="wide mlp")
        free = planner.plan(mesh, PlannerConfig(memory_budget=UNBOUNDED))
    return planner, spec, free


def _plan(planned, **config):
    planner, spec, _ = planned
    with fake_world(spec) as mesh:
        return planner.plan(mesh, PlannerConfig(memory_budget=UNBOUNDED, **config))


def _graph(planned):
    planner, spec, _ = planned
    with fake_world(spec) as mesh:
        graph, _, _ = planner.graph(mesh, get_profile(None), lambda msg: None)
    return graph


def test_live_bytes_of_the_replicated_assignment_are_the_unsharded_graphs_static_peak(planned):
    graph = _graph(planned)
    replicated = []
    for pn in graph.nodes:
        js = [j for j, c in enumerate(pn.candidates) if all(o is None or all(isinstance(p, Replicate) for p in o) for o in c.outs)]
        assert js, f"{pn.key}: no replicated candidate"
        replicated.append(js[0])
    peak, at = peak_of(graph, replicated)
    assert peak == static_peak_bytes(planned[0].pg.gm) > 0, at
    # gradients are held to the end of the step, parameters through all of it
    lt = lifetimes(graph)
    last = len(graph.nodes) - 1
    for pn in graph.params():
        assert lt.first[pn.index] == 0 and lt.last[pn.index] == last


def test_every_plan_reports_its_peak_and_where_it_happens(planned):
    free = planned[2]
    assert free.peak["bytes"] > free.param_memory_bytes > 0
    assert free.peak["at"] in free.nodes or free.peak["at"].startswith(("param:", "input:", "tangent:"))
    assert "peak memory" in free.summary() and free.peak["budget_bytes"] is None


def test_a_peak_budget_changes_the_plan_and_the_plan_respects_it(planned):
    free = planned[2]
    budget = free.peak["bytes"] - 1
    tight = _plan(planned, peak_memory_budget=budget)
    assert tight.peak["bytes"] <= budget < free.peak["bytes"]
    assert tight.params != free.params or tight.nodes != free.nodes
    assert tight.objective_us >= free.objective_us  # the budget only removes plans
    assert f"budget {int(budget)} bytes" in tight.text()
    # a budget the unbudgeted plan meets leaves it alone
    loose = _plan(planned, peak_memory_budget=free.peak["bytes"])
    assert loose.params == free.params and loose.objective_us == pytest.approx(free.objective_us)


def test_an_impossible_peak_budget_names_its_constraint_group(planned):
    with pytest.raises(InfeasiblePlanError, match="peak_memory") as err:
        _plan(planned, peak_memory_budget=1024.0)
    assert err.value.group == "peak_memory"
    with pytest.raises(ValueError, match="peak memory budget"):
        _plan(planned, peak_memory_budget=-1.0)


def test_peak_rows_bound_every_point_not_only_the_last(planned):
    """Dropping every row but one (the last point's) lets a plan over the budget through: the rows
    at earlier points are what bound the forward's activations."""
    free = planned[2]
    budget = free.peak["bytes"] - 1
    rows = memory.peak_rows

    def last_row_only(graph, class_of):
        return rows(graph, class_of)[-1:]

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(api, "peak_rows", last_row_only)
        blind = _plan(planned, peak_memory_budget=budget)
    finally:
        mp.undo()
    assert blind.peak["bytes"] > budget
