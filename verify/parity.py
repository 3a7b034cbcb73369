"""Bitwise loss/gradient comparison, and the report that says where two runs diverge.

Bitwise is the bar between programs that should compute the same floating-point operations in
the same order (eager parallel program vs its traced or compiled graphs). Against single-device
eager only closeness is expected (reduction order differs), so that comparison reads the max abs
difference instead.

**What "bitwise equal" means here.** Two tensors are bitwise equal when they have the same shape
and dtype and every element has the same bit pattern. So, unlike ``torch.equal``:

* a NaN equals a NaN with the same bits (a deterministic program reproduces its NaNs), and
  differs from any number and from a NaN with another payload;
* ``-0.0`` differs from ``+0.0`` (``torch.equal`` calls them equal; a sign flip of a zero is
  a different computation and can change a later ``1/x`` or ``copysign``);
* strides, device and ``requires_grad`` do not matter (values are compared on the CPU);
* empty tensors of the same shape and dtype are equal.

A mismatch says how many elements differ, how many of them are NaN-vs-number, NaN payload or
signed-zero differences, and the first differing index with both values. ``max_abs`` is the
largest ``|a - b|`` over differing elements, ``inf`` when a NaN is involved, a shape or dtype
differs or a tensor is missing, so a tolerance check on it can never pass those. A report is
bitwise only when it compared at least one tensor and all were equal: a report of nothing
proves nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from autoparallel.runtime.steps import StepTrace

_INF = float("inf")


@dataclass
class TensorDiff:
    name: str
    equal: bool
    max_abs: float
    note: str = ""
    differing: int = 0  # elements whose bits differ (0 when shapes/dtypes differ or missing)
    numel: int = 0


@dataclass
class ParityReport:
    """Per-step, per-tensor comparison of two runs ``a`` and ``b``."""

    a: str
    b: str
    diffs: list[TensorDiff] = field(default_factory=list)

    @property
    def bitwise(self) -> bool:
        """At least one tensor compared, and every one bitwise equal (see the module docstring)."""
        return bool(self.diffs) and all(d.equal for d in self.diffs)

    @property
    def max_abs(self) -> float:
        return max((d.max_abs for d in self.diffs), default=0.0)

    def mismatches(self) -> list[TensorDiff]:
        return [d for d in self.diffs if not d.equal]

    def summary(self, limit: int = 10) -> str:
        if not self.diffs:
            return f"{self.a} vs {self.b}: nothing compared (0 tensors), so not bitwise"
        verdict = "bitwise equal" if self.bitwise else f"{len(self.mismatches())} differ"
        lines = [f"{self.a} vs {self.b}: {len(self.diffs)} tensors, {verdict}, max |diff| {self.max_abs:.3e}"]
        for d in self.mismatches()[:limit]:
            lines.append(f"  {d.name}: max |diff| {d.max_abs:.3e}{'; ' + d.note if d.note else ''}")
        more = len(self.mismatches()) - limit
        if more > 0:
            lines.append(f"  ... and {more} more")
        return "\n".join(lines)

    def assert_bitwise(self) -> None:
        if not self.bitwise:
            raise AssertionError(self.summary())

    def to_dict(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "bitwise": self.bitwise,
            "tensors": len(self.diffs),
            "mismatches": len(self.mismatches()),
            "max_abs_diff": self.max_abs,
        }


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as integers (one per element; complex: one per real part)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_floating_point():
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def _describe(x: torch.Tensor, y: torch.Tensor, differ: torch.Tensor) -> tuple[float, str]:
    """(max |x - y| over differing elements, note) for same-shape, same-dtype tensors."""
    n = int(differ.sum())
    parts = [f"{n} of {x.numel()} elements differ in bits"]
    if x.is_floating_point() or x.is_complex():
        nan_x, nan_y = torch.isnan(x), torch.isnan(y)
        nan_vs_number = int((nan_x ^ nan_y).sum())
        nan_payload = int((nan_x & nan_y & differ).sum())
        signed_zero = int(((x == y) & differ).sum())  # equal values, other bits: -0.0 vs +0.0
        if nan_vs_number:
            parts.append(f"{nan_vs_number} NaN vs number")
        if nan_payload:
            parts.append(f"{nan_payload} NaN vs NaN with other bits")
        if signed_zero:
            parts.append(f"{signed_zero} signed zero (-0.0 vs +0.0)")
        if nan_vs_number or nan_payload:
            max_abs = _INF
        else:
            wide = torch.complex128 if x.is_complex() else torch.float64
            max_abs = float((x.to(wide) - y.to(wide)).abs()[differ].max())
    else:
        max_abs = float((x.to(torch.float64) - y.to(torch.float64)).abs()[differ].max())
    first = tuple(int(i) for i in differ.nonzero()[0])
    parts.append(f"first at {list(first)}: {x[first].item()!r} vs {y[first].item()!r}")
    return max_abs, "; ".join(parts)


def diff_tensors(name: str, x: torch.Tensor, y: torch.Tensor) -> TensorDiff:
    """Bitwise comparison of two tensors (see the module docstring for NaN and signed zeros)."""
    for side, t in (("a", x), ("b", y)):
        if not isinstance(t, torch.Tensor):
            return TensorDiff(name, False, _INF, f"{side} is not a tensor: {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{name}: cannot compare a {t.layout} tensor bitwise; pass dense tensors")
    problems = []
    if x.shape != y.shape:
        problems.append(f"shape {tuple(x.shape)} vs {tuple(y.shape)}")
    if x.dtype != y.dtype:
        problems.append(f"dtype {x.dtype} vs {y.dtype}")
    if problems:
        return TensorDiff(name, False, _INF, "; ".join(problems), numel=max(x.numel(), y.numel()))
    x, y = x.detach().cpu(), y.detach().cpu()
    # The bit view needs element-aligned dense memory; column vectors (view_as_real) too.
    bx, by = _bits(x.contiguous()), _bits(y.contiguous())
    differ = bx != by
    if differ.dim() > x.dim():  # complex: a differing real or imaginary part
        differ = differ.any(dim=-1)
    if not bool(differ.any()):
        return TensorDiff(name, True, 0.0, numel=x.numel())
    max_abs, note = _describe(x, y, differ)
    return TensorDiff(name, False, max_abs, note, differing=int(differ.sum()), numel=x.numel())


def compare_tensors(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], *, a_name: str = "a", b_name: str = "b"
) -> ParityReport:
    report = ParityReport(a_name, b_name)
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            report.diffs.append(TensorDiff(k, False, _INF, f"missing in {a_name if k not in a else b_name}"))
            continue
        report.diffs.append(diff_tensors(k, a[k], b[k]))
    return report


def compare_traces(a: StepTrace, b: StepTrace, *, a_name: str = "a", b_name: str = "b") -> ParityReport:
    """Compare losses and gradients step by step."""
    if len(a.losses) != len(b.losses):
        raise ValueError(f"{a_name} ran {len(a.losses)} steps but {b_name} ran {len(b.losses)}")
    for name, t in ((a_name, a), (b_name, b)):
        if len(t.grads) != len(t.losses):
            raise ValueError(f"{name}: {len(t.losses)} losses but {len(t.grads)} gradient sets; a StepTrace has one of each per step")
    report = ParityReport(a_name, b_name)
    for step, (la, lb, ga, gb) in enumerate(zip(a.losses, b.losses, a.grads, b.grads, strict=True)):
        report.diffs.append(diff_tensors(f"step{step}/loss", la, lb))
        sub = compare_tensors(ga, gb, a_name=a_name, b_name=b_name)
        report.diffs.extend(dataclasses.replace(d, name=f"step{step}/grad:{d.name}") for d in sub.diffs)
    return report


def merge_reports(reports: Sequence[ParityReport], prefixes: Sequence[str]) -> ParityReport:
    """One report out of several (e.g. one per rank), names prefixed."""
    if not reports:
        raise ValueError("no reports to merge")
    out = ParityReport(reports[0].a, reports[0].b)
    pairs = sorted({(r.a, r.b) for r in reports})
    if len(pairs) > 1:
        raise ValueError(f"cannot merge reports of different comparisons: {pairs}")
    for prefix, r in zip(prefixes, reports, strict=True):
        out.diffs.extend(dataclasses.replace(d, name=f"{prefix}/{d.name}") for d in r.diffs)
    return out
