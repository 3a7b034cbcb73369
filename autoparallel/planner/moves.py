"""The lowering's moves written directly: one functional collective per mesh dim, plus the one
permuted copy a dim other than 0 needs, instead of DTensor's ``redistribute_local_tensor``.

DTensor gathers or scatters a tensor dim ``d > 0`` around a dim-0 collective by chunking and
concatenating (``split -> W getitems -> cat``: W + 2 traced nodes, then rewritten by
``passes/permuted_split_cat.py``); at 8B shapes those moves were a third of the lowering
(docs/lean-planned.md). Here each step of DTensor's own transform plan (``_gen_transform_infos``:
the same steps in the same order, so the same collectives on the same groups, summing in the same
order) is written as:

* ``Partial -> Replicate``: ``all_reduce`` (the Partial's reduce op);
* ``Shard(d) -> Replicate``: ``all_gather_into_tensor`` (dim 0), then for ``d > 0`` one permuted
  copy moving the W gathered blocks to dim ``d`` (``view -> permute -> contiguous clone -> view``);
* ``Partial -> Shard(d)``: for ``d > 0`` the permuted copy moving dim ``d``'s W blocks to dim 0,
  then ``reduce_scatter_tensor`` (dim 0);
* ``Replicate -> Shard(d)``: this rank's block, ``narrow -> clone`` (no communication).

The values are DTensor's bit for bit (data movement is exact, and each reduction reads the same
bytes in the same group), which ``tests/property/test_direct_moves_properties.py`` checks on
generated placements. Everything else stays DTensor's redistribution, counted by
:func:`direct_move`'s caller under the reason returned here: a ``Shard -> Shard`` step (an
all-to-all; DTensor writes it per backend), ``Replicate -> Partial``, strided shards,
``_MaskPartial`` and other placement subclasses, and a shard that does not divide evenly (DTensor
pads).

Patch ``direct_moves``; disabled, every move is DTensor's (and ``permuted_split_cat`` rewrites its
chunk/cat after the trace, as before).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autoparallel import patches

PATCH = "direct_moves"

Placements = tuple[Placement, ...]


def _kind(p: Placement) -> str | None:
    """``R`` / ``S`` / ``P`` for the plain placements this module writes, else None (subclasses:
    ``_StridedShard``, ``_MaskPartial``, ... stay DTensor's)."""
    t = type(p)
    return {Replicate: "R", Shard: "S", Partial: "P"}.get(t)


def _step_refusal(src: Placement, dst: Placement, size: int, shape: Sequence[int]) -> str | None:
    """Why one step (``src -> dst`` on a mesh dim of ``size``, logical ``shape``) is not written
    here, or None when it is."""
    a, b = _kind(src), _kind(dst)
    if a is None or b is None:
        return "placement subclass"
    if size == 1:
        return None
    pair = a + b
    if pair not in ("PR", "SR", "PS", "RS"):
        return {"SS": "shard to shard (all-to-all)", "RP": "replicate to partial"}.get(pair, f"{a} to {b}")
    shard = src if a == "S" else dst if b == "S" else None
    if shard is not None and int(shape[shard.dim]) % size:
        return "uneven shard"
    return None


def plan_steps(src: Placements, dst: Placements, meta: TensorMeta, device_mesh) -> tuple[list, str | None]:
    """DTensor's transform plan for ``src -> dst`` (``_gen_transform_infos``, cached on the specs)
    and the reason a step of it is not written here (None: every step is)."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    steps = _gen_transform_infos(DTensorSpec(device_mesh, src, tensor_meta=meta), DTensorSpec(device_mesh, dst, tensor_meta=meta))
    for s in steps:
        why = _step_refusal(*s.src_dst_placements, device_mesh.size(s.mesh_dim), s.logical_shape)
        if why is not None:
            return steps, why
    return steps, None


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def blocks_to_dim(t: torch.Tensor, pieces: int, d: int) -> torch.Tensor:
    """``t``'s ``pieces`` dim-0 blocks laid side by side along dim ``d`` (what ``cat(chunk(t,
    pieces, 0), d)`` gives), as one contiguous copy."""
    shape = list(t.shape)
    block = [shape[0] // pieces, *shape[1:]]
    v = t.view([pieces, *block])
    # the pieces dim goes just before dim d (d + 1 in the viewed shape, counting it)
    perm = [*range(1, d + 1), 0, *range(d + 1, len(block) + 1)]
    out = list(block)
    out[d] *= pieces
    return v.permute(perm).clone(memory_format=torch.contiguous_format).view(out)


def dim_to_blocks(t: torch.Tensor, pieces: int, d: int) -> torch.Tensor:
    """``t``'s dim ``d`` cut into ``pieces`` blocks stacked along dim 0 (what ``cat(chunk(t,
    pieces, d), 0)`` gives), as one contiguous copy."""
    if d == 0:
        return t.contiguous()
    shape = list(t.shape)
    split = [*shape[:d], pieces, shape[d] // pieces, *shape[d + 1:]]
    perm = [d, *range(d), *range(d + 1, len(split))]
    out = list(shape)
    out[0] *= pieces
    out[d] //= pieces
    # reshape: a view of a contiguous piece (traced as view), a copy of a strided one
    return t.reshape(split).permute(perm).clone(memory_format=torch.contiguous_format).view(out)


def _step(t: torch.Tensor, src: Placement, dst: Placement, device_mesh, i: int) -> torch.Tensor:
    w = device_mesh.size(i)
    if w == 1:
        return t
    group = (device_mesh, i)
    if dst.is_replicate() and src.is_partial():
        return _waited(funcol.all_reduce(t, reduceOp=src.reduce_op, group=group))
    if dst.is_replicate():  # Shard(d) -> Replicate
        gathered = _waited(funcol.all_gather_single(t.contiguous(), 0, group))
        return blocks_to_dim(gathered, w, src.dim) if src.dim else gathered
    if src.is_partial():  # Partial -> Shard(d)
        stacked = dim_to_blocks(t, w, dst.dim)
        return _waited(funcol.reduce_scatter_single(stacked, src.reduce_op, 0, group))
    # Replicate -> Shard(d): this rank's block (DTensor's chunk[i].clone(), the same view)
    c = t.size(dst.dim) // w
    return t.narrow(dst.dim, device_mesh.get_coordinate()[i] * c, c).clone()


def direct_move(value: torch.Tensor, src: Placements, dst: Placements, meta: TensorMeta, device_mesh) -> tuple[torch.Tensor | None, str | None]:
    """(``value`` moved from ``src`` to ``dst``, None) when every step of DTensor's plan is one
    this module writes; (None, the reason) otherwise, or when the patch is disabled."""
    if not patches.enabled(PATCH):
        return None, f"patch {PATCH} disabled"
    steps, why = plan_steps(src, dst, meta, device_mesh)
    if why is not None:
        return None, why
    for s in steps:
        value = _step(value, *s.src_dst_placements, device_mesh, s.mesh_dim)
    return value, None


def pair_name(src: Placements, dst: Placements) -> str:
    """``S(1)R -> RR``: a move's placements, DTensor's short forms."""
    return f"{''.join(str(p) for p in src)} -> {''.join(str(p) for p in dst)}"


__all__ = ["PATCH", "blocks_to_dim", "dim_to_blocks", "direct_move", "pair_name", "plan_steps"]
