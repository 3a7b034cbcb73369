"""plan="auto" on layers whose sizes do not divide the mesh: every rank lowers the same program.

Hypothesis draws two Linear layers (batch rows, in, hidden and out features in 1..7) and a mesh
(tp=2, dp=2, dp=2,tp=2); the planner plans them on a fake world, and the plan is lowered on
every rank of that world (lowered graphs are rank-specific). The ranks' joint graphs must issue
the same collectives (op, mesh dim, sizes, dtypes: ``check_agreement``) and be the same program
up to the piece a local split keeps (``structure_disagreement``): every later pass then decides
alike on every rank. The negative test puts the planner's padded ``Shard(0)`` back (what
``autoparallel.planner.even_shards`` keeps out) and watches the same check fail on a 3-output
head (rank 2's bias pads before its gather, rank 0's does not).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import autoparallel.planner.api as api
import autoparallel.planner.lower as lower
from autoparallel.mesh import MeshSpec, fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.pipeline import run_pipeline
from autoparallel.planner.auto import plan_for_pipeline
from autoparallel.planner.problem import min_param_bytes
from verify.graphs.collective_agreement import check_agreement, rank_calls, structure_disagreement

MESHES = ("tp=2", "dp=2", "dp=2,tp=2")


class _TwoLayers(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _lowered_on_every_rank(rows: int, d_in: int, hidden: int, d_out: int, mesh_spec: str):
    """The plan made on rank 0 of a fake world, lowered on each of its ranks: their joint graphs."""
    with torch.device("meta"):
        model = _TwoLayers(d_in, hidden, d_out)
    batch = (torch.randn(rows, d_in), torch.randint(0, d_out, (rows,)))
    spec = MeshSpec.parse(mesh_spec)
    with fake_world(spec) as mesh:
        planned = plan_for_pipeline(model, F.cross_entropy, batch, mesh, ParallelPlan.auto())
        planned.pg.joint.close()
    graphs = []
    for rank in range(spec.world_size):
        with fake_world(spec, rank=rank) as mesh:
            run = run_pipeline(model, F.cross_entropy, batch, ParallelPlan.auto(solution=planned.solved), mesh, until="joint")
            graphs.append(run.stage("joint").graphs)
    return planned.solved, graphs


def _assert_same_program(graphs) -> None:
    check_agreement([rank_calls([("joint", g)]) for g in graphs])
    diff = structure_disagreement(graphs)
    assert diff is None, diff


sizes = st.integers(1, 7)


@settings(max_examples=12)  # each example plans and lowers on up to 4 ranks (~0.5 s); the tier is near its budget
@given(rows=sizes, d_in=sizes, hidden=sizes, d_out=sizes, mesh=st.sampled_from(MESHES))
def test_every_rank_lowers_the_same_collectives_and_program(rows, d_in, hidden, d_out, mesh):
    plan, graphs = _lowered_on_every_rank(rows, d_in, hidden, d_out, mesh)
    _assert_same_program(graphs)


def test_uneven_shards_put_back_lower_a_different_program_per_rank(monkeypatch):
    """The check fails where the planner may pad: padded Shard(0) allowed again (and the
    lowering's refusal of it switched off), the 3-entry head bias is sharded unevenly."""
    monkeypatch.setattr(api, "with_even_shards", lambda graph, pins: pins)
    monkeypatch.setattr(api, "param_bytes_floor", lambda graph, pins: min_param_bytes(graph))
    monkeypatch.setattr(lower, "_check_even", lambda *a: None)
    plan, graphs = _lowered_on_every_rank(4, 8, 16, 3, "dp=2,tp=2")
    assert plan.params["fc2.bias"] == {"dp": "S(0)", "tp": "S(0)"}  # 3 entries over 4 ranks: padded
    with pytest.raises(AssertionError, match=r"rank [1-3] has (slice|constant_pad_nd)"):  # a narrow or pad only some ranks have
        _assert_same_program(graphs)
