"""Which moved pieces must take the traced value's memory layout.

A move returns its piece in the collective's layout (dense, dims in order), and the lowering
copies it into the traced value's dim order (``lower.in_layout_of``: permute -> contiguous clone
-> permute) because the traced graph's ops assume the traced strides: a ``view`` of a piece laid
out otherwise fails, and a kernel (a matmul, a reduction) may sum in another order on other
strides. That copy is wasted where nothing downstream reads the layout: a weight's gradient
reduce-scattered before its ``t`` and dtype cast reaches the graph output through ops that take
any strides and keep every value. At 8B shapes (8 layers, plan="auto") such copies were about
one in eight of the nodes the planned graph has beyond the hand plan's.

:func:`reads_layout` answers, for the op that takes a moved piece, whether anything from it to
the graph's outputs can see the piece's strides: it follows the op's users through
:data:`LAYOUT_BLIND` ops only, and anything else (or a path too long to follow) counts as a
reader. Patch ``layout_blind_moves``; disabled, every move takes the traced layout as before.
"""

from __future__ import annotations

import torch
from torch import fx

from autoparallel import patches
from autoparallel.planner.graph import ALIAS

PATCH = "layout_blind_moves"
aten = torch.ops.aten

# Ops whose output values (as a function of the input's values) do not depend on the input's
# strides, and which accept any strides: views that only permute dims, detach, dtype/device copies.
LAYOUT_BLIND = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten.detach.default, aten._to_copy.default})
MAX_DEPTH = 16  # a longer chain of blind ops is followed no further: it counts as a reader


def reads_layout(consumer: fx.Node, memo: dict[fx.Node, bool] | None = None) -> bool:
    """Whether the strides of a value ``consumer`` takes can reach an op that reads them.

    True unless the patch is on and every path from ``consumer`` ends at the graph's output
    through :data:`LAYOUT_BLIND` ops (and the planner's aliases)."""
    if not patches.enabled(PATCH):
        return True
    return _reads(consumer, {} if memo is None else memo, 0)


def _reads(node: fx.Node, memo: dict[fx.Node, bool], depth: int) -> bool:
    if node.op == "output":
        return False
    if depth >= MAX_DEPTH or node.op != "call_function" or not (node.target in LAYOUT_BLIND or node.target is ALIAS):
        return True
    got = memo.get(node)
    if got is None:
        got = memo[node] = any(_reads(user, memo, depth + 1) for user in node.users)
    return got


__all__ = ["LAYOUT_BLIND", "PATCH", "reads_layout"]
