"""Training steps on one rank, the same way for every executor of the parallel program.

An executor maps (parameter shards, local batch) -> (loss, gradients). Running several
executors through ``train_steps`` with the same optimizer lets parity tests compare eager, the
joint graph and compiled modules step by step, optimizer updates included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from autoparallel import roles

Executor = Callable[[Mapping[str, torch.Tensor], Sequence[torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class StepTrace:
    """Losses and gradients of each step (detached copies)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


def eager_program_executor(program: torch.nn.Module) -> Executor:
    """Runs the ParallelProgram eagerly with autograd (the reference)."""

    def run(params, inputs):
        local = program.local_parameters()
        for fqn, p in local.items():
            p.grad = None
            if p is not params[fqn]:
                with torch.no_grad():
                    p.copy_(params[fqn])
        loss = program(*inputs)
        loss.backward()
        return loss.detach(), {fqn: p.grad for fqn, p in local.items()}

    return run


def _module_step(module: torch.nn.Module, call: Callable[..., torch.Tensor]) -> Executor:
    def run(params, inputs):
        local = module.local_parameters()
        for fqn, p in local.items():
            p.grad = None
            with torch.no_grad():
                p.copy_(params[fqn])
        loss = call(*inputs)
        loss.backward()
        return loss.detach(), {fqn: p.grad for fqn, p in local.items()}

    return run


def parallel_module_executor(module: torch.nn.Module) -> Executor:
    """Runs a ParallelModule (the first partition's graphs; autograd drives the backward)."""
    return _module_step(module, module)


def compiled_module_executor(module: torch.nn.Module, compiled: Callable[..., torch.Tensor]) -> Executor:
    """Runs ``compiled`` (e.g. ``torch.compile(module, backend=...)``); gradients land on
    ``module.local_parameters()``."""
    return _module_step(module, compiled)


def primals_by_role(
    input_roles: Sequence[str],
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """A graph's primal inputs in placeholder order, picked by role (tangents are left out)."""
    primals = []
    for role in input_roles:
        kind, name = roles.parse(role)
        if kind == roles.PARAM:
            primals.append(params[name])
        elif kind == roles.BUFFER:
            primals.append(buffers[name])
        elif kind == roles.INPUT:
            primals.append(inputs[int(name)])
    return primals


def joint_graph_executor(
    gm: fx.GraphModule,
    input_roles: Sequence[str],
    output_roles: Sequence[str | None],
    buffers: Mapping[str, torch.Tensor],
) -> Executor:
    """Runs a joint graph ``gm(primals, tangents)``: forward and backward in one call."""
    tangent_count = sum(1 for r in input_roles if roles.is_tangent(r))

    def run(params, inputs):
        primals = primals_by_role(input_roles, params, buffers, inputs)
        with torch.no_grad():
            fw_out, grads = gm(primals, [torch.ones((), dtype=torch.float32)] * tangent_count)
        loss = fw_out[0]
        named = {}
        grad_fqns = roles.names_of(output_roles, roles.GRAD)
        for fqn, g in zip(grad_fqns, [g for g in grads if g is not None], strict=True):
            named[fqn] = g
        return loss.detach(), named

    return run


def train_steps(
    executor: Executor,
    params: Mapping[str, torch.Tensor],
    batches: Sequence[Sequence[torch.Tensor]],
    *,
    lr: float = 1e-2,
) -> StepTrace:
    """Run one step per batch with AdamW between steps; ``params`` are updated in place."""
    leaves = {k: v if isinstance(v, torch.nn.Parameter) else torch.nn.Parameter(v) for k, v in params.items()}
    opt = torch.optim.AdamW(list(leaves.values()), lr=lr)
    trace = StepTrace()
    for inputs in batches:
        loss, grads = executor(leaves, inputs)
        missing = set(leaves) - set(grads)
        if missing:
            raise RuntimeError(f"executor returned no gradient for {sorted(missing)}")
        for k, p in leaves.items():
            p.grad = grads[k]
        trace.losses.append(loss.detach().clone())
        trace.grads.append({k: g.detach().clone() for k, g in grads.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return trace
