"""Parameters that some data-parallel ranks read and others do not, gathered first on every rank.

The program gathers a parameter where the model reads it (``program._GatherParam``). An MoE that
runs only the experts some token reaches (switch_transformers' ``for expert_idx in expert_hit``)
reads an expert on the ranks whose slice reaches it only, so the ranks would issue different
all-gathers and reduce-scatters. FSDP2 gathers a whole FSDP unit at its pre-forward whether or not
the step reads each parameter, and with ``set_reduce_scatter_unused_params(True)`` (meant for
"mixture of experts" in its docstring) reduce-scatters a zero gradient for those without one;
DDP's ``find_unused_parameters`` all-reduces zeros likewise. The program has no units (a
parameter is gathered at its first read), so the parameters the ranks disagree on are gathered at
the start of the forward, in parameter order, on every rank (one point every rank reaches in the
same order), and the loss passes each of them a zero gradient (:class:`ZeroGrads`): a rank that
read one adds zero to its gradient, one that did not reduces zeros. A parameter no rank reads is
not in the set: no collective, gradient None, as single-device eager gives it.

Which parameters each rank reads is the caller's to find and agree on (``verify.parity.retrace``
records them per rank and step, and exchanges the sets).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


class ZeroGrads(torch.autograd.Function):
    """``loss`` unchanged; backward gives each of ``xs`` a zero gradient shaped like it. It reads
    each x (``zeros_like``), so every rank's backward uses the gathered value at the same point,
    and the FSDP tagging keeps these gathers saved, not recomputed (``fsdp_recompute``'s ``kept``):
    a recomputed gather would land at each rank's own first backward use."""

    @staticmethod
    def forward(ctx, loss, *xs):
        ctx.save_for_backward(*xs)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros_like(x) * grad for x in ctx.saved_tensors))


def gather_first(model: nn.Module, fqns: Sequence[str]) -> list[torch.Tensor]:
    """Read ``model``'s parameters ``fqns`` (user FQNs) in order: under ``parametrize.cached()``
    each is gathered here, once, and the model's later read takes the cached value."""
    out = []
    for fqn in fqns:
        owner, _, attr = fqn.rpartition(".")
        try:
            module = model.get_submodule(owner) if owner else model
            out.append(getattr(module, attr))
        except AttributeError as e:
            raise ValueError(f"gather_first: the model has no parameter {fqn!r}") from e
    return out


def with_zero_grads(loss: torch.Tensor, gathered: Iterable[torch.Tensor]) -> torch.Tensor:
    """``loss`` through :class:`ZeroGrads` for the gathered values that need a gradient."""
    xs = [t for t in gathered if t.requires_grad]
    return ZeroGrads.apply(loss, *xs) if xs else loss


__all__ = ["ZeroGrads", "gather_first", "with_zero_grads"]
