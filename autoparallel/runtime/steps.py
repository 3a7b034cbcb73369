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

from autoparallel import meta as M
from autoparallel import roles

Executor = Callable[[Mapping[str, torch.Tensor], Sequence[torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class StepTrace:
    """Losses and gradients of each step (detached copies), and the parameters and AdamW state
    after the last step (``optimizer_state[fqn]``: ``exp_avg``, ``exp_avg_sq``)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


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
    """Runs a joint graph: forward and backward in one call, ``gm(primals, tangents)`` as traced,
    or with flat arguments once a pass has recompiled it (the placement steps' graphs)."""
    tangent_count = sum(1 for r in input_roles if roles.is_tangent(r))
    pytree = isinstance(gm.graph._codegen, fx.graph._PyTreeCodeGen)

    def run(params, inputs):
        primals = primals_by_role(input_roles, params, buffers, inputs)
        tangents = [torch.ones((), dtype=torch.float32)] * tangent_count
        with torch.no_grad():
            if pytree:
                fw_out, grads = gm(primals, tangents)
                outs = [*fw_out, *grads]
            else:
                outs = list(gm(*primals, *tangents))
        named = {roles.name(r): o for r, o in zip(output_roles, outs, strict=True) if roles.is_grad(r)}
        return outs[output_roles.index(roles.LOSS)].detach(), named

    return run


def split_graphs_executor(fw: fx.GraphModule, bw: fx.GraphModule, buffers: Mapping[str, torch.Tensor]) -> Executor:
    """Runs a forward graph, then its backward graph on the values the forward saved: any
    partition (the first, the second compile's, bucketed ones). Inputs and outputs are picked by
    the role labels the partitions write on placeholders and outputs (``param:``, ``saved:``,
    ``tangent:``, ``grad:`` ...), so the graphs' own order is all that matters."""
    fw_inputs = [_role_of(n) for n in fw.graph.find_nodes(op="placeholder")]
    fw_outputs = fw.graph.output_node().meta.get(M.ROLE)
    bw_inputs = [_role_of(n) for n in bw.graph.find_nodes(op="placeholder")]
    bw_outputs = bw.graph.output_node().meta.get(M.ROLE)
    if fw_outputs is None or bw_outputs is None:
        raise ValueError("split_graphs_executor: the forward or backward graph's output carries no role labels (meta[ROLE]); label them as the partitioners do")

    def run(params, inputs):
        primals = primals_by_role(fw_inputs, params, buffers, inputs)
        with torch.no_grad():
            values = dict(zip(fw_inputs, primals, strict=True))  # the backward may read primals too
            values.update(zip(fw_outputs, fw(*primals), strict=True))
            grads = bw(*(torch.ones((), dtype=torch.float32) if roles.is_tangent(r) else values[r] for r in bw_inputs))
        outs = values
        named = {roles.name(r): g for r, g in zip(bw_outputs, grads, strict=True) if roles.is_grad(r)}
        return outs[roles.LOSS].detach(), named

    return run


def _role_of(node: fx.Node) -> str:
    role = node.meta.get(M.ROLE)
    if role is None:
        raise ValueError(f"placeholder {node.name!r} has no role label (meta[ROLE]); cannot tell what to feed it")
    return role


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
    trace.params = {k: p.detach().clone() for k, p in leaves.items()}
    trace.optimizer_state = {
        k: {name: t.detach().clone() for name, t in opt.state[p].items() if name in ("exp_avg", "exp_avg_sq")}
        for k, p in leaves.items()
    }
    return trace
