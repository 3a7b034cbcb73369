"""The cost model: redistribution plans agree with DTensor's, alpha-beta numbers, padding, compute."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoparallel.mesh import fake_world
from autoparallel.planner import get_profile
from autoparallel.planner.costs import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, CostModel
from autoparallel.planner.strategies import Candidate


def _meta(*shape, dtype=torch.float32) -> TensorMeta:
    t = torch.empty(shape, dtype=dtype, device="meta")
    return TensorMeta(t.shape, t.stride(), t.dtype)


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_cached_plans_equal_dtensors_plan_for_every_pair(ndim):
    """Single-step shortcut and dim-renumbered patterns give DTensor's own steps, pair by pair."""
    with fake_world("dp=2,tp=2") as mesh:
        cm = CostModel(get_profile(), mesh.spec, mesh.device_mesh)
        opts = [Replicate(), Partial("sum"), Partial("avg")] + [Shard(d) for d in range(ndim)]
        placements = list(itertools.product(opts, repeat=2))
        meta = _meta(*([8] * ndim))
        checked = 0
        for src, dst in itertools.product(placements, repeat=2):
            if src == dst:
                continue
            ours = cm.transforms(cm.codes(src), cm.codes(dst))
            never = any(a != b and isinstance(b, Partial) and not isinstance(a, Replicate) for a, b in zip(src, dst, strict=True))
            if never:
                assert ours is None
                continue
            theirs = _gen_transform_infos_non_cached(DTensorSpec(mesh.device_mesh, src, tensor_meta=meta), DTensorSpec(mesh.device_mesh, dst, tensor_meta=meta))
            assert ours == tuple((t.mesh_dim, cm.code(t.src_dst_placements[0]), cm.code(t.src_dst_placements[1])) for t in theirs), (src, dst)
            checked += 1
        assert checked > 20
        assert cm.dtensor_plans < checked  # most pairs never reach DTensor


def test_alpha_beta_prices_each_collective_on_its_mesh_dims_link():
    with fake_world("dp=16,tp=8") as mesh:
        prof = get_profile("h100")
        cm = CostModel(prof, mesh.spec, mesh.device_mesh)
        meta = _meta(1024, 1024)  # 4 MiB
        full = 4 * 2**20
        r = cm.redistribute(meta, (Replicate(), Shard(0)), (Replicate(), Replicate()))
        (step,) = r.steps
        assert (step.kind, step.mesh_dim, step.nbytes) == (ALL_GATHER, "tp", full)
        intra, inter = prof.intra_node, prof.inter_node
        assert r.us == pytest.approx(intra.latency_us + full * 7 / 8 / (intra.bandwidth_gbps * 1e3))
        r = cm.redistribute(meta, (Partial(), Replicate()), (Replicate(), Replicate()))
        (step,) = r.steps
        assert (step.kind, step.mesh_dim) == (ALL_REDUCE, "dp")
        assert r.us == pytest.approx(inter.latency_us + 2 * full * 15 / 16 / (inter.bandwidth_gbps * 1e3))
        r = cm.redistribute(meta, (Partial(), Replicate()), (Shard(0), Replicate()))
        assert [(s.kind, s.nbytes) for s in r.steps] == [(REDUCE_SCATTER, full)]
        r = cm.redistribute(meta, (Shard(0), Replicate()), (Shard(1), Replicate()))
        assert [(s.kind, s.nbytes) for s in r.steps] == [(ALL_TO_ALL, full // 16)]
        # S(0)S(0) -> RR: tp then dp, each gathering what it holds
        r = cm.redistribute(meta, (Shard(0), Shard(0)), (Replicate(), Replicate()))
        assert [(s.kind, s.mesh_dim, s.nbytes) for s in r.steps] == [(ALL_GATHER, "tp", full // 16), (ALL_GATHER, "dp", full)]
        # local steps are free, impossible ones infinite
        assert cm.redistribute(meta, (Replicate(), Replicate()), (Shard(0), Partial())).us == 0.0
        assert math.isinf(cm.redistribute(meta, (Shard(0), Replicate()), (Partial(), Replicate())).us)
        assert math.isinf(cm.redistribute(meta, (Partial("sum"), Replicate()), (Partial("avg"), Replicate())).us)


def test_padded_shards_move_their_padded_bytes():
    """FSDP2 pads dim 0 to a multiple of the mesh dim: 10 rows on 4 ranks move as 4 x 3 rows."""
    with fake_world("dp=4") as mesh:
        cm = CostModel(get_profile(), mesh.spec, mesh.device_mesh)
        r = cm.redistribute(_meta(10, 4), (Shard(0),), (Replicate(),))
        assert [s.nbytes for s in r.steps] == [4 * 3 * 4 * 4]
        r = cm.redistribute(_meta(10, 4), (Partial(),), (Shard(0),))
        assert [s.nbytes for s in r.steps] == [4 * 3 * 4 * 4]


def test_compute_is_roofline_split_over_sharded_mesh_dims_with_a_launch_floor():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b):
        return torch.mm(a, b).t()

    gm = make_fx(f, tracing_mode="fake")(torch.empty(4096, 4096), torch.empty(4096, 4096))
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    t = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.t.default)
    with fake_world("dp=4,tp=2") as mesh:
        prof = get_profile()
        cm = CostModel(prof, mesh.spec, mesh.device_mesh)
        g = cm.global_compute_us(mm)
        flops = 2 * 4096**3
        assert g == pytest.approx(flops / (prof.tflops(torch.float32) * 1e12 * prof.efficiency) * 1e6)
        assert cm.global_compute_us(t) == 0.0  # a view
        rep = (Replicate(), Replicate())
        assert cm.compute_us(g, Candidate((rep,), (rep, rep))) == pytest.approx(g)
        row = Candidate(((Shard(0), Replicate()),), ((Shard(0), Replicate()), rep))
        assert cm.compute_us(g, row) == pytest.approx(g / 4)
        both = Candidate(((Shard(0), Partial()),), ((Shard(0), Shard(1)), (Replicate(), Shard(0))))
        assert cm.compute_us(g, both) == pytest.approx(g / 8)
        assert cm.compute_us(1.0, both) == prof.launch_floor_us
