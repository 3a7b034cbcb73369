"""The loss output's candidates: Replicate (the global loss) unless a pin asks for a rank's local
mean (``P(avg)``), the hand FSDP convention; offered always, every plan would take it."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate

from autoparallel.planner.problem import loss_placements


def test_the_loss_is_replicate_unless_local_is_asked_for():
    assert loss_placements(2, local=False) == [(Replicate(), Replicate())]


def test_local_offers_every_mix_of_replicate_and_avg_partial():
    got = loss_placements(2, local=True)
    R, P = Replicate(), Partial("avg")
    assert sorted(map(str, got)) == sorted(map(str, [(R, R), (R, P), (P, R), (P, P)]))
    assert all(not isinstance(p, Partial) or p.reduce_op == "avg" for pl in got for p in pl)


@pytest.mark.parametrize("ndim", [1, 3])
def test_local_keeps_replicate_first_and_counts_two_to_the_dims(ndim):
    got = loss_placements(ndim, local=True)
    assert len(got) == 2**ndim and got[0] == tuple(Replicate() for _ in range(ndim))
