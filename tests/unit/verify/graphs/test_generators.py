"""verify.graphs.generators: ``synthetic_graphs(..., repeats=n)`` runs the drawn ops n times in a row,
as a model's blocks do (the reused-bucket-traces property draws such graphs)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from autoparallel.mesh import fake_world
from autoparallel.passes.pre_overlap_bucketing import collective_counts
from verify.graphs.generators import build_synthetic, mesh_groups, synthetic_graphs


def test_repeated_ops_build_every_collective_again():
    with fake_world("dp=4,tp=2") as mesh:

        @settings(max_examples=10, database=None)
        @given(synthetic_graphs(mesh, min_ops=2, max_ops=6, repeats=3))
        def prop(sg):
            n = len(sg.spec.ops) // 3
            once = sg.spec.ops[:n]
            assert sg.spec.ops == once * 3
            single = build_synthetic(type(sg.spec)(sg.spec.hidden, sg.spec.batch, once), mesh_groups(mesh)).gm
            assert {k: 3 * v for k, v in collective_counts(single).items()} == collective_counts(sg.gm)

        prop()


def test_repeats_below_one_are_refused():
    with fake_world("dp=4,tp=2") as mesh, pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        synthetic_graphs(mesh, repeats=0)
