"""Guard each value and count the trace specialised (``aten._local_scalar_dense``, nonzero): correct by construction.

The joint trace answers a model's ``.item()`` / ``if t:`` with the value a real run of the rank's
batch gave (``autoparallel/parallelize/traced_values.py``) and records the branch it took; the read itself is
dead code in the graph. A batch that gives another value would compute the traced branch:
a wrong result, silently (upstream's ``make_fx`` specialisation leaves no check either).

Patch ``value_guards``: each read becomes ``autoparallel.guard_value(read, loss, traced value,
message)``, whose result replaces the loss output. At run time it reads the tensor and raises
:class:`ValueGuardError` naming the module, the model's line and both values when they differ, so
the step returns nothing computed on the wrong branch; else it returns the loss (a copy of one
number: bitwise the same). It is an ordinary custom op with a fake kernel and a pass-through
gradient, so the partition puts it in the forward graph (the loss depends on it), dead-code
elimination keeps it, and the second compile's re-traces record it again. The joint trace's
first output is the loss (``label_roles``), so that is the anchor.

A nonzero count (``nonzero``, or a mask that ``x[mask]``, ``masked_select`` or ``x[mask] = v`` counts
in its kernel) becomes ``autoparallel.guard_rows(mask, rows, message)`` right after the counted
tensor, which every user of it reads: another count raises before any of them runs.

Disabled: no value is taken from a real run, and the trace refuses the read as before.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils.weak import WeakTensorKeyDictionary

from autoparallel import meta as M

PATCH = "value_guards"


class ValueGuardError(RuntimeError):
    """A batch gave another value than the one the graph was traced with."""


@torch.library.custom_op("autoparallel::guard_value", mutates_args=())
def guard_value(read: torch.Tensor, x: torch.Tensor, expected: float, message: str) -> torch.Tensor:
    """``x`` (a copy) when ``read``'s value is ``expected``; else ValueGuardError(``message``)."""
    got = read.item()
    if not same_value(got, expected):
        raise ValueGuardError(f"{message}; this batch gives {got!r}, and the graph holds the traced branch only")
    return x.clone()


@guard_value.register_fake
def _(read, x, expected, message):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return None, grad, None, None


guard_value.register_autograd(_backward)

GUARD = torch.ops.autoparallel.guard_value.default


@torch.library.custom_op("autoparallel::traced_read", mutates_args=())
def traced_read(read: torch.Tensor, value: float, description: str, rows: bool) -> None:
    """Where the trace answered a read of ``read`` with ``value`` (``rows``: the row count of a
    nonzero of it); :func:`guard_reads` replaces it by the guard."""
    raise RuntimeError(f"read {description} left unguarded: the value_guards pass did not run on this graph")


@traced_read.register_fake
def _(read, value, description, rows):
    return None


TRACED_READ = torch.ops.autoparallel.traced_read.default
fx.node.has_side_effect(TRACED_READ)  # dead-code elimination keeps the mark until the pass replaces it


@torch.library.custom_op("autoparallel::guard_rows", mutates_args=())
def guard_rows(mask: torch.Tensor, rows: int, message: str) -> torch.Tensor:
    """``mask`` (a copy) when it has ``rows`` nonzero entries (the row count of its nonzero, the
    size of what it selects); else ValueGuardError(``message``)."""
    got = int(mask.count_nonzero())
    if got != rows:
        raise ValueGuardError(f"{message}; this batch gives {got}, and the graph holds the traced shape only")
    return mask.clone()


# The count each guard_rows' fake output holds: a later re-trace of a graph that holds the guard
# (the second compile's) answers the nonzero of that mask with it (:func:`counts_as_guarded`).
COUNTS = WeakTensorKeyDictionary()


@guard_rows.register_fake
def _(mask, rows, message):
    out = torch.empty_like(mask)
    COUNTS[out] = rows
    return out


@contextlib.contextmanager
def counts_as_guarded() -> Iterator[None]:
    """Within: fake tensors answer the nonzero of a guarded mask (``nonzero``, and inside
    ``x[mask]`` / ``masked_select``) with the count its guard holds, as the joint trace did; any
    other keeps the fake kernel's behaviour. For re-traces of graphs that hold the guards."""
    from torch._subclasses import fake_impls

    nonzero, select = torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default
    saved = {op: fake_impls.op_implementations_dict.get(op) for op in (nonzero, select)}

    def answer_nonzero(fake_mode, func, arg):
        if arg not in COUNTS:
            return saved[nonzero](fake_mode, func, arg)
        n = COUNTS[arg]
        return arg.new_empty_strided((n, arg.dim()), (1, max(n, 1)), dtype=torch.int64)  # CPU's layout

    def answer_select(fake_mode, func, arg, mask):
        if mask not in COUNTS or tuple(mask.shape) != tuple(arg.shape):
            return saved[select](fake_mode, func, arg, mask)
        return arg.new_empty((COUNTS[mask],))

    fake_impls.op_implementations_dict.update({nonzero: answer_nonzero, select: answer_select})
    try:
        yield
    finally:
        fake_impls.op_implementations_dict.update(saved)


GUARD_ROWS = torch.ops.autoparallel.guard_rows.default


def same_value(got: bool | int | float, expected: float) -> bool:
    """Equal as numbers; NaN equals NaN (a NaN read traced as NaN is the traced value)."""
    if isinstance(got, float) and math.isnan(got):
        return math.isnan(expected)
    return float(got) == expected


@dataclass
class ValueGuardsReport:
    guarded: list[str] = field(default_factory=list)  # "module site: traced with value" per read

    @property
    def acted(self) -> int:
        return len(self.guarded)


def guard_reads(gm: fx.GraphModule) -> ValueGuardsReport:
    """Replace each ``traced_read(read, value, description, rows=False)`` mark of ``gm`` by a guard of ``read``
    against ``value`` on the graph's first output (the loss), in graph order."""
    graph = gm.graph
    report = ValueGuardsReport()
    marks = list(graph.find_nodes(op="call_function", target=TRACED_READ))
    for mark in [m for m in marks if m.args[3]]:
        report.guarded.append(_guard_nonzero(graph, mark))
    marks = [m for m in marks if not m.args[3]]
    if not marks:
        if report.guarded:
            graph.lint()
            gm.recompile()
        return report
    out = graph.output_node()
    outputs = list(out.args[0])
    anchor = outputs[0]
    for mark in marks:
        read, value, description, _ = mark.args
        module = (mark.meta.get(M.CUSTOM) or {}).get(M.MODULE_PATH, "")
        where = f"{module} {description}".strip()
        with graph.inserting_after(anchor):
            guard = graph.call_function(GUARD, (read, anchor, value, f"value guard: {where}"))
        guard.meta.update({k: v for k, v in mark.meta.items() if k not in (M.VAL, "tensor_meta")})
        guard.meta[M.VAL] = anchor.meta.get(M.VAL)
        graph.erase_node(mark)
        anchor = guard
        report.guarded.append(where)
    outputs[0] = anchor
    out.args = (type(out.args[0])(outputs), *out.args[1:])
    graph.lint()
    gm.recompile()
    return report


def _guard_nonzero(graph: fx.Graph, mark: fx.Node) -> str:
    """A mark of a nonzero count (a ``nonzero`` of ``read``, or a mask that ``x[mask]``, ``x[mask] =
    v`` or ``masked_select`` takes one of inside its kernel) becomes ``guard_rows(read)`` right after
    ``read``; every user of ``read`` (the nonzero, the indexing, its backward) reads the guard's
    copy, so a batch with another count raises before any of them runs."""
    read, rows, description, _ = mark.args
    where = f"{(mark.meta.get(M.CUSTOM) or {}).get(M.MODULE_PATH, '')} {description}".strip()
    with graph.inserting_after(read):
        guard = graph.call_function(GUARD_ROWS, (read, int(rows), f"value guard: {where}"))
    guard.meta.update({k: v for k, v in read.meta.items() if k in (M.VAL, "tensor_meta")})
    guard.meta.update({k: v for k, v in mark.meta.items() if k not in (M.VAL, "tensor_meta")})
    users = [u for u in read.users if u is not guard and u is not mark]
    if not users:
        raise ValueError(f"no user of {read.name} but the mark of {description}: the graph holds an unguarded shape")
    for user in users:
        user.replace_input_with(read, guard)
    graph.erase_node(mark)
    return where


__all__ = ["COUNTS", "GUARD", "GUARD_ROWS", "counts_as_guarded", "PATCH", "TRACED_READ", "ValueGuardError", "ValueGuardsReport", "guard_reads", "guard_value", "same_value", "traced_read"]
