"""shared_provenance on generated graphs (verify.graphs.generators): the pre-overlap pass leaves the same
provenance, node by node, with the histories shared as upstream leaves with them deep-copied; and
the same graph and collective counts."""

from __future__ import annotations

import copy

from hypothesis import given
from hypothesis import strategies as st
from torch import fx
from torch.fx.traceback import NodeSource, NodeSourceAction

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.mesh import fake_world
from autoparallel.passes.pre_overlap_bucketing import (
    PreOverlapConfig,
    bucket_tagged_collectives,
    collective_counts,
    tag_collectives_for_bucketing,
)
from autoparallel.passes.shared_provenance import PATCH, run_with_shared_provenance
from verify.graphs.generators import synthetic_graphs

MESH = "dp=4,tp=2"
caps_mb = st.sampled_from((2**20, 8192, 512)).map(lambda b: b / 2**20)


def _with_history(gm):
    """Each node ``traced`` from a namesake in an origin graph of its own."""
    origin = fx.Graph()
    for n in list(gm.graph.nodes):
        twin = origin.create_node("call_function", n.target if n.op == "call_function" else len, name=n.name)
        n.meta[M.FROM_NODE] = [NodeSource(twin, "traced", NodeSourceAction.CREATE)]
    return gm


def _provenance(gm):
    ids: dict[int, int] = {}

    def norm(d):
        return {**d, "graph_id": ids.setdefault(d["graph_id"], len(ids)), "from_node": [norm(x) for x in d["from_node"]]}

    return [(n.name, str(n.target), [norm(s.to_dict()) for s in n.meta.get(M.FROM_NODE, [])]) for n in gm.graph.nodes]


def test_pre_overlap_pass_leaves_upstreams_provenance():
    with fake_world(MESH) as mesh:

        @given(synthetic_graphs(mesh, min_ops=3, max_ops=8), caps_mb)
        def prop(sg, cap_mb):
            gm = sg.gm
            tag_collectives_for_bucketing(gm)
            twin = copy.deepcopy(gm)
            _with_history(gm), _with_history(twin)

            def bucket(g):
                bucket_tagged_collectives(g, PreOverlapConfig(bucket_cap_mb=cap_mb))
                return g

            shared = run_with_shared_provenance(gm, bucket)
            with patches.disabled(PATCH):
                copied = run_with_shared_provenance(twin, bucket)
            assert collective_counts(shared) == collective_counts(copied)
            assert _provenance(shared) == _provenance(copied)

        prop()
