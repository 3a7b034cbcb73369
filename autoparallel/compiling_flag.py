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
import os
import sys
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


def _caller_site(frame) -> str | None:
    """Where a model asked ``is_compiling()``: the first caller that is no wrapper of it (a
    predicate, ``is_*`` / ``*compiling*`` / ``*exporting*``, e.g. transformers' ``is_torchdynamo_compiling``);
    None when that caller is PyTorch's own code (``nn.Module``, a higher-order op)."""
    while frame is not None and _is_predicate(frame.f_code.co_name):
        frame = frame.f_back
    if frame is None:
        return None
    path = frame.f_code.co_filename
    if path.startswith(_TORCH_DIR):
        return None
    short = path.split("site-packages/")[-1]
    return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _is_predicate(name: str) -> bool:
    """A function that only passes the flag on (transformers' ``is_torchdynamo_compiling``,
    ``is_tracing``): its caller is the branch."""
    return name.startswith("is_") or "compiling" in name or "exporting" in name


@contextlib.contextmanager
def compiling_queries() -> Iterator[list[str]]:
    """Within: every call of ``torch.compiler.is_compiling()`` from a model's code (not PyTorch's)
    records its site, once, in the yielded list (in call order). A model that branches on the flag
    runs another program when traced than eagerly (transformers' Mamba: a parallel
    ``associative_scan`` under compile, a Python loop over the sequence in eager), which parity
    must name rather than blame on a pass. The attribute is restored on exit."""
    sites: list[str] = []
    seen: set[str] = set()
    original = torch.compiler.is_compiling

    def is_compiling() -> bool:
        site = _caller_site(sys._getframe(1))
        if site is not None and site not in seen:
            seen.add(site)
            sites.append(site)
        return original()

    torch.compiler.is_compiling = is_compiling
    try:
        yield sites
    finally:
        torch.compiler.is_compiling = original


__all__ = ["PATCH", "compiling_queries", "tracing_as_compiling"]
