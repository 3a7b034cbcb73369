"""Invariant, stated as a test instead of left to a golden diff: every FSDP all-gather of a parameter
is tagged for bucketing and bucket-eligible in both compiles, the second compile tags exactly the
parameters the first does, and pre-overlap bucketing leaves none of them alone.

Why: a bug that gave a second-compile placeholder its neighbour's role (the roles the bucketing
tagger reads on the second compile's joint graph) stopped ``output.weight``'s all-gather, the
largest, from being bucketed, and only a 4-line golden diff showed it. Here the first compile's
tags come from the traced joint graph (roles from AOT descriptors); the second compile's are the
ones its own tagger wrote; each parameter is found through the graph (its all-gather reads its
placeholder through single-input ops) and its all-gather must produce the full parameter.

Runs on the FSDP golden scenarios (their pipeline runs are shared with the golden tests' workers)
and on a model that is not LLaMA (an MLP with LayerNorm and biases, fsdp over dp=4, bf16 params).
"""

from __future__ import annotations

import copy
import warnings

import pytest
from torch import fx

from autoparallel import meta as M
from autoparallel.compile import autoparallel_backend
from autoparallel.fx_utils import ALL_GATHER, WAIT
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, build_joint_graph, split_batch
from autoparallel.partition import apply_placement
from autoparallel.passes.collective import CollectivePassesConfig, bucket_fw_bw
from autoparallel.passes.pre_overlap_bucketing import TAG_FSDP_AG, tag_collectives_for_bucketing
from verify.goldens.catalog import GOLDEN_SCENARIOS, PIPELINE_OPTIONS, golden_run


def _source_param(ag: fx.Node) -> str | None:
    """FQN of the parameter placeholder an all-gather reads through single-input ops (a cast, a
    view), or None."""
    node = ag.args[0]
    while isinstance(node, fx.Node) and node.op != "placeholder":
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return None
        node = inputs[0]
    role = node.meta.get(M.ROLE) if isinstance(node, fx.Node) else None
    return role.partition(":")[2] if isinstance(role, str) and role.startswith("param:") else None


def param_all_gathers(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    out: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.target is ALL_GATHER and (fqn := _source_param(n)) is not None:
            out.setdefault(fqn, []).append(n)
    return out


def _forward_part(gm: fx.GraphModule, gathers: dict[str, list[fx.Node]]) -> dict[str, list[fx.Node]]:
    return {k: [n for n in v if n.meta.get(M.PARTITIONER_TAG) != "is_backward"] for k, v in gathers.items()}


def check_fsdp_all_gathers(
    joint: fx.GraphModule,
    second: tuple[fx.GraphModule, fx.GraphModule],
    bucketed: tuple[fx.GraphModule, fx.GraphModule],
    fsdp_params: dict[str, tuple[int, ...]],
    dp_group: str,
) -> None:
    """The invariant of the module docstring; ``fsdp_params``: FQN -> the shape its FSDP
    all-gather must produce (the TP-local parameter) for every FSDP-sharded parameter."""
    first = copy.deepcopy(joint)
    tag_collectives_for_bucketing(first)
    first_tagged = {}
    for fqn, ags in _forward_part(first, param_all_gathers(first)).items():
        assert len(ags) == 1, f"first compile: {fqn} is all-gathered {len(ags)} times in the forward"
        assert M.bucket_tag(ags[0]) == TAG_FSDP_AG, f"first compile: {fqn}'s all-gather is not tagged"
        first_tagged[fqn] = ags[0]
    assert sorted(first_tagged) == sorted(fsdp_params), "first compile: an FSDP parameter is not all-gathered"

    fw, bw = second
    fw_gathers = param_all_gathers(fw)
    assert sorted(fw_gathers) == sorted(fsdp_params), "second compile forward: parameters gathered differ"
    for graph_name, gathers in (("forward", fw_gathers), ("backward", param_all_gathers(bw))):
        for fqn, ags in gathers.items():
            for ag in ags:
                where = f"second compile {graph_name}: {fqn}'s all-gather {ag.name!r}"
                assert M.bucket_tag(ag) == TAG_FSDP_AG, f"{where} is not tagged {TAG_FSDP_AG!r} (not bucketed)"
                assert [u.target for u in ag.users] == [WAIT], f"{where} must have one user, its wait"
                assert ag.args[2] == dp_group, f"{where} is not on the FSDP group"
                val = ag.meta[M.VAL]
                assert tuple(val.shape) == tuple(fsdp_params[fqn]), f"{where} gathers {tuple(val.shape)}, not the parameter"
                assert val.dtype == first_tagged[fqn].meta[M.VAL].dtype, f"{where}: dtype differs from the first compile"
    tagged_second = {fqn for fqn, ags in fw_gathers.items() if all(M.bucket_tag(a) == TAG_FSDP_AG for a in ags)}
    assert tagged_second == set(first_tagged), "the second compile tags other parameters than the first"

    for graph_name, gm in zip(("forward", "backward"), bucketed, strict=True):
        alone = sorted(param_all_gathers(gm))
        assert not alone, f"pre-overlap bucketing left the all-gathers of {alone} unbucketed in the {graph_name}"


def gathered_shapes(shardings, spec) -> dict[str, tuple[int, ...]]:
    """FQN -> shape of its FSDP all-gather (the plan's local shard, dim 0 times the FSDP size:
    padding included for an uneven shard)."""
    return {
        fqn: (s.local_shape[0] * spec.size(s.fsdp_dim), *s.local_shape[1:])
        for fqn, s in shardings.items()
        if s.fsdp_dim is not None
    }


def _dp_group(group_dims: dict[str, str]) -> str:
    (name,) = [g for g, label in group_dims.items() if label == "dp"]
    return name


# FSDP golden scenarios at the default bucket cap (at a small cap a parameter may be alone in its bucket).
FSDP_SIDS = ("gpt2-fsdp-dp2", "tiny-fsdp-bf16-dp8", "tiny-fsdp-dp8", "tiny-fsdp_tp-dp4tp2", "tiny-fsdp-dp3-uneven")


@pytest.mark.parametrize("sid", [pytest.param(s, marks=pytest.mark.xdist_group(s)) for s in FSDP_SIDS])
def test_fsdp_all_gathers_tagged_and_bucketed_in_both_compiles(sid, shared_pipeline_runs):
    sc = GOLDEN_SCENARIOS[sid]
    assert not PIPELINE_OPTIONS.get(sid)
    run = golden_run(sid)
    joint = run.stage("joint").graphs
    check_fsdp_all_gathers(
        joint,
        run.stage("second_compile").graphs,
        run.stage("pre_overlap_bucketing").graphs,
        gathered_shapes(sc.plan_obj().resolve(sc.model(device="meta"), sc.mesh_spec), sc.mesh_spec),
        _dp_group(joint.meta[M.GM_GROUP_DIMS]),
    )


def test_non_llama_fsdp_all_gathers_tagged_and_bucketed_in_both_compiles(layernorm_mlp):
    import torch._dynamo

    make_model, _mse = layernorm_mlp
    torch.manual_seed(0)
    model = make_model()
    plan = ParallelPlan.fsdp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batch = (torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(8, 16))  # bf16 activations, fp32 target
    captured = {}
    with fake_world("dp=4") as mesh:
        jg = build_joint_graph(model, plan, mesh, batch, _mse)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            joint = copy.deepcopy(jg.gm)
        mod = apply_placement(jg)
        backend = autoparallel_backend(
            collective_passes=CollectivePassesConfig(fuse_chained_allgathers=False, pre_overlap_bucketing=False),
            on_collective_passes=lambda fw, bw, _: captured.update(fw=fw, bw=bw),
            group_dims=mesh.group_dims,
        )
        torch._dynamo.reset()
        try:
            torch.compile(mod, backend=backend)(*split_batch(batch, plan, mesh.spec, mesh.coordinate()))
        finally:
            torch._dynamo.reset()
        second = (captured["fw"], captured["bw"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            copies = [copy.deepcopy(g) for g in second]
        fw_b, bw_b, _ = bucket_fw_bw(*copies, CollectivePassesConfig(fuse_chained_allgathers=False))
        shapes = gathered_shapes(plan.resolve(model, mesh.spec), mesh.spec)
        assert len(shapes) == 7  # every parameter is FSDP-sharded
        check_fsdp_all_gathers(joint, second, (fw_b, bw_b), shapes, _dp_group(mesh.group_dims))
