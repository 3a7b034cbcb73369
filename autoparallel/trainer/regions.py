"""Activation-checkpointing regions: one per transformer block, written into node metadata.

``annotate_ac_regions(model)`` makes every node traced inside ``model.layers[i]`` carry
``meta["custom"][AC_REGION] == i`` (through ``torch.fx.traceback.annotate``), so the graph SAC
pass knows each node's block and its ``ac_graph_id`` without parsing module paths. Backward
nodes inherit the region of their forward node (``copy_forward_meta_to_backward``).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.fx.traceback as fx_traceback

from autoparallel import meta as M

__all__ = ["annotate_ac_regions", "clear_ac_regions", "region_of"]

#: Instance attribute holding the region id of an annotated block.
_REGION_ATTR = "_ap_ac_region"


def _annotated_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    with fx_traceback.annotate({M.AC_REGION: getattr(self, _REGION_ATTR)}):
        return type(self).forward(self, *args, **kwargs)


def annotate_ac_regions(model: torch.nn.Module, *, container: str = "layers") -> torch.nn.Module:
    """Give each child of ``model.<container>`` its index as AC region id; in place, idempotent.

    The per-instance ``forward`` is a method bound to the block, so ``copy.deepcopy(model)``
    rebinds it to the copy. Annotations only show up in graphs traced under
    ``preserve_node_meta`` (``trace_train_step`` does that); eager execution is unchanged.
    Raises ValueError when ``model`` has no ``container`` module list.
    """
    blocks = getattr(model, container, None)
    if not isinstance(blocks, torch.nn.ModuleList | torch.nn.ModuleDict | torch.nn.Sequential):
        raise ValueError(
            f"annotate_ac_regions: {type(model).__name__} has no module list {container!r} of "
            "transformer blocks; pass container=<name of the block list>"
        )
    for idx, block in enumerate(blocks.children()):
        setattr(block, _REGION_ATTR, idx)
        block.forward = types.MethodType(_annotated_forward, block)
    return model


def clear_ac_regions(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`annotate_ac_regions` on every submodule of ``model``."""
    for mod in model.modules():
        if _REGION_ATTR in mod.__dict__:
            del mod.__dict__[_REGION_ATTR]
            mod.__dict__.pop("forward", None)
    return model


def region_of(node: torch.fx.Node) -> int | None:
    """The AC region id of an FX node (``None`` outside every region)."""
    value = node.meta.get(M.CUSTOM, {}).get(M.AC_REGION)
    return None if value is None else int(value)
