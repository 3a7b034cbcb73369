"""run_planned_parity's ``lowering``: a name that is no lowering is refused before anything runs
(the model is never built, no rank starts). That the option reaches the ranks is checked in the
slow planned parity cells (tests/parity/test_planned_parity.py: ``PlannedRank.replayed``)."""

from __future__ import annotations

import pytest
import torch

from verify.parity.planned import PlannedCase, run_planned_parity


def _never(*_):
    raise AssertionError("built a model or batches for a refused lowering")


def test_an_unknown_lowering_is_refused_before_any_rank_starts():
    case = PlannedCase("never-run", model=_never, batches=_never, mesh="dp=2", loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(ValueError, match=r"lowering='fast': expected one of \['dtensor', 'replay'\]"):
        run_planned_parity(case, 1, lowering="fast")
