"""Point a traced graph's collectives at the process groups of the world it runs in.

A graph traced on a fake world spells that world's group names; a real world created later has
its own. Both name their groups by mesh dim, so rebinding goes name -> dim -> name.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from autoparallel.fx_utils import GROUP_ARG, copy_graph_module, group_arg_index, group_of
from autoparallel.mesh import attach_group_dims, dim_label, group_dims_of


def rebind_groups(gm: fx.GraphModule, target_dims: Mapping[str, str]) -> fx.GraphModule:
    """A copy of ``gm`` whose collectives use the groups of ``target_dims`` (name -> dim)."""
    source_dims = group_dims_of(gm)
    by_label = {label: name for name, label in target_dims.items()}
    out = copy_graph_module(gm)
    for node in out.graph.nodes:
        i = group_arg_index(node)
        if i is None:
            continue
        label = dim_label(group_of(node), source_dims, where=node.name)
        if label not in by_label:
            raise ValueError(f"node {node.name}: the running world has no group for mesh dim {label!r}")
        if i < len(node.args):
            args = list(node.args)
            args[i] = by_label[label]
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, GROUP_ARG: by_label[label]}
    out.recompile()
    attach_group_dims(out, target_dims)
    return out
