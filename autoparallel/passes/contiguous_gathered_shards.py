"""Bucketed all-gathers hand out contiguous parameters, as unbucketed ones do.

PyTorch's all-gather bucket merge (``torch/_inductor/fx_passes/bucketing.py``,
``all_gather_merge_fn_to_trace``) gathers a bucket into ``[world, bucket]``, splits it into
column blocks ``[world, shard numel]`` and reshapes each to the parameter's full shape. A
parameter whose shard is one row (``world`` rows in all: dim 0 = 8 on dp=8) reshapes without a
copy, so it comes out as a strided view (row stride = the bucket's width), where the unbucketed
all-gather gave a contiguous tensor, and the graph's fake values do not say so. CPU kernels then
compute something else: ``native_group_norm`` reads a strided weight and bias as contiguous
(wrong values: the zoo convnet's loss moved 7 % on dp=8), BatchNorm takes another code path
(another rounding), and a ``view`` of the parameter fails at run time.

:func:`make_gathered_shards_contiguous` finds those reshapes (the merge's pattern: ``wait`` of an
``all_gather_into_tensor_out``, viewed ``[world, -1]``, ``split_with_sizes`` on dim 1, a column
block narrower than the bucket reshaped to ``world`` rows) and gives their users a contiguous
clone: the bytes the unbucketed graph had, in its layout. Patch ``contiguous_gathered_shards``;
the bucketing passes run it after merging.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.fx_utils import ALL_GATHER_OUT, WAIT

log = logging.getLogger(__name__)

PATCH = "contiguous_gathered_shards"

aten = torch.ops.aten
_SPLIT = aten.split_with_sizes.default
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_DTYPE_VIEW = aten.view.dtype


def _bucket_split(node: fx.Node) -> tuple[int, int] | None:
    """(world, bucket width) when ``node`` splits a merged all-gather's ``[world, -1]`` view."""
    if node.op != "call_function" or node.target is not _SPLIT or _arg(node, 2, "dim", 0) != 1:
        return None
    viewed = node.args[0]
    if not (isinstance(viewed, fx.Node) and viewed.target in _RESHAPES):
        return None
    wait = viewed.args[0]
    if not (isinstance(wait, fx.Node) and wait.target is WAIT and isinstance(wait.args[0], fx.Node)
            and wait.args[0].target is ALL_GATHER_OUT):
        return None
    shape = viewed.args[1]
    if len(shape) != 2:
        return None
    world = shape[0]
    return world, sum(node.args[1])


def _arg(node: fx.Node, i: int, name: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _strided_reshapes(split: fx.Node, world: int, width: int) -> list[fx.Node]:
    """The reshapes of ``split``'s column blocks that come out as strided views."""
    out = []
    sizes = split.args[1]
    for item in split.users:
        if item.target is not operator.getitem or sizes[item.args[1]] == width:
            continue  # one block as wide as the bucket is the whole bucket: contiguous
        frontier = list(item.users)
        while frontier:
            user = frontier.pop()
            if user.target is _DTYPE_VIEW:
                frontier.extend(user.users)
            elif user.target in _RESHAPES and list(user.args[1])[:1] == [world]:
                out.append(user)  # one row per rank: the reshape is a view of the column block
    return out


def make_gathered_shards_contiguous(gm: fx.GraphModule) -> int:
    """Clone every strided parameter a merged all-gather hands out (module docstring); the number
    of clones inserted. Nothing when the patch is disabled (upstream's strided views stay)."""
    if not patches.enabled(PATCH):
        return 0
    graph = gm.graph
    inserted = 0
    for split in list(graph.nodes):
        found = _bucket_split(split)
        if found is None:
            continue
        for reshape in _strided_reshapes(split, *found):
            with graph.inserting_after(reshape):
                clone = graph.call_function(aten.clone.default, (reshape,), {"memory_format": torch.contiguous_format})
            clone.meta.update({k: v for k, v in reshape.meta.items() if k != M.VAL})
            val = reshape.meta.get(M.VAL)
            if isinstance(val, torch.Tensor):
                clone.meta[M.VAL] = val.clone(memory_format=torch.contiguous_format)
            reshape.replace_all_uses_with(clone, delete_user_cb=lambda u, c=clone: u is not c)
            inserted += 1
    if inserted:
        graph.lint()
        gm.recompile()
        log.info("contiguous_gathered_shards: %d one-row parameter(s) cloned contiguous", inserted)
    return inserted


__all__ = ["PATCH", "make_gathered_shards_contiguous"]
