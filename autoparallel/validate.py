"""Checks of what users bring (the loss, the example inputs), shared by both front ends: the
joint-graph tracer (``autoparallel.parallelize``) and the graph trainer (``autoparallel.trainer``).

Each check raises ValueError naming the culprit and what to do, before it turns into an obscure
failure deep in a trace or an executor.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["DataDependentError", "check_input_dtypes", "check_loss", "data_dependent_error", "data_dependent_ops_named"]


class DataDependentError(ValueError):
    """The model reads a value or a shape from tensor data that the trace cannot take (a ValueError:
    bad input to the compile stack, named where the model does it)."""


def check_loss(loss: Any, *, needs_grad: bool = True) -> None:
    """``loss`` must be a floating-point scalar tensor (that depends on a parameter)."""
    if isinstance(loss, (tuple, list)):
        raise ValueError(
            f"loss_fn returned a {type(loss).__name__} of {len(loss)}; it must return the loss alone, "
            "a scalar tensor (compute auxiliary values outside loss_fn)"
        )
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn must return a scalar (0-dim) tensor, got shape {tuple(loss.shape)}; "
            "reduce it (e.g. .mean()) inside loss_fn"
        )
    if not loss.dtype.is_floating_point:
        raise ValueError(f"loss_fn must return a floating-point scalar, got dtype {loss.dtype}")
    if needs_grad and torch.is_grad_enabled() and loss.grad_fn is None:
        raise ValueError("the loss does not depend on any parameter (it has no grad_fn)")


def check_input_dtypes(model: torch.nn.Module, model_inputs: Sequence[torch.Tensor], compute_dtype: torch.dtype | None = None) -> None:
    """Floating model inputs must have the dtype the parameters compute in. Eager PyTorch rejects
    a float64 input to a float32 Linear; a trace on fake tensors may not, and would describe a
    program that cannot run. Integer inputs (token ids) and the loss target are not checked.
    Under a mixed-precision plan (``compute_dtype``, its param dtype) nothing is refused: the
    parallel program casts floating inputs to it, as FSDP2's ``MixedPrecisionPolicy`` does
    (``autoparallel.parallelize.program.cast_forward_inputs``)."""
    if compute_dtype is not None:
        return
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    want = dtypes.pop() if len(dtypes) == 1 else None
    if want is None:
        return
    for i, t in enumerate(model_inputs):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != want:
            raise ValueError(
                f"example input {i} has dtype {t.dtype} but the model computes in {want}; eager PyTorch "
                f"rejects mixing them (e.g. a Linear). Cast the input to {want}, or the model to "
                f"{t.dtype} (float64 models are supported)"
            )


# Ops whose result a trace on fake tensors cannot know: the value of a tensor (``.item()``, a
# Python ``if`` on a tensor, ``int(t)``), or an output shape that depends on values (nonzero,
# boolean masking, unique).
_VALUE_OPS = {"_local_scalar_dense": "reads a tensor's value into Python (.item(), int(t), float(t), or `if t:`)"}
_SHAPE_HINT = "has an output shape that depends on tensor values (nonzero, boolean-mask indexing, unique, ...)"


def data_dependent_error(exc: BaseException) -> DataDependentError | None:
    """A ValueError naming the op, the model's source line and what to change, when ``exc`` (or
    what caused it) is PyTorch's refusal to trace a data-dependent op on fake tensors; else None.
    The graphs are traced once for every input, so a value or shape decided by the data has no
    place in them."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    refusals = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
    cause = next((c for c in _cause_chain(exc) if isinstance(c, refusals)), None)
    if cause is None:
        return None
    func = getattr(cause, "func", None)
    name = getattr(getattr(func, "_overloadpacket", None), "__name__", "")
    if isinstance(cause, GuardOnDataDependentSymNode):  # unbacked value traced, then branched on
        op, what = "a value read from a tensor", "decides Python control flow (an if, a loop, a size check)"
    else:
        op = str(func) if func is not None else type(cause).__name__
        what = _VALUE_OPS.get(name, _SHAPE_HINT if isinstance(cause, DynamicOutputShapeException) else
                              "depends on tensor values")
    where = _model_frame(exc) or _model_frame(cause)
    at = f" at {where.filename}:{where.lineno} ({(where.line or '').strip()})" if where is not None else ""
    return DataDependentError(
        f"the model is not traceable: {op}{at} {what}, which one graph for every input cannot know. "
        "Compute it in __init__ (a buffer or a Python constant), keep it a tensor (torch.where, masks "
        "instead of indexing by nonzero, torch.cond instead of a Python branch), or move it out of "
        "forward/loss_fn")


def _cause_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what caused it, and so on (each once)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__


@contextlib.contextmanager
def data_dependent_ops_named() -> Iterator[None]:
    """A trace inside that PyTorch refuses for a data-dependent op raises
    :func:`data_dependent_error`'s ValueError instead (PyTorch's exception as its cause)."""
    try:
        yield
    except DataDependentError:
        raise  # already named (autoparallel.parallelize.traced_values)
    except Exception as e:
        named = data_dependent_error(e)
        if named is not None:
            raise named from e
        raise


def _model_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback outside torch and autoparallel: the user's code."""
    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)  # torch/, autoparallel/
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(skip)
              and not f.filename.startswith("<")]
    return frames[-1] if frames else None
