"""A digest per compared stage: two parity runs compared without their tensors.

The digest of an executor is a SHA-256 over every tensor the comparison reads (each rank's
losses, gradients, buffers, final parameters and AdamW state, ``StepTrace``), in a fixed order
(rank, then field, then step, then name sorted), each with its name, dtype and shape ahead of its
bytes. Two runs of the same mesh, plan and seed give equal digests exactly when every compared
tensor is bitwise equal: a forked world and a torchrun world, two machines, two commits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["trace_digest", "stage_digests"]


def _named_tensors(trace) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Every tensor of a ``StepTrace`` in the fixed order (module docstring)."""
    for step, loss in enumerate(trace.losses):
        yield f"loss/{step}", loss
    for step, grads in enumerate(trace.grads):
        for fqn in sorted(grads):
            yield f"grad/{step}/{fqn}", grads[fqn]
    for step, buffers in enumerate(trace.buffers):
        for name in sorted(buffers):
            yield f"buffer/{step}/{name}", buffers[name]
    for fqn in sorted(trace.params):
        yield f"param/{fqn}", trace.params[fqn]
    for fqn in sorted(trace.optimizer_state):
        for key in sorted(trace.optimizer_state[fqn]):
            yield f"adamw/{fqn}/{key}", trace.optimizer_state[fqn][key]


def _update(h, name: str, t: torch.Tensor | None) -> None:
    if t is None:
        h.update(f"{name}:none;".encode())
        return
    t = t.detach().to("cpu").contiguous()
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def trace_digest(ranks: Sequence, executor: str) -> str:
    """The digest of ``executor``'s traces on ``ranks`` (rank order), hex."""
    h = hashlib.sha256()
    for i, r in enumerate(ranks):
        h.update(f"rank{i}:{tuple(r.coord)};".encode())
        for name, t in _named_tensors(r.traces[executor]):
            _update(h, name, t)
    return h.hexdigest()


def stage_digests(ranks: Sequence, executors: Sequence[str]) -> dict[str, str]:
    """``{executor: digest}`` for each of ``executors`` the ranks ran (the reference included)."""
    return {ex: trace_digest(ranks, ex) for ex in executors if ex in ranks[0].traces}
