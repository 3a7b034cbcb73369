"""The lowering's moves written directly (``autoparallel.planner.moves``) against DTensor's
redistribution, on generated placements.

Hypothesis draws a mesh (1-D of 2 or 4 ranks, 2-D 2x2 and 2x3), a source (Replicate / Shard(d) /
Partial sum or avg per mesh dim), a destination (Replicate / Shard(d), or the source's Partial) and
a tensor of 1-3 dims whose sharded dims divide evenly (1-3 times what the shards need; other dims
any size). Uneven shards are not lowered at all (``lower._check_even`` refuses them: DTensor pads
only the short pieces, so ranks would trace different graphs); a move of one is left to DTensor
(``test_moves.py``). The reference is DTensor's ``redistribute_local_tensor`` run
eagerly on the ranks' pieces (LocalTensorMode); the lowering's move (``lower.move_local``) is
traced with ``make_fx`` on each rank of a fake world and run on simulated ranks in lockstep. Every
rank's result is DTensor's, bitwise (integer-valued floats: sums are exact; an average divides the
same sum the same way), and every even move of a pair the module writes was written directly
(``LoweringReport.direct_moves``), not left to DTensor.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoparallel.mesh import MeshSpec, attach_group_dims, fake_world
from autoparallel.planner import moves as planner_moves
from autoparallel.planner.lower import LoweringReport, move_local, shard_tensor
from verify.parity.differential import bind, run_ranks, simulated_world
from verify.parity.redistribute_reference import dtensor_redistribute

MESHES = ("dp=2", "dp=4", "dp=2,tp=2", "dp=2,tp=3")


@st.composite
def moves(draw):
    spec = MeshSpec.parse(draw(st.sampled_from(MESHES)))
    ndim = draw(st.integers(1, 3))
    op = draw(st.sampled_from(["sum", "avg"]))
    shards = [Shard(d) for d in range(ndim)]
    src = tuple(draw(st.sampled_from([Replicate(), Partial(op), *shards])) for _ in spec.shape)
    dst = tuple(draw(st.sampled_from([Replicate(), *shards] + ([s] if s.is_partial() else []))) for s in src)
    assume(src != dst)
    # a multiple of the pieces a dim is cut into by every mesh dim that shards it in src or dst: DTensor's
    # plan may pass through both at once (S(0)R -> S(0)S(0) -> RS(0)), and an uneven step is DTensor's
    shape = tuple(draw(st.integers(1, 3)) * _ways_either(src, dst, spec, d) for d in range(ndim))
    return spec, shape, src, dst, draw(st.integers(0, 2**16))


def _ways_either(src, dst, spec, d) -> int:
    """Into how many pieces tensor dim ``d`` is cut by the mesh dims that shard it in ``src`` or ``dst``."""
    return math.prod(n for s, t, n in zip(src, dst, spec.shape, strict=True)
                     if (s.is_shard() and s.dim == d) or (t.is_shard() and t.dim == d))


def _pieces(spec, shape, src, seed):
    """Each rank's local value under ``src`` (a Partial mesh dim: the rank's integer addend) and
    the ranks' values, by rank."""
    g = torch.Generator().manual_seed(seed)
    plain = tuple(Replicate() if p.is_partial() else p for p in src)
    partial = [i for i, p in enumerate(src) if p.is_partial()]
    addends = {}
    out = []
    for r, c in enumerate(itertools.product(*[range(n) for n in spec.shape])):
        key = tuple(c[i] for i in partial)
        if key not in addends:
            addends[key] = torch.randint(-8, 8, shape, generator=g).float()
        with fake_world(spec, rank=r) as mesh:
            out.append(shard_tensor(addends[key], plain, mesh))
    return out


def _lowered(spec, shape, src, dst, pieces):
    """The lowering's move traced on each rank of a fake world, and the reports."""
    from torch.distributed.tensor._redistribute import disable_redistribute_transform_optimization
    from torch.fx.experimental.proxy_tensor import make_fx

    val = torch.empty(shape)
    gms, reports = [], []
    for r in range(spec.world_size):
        report = LoweringReport()
        with fake_world(spec, rank=r) as mesh, disable_redistribute_transform_optimization():
            gm = make_fx(lambda x: move_local(x, val, src, dst, mesh.device_mesh, report))(torch.empty_like(pieces[r]))
            attach_group_dims(gm, mesh.group_dims)
        gms.append(gm)
        reports.append(report)
    return gms, reports


def _check(spec, shape, src, dst, seed):
    pieces = _pieces(spec, shape, src, seed)
    gms, reports = _lowered(spec, shape, src, dst, pieces)
    with simulated_world(spec) as world:
        eager = dtensor_redistribute(pieces, shape, src, dst, world.device_mesh)
        (traced,) = run_ranks([bind(gm, world) for gm in gms], [tuple(pieces)])
    for r in range(spec.world_size):
        assert traced[r].shape == eager[r].shape and torch.equal(traced[r], eager[r]), (
            f"rank {r}: {src} -> {dst} of {shape} on {spec}: the lowered move differs from DTensor's")
    return reports


@given(moves())
def test_direct_moves_give_dtensors_pieces(move):
    _, _, src, dst, _ = move
    reports = _check(*move)
    if not any(s.is_shard() and d.is_shard() for s, d in zip(src, dst, strict=True)):
        # no Shard -> Shard on a mesh dim (an all-to-all, left to DTensor): written here
        assert all(r.direct_moves == 1 for r in reports), [r.dtensor_moves for r in reports]


@pytest.mark.parametrize("mesh", ["dp=2", "dp=2,tp=2"])
def test_a_scatter_and_a_gather_of_the_last_dim(mesh):
    spec = MeshSpec.parse(mesh)
    n = len(spec.shape)
    for src, dst in [((Partial(),) * n, (Shard(2),) * n), ((Shard(2),) * n, (Replicate(),) * n), ((Partial("avg"),) * n, (Shard(1), Replicate())[:n])]:
        reports = _check(spec, (4, 4, 8), src, dst, 1)
        assert reports[0].direct_moves == 1


def test_a_move_giving_another_ranks_piece_fails_the_check(monkeypatch):
    """Negative: a gather that puts the blocks in the wrong order is caught."""
    real = planner_moves.blocks_to_dim
    monkeypatch.setattr(planner_moves, "blocks_to_dim", lambda t, w, d: real(t.flip(0), w, d))
    with pytest.raises(AssertionError, match="differs from DTensor"):
        _check(MeshSpec.parse("dp=2"), (4, 4), (Shard(1),), (Replicate(),), 0)
