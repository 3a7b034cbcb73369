"""Small predicates over FX nodes that several passes share."""

from __future__ import annotations

import torch
from torch import fx

_c10d = torch.ops._c10d_functional

ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
WAIT = _c10d.wait_tensor.default


def is_dtype_cast(node: fx.Node) -> bool:
    """A pure dtype conversion: ``prims.convert_element_type`` or ``aten._to_copy(x, dtype=...)``
    that changes nothing but the dtype."""
    if node.op != "call_function":
        return False
    if node.target == torch.ops.prims.convert_element_type.default:
        return True
    if node.target == torch.ops.aten._to_copy.default:
        return set(node.kwargs) <= {"dtype"} and "dtype" in node.kwargs and len(node.args) == 1
    return False


GROUP_ARG = "group_name"


def group_arg_index(node: fx.Node) -> int | None:
    """Position of the ``group_name`` argument of a ``_c10d_functional`` node, else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "_c10d_functional":
        return None
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == GROUP_ARG:
            return i
    return None


def group_of(node: fx.Node) -> str | None:
    """The process-group name a collective node uses (None for non-collectives)."""
    i = group_arg_index(node)
    if i is None:
        return None
    if i < len(node.args):
        return str(node.args[i])
    return str(node.kwargs[GROUP_ARG])
