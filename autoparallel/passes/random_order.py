"""Random ops draw in the order they drew before a collective pass.

On CPU a graph's random ops (dropout, bernoulli, rand: ``autoparallel.ac.is_random``) all draw
from one generator, in the order the graph runs them, so their order is part of what the graph
computes: swap two dropouts and each gets the other's mask. Upstream's passes see only data
dependencies. After a bucket merge, ``stable_topological_sort`` releases the consumers of the
merged all-gather depth first, and the overlap scheduler picks its own order, so random ops on
independent branches change places. T5 and BART read one embedding in the encoder and the
decoder: the decoder's embedding dropout then ran before the encoder's attention dropout (loss
off by 0.3 on fsdp dp=2). Inductor on CUDA is not affected, because its random ops take their
own philox seed and offset.

:func:`run_keeping_random_order` runs a pass and then puts the random ops back in their earlier
relative order. It does this with a stable topological sort that makes each random op depend on
the one before it, so a node moves only when it is a random op drawn too early, or a consumer of
one. If the pass adds or drops a random op, or makes the old order impossible (a dependency
from an earlier random op on a later one), it raises an error naming those ops. Patch
``random_op_order``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import fx

from autoparallel import ac, patches

PATCH = "random_op_order"


class RandomOrderError(RuntimeError):
    """A pass changed a graph's random ops so that they cannot draw as they did before it."""


@dataclass
class RandomOrderReport:
    """What restoring the order did to one graph: ``random_ops``, how many the graph has;
    ``moved``, the nodes the sort moved (0 when the pass kept the order)."""

    random_ops: int = 0
    moved: int = 0


def random_ops(graph: fx.Graph) -> list[fx.Node]:
    """The graph's random ops, in the order they run."""
    return [n for n in graph.nodes if n.op == "call_function" and ac.is_random(n.target)]


def _chained_order(graph: fx.Graph, chain: Sequence[fx.Node]) -> list[fx.Node]:
    """The graph's nodes in a stable topological order in which each node of ``chain`` comes
    after the previous one. This is Inductor's ``stable_topological_sort`` with one more edge
    per chain link. A node waits for the last input it lacks and is released depth-first."""
    after = dict(zip(chain[1:], chain[:-1], strict=True))
    done: set[fx.Node] = set()
    order: list[fx.Node] = []
    waiting: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    pending = list(reversed(graph.nodes))
    while pending:
        node = pending.pop()
        deps = [*node.all_input_nodes, *([after[node]] if node in after else [])]
        missing = [d for d in deps if d not in done]
        if missing:
            waiting[missing[-1]].append(node)
            continue
        done.add(node)
        order.append(node)
        pending.extend(reversed(waiting.pop(node, [])))
    if len(order) != len(graph.nodes):
        stuck = [n.name for n in chain if n not in done]
        raise RandomOrderError(
            f"random ops {stuck} cannot draw in their order before the pass ({[n.name for n in chain]}): "
            "the pass made an earlier random op depend on a later one")
    return order


def restore_random_order(gm: fx.GraphModule, before: Sequence[str], where: str = "a pass") -> RandomOrderReport:
    """Put ``gm``'s random ops back in the order ``before`` (their node names before ``where``
    ran), moving as few nodes as a stable sort can; see the module docstring."""
    now = random_ops(gm.graph)
    report = RandomOrderReport(random_ops=len(now))
    names = [n.name for n in now]
    if names == list(before):
        return report
    added, dropped = sorted(set(names) - set(before)), sorted(set(before) - set(names))
    if added or dropped or len(names) != len(before):
        raise RandomOrderError(
            f"{where} changed the random ops of the graph (added {added}, dropped {dropped}): they no longer "
            "draw what they drew before it")
    by_name = {n.name: n for n in now}
    order = _chained_order(gm.graph, [by_name[name] for name in before])
    cursor = None
    for node in order:
        if cursor is not None and cursor.next is not node:
            cursor.append(node)
            report.moved += 1
        cursor = node
    gm.graph.lint()
    gm.recompile()
    return report


def run_keeping_random_order(
    gm: fx.GraphModule, run: Callable[[fx.GraphModule], fx.GraphModule], where: str = "a pass"
) -> fx.GraphModule:
    """``run(gm)`` (a pass that returns the graph module it leaves), with the random ops put back
    in the order they had before it (names ``where`` in errors)."""
    if not patches.enabled(PATCH):
        return run(gm)
    before = [n.name for n in random_ops(gm.graph)]
    out = run(gm)
    restore_random_order(out, before, where)
    return out


__all__ = ["PATCH", "RandomOrderError", "RandomOrderReport", "random_ops", "restore_random_order", "run_keeping_random_order"]
