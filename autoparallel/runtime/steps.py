"""Training steps on one rank, the same way for every executor of the parallel program.

An executor maps (parameter shards, local batch) -> (loss, gradients), and updates the rank's
buffers in place where the model mutates them (BatchNorm's running stats). A parameter without
a gradient (frozen, or one the loss does not reach) has the gradient None, as eager PyTorch
leaves its ``.grad``: ``train_steps`` records None and AdamW skips it. Running several
executors through ``train_steps`` with the same optimizer lets parity tests compare eager, the
joint graph, the split graphs and compiled modules step by step, optimizer updates and buffers
included.

Executors (each an :class:`Executor`: call it, and read ``.buffers`` for the live buffers it
updates, by FQN):

* :func:`eager_program_executor`: a ``ParallelProgram`` with autograd (the reference);
* :func:`joint_graph_executor`: a joint graph ``gm(primals, tangents)``, forward and backward in
  one call; the buffers' new values it returns (``mutated:<fqn>`` outputs) are applied;
* :func:`split_graph_executor`: a (forward, backward) pair, inputs and outputs matched by role;
* :func:`parallel_module_executor` / :func:`compiled_module_executor`: a ``ParallelModule`` and
  its ``torch.compile``'d version (autograd drives the backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from autoparallel import meta as M
from autoparallel import patches, roles
from autoparallel.parallelize.program import clean_fqn

ZERO_TANGENTS = "zero_tangents"

Step = Callable[[Mapping[str, torch.Tensor], Sequence[torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class Executor:
    """One training step of some form of the parallel program: ``executor(params, inputs) ->
    (loss, {fqn: grad})``. ``buffers``: the live buffers (by FQN) the step updates in place, which
    ``train_steps`` records after every step."""

    step: Step
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, params: Mapping[str, torch.Tensor], inputs: Sequence[torch.Tensor]):
        return self.step(params, inputs)


@dataclass
class StepTrace:
    """Losses, gradients and buffers (after the step) of each step (detached copies; ``buffers``
    is empty for an executor without buffers; a gradient is None where the parameter got none),
    and the parameters and AdamW state after the last step (``optimizer_state[fqn]``:
    ``exp_avg``, ``exp_avg_sq``; empty for a parameter AdamW never stepped)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)
    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
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

    return Executor(run, {clean_fqn(n): b for n, b in program.named_buffers()})


def _module_step(module: torch.nn.Module, call: Callable[..., torch.Tensor]) -> Executor:
    """A step of a module that keeps its own parameters: the step's ``params`` are copied in, and
    back out after the step, so an update the module makes in place in forward (AOTAutograd's
    epilogue writing a ``mutated:<fqn>`` parameter, gemma3n's clamp of ``weight.data``) is what the
    optimizer steps, as in eager and in the graph executors (:func:`loss_and_updates`)."""

    def run(params, inputs):
        local = module.local_parameters()
        for fqn, p in local.items():
            p.grad = None
            with torch.no_grad():
                p.copy_(params[fqn])
        loss = call(*inputs)
        loss.backward()
        with torch.no_grad():
            for fqn, p in local.items():
                if p is not params[fqn]:
                    params[fqn].copy_(p)
        return loss.detach(), {fqn: p.grad for fqn, p in local.items()}

    return Executor(run, dict(module.model.named_buffers()))


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


def loss_and_updates(
    values: Sequence[object], output_roles: Sequence[str | None], buffers: Mapping[str, torch.Tensor], where: str,
    params: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The loss among a forward's outputs (by role); each ``mutated:<fqn>`` output is copied into
    its buffer, or its parameter (a model that updates a weight in place in forward: gemma3n's
    clamp of ``weight.data``), as AOTAutograd's epilogue does in a compiled module."""
    loss = None
    for value, role in zip(values, output_roles, strict=False):
        if role == roles.LOSS:
            loss = value
        elif roles.is_mutated(role):
            fqn = roles.name(role)
            target = buffers.get(fqn, (params or {}).get(fqn))
            if target is None:
                raise KeyError(f"{where}: output {role!r} updates {fqn!r}, which is no buffer or parameter given to the step")
            with torch.no_grad():
                target.copy_(value)
    if loss is None:
        raise ValueError(f"{where}: no output has the role {roles.LOSS!r} (output roles: {list(output_roles)})")
    return loss


def _named_grads(
    values: Sequence[object], output_roles: Sequence[str | None], where: str, input_roles: Sequence[str | None]
) -> dict[str, torch.Tensor | None]:
    """The ``grad:<fqn>`` outputs by FQN, one entry per ``param:<fqn>`` of ``input_roles``; None
    where the graph returns None or no output at all (no gradient: frozen, or the loss does not
    reach the parameter)."""
    named = dict.fromkeys(roles.names_of([r for r in input_roles if roles.kind(r) is not None], roles.PARAM))
    if len(values) != len(output_roles):
        raise ValueError(f"{where}: {len(values)} outputs but {len(output_roles)} output roles")
    for value, role in zip(values, output_roles, strict=True):
        if not roles.is_grad(role):
            continue
        named[roles.name(role)] = value
    return named


def tangent_value(role: str, traced: object) -> torch.Tensor:
    """What a step feeds the tangent placeholder ``role``: a 1 for the loss's, zeros for any other
    output's (patch ``zero_tangents``), in the dtype (and, for zeros, the shape) of ``traced``, the
    placeholder's traced value (a rank's piece where the graph is a rank's).

    A step differentiates the loss alone. Another output that needs a tangent, such as a
    parameter's new value (``tangent:mutated:<fqn>``: gemma3n clamps ``weight.data`` in forward),
    is read by nothing after the graph, so its gradient is 0, the zeros autograd materializes for
    it in the compiled module. Disabled: a 1 for every tangent, which adds 1 to that parameter's
    gradient. ValueError for a tangent of another output without a traced value to shape it."""
    dtype = getattr(traced, "dtype", torch.float32)
    if role == roles.tangent(roles.LOSS) or not patches.enabled(ZERO_TANGENTS):
        return torch.ones((), dtype=dtype)
    if not isinstance(traced, torch.Tensor):
        raise ValueError(f"tangent {role!r} has no traced value (meta['val']) to shape its zeros")
    return torch.zeros(traced.shape, dtype=dtype)


def _tangents(gm: fx.GraphModule, input_roles: Sequence[str]) -> list[torch.Tensor]:
    """The joint graph's tangents (:func:`tangent_value`), in placeholder order; ``input_roles``
    has one role per placeholder (without one per placeholder, no traced values: fp32)."""
    phs = list(gm.graph.find_nodes(op="placeholder"))
    traced = [ph.meta.get(M.VAL) for ph in phs] if len(phs) == len(input_roles) else [None] * len(input_roles)
    return [tangent_value(r, t) for r, t in zip(input_roles, traced, strict=True) if roles.is_tangent(r)]


def joint_graph_executor(
    gm: fx.GraphModule,
    input_roles: Sequence[str],
    output_roles: Sequence[str | None],
    buffers: Mapping[str, torch.Tensor],
) -> Executor:
    """Runs a joint graph: forward and backward in one call, ``gm(primals, tangents)`` as traced
    (or ``gm(*primals, *tangents)`` once a pass has flattened its calling convention). Outputs
    are read by role (``output_roles``, flat): the ``loss``, the ``grad:<fqn>`` gradients, and
    ``mutated:<fqn>`` new buffer values, copied into ``buffers`` (the caller's)."""
    tangents = _tangents(gm, input_roles)
    nested = isinstance(gm.graph._codegen, fx.graph._PyTreeCodeGen)

    def run(params, inputs):
        primals = primals_by_role(input_roles, params, buffers, inputs)
        with torch.no_grad():
            if nested:
                fw_out, grads = gm(primals, tangents)
                outs = [*fw_out, *grads]
            else:
                outs = list(gm(*primals, *tangents))
        loss = loss_and_updates(outs, output_roles, buffers, "joint graph", params)
        return loss.detach(), _named_grads(outs, output_roles, "joint graph", input_roles)

    return Executor(run, buffers)


def split_graph_executor(fw: fx.GraphModule, bw: fx.GraphModule, buffers: Mapping[str, torch.Tensor]) -> Executor:
    """Runs a (forward, backward) pair from a partitioner (``label_partition`` roles on both):
    forward placeholders fed by role (``param:``, ``buffer:``, ``input:``), the loss and buffer
    updates read from the forward's outputs by role, the backward fed the forward's ``saved:<k>``
    outputs, parameters and the tangents (:func:`tangent_value`), gradients read by role."""
    fw_roles = [_role_of(ph) for ph in fw.graph.find_nodes(op="placeholder")]
    bw_roles = [_role_of(ph) for ph in bw.graph.find_nodes(op="placeholder")]
    fw_out_roles = fw.graph.output_node().meta.get(M.ROLE)
    bw_out_roles = bw.graph.output_node().meta.get(M.ROLE)
    if fw_out_roles is None or bw_out_roles is None:
        raise ValueError("split_graph_executor: the output nodes carry no roles; label the pair with partition.label_partition")
    tangents = {  # fed every step: a 1 for the loss's, zeros for another output's
        r: tangent_value(r, ph.meta.get(M.VAL))
        for r, ph in zip(bw_roles, bw.graph.find_nodes(op="placeholder"), strict=True)
        if roles.is_tangent(r)
    }

    def run(params, inputs):
        primals = primals_by_role(fw_roles, params, buffers, inputs)
        with torch.no_grad():
            outs = fw(*primals)
            loss = loss_and_updates(outs, fw_out_roles, buffers, "forward graph", params)
            saved = {r: v for v, r in zip(outs, fw_out_roles, strict=True) if roles.is_saved(r)}
            bw_in = []
            for r in bw_roles:
                kind, name = roles.parse(r)
                if kind == roles.SAVED:
                    bw_in.append(saved[r])
                elif kind == roles.TANGENT:
                    bw_in.append(tangents[r])
                else:
                    bw_in.append(primals_by_role([r], params, buffers, inputs)[0])
            grads = bw(*bw_in)
        return loss.detach(), _named_grads(grads, bw_out_roles, "backward graph", fw_roles)

    return Executor(run, buffers)


def _role_of(node: fx.Node) -> str:
    role = node.meta.get(M.ROLE)
    if role is None:
        raise ValueError(
            f"placeholder {node.name!r} has no role label (meta[ROLE]); cannot tell what to feed it "
            "(label the pair with partition.label_partition)"
        )
    return role


def step_seed(seed: int, step: int) -> int:
    """The generator seed of training step ``step`` for a run seeded ``seed``."""
    return seed * 1_000_003 + step


@contextlib.contextmanager
def seeded(seed: int, devices: Iterable[torch.device] = ()) -> Iterator[None]:
    """Every generator seeded ``seed`` inside (``torch.manual_seed`` seeds the CUDA ones too);
    after, the CPU generator's state and that of each CUDA device in ``devices`` are what they
    were before."""
    cuda = sorted({d.index if d.index is not None else torch.cuda.current_device()
                   for d in map(torch.device, devices) if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


def _devices_of(batches: Sequence[Sequence[torch.Tensor]]) -> set[torch.device]:
    return {t.device for b in batches for t in b if isinstance(t, torch.Tensor)}


def train_steps(
    executor: Executor | Step,
    params: Mapping[str, torch.Tensor],
    batches: Sequence[Sequence[torch.Tensor]],
    *,
    lr: float = 1e-2,
    seed: int | None = None,
) -> StepTrace:
    """Run one step per batch with AdamW between steps; ``params`` are updated in place. The
    executor's ``buffers`` (if any) are recorded after each step. ``seed``: each step runs with the
    generators seeded ``step_seed(seed, step)`` (:func:`seeded`; the CPU one and those of the
    batches' CUDA devices restored after), so every executor of a rank draws the same random
    numbers (dropout masks) whatever ran before it."""
    leaves = {k: v if isinstance(v, torch.nn.Parameter) else torch.nn.Parameter(v) for k, v in params.items()}
    opt = torch.optim.AdamW(list(leaves.values()), lr=lr)
    buffers = getattr(executor, "buffers", None) or {}
    trace = StepTrace()
    devices = _devices_of(batches)
    for step, inputs in enumerate(batches):
        with seeded(step_seed(seed, step), devices) if seed is not None else contextlib.nullcontext():
            loss, grads = executor(leaves, inputs)
        missing = set(leaves) - set(grads)
        if missing:
            raise RuntimeError(f"executor returned no gradient entry for {sorted(missing)} (None says: no gradient)")
        for k, p in leaves.items():
            p.grad = grads[k]  # None: AdamW skips the parameter, as in eager PyTorch
        trace.losses.append(loss.detach().clone())
        trace.grads.append({k: None if g is None else g.detach().clone() for k, g in grads.items()})
        if buffers:
            trace.buffers.append({k: b.detach().clone() for k, b in buffers.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    trace.params = {k: p.detach().clone() for k, p in leaves.items()}
    trace.optimizer_state = {
        k: {name: t.detach().clone() for name, t in opt.state[p].items() if name in ("exp_avg", "exp_avg_sq")}
        for k, p in leaves.items()
    }
    return trace
