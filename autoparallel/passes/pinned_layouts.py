"""Pin the layout of a pointwise op whose operands have mixed layouts to the one the trace recorded.

An ATen pointwise kernel (TensorIterator) picks its output's strides from its operands, in the
order it builds them; when the operands disagree (one contiguous, one transposed) that order
decides. Under fake tensors the op runs its Python decomposition instead, whose own ops may take
the operands in another order: ``aten.softplus_backward(grad, x)`` with ``grad`` transposed is
transposed on CPU but contiguous on fake tensors (``torch.where`` on ``x * beta`` first), and so
is ``hardswish_backward``. Every layout decision the trace made after it then holds on the fake
tensor only: the ``reshape`` of the op's gradient became a ``view``, which the real tensor cannot
satisfy ("view size is not compatible with input tensor's size and stride"), and clean-up's
``remove_noop_ops`` trusts the same strides.

Since patch ``kernel_strides`` gives the trace the kernel's layout, this is the safety net for an
op its probe cannot run: an op whose traced strides a probe confirms is not pinned.

Patch ``pinned_layouts``: after the joint trace, each op whose tensor operands of its output's
shape do not all share one layout is followed by ``prims.copy_strided(out, traced strides)``,
so the real tensor has the strides the trace recorded from there on, whatever the kernel picked:
correct by construction, one copy per such op. Operands that share a layout give that layout in
kernel and decomposition alike, so those ops are left alone. ``copy_strided`` is not one of
clean-up's no-op ops (``aten.copy``/``clone`` with equal fake metadata are), and a re-trace of the
graph (the second compile) records it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.kernel_strides import PATCH as KERNEL_STRIDES
from autoparallel.kernel_strides import probe_strides

PATCH = "pinned_layouts"

COPY_STRIDED = torch.ops.prims.copy_strided.default


@dataclass
class PinnedLayoutsReport:
    pinned: list[str] = field(default_factory=list)  # "node (op)" per pinned output

    @property
    def acted(self) -> int:
        return len(self.pinned)


def layout(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of the dims that have more than one element (the dims a layout can disagree on)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n != 1)


def mixed_layouts(node: fx.Node) -> bool:
    """An op (no view) with one tensor output whose tensor operands of that output's shape do not
    all share one layout. Not only ops tagged pointwise: ``softplus_backward`` and
    ``hardswish_backward`` carry no tag; an op that is no TensorIterator kernel costs a copy."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.is_view:
        return False
    out = node.meta.get(M.VAL)
    if not isinstance(out, torch.Tensor) or out.numel() <= 1:
        return False
    operands = [a.meta.get(M.VAL) for a in tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
    layouts = {layout(t) for t in operands if isinstance(t, torch.Tensor) and t.shape == out.shape}
    return len(layouts) > 1


def pin_mixed_layouts(gm: fx.GraphModule) -> PinnedLayoutsReport:
    """Insert ``prims.copy_strided`` after each op :func:`mixed_layouts` finds (see the module
    docstring); the copy carries the op's metadata (module path, partitioner tag, seq_nr)."""
    report = PinnedLayoutsReport()
    graph = gm.graph
    for node in list(graph.nodes):
        if not mixed_layouts(node) or traced_as_the_kernel(node):
            continue
        out = node.meta[M.VAL]
        with graph.inserting_after(node):
            pin = graph.call_function(COPY_STRIDED, (node, list(out.stride())))
        node.replace_all_uses_with(pin, delete_user_cb=lambda user: user is not pin)
        pin.meta.update({k: v for k, v in node.meta.items() if k != "tensor_meta"})
        pin.meta[M.VAL] = out
        report.pinned.append(f"{node.name} ({target_name(node)})")
    if report.pinned:
        graph.lint()
        gm.recompile()
    return report


def traced_as_the_kernel(node: fx.Node) -> bool:
    """With patch ``kernel_strides`` on, the trace gave this op the CPU kernel's layout where it
    could probe it: no pin is needed where a probe now agrees with the traced strides. Pins stay for
    ops the probe cannot run (and for every one with that patch off)."""
    if not patches.enabled(KERNEL_STRIDES):
        return False
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: a.meta.get(M.VAL))
    out = node.meta[M.VAL]
    return probe_strides(node.target, args, kwargs, out.shape) == list(out.stride())


def target_name(node: fx.Node) -> str:
    return str(node.target).removeprefix("aten.")


__all__ = ["PATCH", "PinnedLayoutsReport", "layout", "mixed_layouts", "pin_mixed_layouts"]
