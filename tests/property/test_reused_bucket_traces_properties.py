"""reused_bucket_traces on generated graphs (verify.graphs.generators): the pre-overlap pass builds the
graph upstream builds, node by node (targets, arguments, fake values' metadata, which values alias
which), and it traces each signature once: as many traces as the signatures upstream traced, the
rest reused. The drawn ops run twice, as two blocks of a model do, so buckets can repeat."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from autoparallel import patches
from autoparallel.mesh import fake_world
from autoparallel.passes.pre_overlap_bucketing import (
    PreOverlapConfig,
    bucket_tagged_collectives,
    tag_collectives_for_bucketing,
)
from autoparallel.passes.reused_bucket_traces import PATCH, reusing_bucket_traces
from verify.graphs.generators import synthetic_graphs
from verify.graphs.invariants import check_same_graph_and_values

MESH = "dp=4,tp=2"
# Two bucketing passes per example on graphs of up to 16 ops: a quarter of the profile's examples
# (the tier's 25 -> 6, CI's deep 200 -> 50; the full count doubled the deep pass's 60 s).
EXAMPLES = max(4, settings.default.max_examples // 4)
caps_mb = st.sampled_from((2**20, 8192, 512, 256)).map(lambda b: b / 2**20)


def test_pre_overlap_pass_builds_upstreams_graph_tracing_each_signature_once(bucket_traces):
    traced = []
    with fake_world(MESH) as mesh:

        @settings(max_examples=EXAMPLES)
        @given(synthetic_graphs(mesh, min_ops=3, max_ops=8, repeats=2), caps_mb)
        def prop(sg, cap_mb):
            gm = sg.gm
            tag_collectives_for_bucketing(gm)
            twin = copy.deepcopy(gm)
            config = PreOverlapConfig(bucket_cap_mb=cap_mb)
            with reusing_bucket_traces() as counts:
                bucket_tagged_collectives(gm, config)
            bucket_traces.clear()
            with patches.disabled(PATCH):
                bucket_tagged_collectives(twin, config)
            keys = list(bucket_traces)  # every bucket upstream traced
            assert check_same_graph_and_values(twin, gm) == []
            keyed = [k for k in keys if k is not None]
            assert counts == {"traced": len(keys) - len(keyed) + len(set(keyed)), "reused": len(keyed) - len(set(keyed))}
            traced.append(len(keys))

        prop()
    assert sum(traced) > 0, f"no generated graph had a bucket to merge ({len(traced)} examples)"
