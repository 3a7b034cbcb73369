"""The activation-checkpointing policy: one home for what is saved and what is recomputed.

Three places decide save-or-recompute, and they must decide alike or a graph-level result stops
matching its eager reference:

* the model's eager ``apply_ac`` (``torch.utils.checkpoint`` with :func:`op_sac_context_fn` or a
  full checkpoint, per block: :func:`checkpoint_block`);
* graph SAC of the graph trainer (``autoparallel.trainer.sac``), which feeds each traced block's
  nodes to the same :class:`OpSACState`, so the saved set equals eager op SAC bitwise;
* the joint AC pass of the second compile (``autoparallel.passes.ac_joint``), a minimal
  graph-wide version of the same matmul / SDPA rule (:func:`saves_mm`, :func:`is_sdpa_forward`).

Modes (``apply_ac``): ``"none"``, ``"full"`` (every block), ``"layer:K"`` (full AC on every K-th
block), ``"op"`` (op-selective: save SDPA, the reduce-scatter, ``max``, every other ``mm`` and the
first residual add per block; recompute the rest). Graph SAC policies are ``"op"`` and ``"full"``.

SDPA: one rule, ":func:`is_sdpa_forward`: every ``aten._scaled_dot_product_*`` op that is not a
backward". It used to be two lists: the joint pass knew four variants (flash, flash for cpu,
efficient, cudnn) and the model seven (also fused-attention-overrideable, math, math for mps) plus
this prefix rule for variants a torch build lacks; the union is what every caller wants, and the
prefix rule is that union without having to keep a list up to date.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from autoparallel import meta as M

__all__ = [
    "AC_MODES",
    "FULL",
    "NONE",
    "OP",
    "SAC_POLICIES",
    "SAC_SAVE_OPS",
    "OpSACState",
    "checkpoint_block",
    "is_random",
    "is_sdpa_forward",
    "op_sac_context_fn",
    "op_sac_policy",
    "parse_ac_mode",
    "restore_sac_meta",
    "saves_mm",
]

NONE = "none"
FULL = "full"
OP = "op"
_LAYER = "layer:"
AC_MODES = (NONE, FULL, f"{_LAYER}K", OP)
SAC_POLICIES = (OP, FULL)
_AC_MODES_MSG = f"valid modes: None, {NONE!r}, {FULL!r}, '{_LAYER}K' (K >= 1), {OP!r}"

MM = torch.ops.aten.mm.default
_ADD = torch.ops.aten.add.Tensor
_SDPA_PREFIX = "_scaled_dot_product_"


# --- the op rule ---------------------------------------------------------------------------------


def is_sdpa_forward(func: Any) -> bool:
    """An ``aten._scaled_dot_product_*`` forward op (flash, flash for cpu, efficient, cudnn,
    fused-attention-overrideable, math, math for mps, and any this torch build lacks)."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        return False
    name = func._opname
    return name.startswith(_SDPA_PREFIX) and not name.endswith("_backward")


def _existing(namespace: Any, names: tuple[str, ...]) -> frozenset:
    return frozenset(getattr(namespace, n).default for n in names if hasattr(getattr(namespace, n, None), "default"))


#: Ops op-selective AC saves besides SDPA (:func:`is_sdpa_forward`). ``aten.mm`` only at odd
#: positions within a block (:func:`saves_mm`), the residual ``aten.add.Tensor`` only first.
SAC_SAVE_OPS: frozenset = _existing(torch.ops._c10d_functional, ("reduce_scatter_tensor",)) | frozenset(
    {MM, torch.ops.aten.max.default}
)


def saves_mm(position: int) -> bool:
    """Whether the ``position``-th matmul (1-based, in forward order) is saved: 1st, 3rd, 5th, ...

    The rule behind "save every other matmul": op SAC counts per block, the joint AC pass over
    its whole graph."""
    if position < 1:
        raise ValueError(f"matmul positions are 1-based, got {position}")
    return position % 2 == 1


def _is_residual_add(func: Any, args: tuple) -> bool:
    """A residual add is an ``aten.add.Tensor`` whose two operands are both tensors.

    It works on eager args (``torch.Tensor``) and on FX node args (``torch.fx.Node``).
    Inside a block, the only other ``aten.add.Tensor`` is RMSNorm's ``+ eps``, whose
    second operand is a Python scalar.
    """
    if func is not _ADD or len(args) < 2:
        return False
    tensor_like = (torch.Tensor, torch.fx.Node)
    return isinstance(args[0], tensor_like) and isinstance(args[1], tensor_like)


def op_sac_policy(
    func: Any, *, mm_index: int | None = None, residual_add_index: int | None = None
) -> CheckpointPolicy:
    """Pure op-selective AC decision for one op of one transformer block.

    Args:
        func: the op (an ``OpOverload``, e.g. ``node.target`` of an FX ``call_function`` node).
        mm_index: for ``aten.mm``, its 1-based position among the block's mms in forward
            order (:func:`saves_mm`). Required when ``func`` is ``aten.mm.default``.
        residual_add_index: for a residual ``aten.add.Tensor`` (two tensor operands), its
            1-based position among the block's residual adds. Only the first is saved.
            Pass ``None`` for a non-residual add (e.g. ``x + eps``).

    Returns ``MUST_SAVE`` for SDPA (:func:`is_sdpa_forward`), random ops (:func:`is_random`),
    ``_c10d_functional.reduce_scatter_tensor``, ``aten.max.default``, odd mms and the first
    residual add. Every other op gets ``PREFER_RECOMPUTE``.

    Graph passes usually go through :class:`OpSACState`, which keeps the per-block counters.
    """
    if func is MM:
        if mm_index is None or mm_index < 1:
            raise ValueError("op_sac_policy: aten.mm needs a 1-based mm_index")
        return CheckpointPolicy.MUST_SAVE if saves_mm(mm_index) else CheckpointPolicy.PREFER_RECOMPUTE
    if func is _ADD:
        if residual_add_index == 1:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    if func in SAC_SAVE_OPS or is_sdpa_forward(func) or is_random(func):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def is_random(func: Any) -> bool:
    """An op that draws from the generator (dropout, rand, bernoulli: ``nondeterministic_seeded``):
    never recomputed, since a replay on CPU draws new numbers (CUDA's functionalized RNG, which
    replays the offset, is not there), so the backward would see another mask than the forward."""
    return isinstance(func, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in func.tags


@dataclass
class OpSACState:
    """Per-block counters that feed :func:`op_sac_policy`.

    Make a new one for each block (and, in eager SAC, one per forward/recompute mode).
    Then call :meth:`decide` once per op, in forward order. In an FX graph, feed it the
    block's ``OpOverload`` nodes (``aten.detach`` included or not; it never moves a
    counter). ``operator.getitem`` nodes of a multi-output op, such as SDPA's
    ``(out, logsumexp)``, take their parent's decision, as they do under eager SAC tracing.
    """

    mm_count: int = 0
    residual_add_count: int = 0

    def decide(self, func: Any, args: tuple = ()) -> CheckpointPolicy:
        """Advance the counters for ``func`` and return its policy.

        ``args`` are the op's positional args (tensors or FX nodes). They are only used to
        tell a residual add from ``x + scalar``.
        """
        mm_index = None
        add_index = None
        if func is MM:
            self.mm_count += 1
            mm_index = self.mm_count
        elif _is_residual_add(func, args):
            self.residual_add_count += 1
            add_index = self.residual_add_count
        return op_sac_policy(func, mm_index=mm_index, residual_add_index=add_index)


# --- eager: torch.utils.checkpoint ----------------------------------------------------------------


def op_sac_context_fn(ac_graph_id: int) -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` implementing op-selective AC.

    Each call (one per checkpointed forward) gets fresh counters, with separate counters
    for forward and recompute mode. The caching context carries the int ``ac_graph_id``,
    so graph nodes traced under it get ``meta["ac_graph_id"] == ac_graph_id``.
    """
    states = {False: OpSACState(), True: OpSACState()}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return states[bool(ctx.is_recompute)].decide(func, args)

    caching, cached = create_selective_checkpoint_contexts(policy)
    caching.ac_graph_id = int(ac_graph_id)
    return caching, cached


_SAC_META_KEYS = (M.RECOMPUTE, M.AC_GRAPH_ID)


@contextlib.contextmanager
def restore_sac_meta(keys: tuple[str, ...] = _SAC_META_KEYS) -> Iterator[None]:
    """Undo SAC's writes to ``torch.fx.traceback.current_meta`` when the region ends.

    Under make_fx / aot_export, ``_CachingTorchDispatchMode`` sets
    ``current_meta["recompute"]`` and ``["ac_graph_id"]`` and never clears them. Every
    node traced afterwards, including the whole backward, would then inherit the tag.
    """
    old = {k: fx_traceback.current_meta[k] for k in keys if k in fx_traceback.current_meta}
    try:
        yield
    finally:
        # Look the dict up again: preserve_node_meta() may have rebound the global.
        cm = fx_traceback.current_meta
        for k in keys:
            cm.pop(k, None)
        cm.update(old)


def parse_ac_mode(mode: str | None, n_blocks: int) -> list[str | None]:
    """Per-block mode list (``None``, ``"full"`` or ``"op"``) for an ``apply_ac`` mode. Raises
    ValueError naming the mode and the valid ones."""
    if mode is None or mode == NONE:
        return [None] * n_blocks
    if mode in (FULL, OP):
        return [mode] * n_blocks
    if isinstance(mode, str) and mode.startswith(_LAYER):
        k_str = mode[len(_LAYER) :]
        if k_str.isascii() and k_str.isdigit() and int(k_str) >= 1:
            k = int(k_str)
            return [FULL if i % k == 0 else None for i in range(n_blocks)]
    raise ValueError(f"unknown activation checkpointing mode {mode!r}; {_AC_MODES_MSG}")


def checkpoint_block(fn: Callable[..., Any], block_mode: str | None, ac_graph_id: int, *args: Any) -> Any:
    """``fn(*args)`` under the block's AC mode: plain (None), a full non-reentrant checkpoint, or
    op-selective SAC whose nodes carry ``ac_graph_id``. SAC's metadata writes are undone after
    the block (:func:`restore_sac_meta`), so tags do not leak into later nodes of a trace."""
    if block_mode is None:
        return fn(*args)
    if block_mode == FULL:
        context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn
    elif block_mode == OP:

        def context_fn() -> tuple[Any, Any]:
            return op_sac_context_fn(ac_graph_id)

    else:
        raise ValueError(f"a block's AC mode must be None, {FULL!r} or {OP!r}, got {block_mode!r}")
    with restore_sac_meta():
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
