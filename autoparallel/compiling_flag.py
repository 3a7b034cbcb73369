"""The joint trace and the graph trainer's trace run with ``torch.compiler.is_compiling()`` true.

A model tells eager runs from graph captures with ``torch.compiler.is_compiling()``: Hugging Face
transformers skips its data-dependent fast paths there (``masking_utils``: "is every attention
mask entry 1?", "are these packed sequences?"), which a trace on fake tensors cannot take.
torch.compile sets the flag for its whole session; ``aot_export_joint_with_descriptors`` and
``make_fx``, which this project traces with, do not, so every transformers decoder and encoder
stopped with a data-dependent ``aten._local_scalar_dense``. Patch ``trace_as_compiling``: the
traces set the flag (PyTorch's own ``torch.compiler._compile_session_context``, or on torch 2.11,
which has none, the flag it sets) and restore it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from autoparallel import patches

PATCH = "trace_as_compiling"


@contextlib.contextmanager
def tracing_as_compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true inside (unless the patch is disabled)."""
    if not patches.enabled(PATCH):
        yield
        return
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    # torch before 2.12 (2.11 on the GPU machines) has no session context: the flag itself.
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


__all__ = ["PATCH", "tracing_as_compiling"]
