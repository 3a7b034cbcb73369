"""A forward that reseeds the global RNG is refused at trace time, naming the call (reformer's
training forward reseeds from OS entropy per layer; before, it traced and failed "NOT bitwise"
on 183 of 230 tensors with no reason given)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, build_joint_graph
from autoparallel.parallelize.reseeds import RNGReseedError, reseeds_refused
from verify.commands.sweep import classify


class Reseeding(nn.Module):
    """Dropout after a reseed in forward: ``entropy`` draws the seed as reformer does."""

    def __init__(self, entropy: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.entropy = entropy

    def forward(self, x):
        torch.manual_seed(int(torch.seed() % 2**31) if self.entropy else 7)
        return F.dropout(self.lin(x), 0.1, self.training)


class OwnGenerator(nn.Module):
    """Draws from a generator of its own, seeded in forward: the global RNG is untouched."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        g = torch.Generator().manual_seed(3)
        return self.lin(x) + torch.rand(x.shape, generator=g)


def _trace(model):
    batch = torch.randn(4, 4), torch.randn(4, 4)
    with fake_world("dp=2") as mesh, build_joint_graph(model, ParallelPlan.fsdp(), mesh, batch, F.mse_loss) as joint:
        return joint


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy-seed", "constant-seed"])
def test_a_forward_that_reseeds_the_global_rng_is_refused_naming_the_call(entropy):
    torch.manual_seed(0)
    with pytest.raises(RNGReseedError, match=r"reseeds the global RNG in forward \(torch\.(seed|manual_seed)\(\) at .*test_reseeds\.py"):
        _trace(Reseeding(entropy))
    assert torch.initial_seed() == 0, "the refusal left the global generator reseeded"


def test_a_module_with_its_own_generator_is_not_refused():
    # negative: seeding a private generator is no reseed of the global one; the draw is traced
    joint = _trace(OwnGenerator())
    assert any("rand" in str(n.target) for n in joint.gm.graph.nodes)


def test_a_reseed_through_the_generator_object_is_caught_without_a_site():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises(RNGReseedError, match="through torch.default_generator"):
        with reseeds_refused():
            torch.default_generator.manual_seed(5)
    assert torch.initial_seed() == 0 and torch.equal(torch.get_rng_state(), state)
    with reseeds_refused():  # negative: drawing is not reseeding
        torch.rand(3)


def test_the_wrappers_are_removed_on_exit_even_when_the_body_raises():
    seed, manual_seed = torch.seed, torch.manual_seed
    with pytest.raises(KeyError):
        with reseeds_refused():
            raise KeyError("body")
    assert (torch.seed, torch.manual_seed) == (seed, manual_seed)


def test_the_sweep_classes_the_refusal():
    msg = str(RNGReseedError("the model reseeds the global RNG in forward (torch.seed() at m.py:1)"))
    assert classify("REFUSED", msg) == "RNG reseed"
    assert classify("REFUSED", "some other refusal") != "RNG reseed"
