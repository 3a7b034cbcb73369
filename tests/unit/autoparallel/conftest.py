"""Fixtures shared by the autoparallel unit tests: a small model that is not LLaMA."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class TwoLayerMLP(nn.Module):
    """16 -> 32 -> 8, no biases: two FSDP-shardable weights, a few kernels to compile."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


@pytest.fixture(scope="session")
def mlp():
    """``(TwoLayerMLP factory, mse loss)``: a user model with a custom loss (not LLaMA)."""
    return TwoLayerMLP, mse


@pytest.fixture(scope="session")
def mlp_batch():
    """A function returning a deterministic (input, target) batch of 4 for the TwoLayerMLP."""

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)

    return batch
