"""Structural clean-up of a joint graph before any tag is written: CSE, no-op removal, DCE, view -> reshape.

Runs first at the apply_placement boundary so that the tagging pass and the partitioner see the
final structure (a tag written on a node that a later rewrite replaces is lost). Each step is
upstream's where upstream has one:

* ``fx_graph_cse`` (torch._functorch.compile_utils): identical nodes merged, e.g. the three
  reshapes of one normed activation feeding q/k/v. The second compile's partitioner runs CSE on
  its re-trace, so the first partition must save CSE'd values too or the two saved sets cannot
  be compared one to one. Merging identical all-gather chains (tied weights) is also intended.
* :func:`merge_duplicate_waits`: a collective CSE merged keeps one ``wait_tensor``.
* ``remove_noop_ops`` (torch._inductor.fx_passes.post_grad): clones/aliases/identity slices,
  views and casts whose output equals their input; needs ``meta["val"]`` (checked up front), except
  on an op that returns nothing (``aten._assert_async.msg``: one_hot's range check): a side effect
  with no value to compare, kept as it is (:func:`has_no_output`).
* ``eliminate_dead_code``: unused nodes, e.g. the ``detach`` nodes autograd leaves in a trace.
  ``wait_tensor`` is side-effectful to FX and therefore never removed, which is what we want.
* ``view_to_reshape`` (post_grad): ``aten.view`` -> ``aten.reshape``, because partitioned graphs
  may receive non-contiguous saved tensors where the traced one was contiguous.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx

from autoparallel.fx_utils import WAIT, node_val


@dataclass
class CleanupReport:
    nodes_before: int
    nodes_after: int
    removed: Counter  # op name -> count of removed nodes
    views_to_reshape: int

    @property
    def acted(self) -> int:
        """Rewrites made (nodes removed, views turned into reshapes): 0 means the pass did nothing."""
        return self.nodes_before - self.nodes_after + self.views_to_reshape

    def summary(self) -> str:
        top = ", ".join(f"{k} x{v}" for k, v in sorted(self.removed.items()))
        return (
            f"{self.nodes_before} -> {self.nodes_after} nodes (removed: {top or 'none'}); "
            f"{self.views_to_reshape} view -> reshape"
        )


def _op_name(node: fx.Node) -> str:
    t = node.target
    return str(t) if not isinstance(t, torch._ops.OpOverload) else f"{t.namespace}.{t._schema.name.split('::')[-1]}"


def has_no_output(node: fx.Node) -> bool:
    """``node`` calls an op whose schema returns nothing (an assert, a print): run for its side
    effect, it has no value for the no-op removal to compare, and FX's dead-code elimination keeps it."""
    return isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.returns


def merge_duplicate_waits(graph: fx.Graph) -> None:
    """One ``wait_tensor`` per collective: CSE merges two identical collectives (two gradients
    computed alike, as in GPT-NeoX) but never their waits (side-effectful to FX), which left one
    collective with two waits, a shape the bucketing passes refuse. The later waits' users read
    the first (the report counts the waits removed)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        waits = sorted((u for u in node.users if u.op == "call_function" and u.target is WAIT and u.args == (node,)),
                       key=order.__getitem__)
        for extra in waits[1:]:
            extra.replace_all_uses_with(waits[0])
            graph.erase_node(extra)


def cleanup_graph(gm: fx.GraphModule) -> CleanupReport:
    """Clean ``gm`` in place (``gm.graph`` is replaced by the CSE'd graph; placeholders and outputs
    are kept) and recompile it."""
    from torch._functorch.compile_utils import fx_graph_cse
    from torch._inductor.fx_passes.post_grad import remove_noop_ops, view_to_reshape

    graph = gm.graph
    for node in graph.nodes:
        if node.op == "call_function" and not has_no_output(node):
            node_val(node, "the clean-up's no-op removal (it compares input and output values)")
    before = {n.name: _op_name(n) for n in graph.nodes}
    graph = fx_graph_cse(graph)
    gm.graph = graph
    merge_duplicate_waits(graph)
    remove_noop_ops(graph)
    graph.eliminate_dead_code()
    after = {n.name for n in graph.nodes}
    removed = Counter(op for name, op in before.items() if name not in after)
    views = len(graph.find_nodes(op="call_function", target=torch.ops.aten.view.default))
    view_to_reshape(gm)
    graph.lint()
    gm.recompile()
    return CleanupReport(len(before), len(after), removed, views)
