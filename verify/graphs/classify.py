"""What a graph node is, for the graph statistics: its category, its collective kind and mesh-dim
label, and byte sizes (the conventions are in verify/graphs/stats.py's docstring; stats.py and
liveness.py both read nodes through these)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols

from autoparallel.fx_utils import group_arg, group_arg_name, node_val, size_hint
from autoparallel.mesh import dim_label

CATEGORIES = ("placeholder", "output", "collective", "wait", "view", "compute", "other")
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
_KIND_OF_OPNAME = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
_NOT_COLLECTIVE = {"wait_tensor"}
_VIEW_LIKE = {"_unsafe_view", "reshape"}
_SCALAR_MODULES = {"_operator", "operator", "math", "builtins"}


# --- classification -----------------------------------------------------------------------------


def _is_c10d_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace in _COLLECTIVE_NAMESPACES


def collective_kind(node: fx.Node) -> str | None:
    """``all_gather`` / ``reduce_scatter`` / ``all_reduce`` / ``all_to_all`` / ... or None."""
    if node.op != "call_function" or not _is_c10d_op(node.target):
        return None
    name = node.target._opname
    if name in _NOT_COLLECTIVE:
        return None
    if name in ("isend", "irecv", "batch_p2p_ops"):
        return "p2p"
    return _KIND_OF_OPNAME.get(name, name)


def is_wait(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and _is_c10d_op(node.target)
        and node.target._opname == "wait_tensor"
    )


def _returns_tensor(op: torch._ops.OpOverload) -> bool:
    return any("Tensor" in str(r.type) for r in op._schema.returns)


def node_category(node: fx.Node) -> str:
    """One of ``CATEGORIES`` (see the module docstring)."""
    if node.op in ("placeholder", "output"):
        return node.op
    if node.op == "get_attr":
        return "other"
    t = node.target  # call_method / call_module: a string, "compute" at the end
    if is_wait(node):
        return "wait"
    if collective_kind(node) is not None:
        return "collective"
    if t is operator.getitem:
        return "other"
    if isinstance(t, torch._ops.OpOverload):
        if t.is_view or t._opname in _VIEW_LIKE:
            return "view"
        return "compute" if _returns_tensor(t) else "other"
    if isinstance(t, torch._ops.HigherOrderOperator):
        return "compute"
    if getattr(t, "__module__", None) in _SCALAR_MODULES or str(
        getattr(t, "__name__", "")
    ).startswith("sym_"):
        return "other"
    return "compute"


# --- sizes --------------------------------------------------------------------------------------


def int_hint(x: Any, node: fx.Node) -> int:
    """``x`` as an int: a symbolic size's trace-time hint. A data-dependent (unbacked) size has
    none: torch's ``optimization_hint`` would make one up (8192), so it is refused instead."""
    if isinstance(x, torch.SymInt):
        if has_free_unbacked_symbols(x):
            raise ValueError(
                f"node {node.name!r}: size {x} is data-dependent (an unbacked symbol, no trace-time "
                "hint); cannot count its bytes"
            )
        return size_hint(x)  # torch 2.11 (the GPU machines' CUDA build) has no optimization_hint
    return int(x)


def tensors_of(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in tensors_of(x)]
    return []


def tensor_bytes(t: torch.Tensor, node: fx.Node) -> int:
    return int_hint(t.numel(), node) * t.element_size()


def value_bytes(v: Any, node: fx.Node) -> int:
    return sum(tensor_bytes(t, node) for t in tensors_of(v))


def collective_bytes(node: fx.Node, kind: str) -> int:
    if kind == "all_gather":
        return value_bytes(node_val(node, f"the bytes of collective {node.name!r}"), node)
    i, arg = next((i, a) for i, a in enumerate(node.target._schema.arguments) if "Tensor" in str(a.type))
    src = node_arg(node, i, arg.name, None)
    srcs = src if isinstance(src, (list, tuple)) else [src]
    total = 0
    for s in srcs:
        if isinstance(s, fx.Node):
            total += value_bytes(node_val(s, f"the bytes of collective {node.name!r}"), s)
    return total


def collective_node_bytes(node: fx.Node) -> int:
    """Bytes of one collective launch, by the module's convention (0 for a non-collective)."""
    kind = collective_kind(node)
    return collective_bytes(node, kind) if kind is not None else 0


def group_label(node: fx.Node, group_dims: Mapping[str, str]) -> str:
    """Mesh-dim label of a collective's group ("?" for a node that names none)."""
    g = group_arg(node)
    if g is None:
        return "?"
    try:
        return dim_label(group_arg_name(g), group_dims, where=f"node {node.name!r} ({node.target})")
    except ValueError as e:
        raise ValueError(f"{e}, or pass group_dims={{name: label}}") from None


def node_arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)
