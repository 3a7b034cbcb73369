"""shared_provenance: the collective passes give bucketed nodes the provenance upstream would, with
the members' histories shared instead of deep-copied (autoparallel/passes/shared_provenance.py)."""

from __future__ import annotations

import torch
from torch.fx.traceback import NodeSource, NodeSourceAction

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.mesh import fake_world
from autoparallel.passes.collective import CollectivePassesConfig, bucket_joint
from autoparallel.passes.shared_provenance import PATCH, run_with_shared_provenance
from verify.graphs.generators import GraphBuilder, mesh_groups

aten = torch.ops.aten
H = 16


def _graph_with_history(mesh):
    """Three parameter all-gathers (one bucket) and two gradient reduce-scatters, every node with a
    one-step history (``traced`` from a node of an origin graph of the same name)."""
    b = GraphBuilder(mesh_groups(mesh))
    acc = b.placeholder("x", (8, H), role="input:0")
    for _ in range(3):
        w = b.all_gather(b.param((2, H)), "dp")
        acc = b.call(aten.mm.default, acc, b.call(aten.t.default, w))
        acc = b.call(aten.mm.default, acc, w)
    grads = [b.reduce_scatter(b.call(aten.mm.default, b.call(aten.t.default, acc), acc), "dp") for _ in range(2)]
    gm = b.output([b.call(aten.sum.default, acc), *grads], ["loss", "grad:g0", "grad:g1"])
    origin = torch.fx.Graph()
    for n in list(gm.graph.nodes):
        twin = origin.create_node("call_function", aten.clone.default, name=n.name)
        n.meta[M.FROM_NODE] = [NodeSource(twin, "traced", NodeSourceAction.CREATE)]
    return gm


def _bucketed(disable: bool):
    with fake_world("dp=4,tp=2") as mesh:
        gm = _graph_with_history(mesh)
        before = {n.name: n.meta[M.FROM_NODE] for n in gm.graph.nodes}
        config = CollectivePassesConfig(fuse_chained_allgathers=False)
        if disable:
            with patches.disabled(PATCH):
                gm, metrics = bucket_joint(gm, config)
        else:
            gm, metrics = bucket_joint(gm, config)
    assert metrics.graphs["joint"].after["all_gather"] == 1, "the three all-gathers were bucketed"
    return gm, before


def _provenance(gm):
    """Every node's history as dicts, graph ids numbered in order of appearance (two runs build
    different graph objects)."""
    ids: dict[int, int] = {}

    def norm(d):
        return {**d, "graph_id": ids.setdefault(d["graph_id"], len(ids)), "from_node": [norm(x) for x in d["from_node"]]}

    return [(n.name, [norm(s.to_dict()) for s in n.meta.get(M.FROM_NODE, [])]) for n in gm.graph.nodes]


def test_bucketed_nodes_share_the_histories_of_their_members():
    gm, before = _bucketed(disable=False)
    made = [n for n in gm.graph.nodes if any(s.pass_name == "bucketing_pass" for s in n.meta.get(M.FROM_NODE, []))]
    assert made, "bucketing made nodes"
    for n in made:
        for src in n.meta[M.FROM_NODE]:
            assert src.from_node is before[src.node_info.name], (n.name, src.node_info.name)
    kept = [n for n in gm.graph.nodes if n.name in before]
    assert kept and all(n.meta[M.FROM_NODE] is before[n.name] for n in kept), "survivors keep their own list"


def test_the_provenance_is_the_one_upstream_builds():
    shared, _ = _bucketed(disable=False)
    copied, _ = _bucketed(disable=True)
    assert _provenance(shared) == _provenance(copied)
    histories = [s for _, srcs in _provenance(shared) for s in srcs if s["pass_name"] == "bucketing_pass"]
    assert histories and all(s["from_node"] and s["from_node"][0]["pass_name"] == "traced" for s in histories)


def test_histories_come_back_when_the_pass_raises():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _graph_with_history(mesh)
    before = {n.name: n.meta[M.FROM_NODE] for n in gm.graph.nodes}

    def boom(g):
        assert all(M.FROM_NODE not in n.meta for n in g.graph.nodes), "taken off during the pass"
        raise RuntimeError("pass failed")

    try:
        run_with_shared_provenance(gm, boom)
    except RuntimeError:
        pass
    assert {n.name: n.meta[M.FROM_NODE] for n in gm.graph.nodes} == before
