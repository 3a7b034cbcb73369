"""ParallelPlan.resolve on the tiny LLaMA-3 preset: FSDP/TP shardings, shard/unshard, errors that
name the parameter and mesh dim; and clean_fqn."""

import pytest
import torch

from autoparallel.mesh import MeshSpec
from autoparallel.models.llama3 import build_model
from autoparallel.parallelize import ParallelPlan
from autoparallel.parallelize.program import clean_fqn


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", device="meta")


def test_fsdp_shards_dim0(tiny):
    sh = ParallelPlan.fsdp().resolve(tiny, MeshSpec.parse("dp=8"))
    assert len(sh) == len(list(tiny.parameters()))
    wq = sh["layers.0.attention.wq.weight"]
    assert wq.full_shape == (64, 64) and wq.local_shape == (8, 64) and wq.fsdp_dim == "dp"


def test_fsdp_tp_colwise_and_rowwise(tiny):
    sh = ParallelPlan.fsdp_tp().resolve(tiny, MeshSpec.parse("dp=4,tp=2"))
    assert sh["layers.0.attention.wq.weight"].tp_style == "colwise"
    assert sh["layers.0.attention.wq.weight"].local_shape == (64 // 2 // 4, 64)
    assert sh["layers.0.attention.wo.weight"].tp_style == "rowwise"
    assert sh["layers.0.attention.wo.weight"].local_shape == (64 // 4, 64 // 2)
    assert sh["tok_embeddings.weight"].tp_style is None


def test_shard_then_unshard_roundtrip():
    model = build_model("tiny")
    spec = MeshSpec.parse("dp=2,tp=2")
    sh = ParallelPlan.fsdp_tp().resolve(model, spec)
    sizes = dict(spec.dims)
    for fqn, p in model.named_parameters():
        pieces = {}
        for rank in range(spec.world_size):
            coord = spec.coordinate(rank)
            pieces[tuple(coord.values())] = sh[fqn].shard(p.detach(), coord, sizes)
        assert torch.equal(sh[fqn].unshard(pieces, spec), p.detach()), fqn


def test_unknown_mesh_dim_names_dim(tiny):
    with pytest.raises(ValueError, match=r"fsdp mesh dim 'data'.*dims: \['dp'\]"):
        ParallelPlan.fsdp("data").resolve(tiny, MeshSpec.parse("dp=8"))


def test_indivisible_dim_names_parameter_and_dim(tiny):
    with pytest.raises(ValueError, match=r"'tok_embeddings.weight'.*256.*not divisible.*'dp' of size 3"):
        ParallelPlan.fsdp().resolve(tiny, MeshSpec.parse("dp=3"))


def test_tp_rule_matching_nothing_is_unknown_parameter(tiny):
    plan = ParallelPlan.fsdp_tp(tp_rules={"layers.*.attention.wqkv.weight": "colwise"})
    with pytest.raises(ValueError, match=r"wqkv.*matches no parameter"):
        plan.resolve(tiny, MeshSpec.parse("dp=4,tp=2"))


def test_unknown_plan_lists_presets():
    with pytest.raises(ValueError, match=r"unknown plan 'zero3'.*\['auto', 'ddp', 'fsdp', 'fsdp_tp'\]"):
        ParallelPlan.preset("zero3")


@pytest.mark.parametrize(
    "raw, clean",
    [
        ("model.layers.0.attention.wq.parametrizations.weight.original", "layers.0.attention.wq.weight"),
        ("model.parametrizations.w1.original", "w1"),
        ("model.rope_cos", "rope_cos"),
        ("model.norm.weight", "norm.weight"),
    ],
)
def test_clean_fqn_strips_wrapper_and_parametrization(raw, clean):
    assert clean_fqn(raw) == clean


def test_auto_plan_is_left_to_the_planner(tiny):
    auto = ParallelPlan.auto(profile="a100", param_dtype=torch.bfloat16)
    assert auto.is_auto and not ParallelPlan.fsdp().is_auto
    assert auto.planner == {"profile": "a100"} and auto.param_dtype == torch.bfloat16
    assert auto.describe() == "auto profile=a100 param_dtype=bfloat16"
    assert ParallelPlan.preset("auto").describe() == "auto"
    assert auto.data_dims == () and auto.tp_rules == {}
    with pytest.raises(ValueError, match=r"plan 'auto' has no hand placements to resolve: the pipeline's plan stage"):
        auto.resolve(tiny, MeshSpec.parse("dp=8"))
