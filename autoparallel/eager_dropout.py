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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._C import DispatchKey

from autoparallel import patches

PATCH = "eager_dropout"

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
def dropout_as_eager() -> Iterator[None]:
    """Within: ``aten.dropout`` decomposes as :func:`eager_dropout` (unless the patch is
    disabled); upstream's decomposition is restored on exit."""
    if not patches.enabled(PATCH):
        yield
        return
    op = aten.dropout.default
    saved = {k: op.py_kernels.get(k) for k in _KEYS}
    for k in _KEYS:
        op.py_kernels[k] = eager_dropout
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        for k, fn in saved.items():
            if fn is None:
                op.py_kernels.pop(k, None)
            else:
                op.py_kernels[k] = fn
        op._dispatch_cache.clear()


__all__ = ["PATCH", "dropout_as_eager", "eager_dropout", "fused_kernel_acceptable"]
