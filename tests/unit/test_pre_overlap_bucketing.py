"""Pre-overlap bucketing: tags written on the joint graph, carried through the fw/bw split by node
meta, merged on the split graphs with PyTorch's merge functions (hand-built and traced graphs).

The split graphs come from upstream ``default_partition`` (the project's own partitioner is
built separately); what matters here is that the partitioner copies node meta.
"""

from __future__ import annotations

import pytest
import torch
from torch._functorch.partitioners import default_partition

from autoparallel import meta as M
from autoparallel.mesh import attach_group_dims, fake_world
from autoparallel.passes import registry
from autoparallel.passes.graph_utils import ALL_GATHER, REDUCE_SCATTER
from autoparallel.passes.pre_overlap_bucketing import (
    TAG_FSDP_AG,
    TAG_GRAD_AR,
    TAG_GRAD_RS,
    PreOverlapConfig,
    bucket_tagged_collectives,
    collective_counts,
    tag_collectives_for_bucketing,
)
from autoparallel.runtime.rebind import rebind_groups
from verify.scenario import Scenario
from verify.strategies import GraphBuilder, mesh_groups

aten = torch.ops.aten
H = 64

SCENARIOS = {
    "fsdp-dp8": Scenario(mesh="dp=8"),
    "fsdp_tp-dp4tp2": Scenario(plan="fsdp_tp", mesh="dp=4,tp=2"),
    "ddp-dp2": Scenario(plan="ddp", mesh="dp=2"),
}


@pytest.fixture(scope="module")
def traced():
    """Joint graphs traced once per module (each trace starts and ends its own fake world)."""
    out = {}
    for name, sc in SCENARIOS.items():
        with sc.trace() as jg:
            out[name] = (sc, jg.gm, jg.num_fwd_outputs)
    return out


def _split(gm, num_fwd_outputs):
    ph = gm.graph.find_nodes(op="placeholder")
    fw, bw = default_partition(gm, [p.meta[M.VAL] for p in ph], num_fwd_outputs=num_fwd_outputs)
    for g in (fw, bw):
        attach_group_dims(g, gm.meta[M.GM_GROUP_DIMS])
    return fw, bw


def _tags(gm):
    out = {}
    for n in gm.graph.nodes:
        if M.bucket_tag(n) is not None:
            out[M.bucket_tag(n)] = out.get(M.bucket_tag(n), 0) + 1
    return out


# --- tagging ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected, untagged",
    [
        ("fsdp-dp8", {TAG_FSDP_AG: 21, TAG_GRAD_RS: 21}, 0),
        # TP all-reduces (activations and their gradients) feed compute: never tagged.
        ("fsdp_tp-dp4tp2", {TAG_FSDP_AG: 21, TAG_GRAD_RS: 21}, 8),
        ("ddp-dp2", {TAG_GRAD_AR: 21}, 0),
    ],
)
def test_tags_eligible_collectives_on_joint_graph(traced, name, expected, untagged):
    _, gm, _ = traced[name]
    counts = tag_collectives_for_bucketing(gm)
    assert {k: v for k, v in counts.tagged.items() if v} == expected
    assert counts.untagged == untagged
    assert _tags(gm) == expected


def test_tags_survive_the_fw_bw_split(traced):
    sc, gm, nfwd = traced["fsdp-dp8"]
    tag_collectives_for_bucketing(gm)
    fw, bw = _split(gm, nfwd)
    assert _tags(fw) == {TAG_FSDP_AG: 21}
    assert _tags(bw) == {TAG_GRAD_RS: 21}
    for n in fw.graph.nodes:
        if n.target is ALL_GATHER:
            assert M.bucket_tag(n) == TAG_FSDP_AG


# --- bucketing ----------------------------------------------------------------------------------


def _hand_graph(mesh):
    """4 parameter all-gathers, an activation all-gather (not parameter-derived) on the same
    group between them, 3 gradient reduce-scatters and a TP-style activation all-reduce."""
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (8, H), role="input:0")
    acc = x
    for i in range(4):
        w = b.all_gather(b.param((2, H)), "dp")  # [8, 64]
        acc = b.call(aten.mm.default, b.call(aten.mm.default, acc, b.call(aten.t.default, w)), w)
        if i == 1:
            g = b.all_gather(acc, "dp")  # [32, 64], depends on the first two weights
            acc = b.call(aten.sum.dim_IntList, b.call(aten.view.default, g, [4, 8, H]), [0])
    acc = b.all_reduce(acc, "tp")
    grads = [
        b.reduce_scatter(b.call(aten.mm.default, b.call(aten.t.default, acc), acc), "dp")
        for _ in range(3)
    ]
    roles = ["loss"] + [f"grad:g{i}" for i in range(3)]
    return b.output([b.call(aten.sum.default, acc), *grads], roles)


def test_merges_tagged_collectives_on_hand_graph():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        counts = tag_collectives_for_bucketing(gm)
        assert (
            counts.tagged == {TAG_FSDP_AG: 4, TAG_GRAD_RS: 3, TAG_GRAD_AR: 0}
            and counts.untagged == 2
        )
        res = bucket_tagged_collectives(gm, PreOverlapConfig(bucket_cap_mb=1.0))
        assert res.enabled
        assert res.before == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 1}
        # 4 parameter all-gathers -> 1 bucket; the activation all-gather stays alone.
        assert res.after == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}
        assert res.metrics["all_gather"].num_bucketed == 4
        gm.graph.lint()
        assert [n for n in gm.graph.nodes if n.target is ALL_GATHER][0].args[0].op != "placeholder"


def test_bucket_cap_bounds_each_bucket():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        tag_collectives_for_bucketing(gm)
        cap = 2 * 8 * H * 4 / 2**20  # two gathered weights
        res = bucket_tagged_collectives(gm, PreOverlapConfig(bucket_cap_mb=cap))
        assert res.after["all_gather"] == 3  # 2 buckets of 2 + the activation all-gather
        assert res.metrics["all_gather"].closed_by_bytes == 1
        gm.graph.lint()


def test_pass_is_idempotent():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        tag_collectives_for_bucketing(gm)
        first = bucket_tagged_collectives(gm)
        second = bucket_tagged_collectives(gm)
        assert second.before == second.after == first.after


def test_split_fw_bw_graphs_are_bucketed(traced):
    sc, gm, nfwd = traced["fsdp-dp8"]
    with fake_world(sc.mesh_spec) as mesh:
        gm = rebind_groups(gm, mesh.group_dims)
        tag_collectives_for_bucketing(gm)
        fw, bw = _split(gm, nfwd)
        small = PreOverlapConfig(bucket_cap_mb=0.05)
        rf = bucket_tagged_collectives(fw, small)
        rb = bucket_tagged_collectives(bw, small)
        assert (rf.before["all_gather"], rf.after["all_gather"]) == (21, 11)
        assert (rb.before["reduce_scatter"], rb.after["reduce_scatter"]) == (21, 11)
        fw.graph.lint()
        bw.graph.lint()
        fw2, bw2 = _split(gm, nfwd)
        assert bucket_tagged_collectives(fw2).after["all_gather"] == 1  # default cap: 25 MB
        assert bucket_tagged_collectives(bw2).after["reduce_scatter"] == 1


def test_disabled_patch_leaves_graph_alone():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        tag_collectives_for_bucketing(gm)
        with registry.disabled("pre_overlap_bucketing"):
            res = bucket_tagged_collectives(gm)
        assert not res.enabled and res.after == res.before == collective_counts(gm)


# --- bad input ----------------------------------------------------------------------------------


def test_unknown_process_group_names_the_node():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        tag_collectives_for_bucketing(gm)
        rs = [n for n in gm.graph.nodes if n.target is REDUCE_SCATTER][1]
        rs.args = (*rs.args[:3], "nope")
        with pytest.raises(
            ValueError, match=rf"node '{rs.name}' uses unknown process group 'nope'"
        ):
            bucket_tagged_collectives(gm)


@pytest.mark.parametrize("cap", [0, -2.5])
def test_bucket_cap_must_be_positive(cap):
    with pytest.raises(ValueError, match=rf"bucket_cap_mb must be a number of MB > 0, got {cap}"):
        PreOverlapConfig(bucket_cap_mb=cap)


def test_negative_span_is_rejected():
    with pytest.raises(ValueError, match="max_topo_span must be None or an int >= 0, got -3"):
        PreOverlapConfig(max_topo_span=-3)


def test_tagging_needs_output_roles():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        del gm.graph.output_node().meta[M.ROLE]
        with pytest.raises(ValueError, match=r"output node 'output' has no meta\['ap_role'\]"):
            tag_collectives_for_bucketing(gm)


def test_tags_reach_the_first_partitions_recomputed_all_gathers():
    """Through compile stack I's first partition: the backward's recomputed all-gathers are
    node copies of the tagged forward ones, so they carry the tag too."""
    from autoparallel.partition import apply_placement

    sc = SCENARIOS["fsdp-dp8"]
    with fake_world(sc.mesh_spec) as mesh:
        jg = sc.trace(mesh)
        tag_collectives_for_bucketing(jg.gm)
        first = apply_placement(jg).first_partition
        assert _tags(first.fw) == {TAG_FSDP_AG: 21}
        assert _tags(first.bw) == {TAG_FSDP_AG: 20, TAG_GRAD_RS: 21}  # the last layer's stays saved
        res = bucket_tagged_collectives(first.bw)
        assert (res.after["all_gather"], res.after["reduce_scatter"]) == (1, 1)
        first.bw.graph.lint()
