"""The joint trace records an op that has an ATen kernel as that kernel, not as its Python decomposition.

Some ops with a CPU kernel and a derivative of their own also carry a Python decomposition on
their ``Autograd`` / ``CompositeImplicitAutograd`` keys (``py_kernels``, from
``torch._decomp.decompositions``), which every trace runs (the Python dispatcher is on) and eager
never does. ``F.interpolate(mode="bilinear")`` traces as ``_unsafe_index`` gathers, products and
sums, and its backward as ``_unsafe_index_put(accumulate=True)``: other roundings than eager's
``upsample_bilinear2d`` and ``upsample_bilinear2d_backward`` (7e-7 apart on a 4x4 -> 6x6 image;
mobilevit's joint graph was "NOT bitwise" at every stage, 5.7e-3 after three steps).

Patch ``eager_kernels``: inside the trace, those Python kernels are lifted for every op that has a
CPU kernel (the upsample family, hardshrink, softshrink, the margin losses) and for the overloads
whose C++ composite calls such a kernel (``upsample_bilinear2d.vec``), so the trace records
the op and autograd's derivative for it, as eager runs them. ``native_batch_norm`` keeps its Python
kernel: it is what makes batch norm functional (running stats as outputs), which the joint graph needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._C import DispatchKey

from autoparallel import patches

PATCH = "eager_kernels"
# The same lift around the second compile's re-trace (autoparallel_backend): the first partition's
# graphs hold the ATen op, and a re-trace that ran its decomposition again would undo the joint trace's fix.
RETRACE_PATCH = "eager_kernels_retrace"

KEYS = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)

# Kept decomposed: the functional form (running-stat updates as outputs) comes from this kernel.
KEEP = frozenset({"aten::native_batch_norm"})


def decomposed_kernels() -> list[torch._ops.OpOverload]:
    """aten ops with a CPU kernel whose Autograd / CompositeImplicitAutograd key a Python
    decomposition takes over inside a trace (see the module docstring)."""
    ops = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        overloads = [getattr(packet, o) for o in packet.overloads()]
        kernel = [op for op in overloads if _has(op, "CPU")]
        for op in overloads:
            if op.name() in KEEP or not set(op.py_kernels) & set(KEYS):
                continue
            # the kernel itself, or an overload whose C++ composite calls the kernel's overload
            # (upsample_bilinear2d.vec -> upsample_bilinear2d.default); out= overloads stay
            if op in kernel or (kernel and _has(op, "CompositeImplicitAutograd") and not op._schema.is_mutable):
                ops.append(op)
    return ops


def _has(op: torch._ops.OpOverload, key: str) -> bool:
    """Whether the dispatcher has a C++ kernel for ``key`` on this overload."""
    overload = op._overloadname
    name = op._schema.name if overload == "default" else f"{op._schema.name}.{overload}"
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
    except RuntimeError:  # an overload the dispatcher does not know by this name (python-only schemas)
        return False


@contextlib.contextmanager
def kernels_as_eager(patch: str = PATCH) -> Iterator[list[torch._ops.OpOverload]]:
    """Within: :func:`decomposed_kernels` run their ATen kernels (unless ``patch`` is disabled);
    yields the ops lifted, and restores every Python kernel on exit."""
    if not patches.enabled(patch):
        yield []
        return
    ops = decomposed_kernels()
    saved = {op: {k: op.py_kernels[k] for k in KEYS if k in op.py_kernels} for op in ops}
    for op in ops:
        for k in saved[op]:
            del op.py_kernels[k]
        op._dispatch_cache.clear()
    try:
        yield ops
    finally:
        for op, kernels in saved.items():
            op.py_kernels.update(kernels)
            op._dispatch_cache.clear()


__all__ = ["PATCH", "RETRACE_PATCH", "decomposed_kernels", "kernels_as_eager"]
