"""A scalar random draw in forward is one draw for the whole batch: every data-parallel rank takes
data-parallel rank 0's (patch ``replicated_draws``).

A layer drop (m2m_100, nllb-moe, seamless_m4t: ``if torch.rand([]) < self.layerdrop: skip``)
draws one number per forward. A single device running the whole batch draws it once and every
example takes the same branch. Data-parallel ranks seed their generators per slice (their dropout
masks are their slices'), so each would draw its own number: ranks that skip different layers
gather different parameters, a collective mismatch (a hang, or all-gathers paired with the wrong
tensors), and no one program, traced or eager, serves them. A scalar draw (a random factory
call with no tensor argument and a 0-dim result) cannot depend on the batch, so it is replicated:
every rank draws it, consuming its generator exactly as eager does (later dropout masks stay the
eager ones), then all ranks take the draw of data-parallel coordinate 0 through one all-gather of
the scalar per data dim (its first element). The single-device reference
that runs slice by slice does the same with :func:`first_slice_draws`.

The value a draw gives decides a branch the trace takes: ``traced_values`` records it and
``value_guards`` guards the outcome, so a step whose (replicated) draw takes the other branch raises
on every rank alike instead of computing the traced one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

PATCH = "replicated_draws"

# Random factory functions: they draw from the generator and take no tensor (a shape, a range).
RANDOM_FACTORIES = frozenset({torch.rand, torch.randn, torch.randint, torch.normal})


def is_scalar_draw(func, args, kwargs, out) -> bool:
    """``func(*args, **kwargs)`` -> ``out`` drew one number that no tensor decides: a random factory
    with no tensor argument and a 0-dim result."""
    return (func in RANDOM_FACTORIES and isinstance(out, torch.Tensor) and out.dim() == 0
            and not any(isinstance(t, torch.Tensor) for t in tree_leaves((args, kwargs))))


class ReplicatedDraws(TorchFunctionMode):
    """Inside: each scalar draw's result goes through ``share`` (after it drew, so the generator
    advances as in eager)."""

    def __init__(self, share: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.share = share

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        return self.share(out) if is_scalar_draw(func, args, kwargs, out) else out


def from_first_rank(groups: Sequence[str]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``share`` over the data dims' ``groups`` (their names, dims of size > 1): per group, an
    all-gather of the draw and its first element, the draw of the group's rank 0. The graph is the
    same on every rank (no rank's coordinate is baked in: a rank may run a graph another traced)."""
    import torch.distributed._functional_collectives as funcol

    def share(draw: torch.Tensor) -> torch.Tensor:
        for group in groups:
            draw = funcol.all_gather_tensor(draw.reshape(1), 0, group)[0]
        return draw

    return share


def first_slice_draws() -> Callable[[], contextlib.AbstractContextManager]:
    """For a reference that runs the data-parallel slices one after another on one process:
    ``one_slice()``, a context for each slice in order. The first slice's scalar draws are recorded;
    every later slice draws its own (its generator advances as its rank's does) and takes the first
    slice's, in order: what the replicated program computes."""
    drawn: list[torch.Tensor] = []
    slices = [0]

    @contextlib.contextmanager
    def one_slice():
        first, at = slices[0] == 0, [0]

        def share(draw: torch.Tensor) -> torch.Tensor:
            if first:
                drawn.append(draw.clone())
                return draw
            if at[0] >= len(drawn):
                raise RuntimeError(f"a data-parallel slice draws more scalars ({at[0] + 1}) than the first "
                                   f"({len(drawn)}): the slices take different paths, no replicated draw matches")
            at[0] += 1
            return drawn[at[0] - 1].clone()

        with ReplicatedDraws(share):
            yield
        slices[0] += 1

    return one_slice


__all__ = ["PATCH", "RANDOM_FACTORIES", "ReplicatedDraws", "first_slice_draws", "from_first_rank", "is_scalar_draw"]
