"""The oracle's scale for a buffer: what its module reads, not only its own value.

A gradient's bound uses its module's largest gradient entry (``compare.module_scales``): a
gradient made of cancelling terms is ~0 while its rounding is not. A buffer a forward updates has
the same problem: a running mean of a map that is zero-mean in exact arithmetic (a batch norm
after a normalisation; mobilevit's ``conv_kxk.normalization``) is 0.0 in one summation order and
1e-12 in another, and a bound relative to its own value (0) fails on rounding alone. Its rounding
error scales with the activations it averages, the input of the module that owns it; so a
floating buffer's scale is the larger of its own largest entry and the largest floating input
entry its owning module saw in the reference's forward (max over the data-parallel slices).
A buffer of a module without floating inputs (position ids, tables indexed by tokens) keeps its
own scale; integer buffers stay exact (``compare.check_within``). So does a buffer the step never
writes in the reference (a constant table, a frozen statistic in eval mode; written means a version
bump or a replaced tensor, not a changed value: a running mean of an exactly zero-mean map stays
0.0): nothing was accumulated into it, so any difference is an error of the program, not
rounding, and the wider bound would hide it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


@contextlib.contextmanager
def owner_input_scales(model: torch.nn.Module, scales: dict[str, float]) -> Iterator[dict[str, float]]:
    """While open, ``scales[module fqn]`` is kept at the largest |entry| of the floating tensors
    passed to each module of ``model`` that owns buffers directly (positional and keyword)."""

    def hook(name: str):
        def record(module, args, kwargs):
            leaves = [t for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
            if leaves:
                size = max(float(t.detach().abs().max()) for t in leaves)
                scales[name] = max(scales.get(name, 0.0), size)

        return record

    handles = [m.register_forward_pre_hook(hook(name), with_kwargs=True)
               for name, m in model.named_modules() if next(m.buffers(recurse=False), None) is not None]
    try:
        yield scales
    finally:
        for h in handles:
            h.remove()


# Ops whose schema does not declare the arguments they write: native_batch_norm updates its
# running stats (arguments 3 and 4) in place when training (argument 5), as ``Tensor?``.
_UNDECLARED_WRITES = {torch.ops.aten.native_batch_norm.default: ((3, 4), 5)}


class _Writes(TorchDispatchMode):
    """Names of the storages in ``names`` (by data pointer) that an op writes: its schema's
    ``Tensor(a!)`` arguments, and :data:`_UNDECLARED_WRITES`."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names, self.written = names, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        undeclared, training = _UNDECLARED_WRITES.get(func, ((), None))
        for i, a in enumerate(func._schema.arguments):
            declared = a.alias_info is not None and a.alias_info.is_write
            if not declared and not (i in undeclared and len(args) > max(i, training) and args[training]):
                continue
            value = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.names:
                    self.written.add(self.names[t.untyped_storage().data_ptr()])
        return func(*args, **kwargs)


@contextlib.contextmanager
def written_buffers(model: torch.nn.Module) -> Iterator[set[str]]:
    """While open, the set it yields gets the name of each buffer of ``model`` that an op writes
    in place (batch norm's running stats, even where the value stays: a running mean of an exactly
    zero-mean map is 0.0 before and after) or that the model replaces (ibert's ranges)."""
    before = dict(model.named_buffers())
    mode = _Writes({b.untyped_storage().data_ptr(): k for k, b in before.items() if b.numel()})
    with mode:
        yield mode.written
    mode.written.update(k for k, b in model.named_buffers() if before.get(k) is not b)


def buffer_scales(buffers: Mapping[str, torch.Tensor], input_scales: Mapping[str, float],
                  updated: Collection[str] | None = None) -> dict[str, float]:
    """Per floating buffer of ``buffers`` (one slice's, by fqn), max(its largest |entry|, the
    largest input entry of its owning module in ``input_scales``); integer buffers are left out.
    ``updated``: the buffers the reference's step wrote; any other keeps its own scale (None:
    every buffer counts as updated)."""
    out = {}
    for fqn, b in buffers.items():
        if b is None or not b.is_floating_point():
            continue
        own = float(b.detach().abs().max()) if b.numel() else 0.0
        widen = updated is None or fqn in updated
        out[fqn] = max(own, input_scales.get(fqn.rpartition(".")[0], 0.0)) if widen else own
    return out
