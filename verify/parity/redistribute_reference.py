"""DTensor's own redistribution, run eagerly on simulated ranks: the reference the lowering's
moves (``autoparallel/planner/moves.py``, strided shards in ``planner/strided.py``) are checked
against on generated placements (tests/property/test_direct_moves_properties.py,
test_strided_moves_properties.py).

DTensor's transform-plan optimisation is disabled, so each mesh dim is one step, as the lowering
writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def dtensor_redistribute(pieces: Sequence[torch.Tensor], shape: Sequence[int], src, dst, device_mesh) -> list[torch.Tensor]:
    """Each rank's piece after ``redistribute_local_tensor`` moves the global ``shape`` (fp32)
    from placements ``src`` to ``dst``; ``pieces[r]`` is rank ``r``'s piece before."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import disable_redistribute_transform_optimization, redistribute_local_tensor

    meta = TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float32)
    with LocalTensorMode(len(pieces)), disable_redistribute_transform_optimization():
        out = redistribute_local_tensor(LocalTensor(dict(enumerate(pieces))), DTensorSpec(device_mesh, src, tensor_meta=meta),
                                        DTensorSpec(device_mesh, dst, tensor_meta=meta))
        return [out._local_tensors[r] for r in range(len(pieces))]


__all__ = ["dtensor_redistribute"]
