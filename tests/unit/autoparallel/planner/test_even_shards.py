"""autoparallel.planner.even_shards: plans that run keep only shards that divide evenly.

On a model with a 3-output head on dp=2: the candidates still list the padded Shard(0) of the
3-entry bias (hand plans are priced with it), the filter masks it out, the default budget is
the smallest *allowed* bytes, a pin to it is refused naming the parameter, and a padded plan made
with the filter off is refused by the lowering, naming the node and its key.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autoparallel import pipeline as P
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.planner import PlannerConfig, plan_model
from autoparallel.planner.even_shards import even_masks, param_bytes_floor, with_even_shards
from autoparallel.planner.lower import LoweringError
from autoparallel.planner.problem import min_param_bytes


class _Head3(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _model_and_batch():
    with torch.device("meta"):
        model = _Head3()
    return model, (torch.randn(4, 8), torch.randint(0, 3, (4,)))


@pytest.fixture(scope="module")
def planned():
    model, batch = _model_and_batch()
    with fake_world("dp=2") as mesh:
        return plan_model(model, mesh, batch, F.cross_entropy)


def test_the_padded_candidate_exists_but_is_masked_out(planned):
    graph = planned._context.graph
    bias = graph.by_key()["param:fc2.bias"]
    outs = [c.outs[0] for c in bias.candidates]
    assert outs == [(Replicate(),), (Shard(0),)]  # Shard(0) of 3 rows on 2 ranks: padded
    masks = even_masks(graph)
    assert masks[bias.index].tolist() == [True, False]
    assert graph.by_key()["param:fc1.bias"].index not in masks  # 16 divides: nothing masked
    assert planned.params["fc2.bias"] == {"dp": "R"}


def test_the_default_budget_is_the_smallest_allowed_bytes(planned):
    graph = planned._context.graph
    masks = with_even_shards(graph, {})
    assert param_bytes_floor(graph, masks) == min_param_bytes(graph) + (3 - 2) * 4  # 3 entries, not a padded 2
    assert planned.param_memory_bytes == param_bytes_floor(graph, masks)


def test_a_pin_to_an_uneven_placement_is_refused_naming_it():
    model, batch = _model_and_batch()
    with fake_world("dp=2") as mesh, pytest.raises(ValueError, match=r"pin of param:fc2.bias: its placement does not divide \(3,\) evenly on mesh \{'dp': 2\}"):
        plan_model(model, mesh, batch, F.cross_entropy, PlannerConfig(pins={"fc2.bias": "dp:S(0)"}))


def test_with_even_shards_keeps_a_pin_that_is_even():
    mask = np.array([False, True])
    model, batch = _model_and_batch()
    with fake_world("dp=2") as mesh:
        plan = plan_model(model, mesh, batch, F.cross_entropy, PlannerConfig(pins={"fc1.bias": "dp:S(0)"}))
    graph = plan._context.graph
    i = graph.by_key()["param:fc1.bias"].index
    assert with_even_shards(graph, {i: mask})[i].tolist() == mask.tolist()
    assert plan.params["fc1.bias"] == {"dp": "S(0)"}


def test_a_padded_plan_made_with_the_filter_off_is_refused_by_the_lowering():
    model, batch = _model_and_batch()
    with fake_world("dp=2") as mesh:
        plan = plan_model(model, mesh, batch, F.cross_entropy, PlannerConfig(pins={"fc2.bias": "dp:S(0)"}, even_shards=False))
    assert plan.params["fc2.bias"] == {"dp": "S(0)"}  # priced like FSDP2's padded shard
    with pytest.raises(LoweringError, match=r"node '\w+' \(param:fc2.bias\): placement \(Shard\(dim=0\),\) does not divide "
                                            r"its shape \(3,\) evenly on mesh \{'dp': 2\}"):
        P.run_pipeline(model, F.cross_entropy, batch, ParallelPlan.auto(solution=plan), "dp=2", P.PipelineOptions(), until=P.JOINT)
