"""ParallelPlan.resolve on the tiny LLaMA-3 preset and the zoo: FSDP/TP shardings (chunked TP
rules, Linear biases), shard/unshard, patterns that match one dotted name per '*', errors that
name the parameter, module and mesh dim; uneven FSDP shards (padding, real rows); and clean_fqn."""

import pytest
import torch
from torch import nn

from autoparallel.mesh import MeshSpec
from autoparallel.models.llama3 import build_model
from autoparallel.parallelize import ParallelPlan
from autoparallel.parallelize.plan import TPRule, fqn_match
from autoparallel.parallelize.program import clean_fqn
from autoparallel.planner.api import hand_plan_pins
from autoparallel.planner.costs import local_shape
from verify import zoo


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


def test_indivisible_tp_dim_names_parameter_and_dim(tiny):
    with pytest.raises(ValueError, match=r"'layers.0.attention.wq.weight'.*64.*not divisible.*'tp' of size 3.*TP does not pad"):
        ParallelPlan.fsdp_tp().resolve(tiny, MeshSpec.parse("dp=2,tp=3"))


# --- uneven FSDP shards: padded dim 0 -------------------------------------------------------------


class _Uneven(nn.Module):
    """A class token, a 10-class head and a 4-expert router: dims 0 of 1, 10 and 4."""

    def __init__(self):
        super().__init__()
        self.cls_token = nn.Parameter(torch.arange(6.0).reshape(1, 1, 6) + 1)
        self.head = nn.Parameter(torch.arange(60.0).reshape(10, 6) + 1)
        self.router = nn.Parameter(torch.arange(24.0).reshape(4, 6) + 1)


def _pieces(sharding, full, spec):
    sizes = dict(spec.dims)
    return {tuple(spec.coordinate(r).values()): sharding.shard(full, spec.coordinate(r), sizes) for r in range(spec.world_size)}


@pytest.mark.parametrize(
    "fqn, local_rows, padding, real",
    [
        ("cls_token", 1, 7, [1, 0, 0, 0, 0, 0, 0, 0]),  # ranks 1-7 hold only padding
        ("head", 2, 6, [2, 2, 2, 2, 2, 0, 0, 0]),
        ("router", 1, 4, [1, 1, 1, 1, 0, 0, 0, 0]),
    ],
)
def test_fsdp_pads_dim0_below_the_mesh_size(fqn, local_rows, padding, real):
    spec = MeshSpec.parse("dp=8")
    model = _Uneven()
    s = ParallelPlan.fsdp().resolve(model, spec)[fqn]
    full = dict(model.named_parameters())[fqn].detach()
    assert s.local_shape == (local_rows, *full.shape[1:]) and s.fsdp_rows == full.shape[0]
    assert s.padding_rows == padding and s.padded
    assert [s.real_rows({"dp": i}) for i in range(8)] == real
    pieces = _pieces(s, full, spec)
    for (i,), piece in pieces.items():
        assert piece.shape == s.local_shape  # every rank holds the same shape: one traced graph
        assert torch.equal(s.real_shard(piece, {"dp": i}), full[i * local_rows : i * local_rows + real[i]])
        assert not piece[real[i]:].any()  # the padding is zero
    assert torch.equal(s.unshard(pieces, spec), full)


def test_even_fsdp_shards_have_no_padding(tiny):
    for s in ParallelPlan.fsdp().resolve(tiny, MeshSpec.parse("dp=8")).values():
        assert not s.padded and s.padding_rows == 0
        assert s.real_rows({"dp": 7}) == s.local_shape[0]


def test_uneven_llama_shard_unshard_roundtrip_under_fsdp_and_fsdp_tp():
    """TP splits first (evenly), then FSDP pads dim 0 of the TP-local piece."""
    model = build_model("tiny")
    for plan, spec in ((ParallelPlan.fsdp(), MeshSpec.parse("dp=3")), (ParallelPlan.fsdp_tp(), MeshSpec.parse("dp=3,tp=2"))):
        sh = plan.resolve(model, spec)
        for fqn, p in model.named_parameters():
            assert torch.equal(sh[fqn].unshard(_pieces(sh[fqn], p.detach(), spec), spec), p.detach()), fqn
    wq = ParallelPlan.fsdp_tp().resolve(model, MeshSpec.parse("dp=3,tp=2"))["layers.0.attention.wq.weight"]
    assert (wq.fsdp_rows, wq.local_shape, wq.padding_rows) == (32, (11, 64), 1)  # 64 / tp 2 = 32 rows over dp 3
    wo = ParallelPlan.fsdp_tp().resolve(model, MeshSpec.parse("dp=3,tp=2"))["layers.0.attention.wo.weight"]
    assert (wo.fsdp_rows, wo.local_shape, wo.padding_rows) == (64, (22, 32), 2)  # rowwise: dim 0 whole


def test_real_shard_rejects_a_tensor_of_another_shape():
    s = ParallelPlan.fsdp().resolve(_Uneven(), MeshSpec.parse("dp=8"))["head"]
    with pytest.raises(ValueError, match=r"head: local tensor of shape \(10, 6\), expected \(2, 6\)"):
        s.real_shard(torch.zeros(10, 6), {"dp": 0})


def test_zero_dim_parameter_is_refused_under_fsdp_saying_why():
    model = nn.Module()
    model.temperature = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"parameter 'temperature' is a 0-dim tensor.*no dim 0.*shape \(1,\)"):
        ParallelPlan.fsdp().resolve(model, MeshSpec.parse("dp=2"))
    assert ParallelPlan.ddp().resolve(model, MeshSpec.parse("dp=2"))["temperature"].local_shape == ()


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


@pytest.mark.parametrize("plan, mesh", [(ParallelPlan.fsdp(), "dp=8"), (ParallelPlan.fsdp(), "dp=3"), (ParallelPlan.fsdp_tp(), "dp=3,tp=2")])
def test_planner_prices_the_padded_local_shape_the_plan_builds(plan, mesh):
    """The planner (issue 16) offers padded Shard(0) and prices its bytes with its own per-rank
    shape: for every parameter of a hand plan it is the local shape resolve() builds."""
    spec = MeshSpec.parse(mesh)
    model = build_model("tiny") if mesh != "dp=8" else _Uneven()
    shardings = plan.resolve(model, spec)
    pins = hand_plan_pins(plan, model, spec)
    padded = 0
    for fqn, p in model.named_parameters():
        assert tuple(local_shape(p.shape, pins[fqn], spec.shape)) == shardings[fqn].local_shape, fqn
        padded += shardings[fqn].padded
    assert padded > 0


def test_auto_plan_is_left_to_the_planner(tiny):
    auto = ParallelPlan.auto(profile="a100", param_dtype=torch.bfloat16)
    assert auto.is_auto and not ParallelPlan.fsdp().is_auto
    assert auto.planner == {"profile": "a100"} and auto.param_dtype == torch.bfloat16
    assert auto.describe() == "auto profile=a100 param_dtype=bfloat16"
    assert ParallelPlan.preset("auto").describe() == "auto"
    assert auto.data_dims == () and auto.tp_rules == {}
    with pytest.raises(ValueError, match=r"plan 'auto' has no hand placements to resolve: the pipeline's plan stage"):
        auto.resolve(tiny, MeshSpec.parse("dp=8"))
# --- patterns, TP rules and regions on models that are not LLaMA (verify.zoo) ---------------------

@pytest.mark.parametrize(
    "pattern, fqn, match",
    [
        ("blocks.*", "blocks.0", True),
        ("blocks.*", "blocks.0.attn", False),  # fnmatch's '*' crosses dots: it matched child modules
        ("blocks.*.attn.qkv.weight", "blocks.12.attn.qkv.weight", True),
        ("blocks.*.weight", "blocks.0.attn.weight", False),
        ("blocks.?.w*", "blocks.3.wq", True),
        ("layers.*.attention.wq.weight", "layers.0.attention.wq.weight", True),
    ],
)
def test_patterns_match_one_dotted_name_per_star(pattern, fqn, match):
    assert fqn_match(pattern, fqn) is match


def test_region_pattern_names_only_the_modules_it_matches():
    model = zoo.ln_mlp.build(device="meta")
    plan = ParallelPlan.fsdp_tp(tp_rules=dict(zoo.ln_mlp.tp_rules), tp_regions=zoo.ln_mlp.tp_regions)
    assert plan.region_modules(model) == ["blocks.0", "blocks.1"]  # not blocks.0.fc, blocks.0.proj


def test_nested_regions_and_unmatched_regions_are_errors():
    model = zoo.gpt2.build(device="meta")
    rules = dict(zoo.gpt2.tp_rules)
    with pytest.raises(ValueError, match=r"TP region 'blocks.0.attn' is inside TP region 'blocks.0'"):
        ParallelPlan.fsdp_tp(tp_rules=rules, tp_regions=("blocks.*", "blocks.*.attn")).region_modules(model)
    with pytest.raises(ValueError, match=r"TP region 'layers.\*.attention' matches no module"):
        ParallelPlan.fsdp_tp(tp_rules=rules).resolve(model, MeshSpec.parse("dp=2,tp=2"))


def _gpt2_tp(**kw):
    return ParallelPlan.fsdp_tp(tp_rules=kw.pop("rules", dict(zoo.gpt2.tp_rules)), tp_regions=zoo.gpt2.tp_regions, **kw)


def test_fused_qkv_split_as_three_chunks_and_biases_follow_their_weights():
    model = zoo.gpt2.build()
    spec = MeshSpec.parse("dp=2,tp=2")
    sh = _gpt2_tp().resolve(model, spec)
    qkv, bias = sh["blocks.0.attn.qkv.weight"], sh["blocks.0.attn.qkv.bias"]
    assert (qkv.tp_axis, qkv.tp_chunks, qkv.local_shape) == (0, 3, (48 // 2 // 2, 16))
    assert (bias.tp_style, bias.tp_chunks, bias.local_shape) == ("colwise", 3, (48 // 2 // 2,))
    proj_bias = sh["blocks.0.attn.proj.bias"]
    assert proj_bias.tp_style is None and proj_bias.rowwise_bias_of == "blocks.0.attn.proj"
    # TP rank 1 holds rows 8:16 of each of q, k and v (24 rows); FSDP rank 0 the first 12 of those
    full = dict(model.named_parameters())["blocks.0.attn.qkv.weight"].detach()
    local = qkv.shard(full, {"dp": 0, "tp": 1}, dict(spec.dims))
    assert torch.equal(local, torch.cat([full[8:16], full[24:28]]))
    for fqn, p in model.named_parameters():
        pieces = {tuple(c.values()): sh[fqn].shard(p.detach(), c, dict(spec.dims)) for c in map(spec.coordinate, range(4))}
        assert torch.equal(sh[fqn].unshard(pieces, spec), p.detach()), fqn


def test_chunks_that_do_not_divide_name_the_parameter():
    model = zoo.gpt2.build(device="meta")
    with pytest.raises(ValueError, match=r"'blocks.0.attn.qkv.weight': dim 0 of size 48 as 3 chunks of 16 is not divisible by mesh dim 'tp' of size 3"):
        _gpt2_tp().resolve(model, MeshSpec.parse("dp=1,tp=3"))


def test_tied_names_with_different_tp_rules_are_an_error():
    model = zoo.gpt2.build(device="meta")  # head.weight is wte.weight
    rules = {**dict(zoo.gpt2.tp_rules), "head.weight": "colwise"}
    with pytest.raises(ValueError, match=r"'head.weight' is tied to 'wte.weight'.*different layouts"):
        _gpt2_tp(rules=rules).resolve(model, MeshSpec.parse("dp=2,tp=2"))


def test_a_replicated_parameter_inside_a_tp_region_is_an_error():
    """Its gradient would be a partial sum on each TP rank, reduced by nothing (silently wrong)."""
    model = zoo.gpt2.build(device="meta")
    plan = ParallelPlan.fsdp_tp(tp_rules=dict(zoo.gpt2.tp_rules), tp_regions=("blocks.*",))
    with pytest.raises(ValueError, match=r"'blocks.0.ln_1.weight' is inside TP region 'blocks.0' but no TP rule shards it"):
        plan.resolve(model, MeshSpec.parse("dp=2,tp=2"))


def test_a_tp_sharded_parameter_outside_every_region_is_an_error():
    model = zoo.gpt2.build(device="meta")
    plan = ParallelPlan.fsdp_tp(tp_rules=dict(zoo.gpt2.tp_rules), tp_regions=("blocks.*.attn",))
    with pytest.raises(ValueError, match=r"'blocks.0.mlp.fc.weight' is TP-sharded \(colwise\) but is in no TP region"):
        plan.resolve(model, MeshSpec.parse("dp=2,tp=2"))


def test_tp_rule_values():
    assert TPRule("rowwise").axis == 1 and TPRule("colwise", dim=1).axis == 1
    with pytest.raises(ValueError, match="chunks=0"):
        TPRule("colwise", chunks=0)
    with pytest.raises(ValueError, match="'diagonal'"):
        TPRule("diagonal")
