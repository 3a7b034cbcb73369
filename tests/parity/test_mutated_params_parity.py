"""plan="auto" on a model that updates a parameter in place in forward (gemma3n's AltUp clamps
``prediction_coefs.weight.data``), trained on a dp=2,tp=2 gloo world: AOTAutograd gives the
parameter's new value (``mutated:<fqn>``) a tangent of its own, ahead of the loss's. Every stage
bitwise against the plan's placements run eagerly, and the oracle passing, needs both halves of
the fix: the second compile labels each tangent by what it is the tangent of (patch
``tangent_roles``; without it the collective-pass executor cannot tell what to feed
``tangents_2``, gemma3n_text's failure), and the graph executors feed that tangent zeros, not the
loss's 1 (patch ``zero_tangents``; without it the graphs add 1 to the parameter's gradient, which
the compiled modules, run by autograd, do not). CI's slow step ("planned-parity")."""

from __future__ import annotations

import pytest
import torch

from autoparallel import roles
from verify.model_case import ModelCase
from verify.zoo import ClampedCoefs
from verify.zoo import mse_loss as mse

pytestmark = [pytest.mark.xdist_group("planned-parity"), pytest.mark.timeout(900)]


def _batch(n):
    return torch.randn(n, 16), torch.randn(n, 8)


def test_a_parameter_clamped_in_place_trains_as_in_eager(model_check):
    result = model_check(ModelCase("clamped_coefs", ClampedCoefs, mse, _batch, batch_per_rank=2), plan="auto", mesh="dp=2,tp=2")
    assert roles.mutated("coefs.weight") in result.run.joint.output_roles
