"""Strided shards in the planner (autoparallel.planner.strided): the FSDP-order variants, the block
layout they mean, their text form, their candidates (only for a pin), their prices and the hand
plan's pins. The moves themselves are checked against DTensor in
tests/property/test_strided_moves_properties.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from autoparallel.mesh import MeshSpec, fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.planner import get_profile
from autoparallel.planner.api import hand_plan_pins
from autoparallel.planner.costs import ALL_GATHER, REDUCE_SCATTER, CostModel
from autoparallel.planner.lower import shard_tensor
from autoparallel.planner.solution import parse_placement, placement_text
from autoparallel.planner.strategies import placeholder_candidates, tensor_meta
from autoparallel.planner.strided import has_strided, nesting, piece, strided_variants

SS = _StridedShard


def test_the_fsdp_order_variant_strides_every_mesh_dim_a_later_one_shards_too():
    assert strided_variants((Shard(0), Shard(0)), (2, 4)) == [(SS(0, split_factor=4), Shard(0))]
    assert strided_variants((Shard(0), Shard(0), Shard(0)), (2, 3, 4)) == [(SS(0, split_factor=12), SS(0, split_factor=4), Shard(0))]
    assert strided_variants((Shard(0), Replicate(), Shard(0)), (2, 3, 4)) == [(SS(0, split_factor=4), Replicate(), Shard(0))]
    assert strided_variants((Shard(0), Shard(1)), (2, 2)) == []
    assert strided_variants((Replicate(), Shard(0)), (2, 2)) == []
    assert strided_variants((SS(0, split_factor=2), Shard(0)), (2, 2)) == []


def test_the_strided_layout_is_the_fsdp_shard_of_the_tp_shard():
    """Rank (dp i, tp j) of a 2x2 mesh holds row block 2j + i strided, 2i + j plain."""
    full = torch.arange(8).reshape(8, 1)
    for i in range(2):
        for j in range(2):
            assert piece(full, (SS(0, split_factor=2), Shard(0)), (2, 2), (i, j)).flatten().tolist() == [2 * (2 * j + i), 2 * (2 * j + i) + 1]
            assert piece(full, (Shard(0), Shard(0)), (2, 2), (i, j)).flatten().tolist() == [2 * (2 * i + j), 2 * (2 * i + j) + 1]
    assert nesting((SS(0, split_factor=6), SS(0, split_factor=3), Shard(0)), (2, 2, 3), 0) == [2, 1, 0]
    assert nesting((Shard(0), Replicate(), Shard(0)), (2, 2, 3), 0) == [0, 2]


@pytest.mark.parametrize("bad", [(SS(0, split_factor=3), Shard(0)), (Shard(0), SS(0, split_factor=2)), (SS(0, split_factor=2), SS(0, split_factor=2))])
def test_a_strided_order_the_planner_does_not_lay_out_is_refused(bad):
    with pytest.raises(ValueError, match="is sharded in an order this planner does not lay out"):
        piece(torch.zeros(8), bad, (2, 2), (0, 0))


def test_an_uneven_strided_piece_is_refused():
    with pytest.raises(ValueError, match="does not divide by 4"):
        piece(torch.zeros(6), (SS(0, split_factor=2), Shard(0)), (2, 2), (0, 0))


def test_shard_tensor_keeps_the_strided_piece_of_this_rank():
    with fake_world("dp=2,tp=2", rank=1) as mesh:  # rank 1: (dp 0, tp 1)
        got = shard_tensor(torch.arange(8.0), (SS(0, split_factor=2), Shard(0)), mesh)
    assert got.tolist() == [4.0, 5.0] and got.is_contiguous()


def test_a_strided_placement_reads_back_from_its_text():
    p = SS(1, split_factor=4)
    assert placement_text(p) == "_S(1, 4)" and parse_placement("_S(1, 4)") == p
    with pytest.raises(ValueError, match=r"_S\(d, split_factor\)"):
        parse_placement("_S(1)")


def test_parameters_get_strided_candidates_only_when_asked_and_only_even():
    meta = tensor_meta(torch.empty(8, 4, device="meta"))
    plain = placeholder_candidates(meta, (2, 2), padded_dim0=True)
    asked = placeholder_candidates(meta, (2, 2), padded_dim0=True, strided=True)
    assert not any(has_strided(c.outs[0]) for c in plain)
    assert asked[: len(plain)] == plain
    assert [c.outs[0] for c in asked[len(plain):]] == [(SS(0, split_factor=2), Shard(0)), (SS(1, split_factor=2), Shard(1))]
    uneven = tensor_meta(torch.empty(6, 4, device="meta"))  # padded S(0),S(0) is a candidate; its strided form is not
    assert [c.outs[0] for c in placeholder_candidates(uneven, (2, 2), padded_dim0=True, strided=True) if has_strided(c.outs[0])] == [(SS(1, split_factor=2), Shard(1))]


def test_a_strided_gather_over_the_fsdp_dim_is_priced_as_one_all_gather():
    """dp:_S(0, 2) tp:S(0) -> dp:R tp:S(0) is one dp all-gather (the plain dp-major layout needs more),
    and the gradient's way back one dp reduce-scatter."""
    from torch.distributed.tensor import Partial

    meta = tensor_meta(torch.empty(1024, 64))
    with fake_world("dp=2,tp=2") as mesh:
        cm = CostModel(get_profile(), mesh.spec, mesh.device_mesh)
        gather = cm.redistribute(meta, (SS(0, split_factor=2), Shard(0)), (Replicate(), Shard(0)))
        plain = cm.redistribute(meta, (Shard(0), Shard(0)), (Replicate(), Shard(0)))
        scatter = cm.redistribute(meta, (Partial(), Shard(0)), (SS(0, split_factor=2), Shard(0)))
    assert [(s.kind, s.mesh_dim, s.nbytes) for s in gather.steps] == [(ALL_GATHER, "dp", 1024 * 64 * 4 // 2)]
    assert len(plain.steps) > 1 and plain.us > gather.us
    assert [(s.kind, s.mesh_dim) for s in scatter.steps] == [(REDUCE_SCATTER, "dp")]


class _Colwise(nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.up = nn.Linear(4, rows, bias=False)
        self.down = nn.Linear(rows, 4, bias=False)


@pytest.mark.parametrize("rows, mesh, strided, dp", [
    (8, "dp=2,tp=2", True, SS(0, split_factor=2)),  # the hand layout: FSDP shard of the TP shard
    (8, "dp=2,tp=2", False, Shard(0)),  # plain: DTensor's mesh order, what evaluate_hand_plan prices
    (8, "tp=2,dp=2", True, Shard(0)),  # tp first: mesh order is the hand layout
    (6, "dp=2,tp=2", True, Shard(0)),  # uneven: no strided candidate, the plain pin stays
])
def test_hand_plan_pins_give_the_hand_layout_of_a_colwise_weight(rows, mesh, strided, dp):
    hand = ParallelPlan.fsdp_tp(tp_rules={"up.weight": "colwise", "down.weight": "rowwise"}, tp_regions=("",))
    spec = MeshSpec.parse(mesh)
    pins = {fqn: dict(zip(spec.names, pl, strict=True)) for fqn, pl in hand_plan_pins(hand, _Colwise(rows), spec, strided=strided).items()}
    assert pins["up.weight"] == {"dp": dp, "tp": Shard(0)}
    assert pins["down.weight"] == {"dp": Shard(0), "tp": Shard(1)}  # rowwise: tp shards dim 1, nothing shared
