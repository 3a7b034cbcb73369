"""A parameter's alias that only the backward reads is lowered in the backward (failure class 13a).

The planner reads a tensor with several users through an ``aten.alias``; a parameter's alias
copies the placeholder's AOT phase (``is_forward``). When ``eliminate_alias_round_trips`` rewires
the forward's consumers to the parameter itself (they want its placement), the alias is left
with backward consumers only, and the lowering sinks it to its first one, in the backward
(mobilebert's NoNorm weight: ``x * w + b``, read again by ``grad * w``). Its collectives were
tagged forward there, so AOT's default partitioner counted every backward node before them as
forward and failed ("Node view_84 was invalid, but is output"). The model here is our own
(a Linear, a NoNorm, a Linear); the rewiring is made by a stage ahead of ``joint`` that does
to the plan what the round-trip pass did to mobilebert's, and places the alias replicated
(the weight pinned sharded), so the test does not hang on the ILP choosing a round trip.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from autoparallel import meta as M
from autoparallel import pipeline as P
from autoparallel.parallelize import ParallelPlan
from autoparallel.planner.graph import ALIAS
from autoparallel.planner.lower import sink_placeholder_aliases

MESH = "dp=2,tp=2"
FWD, BWD = "is_forward", "is_backward"


class NoNormMLP(nn.Module):
    """16 -> 16 -> NoNorm (``x * w + b``, w read by forward and backward) -> 8."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 16, bias=False)
        self.weight = nn.Parameter(torch.ones(16))
        self.bias = nn.Parameter(torch.zeros(16))
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.down(self.up(x) * self.weight + self.bias)


def _weight_alias(pg) -> fx.Node:
    ph = next(n for n in pg.graph.find_nodes(op="placeholder") if n.meta.get(M.ROLE) == "param:weight")
    (alias,) = [u for u in ph.users if u.target is ALIAS]
    return alias


def _rewire_forward_reads(state) -> tuple[None, list[str]]:
    """What eliminate_alias_round_trips does to mobilebert's NoNorm weight: the forward's
    consumers of the parameter's alias read the parameter, the backward's keep the alias."""
    pg, plan = state.planned.pg, state.planned.solution
    alias = _weight_alias(pg)
    param = alias.args[0]
    entry = plan.nodes[pg.keys[alias.name]]
    entry.out[0] = entry.ins[0] = {"dp": "R", "tp": "R"}  # gathered by the alias (any plan that moves it)
    assert plan.nodes[pg.keys[param.name]].out[0] != entry.out[0], "the alias must move the weight"
    rewired = [u.name for u in list(alias.users) if u.meta.get(M.PARTITIONER_TAG) == FWD]
    for user in list(alias.users):
        if user.meta.get(M.PARTITIONER_TAG) == FWD:
            user.replace_input_with(alias, param)
    assert rewired and alias.users, "the weight's alias keeps backward users only"
    pg.gm.recompile()
    return None, rewired


REWIRE = P.Stage("rewire_forward_reads", _rewire_forward_reads, "test: forward reads of the weight's alias read the weight")


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


@pytest.fixture(scope="module")
def partitioned():
    with torch.device("meta"):
        model = NoNormMLP()
    plan = ParallelPlan.auto(pins={"weight": "dp:S(0),tp:R", "bias": "dp:S(0),tp:R"})
    stages = P.insert_stage(P.stages_for(plan), REWIRE, before=P.JOINT)
    return P.run_pipeline(model, lambda out, t: ((out - t) ** 2).mean(), _batch(), plan, MESH, P.PipelineOptions(),
                          stages=stages, until="first_partition", trace=None)


def test_a_backward_only_alias_of_a_parameter_is_gathered_in_the_backward(partitioned):
    """Before the fix, the first partition raised "Node ... was invalid, but is output"."""
    joint = partitioned.stage(P.JOINT).graphs
    serves = [n for n in joint.graph.nodes
              if n.op == "call_function" and "all_gather" in str(n.target)
              and (n.meta.get(M.CUSTOM) or {}).get(M.PLANNED_NODE, "").startswith("param:weight/alias")]
    assert serves and all(n.meta[M.PARTITIONER_TAG] == BWD for n in serves)
    fw, bw = partitioned.stage("first_partition").graphs
    gathers = [n.name for n in bw.graph.nodes if n.name in {s.name for s in serves}]
    assert gathers and not any(n.name in gathers for n in fw.graph.nodes)


def _aliased_graph(first_tag: str) -> tuple[fx.Graph, fx.Node]:
    g = fx.Graph()
    w, x = g.placeholder("w"), g.placeholder("x")
    w.meta[M.PARTITIONER_TAG] = FWD
    a = g.call_function(ALIAS, (w,))
    a.meta[M.PARTITIONER_TAG] = FWD  # copied from the placeholder (planner/graph.py insert_aliases)
    n1 = g.call_function(torch.ops.aten.neg.default, (x,))
    n1.meta[M.PARTITIONER_TAG] = FWD
    n2 = g.call_function(torch.ops.aten.mul.Tensor, (n1, a))
    n2.meta[M.PARTITIONER_TAG] = first_tag
    n3 = g.call_function(torch.ops.aten.mul.Tensor, (n2, a))
    n3.meta[M.PARTITIONER_TAG] = BWD
    g.output((n3,))
    return g, a


@pytest.mark.parametrize("first_tag", [FWD, BWD])
def test_a_sunk_alias_takes_its_first_users_phase(first_tag):
    """Backward first user: backward; a forward first user keeps it forward (no blanket retag)."""
    g, a = _aliased_graph(first_tag)
    assert sink_placeholder_aliases(g) == 1
    assert a.meta[M.PARTITIONER_TAG] == first_tag
    assert next(iter(a.users)).meta[M.PARTITIONER_TAG] == first_tag and a.next in a.users
