"""The replaying lowering (issue 44): which planned ops run as the local op itself, without DTensor.

The lowering (``autoparallel.planner.lower.PlacedInterpreter``) moves each input to the
placement the plan gives it, then runs the op. Through DTensor's dispatch that costs a sharding
propagation per op, and under ``make_fx`` DTensor propagates uncached (``_are_we_tracing``): at
8B shapes the lowering is most of a trace again. For many ops the plan already says everything:
once the inputs sit in the candidate's placements, the op on the local tensors, with the traced
arguments unchanged, *is* what DTensor runs (its rule changes no argument and its output placement
is the candidate's). :func:`replays` names those ops; every other op goes through DTensor's
dispatch as before (the fallback per node). The switch is an explicit argument:
``PipelineOptions(lowering="replay")`` (``python -m verify scale --lowering replay``), checked by
:func:`check_lowering`; the default is ``replay`` (``autoparallel.defaults.DEFAULT_LOWERING``: every
planned parity cell is bitwise through it), ``dtensor`` stays selectable as its reference. No environment variable: a switch read
deep inside the lowering is invisible to every cache of runs (``reuse_pipeline_runs`` served a
DTensor run to a replay request, issue 44), an option is part of the run's arguments.

An op replays when

* it is elementwise (``torch.Tag.pointwise``, or a dtype cast / ``detach``), not random, every
  tensor input has the output's global shape (no broadcast: shard dims line up) and the
  placement the plan gives the output: each rank's piece of the output is the op on its pieces;
* it is a matrix product (``mm``, ``bmm``) or a dim transposition (``t``, ``transpose``,
  ``permute``): no argument depends on sizes, and DTensor's strategy maps input placements to
  one output placement, the candidate's.

What that claims is checked where it matters: the lowered graphs of both switches are the same
program, node for node (``tests/unit/autoparallel/planner/test_replay.py``), so parity and
goldens hold unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from autoparallel import meta as M
from autoparallel.defaults import LOWERINGS
from autoparallel.planner.strategies import Placements, is_undroppable_random

aten = torch.ops.aten

MODES = LOWERINGS  # "dtensor" (the reference), "replay" (the default)

_ELEMENTWISE = frozenset({aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.detach.default})
_SIZE_FREE = frozenset({aten.mm.default, aten.bmm.default, aten.t.default, aten.transpose.int, aten.permute.default})


def check_lowering(mode: str) -> str:
    """``mode`` if it names a lowering (:data:`MODES`); ValueError naming the choices otherwise."""
    if mode not in MODES:
        raise ValueError(f"lowering={mode!r}: expected one of {list(MODES)}")
    return mode


def _elementwise(op) -> bool:
    return op in _ELEMENTWISE or (isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags)


def replays(node: fx.Node, ins: Sequence[object], want: Sequence[Placements], out: Sequence[Placements | None]) -> bool:
    """Whether ``node`` (tensor inputs' global values ``ins``, placed ``want``; outputs placed
    ``out``) runs as its local op (see the module docstring)."""
    op = node.target
    if not ins or len(out) != 1 or out[0] is None or is_undroppable_random(op):
        return False
    if op in _SIZE_FREE:
        return True
    if not _elementwise(op):
        return False
    val = node.meta.get(M.VAL)
    if not isinstance(val, torch.Tensor):
        return False
    for v, pl in zip(ins, want, strict=True):
        if pl != out[0] or not isinstance(v, torch.Tensor) or v.shape != val.shape:
            return False
    return True


__all__ = ["MODES", "check_lowering", "replays"]
