"""The joint trace records dropout as the eager program runs it on the traced device.

ATen's ``dropout`` picks its kernel by device (``aten/src/ATen/native/Dropout.cpp``): on CUDA,
XPU, lazy and PrivateUse1 tensors (``is_fused_kernel_acceptable``, 0 < p < 1) it is
``native_dropout``, whose backward is ``native_dropout_backward(grad, mask, 1 / (1 - p))``; on CPU
it is ``_dropout_impl``: ``noise = empty_like(x).bernoulli_(1 - p); noise.div_(1 - p); x * noise``,
so the backward is ``grad * noise`` with the noise rounded to ``x``'s dtype. PyTorch's Python
decomposition of ``aten.dropout``, which every trace runs, always emits ``native_dropout``. On CPU
that computes other bits than the eager program: in bf16 and fp16 the backward multiplies by the
unrounded ``1 / (1 - p)`` (84 of 99 probabilities differ), and in fp32 the forward and backward
scale by ``float(1 / (1 - p))`` where eager divides by ``float(1 - p)`` (15 of 99 differ, p=0.1
and 0.2 among the equal ones). Every stage of a bf16 FSDP plan with dropout was "NOT bitwise".

Patch ``eager_dropout``: inside the trace, ``aten.dropout`` decomposes as ATen's ``dropout``
does on the device of its input: ``native_dropout`` where the fused kernel runs, else the CPU
composite's ops (``bernoulli`` in the input's dtype, the division, the product), whose autograd
is eager's. The draw is the same bernoulli call eager makes, so masks are unchanged.

Patch ``in_place_dropout``, for the planner's trace (which keeps upstream's ``native_dropout``):
``aten.dropout_``, which has no Python decomposition and always runs the composite, traces as
``x.copy_(aten.dropout(x, p, train))``, so an in-place dropout is one ``native_dropout`` too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._C import DispatchKey

from autoparallel import patches

PATCH = "eager_dropout"
PATCH_IN_PLACE = "in_place_dropout"

aten = torch.ops.aten

_FUSED_DEVICES = frozenset({"cuda", "xpu", "lazy"})


def fused_kernel_acceptable(x: torch.Tensor, p: float) -> bool:
    """ATen's ``is_fused_kernel_acceptable``: where ``dropout`` runs ``native_dropout``."""
    fused = x.device.type in _FUSED_DEVICES or x.device.type == torch._C._get_privateuse1_backend_name()
    return fused and 0 < p < 1 and x.numel() > 0


def eager_dropout(x: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    """``aten.dropout`` as ATen computes it on ``x``'s device (see the module docstring)."""
    if train and fused_kernel_acceptable(x, p):
        return aten.native_dropout(x, p, train)[0]
    if p == 0 or not train or x.numel() == 0:
        return x.clone()  # ATen returns x itself; the schema says a new tensor (upstream's decomposition clones)
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    noise = torch.empty_like(x).bernoulli_(1 - p)
    noise.div_(1 - p)
    return x * noise


_KEYS = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)


@contextlib.contextmanager
def _kernel(op: torch._ops.OpOverload, fn) -> Iterator[None]:
    """Within: ``op`` decomposes as ``fn`` under the Python dispatcher; its kernels restored on exit."""
    saved = {k: op.py_kernels.get(k) for k in _KEYS}
    for k in _KEYS:
        op.py_kernels[k] = fn
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        for k, f in saved.items():
            if f is None:
                op.py_kernels.pop(k, None)
            else:
                op.py_kernels[k] = f
        op._dispatch_cache.clear()


@contextlib.contextmanager
def dropout_as_eager() -> Iterator[None]:
    """Within: ``aten.dropout`` decomposes as :func:`eager_dropout` (unless the patch is
    disabled); upstream's decomposition is restored on exit."""
    with _kernel(aten.dropout.default, eager_dropout) if patches.enabled(PATCH) else contextlib.nullcontext():
        yield


def dropout_in_place(x: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    """``aten.dropout_`` as the out-of-place ``aten.dropout`` copied back into ``x`` (see
    :func:`in_place_dropout_as_one_op`)."""
    return x.copy_(aten.dropout(x, p, train))


@contextlib.contextmanager
def in_place_dropout_as_one_op() -> Iterator[None]:
    """Within: ``aten.dropout_`` decomposes as :func:`dropout_in_place` (unless patch
    ``in_place_dropout`` is disabled). The planner's trace keeps every dropout one
    ``native_dropout`` (the op it places, and the op the oracle switches off); ATen's in-place
    dropout has no Python decomposition and traces as its CPU composite on every device
    (``empty_like`` -> ``bernoulli_`` -> ``div_`` -> ``mul_``), a random op no switch knows as a
    dropout: it stayed on in the ranks' dropout-off program while the reference's ``F.dropout``
    ran at p=0 (mobilenet_v1/v2 under auto, docs/failure-classes.md 13c)."""
    with _kernel(aten.dropout_.default, dropout_in_place) if patches.enabled(PATCH_IN_PLACE) else contextlib.nullcontext():
        yield


__all__ = ["PATCH", "PATCH_IN_PLACE", "dropout_as_eager", "dropout_in_place", "eager_dropout", "fused_kernel_acceptable",
           "in_place_dropout_as_one_op"]
