"""Random draws a partition dropped, drawn again where the joint graph drew them.

On CPU every random op draws from one generator, in the order the graph runs them, so a draw
whose result nobody reads still moves every draw after it. A dropout whose output the loss never
reads (the last layer's global-token stream of a model whose head reads the other stream) is
such a draw: eager makes it, the joint graph keeps it (FX's dead-code elimination treats random
ops as impure), but AOT's partitioners build the forward from its outputs backwards and leave it
out. Every later dropout then draws the mask of the one before it (Hugging Face's pegasus_x:
loss 22.810 vs 22.737 from the first partition on, every stage before bitwise).

:func:`restore_dropped_random_ops` runs after a partition: each random op of the joint graph that
is in neither the forward nor the backward is copied into the forward, with the inputs it needs
that the forward lacks, right before the next random op the forward keeps (or its output), so the
forward draws what the joint graph drew, in its order. An ``empty_like`` feeding a draw (ATen's
dropout fills ``empty_like(x)`` with ``bernoulli``) reads only its input's metadata, so one whose
input is not in the forward becomes an ``empty_strided`` of the same layout instead of copying the
dead computation of ``x``.

A dead draw with several outputs (``native_dropout``: output and mask, as ``plan="auto"`` keeps
dropout, one op the planner places) has no user at all once dead-code elimination removed its
getitems, and AOT's default partitioner takes a node without users for a single tensor
("Expected native_dropout_8 to be a tensor": pegasus_x under auto). :func:`read_dead_draws` runs
before a partition and gives each such draw one getitem, so the partitioner sees a multi-output
node, leaves it out like any dead draw, and :func:`restore_dropped_random_ops` draws it again.
Patch ``kept_random_draws``.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autoparallel import ac, patches
from autoparallel import meta as M

PATCH = "kept_random_draws"
aten = torch.ops.aten


class DroppedDrawError(RuntimeError):
    """A dropped random op reads a value the forward cannot have (a backward input)."""


_LAYOUT_ONLY = (aten.empty_like.default, aten.empty_strided.default, aten.empty.memory_format)


def _is_random(node: fx.Node) -> bool:
    return node.op == "call_function" and ac.is_random(node.target)


def read_dead_draws(joint: fx.GraphModule) -> list[str]:
    """A getitem of output 0 after each random op of ``joint`` that has several outputs and no
    user (see the module docstring); returns the draws' names."""
    if not patches.enabled(PATCH):
        return []
    read = []
    for node in [n for n in joint.graph.nodes if _is_random(n) and not n.users]:
        val = node.meta.get(M.VAL)
        if not isinstance(val, list | tuple):
            continue
        with joint.graph.inserting_after(node):
            item = joint.graph.call_function(operator.getitem, (node, 0))
        item.meta.update({k: node.meta[k] for k in (M.PARTITIONER_TAG, M.SEQ_NR, M.CUSTOM, M.NN_MODULE_STACK) if k in node.meta})
        item.meta[M.VAL] = val[0]
        read.append(node.name)
    if read:
        joint.recompile()
    return read


def restore_dropped_random_ops(joint: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule) -> list[str]:
    """Copy ``joint``'s random ops that neither ``fw`` nor ``bw`` has into ``fw`` (see the module
    docstring); returns their names. Nodes are matched by name: the partitioners copy joint nodes
    under their own names."""
    if not patches.enabled(PATCH):
        return []
    # A dead draw in the backward is a copy the backward's extraction made (with fallback_random
    # set, dead-code elimination keeps random ops): eager draws it once, in the forward.
    for node in [n for n in bw.graph.nodes if _is_random(n) and not n.users]:
        inputs = node.all_input_nodes
        bw.graph.erase_node(node)
        for a in inputs:
            if not a.users and a.op == "call_function" and a.target in _LAYOUT_ONLY:
                bw.graph.erase_node(a)
    bw.recompile()
    draws = [n for n in joint.graph.nodes if _is_random(n)]
    kept = {n.name for g in (fw, bw) for n in g.graph.nodes if _is_random(n)}
    dropped = [n for n in draws if n.name not in kept]
    if not dropped:
        return []
    env = {n.name: n for n in fw.graph.nodes}
    fw_output = next(iter(fw.graph.find_nodes(op="output")))

    def copy(node: fx.Node, before: fx.Node) -> fx.Node:
        if node.name in env:
            return env[node.name]
        if node.op != "call_function":
            raise DroppedDrawError(
                f"random op dropped by the partition reads {node.name!r} ({node.op}), which the forward does not have"
            )
        with fw.graph.inserting_before(before):
            if node.target is aten.empty_like.default and node.args[0].name not in env:
                val = node.meta[M.VAL]
                new = fw.graph.call_function(
                    aten.empty_strided.default, (list(val.shape), list(val.stride())),
                    {"dtype": val.dtype, "device": val.device},
                )
                new.meta.update(node.meta)
            else:
                args = fx.map_arg((node.args, node.kwargs), lambda a: copy(a, before))
                with fw.graph.inserting_before(before):
                    new = fw.graph.create_node("call_function", node.target, *args, name=node.name)
                new.meta.update(node.meta)
        env[node.name] = new
        return new

    for node in dropped:
        later = draws[draws.index(node) + 1 :]
        before = next((env[n.name] for n in later if n.name in env), fw_output)
        copy(node, before)
    fw.graph.lint()
    fw.recompile()
    return [n.name for n in dropped]
