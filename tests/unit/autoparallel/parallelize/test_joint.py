"""The joint graph has the collectives the plan promises, on the mesh dims it names.

Traces of named scenarios come from verify.stages.pipeline_run's shared runs (``traced``): the joint stage
of the run the golden and partition tests of the same xdist group build anyway.
"""

import dataclasses
from collections import Counter

import pytest
import torch

from autoparallel import meta as M
from autoparallel.fx_utils import group_of, is_dtype_cast
from autoparallel.mesh import fake_world
from autoparallel.mesh import fake_world as fw
from autoparallel.models.llama3 import build_model
from autoparallel.parallelize import ParallelPlan, build_joint_graph
from autoparallel.pipeline import JOINT
from verify.goldens.catalog import run_group
from verify.stages.pipeline_run import run_scenario
from verify.stages.scenario import Scenario

_c10d = torch.ops._c10d_functional
AG, RS, AR = _c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default
NAMES = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce"}


def collectives(jg) -> Counter:
    dims = jg.group_dims
    return Counter((NAMES[n.target], dims[group_of(n)]) for n in jg.gm.graph.nodes if n.target in NAMES)


def _per_preset(plan: str, mesh: str, **kw):
    """The scenario on the tiny and debug presets, each in the xdist group of its pipeline run."""
    out = []
    for preset in ("tiny", "debug"):
        sc = Scenario(preset=preset, plan=plan, mesh=mesh, **kw)
        out.append(pytest.param(sc, id=preset, marks=pytest.mark.xdist_group(run_group(sc))))
    return out


@pytest.fixture(scope="module")
def traced(shared_pipeline_runs):
    """``traced(scenario)``: its joint graph, the joint stage of the scenario's shared pipeline
    run (the tests only read it)."""

    def get(sc: Scenario):
        run = run_scenario(sc, until=JOINT)
        return dataclasses.replace(run.joint, gm=run.stage(JOINT).graphs)

    return get


@pytest.mark.parametrize("sc", _per_preset("fsdp", "dp=8"))
def test_fsdp_counts_equal_sharded_params(sc, traced):
    jg = traced(sc)
    c = collectives(jg)
    n_params = len(jg.shardings)
    assert jg.num_params == n_params
    assert c == Counter({("all_gather", "dp"): n_params, ("reduce_scatter", "dp"): n_params})


@pytest.mark.parametrize("sc", _per_preset("fsdp_tp", "dp=4,tp=2"))
def test_fsdp_tp_puts_tp_all_reduces_on_tp(sc, traced):
    jg = traced(sc)
    c = collectives(jg)
    n_layers = sum(1 for f in jg.shardings if f.endswith("attention.wq.weight"))
    n_params = len(jg.shardings)
    # Per block: attention and feed-forward regions, each an all-reduce forward (g) and one backward (f).
    assert c[("all_reduce", "tp")] == 4 * n_layers
    assert c[("all_gather", "dp")] == c[("reduce_scatter", "dp")] == n_params
    assert set(c) == {("all_gather", "dp"), ("reduce_scatter", "dp"), ("all_reduce", "tp")}


def test_ddp_all_reduces_each_gradient_on_dp():
    with Scenario(plan="ddp", mesh="dp=4").trace() as jg:
        assert collectives(jg) == Counter({("all_reduce", "dp"): len(jg.shardings)})


BF16 = Scenario(mesh="dp=8", param_dtype="bf16", reduce_dtype="fp32")
TINY_FSDP = Scenario(preset="tiny", plan="fsdp", mesh="dp=8")  # Scenario() spelled out


@pytest.mark.xdist_group(run_group(BF16))
def test_bf16_param_dtype_casts_before_each_all_gather(traced):
    jg = traced(BF16)
    ags = [n for n in jg.gm.graph.nodes if n.target == AG]
    assert ags
    for ag in ags:
        src = ag.args[0]
        assert is_dtype_cast(src), ag.name
        assert src.meta[M.VAL].dtype == torch.bfloat16
        assert src.args[0].op == "placeholder" and src.args[0].meta[M.ROLE].startswith("param:")
        assert ag.meta[M.VAL].dtype == torch.bfloat16
    rss = [n for n in jg.gm.graph.nodes if n.target == RS]
    assert all(rs.meta[M.VAL].dtype == torch.float32 for rs in rss)


@pytest.mark.xdist_group(run_group(TINY_FSDP))
def test_every_node_has_fake_val_and_roles(traced):
    from torch._subclasses.fake_tensor import FakeTensor

    jg = traced(TINY_FSDP)
    for node in jg.gm.graph.nodes:
        if node.op == "output":
            continue
        assert M.VAL in node.meta, node.name
        vals = node.meta[M.VAL] if isinstance(node.meta[M.VAL], (list, tuple)) else [node.meta[M.VAL]]
        assert all(isinstance(v, FakeTensor) or not isinstance(v, torch.Tensor) for v in vals), node.name
        assert not any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in vals), node.name
    roles = jg.input_roles
    assert roles[0] == "param:tok_embeddings.weight"
    assert "buffer:rope_cos" in roles and "input:0" in roles and "input:1" in roles
    assert roles[-1] == "tangent:loss"
    assert jg.output_roles[0] == "loss" and jg.num_fwd_outputs == 1
    assert {r.partition(":")[2] for r in jg.output_roles if r and r.startswith("grad:")} == set(jg.shardings)


def test_group_dims_travel_with_graph_and_shift_with_creation_order():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        dist.new_group([0, 1])  # shifts every later group name
        with fake_world("dp=4,tp=2") as mesh:
            with Scenario(plan="fsdp_tp", mesh="dp=4,tp=2").trace(mesh) as jg:
                assert jg.group_dims == mesh.group_dims
                assert sorted(jg.group_dims.values()) == ["dp", "dp*tp", "tp"]
                assert set(collectives(jg)) == {("all_gather", "dp"), ("reduce_scatter", "dp"), ("all_reduce", "tp")}
    finally:
        dist.destroy_process_group()


def test_local_batch_shapes_follow_data_dims():
    with Scenario(plan="fsdp_tp", mesh="dp=4,tp=2", batch_per_rank=2).trace() as jg:
        inputs = [n for n in jg.gm.graph.find_nodes(op="placeholder") if n.meta[M.ROLE] == "input:0"]
        assert tuple(inputs[0].meta[M.VAL].shape) == (2, 32)


def test_batch_not_divisible_by_data_ranks_is_an_error():
    tokens = torch.zeros(3, 32, dtype=torch.long)
    with fw("dp=2") as mesh, pytest.raises(ValueError, match="input 0 has batch 3, not divisible by the 2"):
        build_joint_graph(build_model("tiny", device="meta"), ParallelPlan.fsdp(), mesh, (tokens, tokens))
