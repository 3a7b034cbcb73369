"""One launcher for multi-rank tests: NCCL on GPUs where there are enough, gloo on CPU otherwise.

A test marked ``multigpu(n)`` and its CPU twin call the same ``run_gated(fn, n)``, so the code path
GPU CI gates on (``run_on_world`` -> ``fn(rank, world_size, device, ...)``) is exercised by every
CPU run too, just with ``backend="gloo"`` and CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from verify.parity.ordered_collectives import run_parity_world

__all__ = ["gated_backend", "run_gated"]


def gated_backend(n: int, *, require_gpu: bool = False) -> str:
    """``"nccl"`` when ``n`` CUDA devices and NCCL are available, else ``"gloo"``.

    ``require_gpu=True`` raises RuntimeError instead of falling back to gloo.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= n and dist.is_nccl_available():
        return "nccl"
    if require_gpu:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise RuntimeError(f"run_gated: {n} CUDA devices with NCCL required, found {have}")
    return "gloo"


def run_gated(
    fn: Callable[..., Any],
    n: int,
    *,
    args: Sequence[Any] = (),
    require_gpu: bool = False,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, device, *args)`` on ``n`` ranks; return the results by rank.

    ``device`` is ``"cuda:<rank>"`` under NCCL and ``"cpu"`` under gloo; reductions are
    rank-ordered unless launched inside ``verify.parity.ordered_collectives.native_collectives``. NCCL ranks are spawned
    (``fn`` and ``args`` must be picklable: a module-level function), because forking a process
    that already initialized CUDA is not possible; gloo ranks are forked (fast).
    """
    backend = gated_backend(n, require_gpu=require_gpu)
    start_method = "spawn" if backend == "nccl" else "fork"
    return run_parity_world(
        _with_device,
        n,
        args=(fn, backend, tuple(args)),
        backend=backend,
        start_method=start_method,
        timeout_s=timeout_s,
    )


def _with_device(
    rank: int, world_size: int, fn: Callable[..., Any], backend: str, args: tuple
) -> Any:
    # The rank's own device: cuda:<rank> in a forked world, cuda:<LOCAL_RANK> in a launched one.
    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    return fn(rank, world_size, device, *args)
