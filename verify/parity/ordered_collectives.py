"""Rank-ordered reductions: the parity worlds' collectives made independent of buffer layout.

gloo's ring reduce_scatter and all_reduce (and NCCL's rings and trees) add the ranks'
contributions to an element in an order that depends on where the element sits in the buffer:
above 2 ranks, the same gradient reduced alone or inside a bucket can differ in the last bit, so
a bucketing pass that moves nothing but offsets failed bitwise parity, or passed by luck of the
layout. In this mode every reduction exchanges the contributions (all_to_all for a
reduce_scatter, all_gather for an all_reduce: collectives that move bytes and add nothing) and
adds them locally, elementwise, in rank order, in the reduction's dtype:
``((x_0 + x_1) + x_2) + ...``. An element's result then depends on nothing but the ranks' values
for it.

It works by registering CPU and CUDA kernels for the ``_c10d_functional`` reductions (the ops
the graphs, the eager parallel program and DTensor all call) in a ``torch.library.Library`` that
:func:`rank_ordered_reductions` creates and destroys, so both sides of every comparison run the
same code and nothing outlives the scope. The graphs are not touched: what they contain, and so
the goldens, is the same in either mode.

Every parity world runs in this mode unless :func:`native_collectives` (the CLI's
``--native-collectives``) is in force where the world is launched (:func:`run_parity_world`), so
the backend's own collectives can still be measured. ``dist.all_reduce`` and the other in-place
``c10d`` ops are not covered: only the graph trainer's memory test calls one, on both sides.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autoparallel.runtime import run_on_world
from autoparallel.runtime.launched import launched_world, run_on_launched_world

RANK_ORDERED = "rank-ordered"
NATIVE = "native"
MODES = (RANK_ORDERED, NATIVE)

_MODE = contextvars.ContextVar("autoparallel_verify_collectives", default=RANK_ORDERED)

_c10d = torch.ops._c10d_functional
_REDUCTIONS = ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
               "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_out")


def current_mode() -> str:
    """The collectives mode parity worlds launched here get: ``RANK_ORDERED`` unless inside
    :func:`native_collectives`."""
    return _MODE.get()


@contextlib.contextmanager
def native_collectives(native: bool = True) -> Iterator[None]:
    """Parity worlds launched inside run the backend's own reductions (``native=False``: the
    rank-ordered mode again, for a scope inside another)."""
    token = _MODE.set(NATIVE if native else RANK_ORDERED)
    try:
        yield
    finally:
        _MODE.reset(token)


def run_parity_world(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (),
                     mode: str | None = None, **kwargs) -> list[Any]:
    """``autoparallel.runtime.run_on_world(fn, world_size, args=args, **kwargs)`` with every rank
    in the collectives mode ``mode`` (default: :func:`current_mode`). Inside a launched job
    (torchrun) the same body runs on the launched world instead
    (``autoparallel.runtime.launched.run_on_launched_world``; ``start_method`` does not apply)."""
    mode = mode or current_mode()
    if mode not in MODES:
        raise ValueError(f"collectives mode {mode!r}: expected one of {list(MODES)}")
    if launched_world() is not None:
        kwargs.pop("start_method", None)
        return run_on_launched_world(_rank_in_mode, world_size, args=(fn, mode, tuple(args)), **kwargs)
    return run_on_world(_rank_in_mode, world_size, args=(fn, mode, tuple(args)), **kwargs)


def _rank_in_mode(rank: int, world_size: int, fn: Callable[..., Any], mode: str, args: tuple) -> Any:
    if mode == NATIVE:
        return fn(rank, world_size, *args)
    with rank_ordered_reductions():
        return fn(rank, world_size, *args)


@contextlib.contextmanager
def rank_ordered_reductions() -> Iterator[None]:
    """Inside, every ``_c10d_functional`` reduction on CPU or CUDA tensors adds the ranks'
    contributions in rank order (module docstring); the kernels go when the scope ends."""
    lib = torch.library.Library("_c10d_functional", "IMPL")
    try:
        for name in _REDUCTIONS:
            kernel = _KERNELS[name]
            for key in ("CPU", "CUDA"):
                lib.impl(name, kernel, key)
        yield
    finally:
        lib._destroy()


# --- the kernels -----------------------------------------------------------------------------------


def _group_size(group_name) -> int:
    """The size of the group a functional collective names."""
    pg = group_name if isinstance(group_name, dist.ProcessGroup) else _resolve_process_group(group_name)
    return pg.size()


def _fold(parts: torch.Tensor, op: str) -> torch.Tensor:
    """``parts[0] (op) parts[1] (op) ...`` elementwise, in rank order, in ``parts``' dtype."""
    op = op.lower()
    acc = parts[0].clone()
    for r in range(1, parts.shape[0]):
        if op in ("sum", "avg"):
            acc.add_(parts[r])
        elif op == "product":
            acc.mul_(parts[r])
        elif op == "max":
            torch.maximum(acc, parts[r], out=acc)
        elif op == "min":
            torch.minimum(acc, parts[r], out=acc)
        else:
            raise NotImplementedError(f"rank-ordered reductions: reduce op {op!r} is not supported "
                                      f"(sum, avg, product, max, min); run with --native-collectives")
    if op == "avg":
        acc.div_(parts.shape[0])
    return acc


def _all_reduce(input: torch.Tensor, reduce_op: str, group_name) -> torch.Tensor:
    size = _group_size(group_name)
    flat = input.contiguous().reshape(1, -1)
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, size, group_name))
    return _fold(gathered, reduce_op).reshape(input.shape)


def _reduce_scatter(input: torch.Tensor, reduce_op: str, group_size: int, group_name) -> torch.Tensor:
    size = _group_size(group_name)
    if size != group_size or input.shape[0] % size:
        raise ValueError(f"reduce_scatter_tensor: dim 0 ({input.shape[0]}) over a group of {size} "
                         f"(group_size {group_size})")
    # Block r of what arrives is rank r's contribution to this rank's shard.
    split = [input.shape[0] // size] * size
    received = _c10d.wait_tensor(_c10d.all_to_all_single(input.contiguous(), split, split, group_name))
    return _fold(received.reshape(size, *_shard_shape(input, size)), reduce_op)


def _shard_shape(input: torch.Tensor, size: int) -> tuple[int, ...]:
    return (input.shape[0] // size, *input.shape[1:])


def _all_reduce_inplace(input: torch.Tensor, reduce_op: str, group_name) -> torch.Tensor:
    return input.copy_(_all_reduce(input, reduce_op, group_name))


def _all_reduce_coalesced(inputs: list[torch.Tensor], reduce_op: str, group_name) -> list[torch.Tensor]:
    return [_all_reduce(t, reduce_op, group_name) for t in inputs]


def _all_reduce_coalesced_inplace(inputs: list[torch.Tensor], reduce_op: str, group_name) -> list[torch.Tensor]:
    return [_all_reduce_inplace(t, reduce_op, group_name) for t in inputs]


def _reduce_scatter_coalesced(inputs: list[torch.Tensor], reduce_op: str, group_size: int, group_name) -> list[torch.Tensor]:
    return [_reduce_scatter(t, reduce_op, group_size, group_name) for t in inputs]


def _reduce_scatter_out(input: torch.Tensor, reduce_op: str, group_size: int, group_name, *, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(_reduce_scatter(input, reduce_op, group_size, group_name))


_KERNELS = {
    "all_reduce": _all_reduce,
    "all_reduce_": _all_reduce_inplace,
    "all_reduce_coalesced": _all_reduce_coalesced,
    "all_reduce_coalesced_": _all_reduce_coalesced_inplace,
    "reduce_scatter_tensor": _reduce_scatter,
    "reduce_scatter_tensor_coalesced": _reduce_scatter_coalesced,
    "reduce_scatter_tensor_out": _reduce_scatter_out,
}
