"""Checks of what users bring (the loss, the example inputs), shared by both front ends: the
joint-graph tracer (``autoparallel.parallelize``) and the graph trainer (``autoparallel.trainer``).

Each check raises ValueError naming the culprit and what to do, before it turns into an obscure
failure deep in a trace or an executor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_input_dtypes", "check_loss"]


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


def check_input_dtypes(model: torch.nn.Module, model_inputs: Sequence[torch.Tensor], compute_dtype: torch.dtype | None = None) -> None:
    """Floating model inputs must have the dtype the parameters compute in (``compute_dtype``, a
    mixed-precision plan's param dtype, else the parameters' own). Eager PyTorch rejects a
    float64 input to a float32 Linear; a trace on fake tensors may not, and would describe a
    program that cannot run. Integer inputs (token ids) and the loss target are not checked."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    want = compute_dtype or (dtypes.pop() if len(dtypes) == 1 else None)
    if want is None:
        return
    for i, t in enumerate(model_inputs):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != want:
            raise ValueError(
                f"example input {i} has dtype {t.dtype} but the model computes in {want}; eager PyTorch "
                f"rejects mixing them (e.g. a Linear). Cast the input to {want}, or the model to "
                f"{t.dtype} (float64 models are supported)"
            )
