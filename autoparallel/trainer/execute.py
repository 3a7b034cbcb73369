"""Run a traced training step and accumulate its gradients into ``param.grad``.

The graph already contains the backward ops, so it runs under ``torch.no_grad()`` (patch
``traced_no_grad``). With grad mode on, every op of the graph would also record an autograd
node holding its inputs, and the returned gradients would keep that whole second autograd graph
(every forward activation and backward intermediate) alive until they die: the peak becomes
roughly "all intermediates of the step" instead of what the graph's liveness allows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from autoparallel.patches import enabled
from autoparallel.trainer.trace import TracedStep

__all__ = ["accumulate_grads", "run_traced"]


def accumulate_grads(
    model: torch.nn.Module, step: TracedStep, grads: Sequence[torch.Tensor]
) -> None:
    """``param.grad = g`` (or ``+= g`` when a gradient is already there), per traced parameter.

    A tied parameter is one object, so it receives its single (already summed) gradient once.
    """
    params = dict(model.named_parameters())
    with torch.no_grad():
        for fqn, g in zip(step.param_fqns, grads, strict=True):
            p = params[fqn]
            g = g.detach()
            if p.grad is None:
                if g.stride() != p.stride():
                    g = torch.empty_like(p).copy_(g)  # AccumulateGrad's layout contract
                p.grad = g
            else:
                p.grad.add_(g)


def run_traced(
    step: TracedStep, model: torch.nn.Module, inputs: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Execute ``step`` with ``model``'s current parameters and buffers; return the loss.

    Gradients are accumulated into ``param.grad`` like ``loss.backward()`` does. The model must
    be the one the step was traced from (or one with the same parameter and buffer names).
    """
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    flat = step.flat_inputs(params, buffers, inputs)
    grad_ctx = torch.no_grad() if enabled("traced_no_grad") else contextlib.nullcontext()
    with grad_ctx:
        outs = step.gm(*flat)
    loss, grads = outs[0], outs[1:]
    accumulate_grads(model, step, grads)
    return loss.detach()
