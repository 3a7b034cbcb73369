"""Fake tensors take the strides the CPU kernel gives, where operands of mixed layouts make them differ.

An ATen pointwise kernel (TensorIterator) orders its output's dims by its operands' strides,
the first operand deciding ties; under fake tensors some ops run a Python decomposition as their
Meta kernel instead, whose own ops read the operands in another order:
``softplus_backward(grad, x)`` with ``grad`` transposed is transposed on CPU and contiguous on
fake tensors. Every layout decision the trace makes afterwards then holds on the fake tensor only:
a ``reshape`` of it traces as a ``view`` the real tensor cannot satisfy, and reductions that eager
runs over the transposed tensor sum in another order. Patch ``pinned_layouts`` keeps such graphs
correct by copying the real output into the traced layout; this keeps them bitwise, by giving the
trace the real layout in the first place (docs/failure-classes.md section 1).

Patch ``kernel_strides``: inside the trace (and the second compile's re-trace), an op with one
tensor output of its operands' broadcast shape, whose operands of that shape have more than one
layout, is run once more on the CPU kernel with tiny probe operands of the same dimension orders
(a dim of size 1 stays 1, an expanded dim stays expanded, every other dim has size 2); the fake
output takes the probe's dimension order with the real sizes. Exact for TensorIterator kernels,
whose output layout depends only on the operands' stride order. Restored on exit.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from autoparallel import patches

PATCH = "kernel_strides"


def layout(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of the dims with more than one element (the dims a layout can disagree on)."""
    return tuple(s for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)


def _candidate(func) -> bool:
    return (
        isinstance(func, torch._ops.OpOverload)
        and not func.is_view
        and not func._schema.is_mutable
        and len(func._schema.returns) == 1
    )


def _probe(t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor with ``t``'s dimension order: sizes 1 stay 1, expanded dims stay
    expanded, every other dim has size 2."""
    sizes = [1 if n == 1 else 2 for n in t.shape]
    expanded = [n != 1 and s == 0 for n, s in zip(t.shape, t.stride(), strict=True)]
    base_sizes = [1 if e else n for n, e in zip(sizes, expanded, strict=True)]
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))  # outermost first, ties by index
    dense = torch.empty([base_sizes[i] for i in order], dtype=t.dtype)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        dense.uniform_(0.5, 1.5)
    else:
        dense.fill_(1)
    base = dense.permute([order.index(i) for i in range(t.dim())])
    return base.expand(sizes) if any(expanded) else base


def kernel_strides(shape: torch.Size, probe_out: torch.Tensor) -> list[int]:
    """Strides for ``shape`` in the dimension order of ``probe_out`` (its dims sorted by stride,
    outermost first; ties keep dim order), dense."""
    order = sorted(range(len(shape)), key=lambda i: -probe_out.stride(i))
    strides = [0] * len(shape)
    step = 1
    for i in reversed(order):
        strides[i] = step
        step *= max(shape[i], 1)
    return strides


def probe_strides(func, args, kwargs, shape: torch.Size) -> list[int] | None:
    """The strides the CPU kernel of ``func`` gives an output of ``shape`` for operands of the
    dimension orders of ``args``' tensors (real or fake: only their metadata is read); None if the
    probe cannot run the op."""
    try:
        with _disable_current_modes():
            probes = {id(t): _probe(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            out = func(*tree_map(lambda a: probes.get(id(a), a), args), **tree_map(lambda a: probes.get(id(a), a), kwargs))
    except Exception:  # noqa: BLE001 - an op the probe cannot run keeps its decomposition's layout
        return None
    return kernel_strides(shape, out) if isinstance(out, torch.Tensor) and out.dim() == len(shape) else None


def _kernel_layout(func, out, args, kwargs):
    """``out`` (the decomposition's fake output) with the CPU kernel's layout, or None where this
    does not apply or the layouts already agree."""
    flat, _ = tree_flatten((args, kwargs))
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    if (
        not isinstance(out, FakeTensor) or len(tensors) < 2 or out.numel() <= 1
        or not all(isinstance(t, FakeTensor) and t.device.type == "cpu" and t.layout == torch.strided for t in tensors)
    ):
        return None
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        return None
    if out.shape != shape or len({layout(t) for t in tensors if t.shape == shape}) < 2:
        return None
    strides = probe_strides(func, args, kwargs, shape)
    if strides is None:
        return None
    if list(out.stride()) == strides:
        return None
    return torch.empty_strided(shape, strides, dtype=out.dtype, device=out.device)  # fake: the caller's mode is on


def _with_kernel_layout(func, decomposition):
    # wraps: fake tensors run a decomposition only if it looks like one of torch._decomp's own
    # (its module and name), so the wrapper keeps both
    @functools.wraps(decomposition)
    def run(*args, **kwargs):
        out = decomposition(*args, **kwargs)
        fixed = _kernel_layout(func, out, args, kwargs)
        return out if fixed is None else fixed

    return run


@contextlib.contextmanager
def strides_as_kernels() -> Iterator[int]:
    """Within: fake outputs of mixed-layout ops that fake tensors compute by a Python
    decomposition take the CPU kernel's strides (unless the patch is disabled); yields how many
    decompositions were wrapped, and puts every one back on exit."""
    if not patches.enabled(PATCH):
        yield 0
        return
    from torch._decomp import decomposition_table

    saved = {f: d for f, d in decomposition_table.items() if _candidate(f)}
    for f, d in saved.items():
        decomposition_table[f] = _with_kernel_layout(f, d)
    # Fake tensors cache outputs by op and operand metadata across modes: entries made without
    # the kernel's layout must not answer inside, nor entries made inside answer after.
    FakeTensorMode.cache_clear()
    try:
        yield len(saved)
    finally:
        decomposition_table.update(saved)
        FakeTensorMode.cache_clear()
