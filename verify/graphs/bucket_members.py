"""Which parameters a collective carries, in order: what two ranks' merged buckets must agree on.

A bucket merge concatenates its members' tensors, runs one collective and splits the result.
Two ranks whose graphs differ (a graph per rank: ``verify.parity.retrace``) can merge the same
collectives into buckets of the same total size but with other members or in another order.
gloo then adds one rank's rows of one gradient to another rank's rows of another gradient at
the same offsets, and nothing aborts (docs/failure-classes.md section 11m). The shapes alone do
not show it. The members do: for a reduce (reduce-scatter, all-reduce), the ``grad:<fqn>``
output that each piece of its result reaches; for an all-gather, the ``param:<fqn>``
placeholders its input is read from, in argument order."""

from __future__ import annotations

import operator
from collections import deque

import torch
from torch import fx

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.fx_utils import wait_of

SPLITS = (torch.ops.aten.split, torch.ops.aten.split_with_sizes, torch.ops.aten.chunk, torch.ops.aten.tensor_split)
_MAX_HOPS = 64  # a piece reaches its output through a few views and casts; beyond this: "?"


def _output_labels(gm_graph: fx.Graph) -> dict[fx.Node, list[str]]:
    out = gm_graph.output_node()
    labels = out.meta.get(M.ROLE)
    leaves = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    found: dict[fx.Node, list[str]] = {}
    if labels is None or len(labels) != len(leaves):
        return found
    for leaf, role in zip(leaves, labels, strict=True):
        if isinstance(leaf, fx.Node) and roles.is_grad(role):
            found.setdefault(leaf, []).append(role)
    return found


def _reached(start: fx.Node, outputs: dict[fx.Node, list[str]]) -> str:
    """The first gradient output ``start``'s value reaches (breadth first), or "?"."""
    seen, todo = {start}, deque([(start, 0)])
    while todo:
        node, hops = todo.popleft()
        if node in outputs:
            return outputs[node][0]
        if hops >= _MAX_HOPS:
            continue
        for user in node.users:
            if user not in seen and user.op != "output":
                seen.add(user)
                todo.append((user, hops + 1))
    return "?"


def _params_read(start: fx.Node) -> list[str]:
    """The ``param:`` placeholders ``start`` is computed from, depth first in argument order."""
    found: list[str] = []
    seen: set[fx.Node] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        role = node.meta.get(M.ROLE) if node.op == "placeholder" else None
        if roles.is_param(role):
            found.append(role)
        stack.extend(reversed(node.all_input_nodes))
    return found


def bucket_members(node: fx.Node, kind: str) -> tuple[str, ...]:
    """The roles ``node`` (a collective launch of kind ``all_gather`` / ``reduce_scatter`` /
    ``all_reduce``) carries, in order; empty for other kinds."""
    if kind == "all_gather":
        return tuple(_params_read(node))
    if kind not in ("reduce_scatter", "all_reduce"):
        return ()
    outputs = _output_labels(node.graph)
    wait = wait_of(node) or node
    pieces = [u for u in wait.users if getattr(u.target, "overloadpacket", None) in SPLITS]
    if len(pieces) != 1:
        return (_reached(wait, outputs),)
    split = pieces[0]
    items = sorted((u for u in split.users if u.target is operator.getitem), key=lambda u: u.args[1])
    return tuple(_reached(item, outputs) for item in items)


__all__ = ["bucket_members"]
