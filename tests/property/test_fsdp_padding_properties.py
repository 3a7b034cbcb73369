"""Properties of FSDP recompute tagging and of the padding statistics on generated graphs
(verify.graphs.generators, whose ops include uneven FSDP shards: an all-gather narrowed by one padding
row, a gradient zero-padded by one row before its reduce-scatter).

* the MUST_RECOMPUTE set of ``mark_fsdp_all_gather_recomputation`` can be recomputed from the
  shards alone (closed) and leaves no forward node that reads only a gathered weight untagged
  (maximal); activation all-gathers are never tagged;
* ``verify.graphs.stats`` counts exactly the padding the generator put in, per kind and mesh dim, and
  the same after pre-overlap bucketing merged the collectives.
"""

from __future__ import annotations

from hypothesis import given, settings
from torch import fx

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.mesh import fake_world
from autoparallel.passes.fsdp_recompute import (
    is_fsdp_all_gather,
    mark_fsdp_all_gather_recomputation,
)
from autoparallel.passes.pre_overlap_bucketing import (
    PreOverlapConfig,
    bucket_tagged_collectives,
    tag_collectives_for_bucketing,
)
from verify.graphs.generators import synthetic_graphs
from verify.graphs.classify import collective_kind
from verify.graphs.stats import graph_stats

MESH = "dp=4,tp=2"


def _shard_side(node: fx.Node) -> bool:
    """A parameter placeholder, or a single-input chain from one (a cast of the shard)."""
    while node.op == "call_function" and len(node.all_input_nodes) == 1 and collective_kind(node) is None:
        node = node.all_input_nodes[0]
    return node.op == "placeholder" and roles.is_param(node.meta.get(M.ROLE))


def test_recompute_tags_are_closed_over_the_shards_and_maximal():
    with fake_world(MESH) as mesh:

        @settings(max_examples=40)  # small: the CPU tier is over budget
        @given(synthetic_graphs(mesh, min_ops=3, max_ops=16))
        def prop(sg):
            report = mark_fsdp_all_gather_recomputation(sg.gm)
            tagged = set(report.recomputed)
            assert all(n.meta[M.RECOMPUTE].name == "MUST_RECOMPUTE" for n in tagged)
            for n in tagged:  # closed: recomputing needs nothing but the shards
                for i in n.all_input_nodes:
                    assert i in tagged or _shard_side(i), f"{n.name} reads {i.name}, neither tagged nor a shard"
            after = {n for n in tagged if not _shard_side(n)} - set(report.all_gathers)  # wait onwards
            for n in after:  # maximal: nothing that reads only the gathered weight is left to save
                for u in n.users:
                    if u.op == "call_function" and len(u.all_input_nodes) == 1:
                        assert u in tagged, f"{u.name} reads only the gathered {n.name} but is not tagged"
            for n in sg.gm.graph.nodes:  # activation all-gathers stay untagged
                if collective_kind(n) == "all_gather" and not is_fsdp_all_gather(n):
                    assert M.RECOMPUTE not in n.meta

        prop()


def _expected_padding(sg) -> dict[tuple[str, str], int]:
    """Bytes of padding the generator added: one fp32 row of ``hidden`` per padded op."""
    out: dict[tuple[str, str], int] = {}
    for op in sg.spec.ops:
        kind = {"param_ag_padded": "all_gather", "grad_rs_padded": "reduce_scatter"}.get(op.kind)
        if kind is not None:
            out[(kind, op.label)] = out.get((kind, op.label), 0) + sg.spec.hidden * 4
    return out


def _padding(gm) -> dict[tuple[str, str], int]:
    st = graph_stats(gm)
    return {(kind, dim): s.bytes for kind, per in st.padding.items() for dim, s in per.items()}


def test_padding_stats_count_the_generated_padding_before_and_after_bucketing():
    with fake_world(MESH) as mesh:

        @settings(max_examples=10)  # each merges buckets (fake-tensor tracing)
        @given(synthetic_graphs(mesh, min_ops=3, max_ops=12))
        def prop(sg):
            want = _expected_padding(sg)
            assert _padding(sg.gm) == want
            tag_collectives_for_bucketing(sg.gm)
            bucket_tagged_collectives(sg.gm, PreOverlapConfig())
            assert _padding(sg.gm) == want, "bucketing hid or invented padding"

        prop()
