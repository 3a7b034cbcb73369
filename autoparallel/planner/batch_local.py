"""Convolutions planned with the batch dim sharded on several mesh dims: lowered as the local op.

DTensor's sharding strategy for ``aten.convolution`` and ``aten.convolution_backward`` (a
single-mesh-dim rule, ``torch/distributed/tensor/_ops/_conv_ops.py``) shards the batch dim
(dim 0 of the input, the output and, in backward, of ``grad_output`` and ``grad_input``),
replicates the weight and makes the weight's and bias's gradients ``Partial(sum)``. The planner
expands single-dim rules over the whole mesh, as DTensor's own propagation does, so on a 2-D mesh
it offers the batch sharded on both dims, ``[Shard(0), Shard(0)]``: no rank repeats another's
rows, the cheapest convolution a conv net has on ``dp=2,tp=2`` (mobilevitv2's plan takes it).

DTensor does not *run* these ops through that strategy alone: its dispatch hands them to
handlers of its own (``torch/distributed/tensor/_tp_conv.py``) that read the spec's ``dim_map``
to decide whether a spatial halo exchange is needed, and ``dim_map`` refuses a tensor dim sharded
on two mesh dims ("Tensor dim 0 is already sharded on mesh dim 0, DTensor operator implementation
does not support things like hybrid sharding strategies yet"). When nothing but the batch dim is
sharded the handler calls the op on the local tensors, unchanged (``_requires_data_exchange`` is
false): each rank's rows of the output are the op on its rows, and its weight gradient is its
rows' partial sum. That holds however many mesh dims split the rows, so the lowering
(``lower.PlacedInterpreter``) runs exactly that call where DTensor's handler cannot: the plan the
strategy allowed runs, and no candidate is taken from the planner (keeping the hybrid out of the
strategies instead would cost every convolution of a 2-D mesh half its batch split).

Only the hybrid case is taken here (:func:`runs_batch_local`); every other convolution still goes
through DTensor's dispatch, the reference. A placement that shards anything but the batch (a
spatial dim, the weight) is DTensor's to run or refuse.

Patch ``batch_local_convolution``; disabled, the lowering dispatches the op through DTensor,
which refuses the hybrid placement (the sweep's REFUSED verdict before the fix).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoparallel import patches
from autoparallel.planner.strategies import Placements

aten = torch.ops.aten

PATCH = "batch_local_convolution"

#: op -> index of its weight among the tensor inputs (forward: input, weight[, bias]; backward:
#: grad_output, input, weight). DTensor runs both through its _tp_conv handlers.
WEIGHT_INPUT = {aten.convolution.default: 1, aten.convolution_backward.default: 2}


def hybrid(placements: Placements) -> bool:
    """Whether one tensor dim is sharded on more than one mesh dim (what ``dim_map`` refuses)."""
    dims = [p.dim for p in placements if isinstance(p, Shard)]
    return len(dims) != len(set(dims))


def _batch_only(placements: Placements) -> bool:
    return all(isinstance(p, Replicate | Partial) or (isinstance(p, Shard) and p.dim == 0) for p in placements)


def runs_batch_local(op, ins: Sequence[Placements], outs: Sequence[Placements | None]) -> bool:
    """Whether the lowering runs ``op`` (tensor inputs placed ``ins``, outputs ``outs``) as its
    local op: a convolution (or its backward) whose placements shard nothing but the batch dim,
    the weight replicated, and shard it on several mesh dims (see the module docstring)."""
    if op not in WEIGHT_INPUT or not patches.enabled(PATCH):
        return False
    placed = [pl for pl in (*ins, *outs) if pl is not None]
    weight = ins[WEIGHT_INPUT[op]] if len(ins) > WEIGHT_INPUT[op] else None
    if weight is None or any(not p.is_replicate() for p in weight):
        return False
    return all(_batch_only(pl) for pl in placed) and any(hybrid(pl) for pl in placed)


__all__ = ["PATCH", "WEIGHT_INPUT", "hybrid", "runs_batch_local"]
