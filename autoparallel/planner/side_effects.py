"""Nodes run only for their side effect (an assert, a print): planned on the whole value, kept.

A trace records calls that return nothing: ``aten._assert_async.msg`` (``F.one_hot``'s "Class
values must be non-negative" check on its indices: dbrx's router), ``aten._assert_scalar``,
``aten._print``, ``sym_constrain_range``. They have no ``meta['val']`` and no users, so they
place no tensor and nothing reads them; yet they are part of what the program does, and the
planner used to refuse the whole model at the first one ("has no tensor meta['val']").

Patch ``side_effect_nodes``: a call with no users and no tensor in its value (:func:`is_side_effect`)
is a replicated fallback with no output (``strategies.SIDE_EFFECT``): its one candidate takes every
tensor input ``Replicate``, the edges into it price the moves, and the lowering runs the op on
those whole inputs on every rank (``lower.PlacedInterpreter``), so each rank makes exactly the
check the single-device program makes. Why the whole value and not the rank's piece:

* ``_assert_async`` reads one element (its contract: a tensor of one value, a reduction's result
  such as one_hot's ``all(x >= 0)``). One element does not split over a mesh dim, so its only
  placements are ``Replicate`` and ``Partial``; a ``Partial`` piece is one rank's term, not the
  value (``all`` is ``Partial(product)``: a rank whose rows are fine holds ``True`` while the
  value is ``False``). Evaluated on its piece, the check raises on the ranks that hold a bad row
  only, while the others train on (or wait at the next collective); on ``Replicate`` every rank
  reads the value and raises alike, as eager raises. The move is one all-reduce of one element.
* Any other such op (a custom op with a side effect) sees on every rank what the single-device
  program passes it: whatever it does, it does as that program does.

Dropping the node instead would be correct only where eager semantics allow it, and they do not:
eager raises the assert's own message on a batch that breaks it, and so must every rank.

Disabled: the planner refuses the model at the first such node (the sweep's REFUSED verdict).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel import patches

PATCH = "side_effect_nodes"


def is_side_effect(node: fx.Node) -> bool:
    """Whether ``node`` is a call run only for its side effect: no users and no tensor in its
    traced value (None for an op that returns nothing). Always False with the patch disabled."""
    if node.op != "call_function" or node.users or not patches.enabled(PATCH):
        return False
    return not any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(node.meta.get(M.VAL)))


__all__ = ["PATCH", "is_side_effect"]
