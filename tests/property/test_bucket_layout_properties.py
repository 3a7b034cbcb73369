"""Property: graphs that compute the same gradients in any two orders (as graphs traced per rank
do) lay their merged reduce-scatter out alike (autoparallel.passes.bucket_layout); the unit tests
beside the pass (tests/unit/autoparallel/passes/test_bucket_layout.py) show the patch-off failure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from autoparallel.fx_utils import REDUCE_SCATTER
from autoparallel.mesh import fake_world
from autoparallel.passes.bucket_layout import layout_keys
from autoparallel.passes.bucket_plan import plan_buckets
from autoparallel.passes.pre_overlap_bucketing import tag_collectives_for_bucketing
from verify.graphs.generators import gradients_in_order


@given(st.permutations(range(4)), st.permutations(range(4)),
       st.lists(st.sampled_from([2, 4, 6]), min_size=4, max_size=4))
def test_property_any_two_gradient_orders_give_one_layout(order_a, order_b, sizes):
    """Generated: four gradients of mixed sizes in two random orders, one bucket: it holds the
    same members in the same order on both graphs (parameter order)."""
    with fake_world("dp=2") as mesh:
        layouts = []
        for order in (order_a, order_b):
            gm = gradients_in_order(mesh, list(order), sizes)
            tag_collectives_for_bucketing(gm)
            rs = [n for n in gm.graph.nodes if n.target is REDUCE_SCATTER]
            buckets = plan_buckets(gm.graph, rs, lambda n: 0, lambda _i: 64.0, None)
            keys = layout_keys(gm.graph, rs)
            layouts.append([[keys[n] for n in bucket] for bucket in buckets])
    assert layouts[0] == layouts[1] == [[f"grad:p{i}" for i in range(4)]]
