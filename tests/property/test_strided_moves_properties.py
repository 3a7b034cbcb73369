"""The lowering's moves from and to strided shards (``autoparallel.planner.strided``) against the
block layout they mean and against DTensor's own redistribution, on generated placements.

Hypothesis draws a mesh (2x2, 2x3, 2x2x2), a tensor (1-3 dims, every dim a multiple of the
world), a source (Replicate / Shard / Partial(sum) per mesh dim) and a destination (Replicate /
Shard), each possibly in its FSDP-order strided variant (at least one of them strided). The
reference is the planner's own block layout (``strided.piece``: which block each rank holds),
independent of DTensor:

* DTensor's ``redistribute_local_tensor`` run eagerly on the ranks' pieces (LocalTensorMode)
  gives every rank its ``piece`` of the destination;
* the lowering's move (``lower.move_local``), traced with ``make_fx`` on each rank of a fake world
  (rank-specific graphs) and run on simulated ranks in lockstep, gives the same, bitwise.

Integer-valued floats keep Partial sums exact, so "bitwise" is the claim. The negative test
feeds the dp-major (plain ``Shard``) pieces to a strided source and watches the check fail.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from autoparallel.mesh import MeshSpec, attach_group_dims, fake_world
from autoparallel.planner.lower import move_local
from autoparallel.planner.strided import has_strided, piece, strided_variants
from verify.parity.differential import bind, run_ranks, simulated_world
from verify.parity.redistribute_reference import dtensor_redistribute

MESHES = ("dp=2,tp=2", "dp=2,tp=3", "pp=2,dp=2,tp=2")


@st.composite
def moves(draw):
    spec = MeshSpec.parse(draw(st.sampled_from(MESHES)))
    sizes = spec.shape
    world = math.prod(sizes)
    ndim = draw(st.integers(1, 3))
    shape = tuple(world * draw(st.integers(1, 2)) for _ in range(ndim))

    def placements(partial: bool):
        opts = [Replicate()] + [Shard(d) for d in range(ndim)] + ([Partial("sum")] if partial else [])
        pl = tuple(draw(st.sampled_from(opts)) for _ in sizes)
        variants = strided_variants(pl, sizes)
        return variants[0] if variants and draw(st.booleans()) else pl

    src, dst = placements(True), placements(False)
    assume(src != dst and (has_strided(src) or has_strided(dst)))
    return spec, shape, src, dst, draw(st.integers(0, 2**16))


def _coords(sizes):
    """Mesh coordinates in rank order."""
    return list(itertools.product(*[range(n) for n in sizes]))


def _pieces(full_parts, placements, sizes):
    """Each rank's local value under ``placements`` (Partial mesh dims: the rank's addend)."""
    plain = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    partial_dims = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    out = []
    for c in _coords(sizes):
        addend = full_parts[tuple(c[i] for i in partial_dims)]
        out.append(piece(addend, plain, sizes, c).contiguous())
    return out


def _parts(shape, placements, sizes, seed):
    """The global tensor as one integer-valued addend per coordinate of the Partial mesh dims."""
    g = torch.Generator().manual_seed(seed)
    partial_dims = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    keys = _coords([sizes[i] for i in partial_dims]) if partial_dims else [()]
    parts = {k: torch.randint(-8, 8, shape, generator=g).float() for k in keys}
    return parts, sum(parts.values())


def _lowered(spec, shape, src, dst):
    """The lowering's move traced on each rank of a fake world (graphs naming rank 0's world)."""
    from torch.distributed.tensor._redistribute import disable_redistribute_transform_optimization
    from torch.fx.experimental.proxy_tensor import make_fx

    val = torch.empty(shape)
    gms = []
    for r in range(spec.world_size):
        with fake_world(spec, rank=r) as mesh, disable_redistribute_transform_optimization():
            local = torch.empty(piece(val, tuple(Replicate() if isinstance(p, Partial) else p for p in src), spec.shape, mesh.device_mesh.get_coordinate()).shape)
            gm = make_fx(lambda x: move_local(x, val, src, dst, mesh.device_mesh))(local)
            attach_group_dims(gm, mesh.group_dims)
            gms.append(gm)
    return gms


def _check(spec, shape, src, dst, seed, *, feed_plain: bool = False):
    parts, full = _parts(shape, src, spec.shape, seed)
    fed = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in src) if feed_plain else src
    pieces = _pieces(parts, fed, spec.shape)
    want = _pieces({(): full}, dst, spec.shape)
    gms = _lowered(spec, shape, src, dst)
    with simulated_world(spec) as world:
        eager = dtensor_redistribute(pieces, shape, src, dst, world.device_mesh)
        (traced,) = run_ranks([bind(gm, world) for gm in gms], [tuple(pieces)])
    for r in range(spec.world_size):
        assert torch.equal(eager[r], want[r]), f"DTensor, rank {r}: {src} -> {dst} on {spec} gives another piece"
        assert torch.equal(traced[r], want[r]), f"lowered move, rank {r}: {src} -> {dst} on {spec} gives another piece"


@given(moves())
def test_strided_moves_give_the_destinations_pieces(move):
    _check(*move)


def test_a_gather_over_the_fsdp_dim_of_a_strided_shard_is_one_all_gather():
    src = (_StridedShard(0, split_factor=2), Shard(0))
    dst = (Replicate(), Shard(0))
    gms = _lowered(MeshSpec.parse("dp=2,tp=2"), (8, 4), src, dst)
    calls = [n.target.__name__ for n in gms[0].graph.nodes if n.op == "call_function"]
    assert calls == ["all_gather_into_tensor.default", "wait_tensor.default"]
    _check(MeshSpec.parse("dp=2,tp=2"), (8, 4), src, dst, 0)


def test_pieces_laid_out_dp_major_fail_the_check():
    """Negative: the plain (dp-major) pieces fed to a strided source are other ranks' rows."""
    src = (_StridedShard(0, split_factor=2), Shard(0))
    with pytest.raises(AssertionError, match="gives another piece"):
        _check(MeshSpec.parse("dp=2,tp=2"), (8, 4), src, (Replicate(), Replicate()), 0, feed_plain=True)
