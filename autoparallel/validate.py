"""Checks of what users bring (the loss, the example inputs), shared by both front ends: the
joint-graph tracer (``autoparallel.parallelize``) and the graph trainer (``autoparallel.trainer``).

Each check raises ValueError naming the culprit and what to do, before it turns into an obscure
failure deep in a trace or an executor.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_loss"]


def check_loss(loss: Any, *, needs_grad: bool = True) -> None:
    """``loss`` must be a floating-point scalar tensor (that depends on a parameter)."""
    if isinstance(loss, (tuple, list)):
        raise ValueError(
            f"loss_fn returned a {type(loss).__name__} of {len(loss)}; it must return the loss alone, "
            "a scalar tensor (compute auxiliary values outside loss_fn)"
        )
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn must return a scalar (0-dim) tensor, got shape {tuple(loss.shape)}; "
            "reduce it (e.g. .mean()) inside loss_fn"
        )
    if not loss.dtype.is_floating_point:
        raise ValueError(f"loss_fn must return a floating-point scalar, got dtype {loss.dtype}")
    if needs_grad and torch.is_grad_enabled() and loss.grad_fn is None:
        raise ValueError("the loss does not depend on any parameter (it has no grad_fn)")
