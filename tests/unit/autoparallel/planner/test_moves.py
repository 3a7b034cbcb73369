"""The lowering's moves written directly (autoparallel/planner/moves.py): what one move traces to,
and which pairs stay DTensor's (named). Values against DTensor: tests/property/test_direct_moves_properties.py."""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import patches
from autoparallel.mesh import fake_world
from autoparallel.planner.lower import LoweringReport, move_local
from autoparallel.planner.moves import PATCH, blocks_to_dim, dim_to_blocks

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _traced(mesh_text, shape, src, dst, local_shape):
    """(the call targets of one traced move, the report)."""
    from torch.distributed.tensor._redistribute import disable_redistribute_transform_optimization

    report = LoweringReport()
    val = torch.empty(shape)
    with fake_world(mesh_text) as mesh, disable_redistribute_transform_optimization():
        gm = make_fx(lambda x: move_local(x, val, src, dst, mesh.device_mesh, report))(torch.empty(local_shape))
    return [n.target for n in gm.graph.nodes if n.op == "call_function"], report


def test_a_gather_of_dim_1_is_one_all_gather_and_one_permuted_copy():
    targets, report = _traced("dp=4", (8, 16), (Shard(1),), (Replicate(),), (8, 4))
    assert targets == [c10d.all_gather_into_tensor.default, c10d.wait_tensor.default,
                       aten.view.default, aten.permute.default, aten.clone.default, aten.view.default]
    assert report.direct_moves == 1 and report.dtensor_moves == {}


def test_a_reduce_scatter_of_dim_1_is_one_permuted_copy_and_one_reduce_scatter():
    targets, report = _traced("dp=4", (8, 16), (Partial(),), (Shard(1),), (8, 16))
    assert targets == [aten.view.default, aten.permute.default, aten.clone.default, aten.view.default,
                       c10d.reduce_scatter_tensor.default, c10d.wait_tensor.default]
    assert report.direct_moves == 1


def test_a_two_dim_move_is_one_collective_per_mesh_dim():
    targets, _ = _traced("dp=2,tp=2", (8, 8), (Shard(0), Shard(1)), (Replicate(), Replicate()), (4, 4))
    collectives = [t for t in targets if t.namespace == "_c10d_functional" and t is not c10d.wait_tensor.default]
    assert collectives == [c10d.all_gather_into_tensor.default] * 2
    assert aten.cat.default not in targets and aten.split.Tensor not in targets


def test_a_local_split_is_a_narrow_and_a_clone():
    targets, _ = _traced("dp=2", (4, 6), (Replicate(),), (Shard(1),), (4, 6))
    assert targets == [aten.slice.Tensor, aten.clone.default]


def test_the_pairs_left_to_dtensor_are_counted_with_their_reason():
    _, s2s = _traced("dp=2", (4, 6), (Shard(0),), (Shard(1),), (2, 6))
    _, uneven = _traced("dp=2", (5, 6), (Shard(0),), (Replicate(),), (3, 6))
    assert s2s.dtensor_moves == {"S(0) -> S(1): shard to shard (all-to-all)": 1} and s2s.direct_moves == 0
    assert uneven.dtensor_moves == {"S(0) -> R: uneven shard": 1}


def test_a_strided_shard_is_moved_by_dtensors_plan_in_plain_steps():
    """DTensor plans a strided shard as plain Shard steps in another mesh-dim order; the steps are
    written here (values: tests/property/test_strided_moves_properties.py)."""
    src = (_StridedShard(0, split_factor=2), Shard(0))
    targets, report = _traced("dp=2,tp=2", (8, 4), src, (Replicate(), Replicate()), (2, 4))
    assert report.direct_moves == 1 and targets.count(c10d.all_gather_into_tensor.default) == 2


def test_disabled_every_move_is_dtensors_chunk_and_cat():
    """The negative of the gather test: without the patch DTensor's split -> getitems -> cat is traced."""
    with patches.disabled(PATCH):
        targets, report = _traced("dp=4", (8, 16), (Shard(1),), (Replicate(),), (8, 4))
    assert aten.cat.default in targets and report.direct_moves == 0
    assert report.dtensor_moves == {f"S(1) -> R: patch {PATCH} disabled": 1}


def test_the_permuted_copies_are_chunk_and_cat():
    x = torch.arange(2 * 3 * 8 * 5).reshape(6, 8, 5)
    for d in (1, 2):
        assert torch.equal(blocks_to_dim(x, 2, d), torch.cat(torch.chunk(x, 2, 0), d))
    for d in (0, 1):
        assert torch.equal(dim_to_blocks(x, 2, d), torch.cat(torch.chunk(x, 2, d), 0))
    strided = x.transpose(1, 2)  # a piece laid out otherwise is copied, same values
    assert torch.equal(dim_to_blocks(strided, 4, 2), torch.cat(torch.chunk(strided, 4, 2), 0))
