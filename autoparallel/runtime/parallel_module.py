"""``ParallelModule``: the per-rank training module that apply_placement returns.

It owns the rank's local parameter shards (and buffers) under the user's FQNs, in a module tree
below ``self.model`` (``model.layers.0.attention.wq.weight``), and runs the first partition's
forward and backward graphs through the callable ``aot_compile_joint_with_descriptors``
returned. That callable is an autograd Function, so ``loss = mod(*inputs); loss.backward()``
fills ``.grad`` of the local shards. Its compilers are FX interpreters under
``preserve_node_meta``, so a later re-trace (``torch.compile(mod, backend=...)``) sees each op
with the metadata of the graph node that ran it: the recompute tags and the first partition's
``custom.ap_must_save`` records reach the second compile that way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from autoparallel import roles


@dataclass
class PartitionRecord:
    """The first partition: its graphs and what its forward saves for the backward."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    saved: list[str] = field(default_factory=list)  # forward output node names saved for backward
    num_fwd_outputs: int = 1

    @property
    def acted(self) -> int:
        """Values the partition saved for the backward (recorded as ``ap_must_save``)."""
        return len(self.saved)


def _module_tree(
    params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], frozen: frozenset[str] = frozenset()
) -> nn.Module:
    """Plain modules holding ``params`` (``frozen`` ones with ``requires_grad=False``, so autograd
    and a later ``torch.compile`` give them no gradient, as the traced program did) and ``buffers``."""
    root = nn.Module()

    def owner_of(fqn: str) -> tuple[nn.Module, str]:
        *path, attr = fqn.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        return mod, attr

    for fqn, t in params.items():
        mod, attr = owner_of(fqn)
        trainable = fqn not in frozen
        keep = isinstance(t, nn.Parameter) and t.requires_grad == trainable
        mod.register_parameter(attr, t if keep else nn.Parameter(t.detach(), requires_grad=trainable))
    for fqn, t in buffers.items():
        mod, attr = owner_of(fqn)
        mod.register_buffer(attr, t, persistent=False)
    return root


class ParallelModule(nn.Module):
    """``forward(*inputs) -> loss`` on one rank, over local shards, through compiled graphs.

    ``input_roles`` are the primal roles of the joint graph, in calling order (``param:<fqn>``,
    ``buffer:<fqn>``, ``input:<i>``); ``inputs`` fill the ``input:<i>`` slots. ``frozen``: the
    parameters the model holds with ``requires_grad=False`` (they get no gradient).
    """

    def __init__(
        self,
        compiled_fn: Callable[..., Any],
        input_roles: Sequence[str],
        params: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        *,
        first_partition: PartitionRecord | None = None,
        steps: Sequence[str] = (),
        group_dims: Mapping[str, str] | None = None,
        uninitialised: Sequence[str] = (),
        frozen: Sequence[str] = (),
    ):
        super().__init__()
        primal_roles = [r for r in input_roles if not roles.is_tangent(r)]
        want_params = roles.names_of(primal_roles, roles.PARAM)
        want_buffers = roles.names_of(primal_roles, roles.BUFFER)
        for kind, want, have in (("parameter", want_params, params), ("buffer", want_buffers, buffers)):
            missing = sorted(set(want) - set(have))
            if missing:
                raise ValueError(f"ParallelModule: no local {kind} given for {missing}")
        self.model = _module_tree(
            {k: params[k] for k in want_params}, {k: buffers[k] for k in want_buffers}, frozenset(frozen)
        )
        self._compiled = compiled_fn
        parsed = [roles.parse(r) for r in primal_roles]
        self._slots = [_slot(kind, name) for kind, name in parsed]
        self.num_inputs = sum(1 for kind, _ in parsed if kind == roles.INPUT)
        self.first_partition = first_partition
        self.steps = tuple(steps)
        self.group_dims = dict(group_dims or {})
        # Local tensors allocated without values (the model was on meta): running the module
        # would compute on memory nobody wrote (pipeline.second_compile refuses to run it).
        self.uninitialised = tuple(uninitialised)

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """Local shards by the user's parameter FQN."""
        return dict(self.model.named_parameters())

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != self.num_inputs:
            raise TypeError(f"ParallelModule takes {self.num_inputs} inputs, got {len(inputs)}")
        args = []
        for store, path, key in self._slots:
            if store is None:
                args.append(inputs[key])
                continue
            mod = self.model
            for part in path:
                mod = mod._modules[part]
            args.append(getattr(mod, store)[key])
        return self._compiled(*args)


def _slot(kind: str, name: str) -> tuple[str | None, tuple[str, ...], Any]:
    """Where ``forward`` finds a primal: (``"_parameters"`` or ``"_buffers"``, the owning
    submodule's path, the attribute name), or (None, (), input index). The local tree is ours
    (``_module_tree``: plain modules, no hooks), so these dict lookups are what ``get_parameter``
    would find. They are for ``torch.compile``: Dynamo runs ``forward`` symbolically, bytecode by
    bytecode, and ``get_parameter``'s string splitting and checks were half of its steps on a
    small model; the sources it records stay ``._modules[...]._parameters[...]``, which
    ``compile.dynamo_input_roles`` reads."""
    if kind == roles.INPUT:
        return None, (), int(name)
    *path, attr = name.split(".")
    return ("_parameters" if kind == roles.PARAM else "_buffers"), tuple(path), attr
