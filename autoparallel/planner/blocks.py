"""Plan a model of L identical blocks from a trace of four: first, two interior, last.

Tracing is the planner's largest cost and grows with depth (LLaMA-3 8B: 32 blocks, about half
a second each), while the plan of a deep model is the plan of a few blocks repeated: the
first block reads the embedding, the last feeds the head, and every block in between looks
like every other. So the planner can trace a copy of the model that keeps only the first
``k`` blocks (k >= 4) and rebuild the graph of all L blocks from it (:func:`expand_graph`):

* trace block 0 stands for block 0, trace block k-1 for block L-1, trace block 1 for blocks
  1 .. L-2 (the interior); keys and roles are relabelled (``layers.3`` -> ``layers.31``);
* a node's inputs are rewired by their relation in the trace: same block, the neighbouring
  block (+-1), or outside the blocks.

This is only sound when the trace shows the pattern: interior blocks 1 .. k-2 identical node
for node (same candidates, costs and wiring), blocks connected only to their neighbours, and
nodes outside the blocks reading only the first or last block. :func:`expand_graph` checks
all of it and raises :class:`NotPeriodic` otherwise; the planner then traces every block. A
test plans a small model both ways and compares the plan texts.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
from torch import nn

from autoparallel.planner.graph import NO_BLOCK
from autoparallel.planner.problem import BLOCK_PLACEHOLDER, Graph, PNode, unblocked_key

MIN_TRACE_BLOCKS = 4


class NotPeriodic(ValueError):
    """The traced blocks do not repeat in the way the expansion assumes."""


def num_blocks(model: nn.Module, container: str) -> int:
    return len(model.get_submodule(container))


def truncated(model: nn.Module, container: str, keep: int) -> nn.Module:
    """A shallow copy of ``model`` whose block list keeps its first ``keep`` blocks (shared)."""
    path = container.split(".")
    root = copy.copy(model)
    root._modules = dict(model._modules)
    new, old = root, model
    for name in path[:-1]:
        child = copy.copy(old._modules[name])
        child._modules = dict(old._modules[name]._modules)
        new._modules[name] = child
        new, old = child, old._modules[name]
    blocks = old._modules[path[-1]]
    new._modules[path[-1]] = type(blocks)(list(blocks)[:keep]) if isinstance(blocks, nn.ModuleList) else nn.ModuleList(list(blocks)[:keep])
    return root


def _block_index(label: str, container: str) -> int:
    return int(label[len(container) + 1 :])


def expand_graph(graph: Graph, container: str, k: int, total: int) -> Graph:
    """The graph of ``total`` blocks, from ``graph`` traced with blocks 0 .. k-1 (see module doc)."""
    if k < MIN_TRACE_BLOCKS or total <= k:
        raise NotPeriodic(f"expansion needs {MIN_TRACE_BLOCKS} <= traced blocks < total blocks, got {k} and {total}")
    nodes = graph.nodes
    block_of: dict[int, int | None] = {}
    for pn in nodes:
        block_of[pn.index] = None if pn.block in (None, NO_BLOCK) else _block_index(pn.block, container)
    suffix = {pn.index: unblocked_key(pn.key, pn.block) for pn in nodes if block_of[pn.index] is not None}
    by_block: dict[int, dict[str, PNode]] = {b: {} for b in range(k)}
    for pn in nodes:
        b = block_of[pn.index]
        if b is not None:
            by_block[b][suffix[pn.index]] = pn

    def feeds(pn: PNode) -> tuple:
        out = []
        b = block_of[pn.index]
        for p in pn.inputs:
            q = block_of[p]
            if q is None:
                out.append(("outside", nodes[p].key))
            else:
                if b is not None and abs(q - b) > 1:
                    raise NotPeriodic(f"{pn.key} reads {nodes[p].key}, {abs(q - b)} blocks away")
                out.append(("block", None if b is None else q - b, suffix[p]))
        return tuple(out)

    # interior blocks 1 .. k-2 must be identical node for node
    ref = by_block[1]
    for b in range(2, k - 1):
        other = by_block[b]
        if set(other) != set(ref):
            raise NotPeriodic(f"interior blocks 1 and {b} have different nodes: {sorted(set(ref) ^ set(other))[:5]}")
        for s, a in ref.items():
            o = other[s]
            if (
                a.candidates != o.candidates
                or not np.array_equal(a.compute_us, o.compute_us)
                or a.locked_inputs != o.locked_inputs
                or feeds(a) != feeds(o)
                or (a.kind, a.op, a.phase, a.static) != (o.kind, o.op, o.phase, o.static)
            ):
                raise NotPeriodic(f"interior blocks 1 and {b} differ at {a.key} / {o.key}")
    for pn in nodes:
        if block_of[pn.index] is None:
            for p in pn.inputs:
                q = block_of[p]
                if q is not None and 0 < q < k - 1:
                    raise NotPeriodic(f"{pn.key} (outside the blocks) reads the interior block node {nodes[p].key}")
        else:
            feeds(pn)  # checks neighbour distances

    def template(j: int) -> int:
        return 0 if j == 0 else k - 1 if j == total - 1 else 1

    def trace_block_of(j: int) -> int | None:
        """The trace block whose FX names a virtual block can keep (it is that very block)."""
        if j == 0:
            return 0
        if j == total - 1:
            return k - 1
        return j if j < k - 1 else None

    # create the virtual nodes
    new_nodes: list[PNode] = []
    origin: list[tuple[PNode, int | None]] = []  # (template node, virtual block)
    index_of: dict[tuple[int | None, str], int] = {}  # (virtual block, suffix or outside key) -> index
    for pn in nodes:
        b = block_of[pn.index]
        if b is None:
            targets = [None]
        elif b == 0:
            targets = [0]
        elif b == 1:
            targets = list(range(1, total - 1))
        elif b == k - 1:
            targets = [total - 1]
        else:
            continue  # interior blocks 2 .. k-2: block 1 stands for them
        for j in targets:
            label = None if j is None else f"{container}.{j}"
            s = suffix.get(pn.index)
            clone = dataclasses.replace(
                pn,
                index=len(new_nodes),
                key=_vkey(pn, label),
                role=pn.role if pn.role is None or label is None else unblocked_key(pn.role, pn.block).replace(BLOCK_PLACEHOLDER, label),
                block=pn.block if j is None else label,
                name=pn.name if j is None else _named(by_block, s, trace_block_of(j)),
                inputs=(),
            )
            index_of[(j, s if j is not None else pn.key)] = clone.index
            new_nodes.append(clone)
            origin.append((pn, j))
    # wire inputs
    for clone, (pn, j) in zip(new_nodes, origin, strict=True):
        ins = []
        b = block_of[pn.index]
        for p in pn.inputs:
            q = block_of[p]
            if q is None:
                target = (None, nodes[p].key)
            elif j is None:  # outside node reading the first or last block
                target = (0 if q == 0 else total - 1, suffix[p])
            else:
                target = (j + (q - b), suffix[p])
            if target not in index_of:
                raise NotPeriodic(f"{clone.key} would read {target[1]} in block {target[0]}, which the trace does not have there")
            ins.append(index_of[target])
        clone.inputs = tuple(ins)
    key_index = {n.key: n.index for n in new_nodes}
    equal = []
    for a, b, why in graph.equal:
        if block_of[a] != block_of[b]:
            raise NotPeriodic(f"{nodes[a].key} and {nodes[b].key} must agree but sit in different blocks")
        for j in _virtual_blocks(block_of[a], k, total):
            label = None if j is None else f"{container}.{j}"
            equal.append((key_index[_vkey(nodes[a], label)], key_index[_vkey(nodes[b], label)], why))
    return Graph(new_nodes, equal, graph.mesh_names, graph.mesh_sizes, graph.strategy_seconds)


def _virtual_blocks(b: int | None, k: int, total: int) -> list[int | None]:
    if b is None:
        return [None]
    if b == 0:
        return [0]
    if b == k - 1:
        return [total - 1]
    if b == 1:
        return list(range(1, total - 1))
    return []


def _vkey(pn: PNode, label: str | None) -> str:
    if label is None or pn.block in (None, NO_BLOCK):
        return pn.key
    return unblocked_key(pn.key, pn.block).replace(BLOCK_PLACEHOLDER, label)


def _named(by_block, s: str, trace_block: int | None) -> str:
    if trace_block is None:
        return ""
    twin = by_block[trace_block].get(s)
    return twin.name if twin is not None else ""
