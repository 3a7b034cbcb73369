"""Strided shards: a tensor dim sharded by two mesh dims in the order FSDP2 + TP shard it.

DTensor applies placements in mesh order, so on a mesh ``dp, tp`` the placements ``dp:S(0)
tp:S(0)`` mean dp-major blocks: rank (dp i, tp j) holds block ``i * n_tp + j``. FSDP2 on top of
TP shards the TP shard: rank (i, j) holds block ``j * n_dp + i``, and gathering over dp then
yields the rank's TP shard with one all-gather. DTensor writes that layout with
``_StridedShard(0, split_factor=n_tp)`` on dp (the dp shard of pieces already split ``n_tp``
ways by the later mesh dim). Without it a planner pinned to a hand FSDP+TP plan on ``dp, tp``
can only pin the dp-major layout, and gathers over tp as well to undo it (docs/lean-planned.md).

:func:`strided_variants` gives, for a placement tuple in which a mesh dim shards a tensor dim that
later mesh dims shard too, the variant with that mesh dim applied last (innermost), as FSDP does.
``_StridedShard`` is no ``Shard`` subclass in PyTorch 2.13: code that counts shards per dim asks
:func:`sharded_dim`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement, Shard, _StridedShard

Placements = tuple[Placement, ...]


def sharded_dim(p: Placement) -> int | None:
    """The tensor dim ``p`` shards (a ``Shard`` or a ``_StridedShard``), else None."""
    if isinstance(p, Shard | _StridedShard):
        return p.dim
    return None


def has_strided(placements: Sequence[Placement] | None) -> bool:
    return placements is not None and any(isinstance(p, _StridedShard) for p in placements)


def strided_variants(placements: Placements, sizes: Sequence[int]) -> list[Placements]:
    """The FSDP-order variant of ``placements`` (none when no tensor dim is sharded by two mesh
    dims): each mesh dim that shards a tensor dim some later mesh dims also shard becomes
    ``_StridedShard(dim, split_factor=product of those later dims' sizes)``, so it shards the
    pieces the later dims made. Only plain ``Shard`` tuples are varied."""
    if any(isinstance(p, _StridedShard) for p in placements):
        return []
    out = list(placements)
    for i, p in enumerate(placements):
        if not isinstance(p, Shard):
            continue
        later = [sizes[j] for j in range(i + 1, len(placements)) if sharded_dim(placements[j]) == p.dim]
        if later:
            out[i] = _StridedShard(p.dim, split_factor=math.prod(later))
    variant = tuple(out)
    return [variant] if variant != tuple(placements) else []


def nesting(placements: Sequence[Placement], sizes: Sequence[int], dim: int) -> list[int]:
    """The mesh dims that shard tensor dim ``dim``, outermost block first: mesh order for plain
    shards, reverse mesh order for a :func:`strided_variants` layout. ValueError for any other
    mix (a ``_StridedShard`` whose split factor is not the product of the later mesh dims that
    shard its dim, or one followed by a strided one that is not so)."""
    dims = [i for i, p in enumerate(placements) if sharded_dim(p) == dim]
    if not any(isinstance(placements[i], _StridedShard) for i in dims):
        return dims
    for k, i in enumerate(dims):
        later = math.prod(sizes[j] for j in dims[k + 1:])
        p = placements[i]
        ok = p.split_factor == later if isinstance(p, _StridedShard) else k == len(dims) - 1
        if not ok:
            raise ValueError(f"placements {tuple(placements)}: dim {dim} is sharded in an order this planner does not lay out "
                             "(each mesh dim but the last that shards it must be _StridedShard(dim, split_factor=product of the "
                             "later ones' sizes), as strided_variants writes)")
    return dims[::-1]


def piece(full, placements: Sequence[Placement], sizes: Sequence[int], coord: Sequence[int]):
    """The rank at mesh coordinate ``coord``'s piece of ``full`` (a view) under ``placements``
    (Replicate, Shard, strided shards as :func:`nesting` orders them; every sharded dim must
    divide evenly): the block numbered by the nesting mesh dims' coordinates, outermost first."""
    out = full
    for dim in sorted({d for p in placements if (d := sharded_dim(p)) is not None}):
        order = nesting(placements, sizes, dim)
        count = math.prod(sizes[i] for i in order)
        if out.shape[dim] % count:
            raise ValueError(f"placements {tuple(placements)}: dim {dim} of shape {tuple(full.shape)} does not divide by {count}")
        index = 0
        for i in order:
            index = index * sizes[i] + coord[i]
        step = out.shape[dim] // count
        out = out.narrow(dim, index * step, step)
    return out


__all__ = ["has_strided", "nesting", "piece", "sharded_dim", "strided_variants"]
