"""Bitwise loss/gradient comparison, and the report that says where two runs diverge.

Bitwise (``torch.equal``) is the bar between programs that should compute the same floating-point
operations in the same order (eager parallel program vs its traced or compiled graphs). Against
single-device eager only closeness is expected (reduction order differs), so that comparison
reports the max abs difference instead of asserting equality.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from autoparallel.runtime.steps import StepTrace


@dataclass
class TensorDiff:
    name: str
    equal: bool
    max_abs: float
    note: str = ""


@dataclass
class ParityReport:
    """Per-step, per-tensor comparison of two runs ``a`` and ``b``."""

    a: str
    b: str
    diffs: list[TensorDiff] = field(default_factory=list)

    @property
    def bitwise(self) -> bool:
        return bool(self.diffs) and all(d.equal for d in self.diffs)

    @property
    def max_abs(self) -> float:
        return max((d.max_abs for d in self.diffs), default=0.0)

    def mismatches(self) -> list[TensorDiff]:
        return [d for d in self.diffs if not d.equal]

    def summary(self, limit: int = 10) -> str:
        head = (
            f"{self.a} vs {self.b}: {len(self.diffs)} tensors, "
            f"{'bitwise equal' if self.bitwise else f'{len(self.mismatches())} differ'}, max |diff| {self.max_abs:.3e}"
        )
        lines = [head]
        for d in self.mismatches()[:limit]:
            lines.append(f"  {d.name}: max |diff| {d.max_abs:.3e}{' ' + d.note if d.note else ''}")
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


def diff_tensors(name: str, x: torch.Tensor, y: torch.Tensor) -> TensorDiff:
    if x.shape != y.shape or x.dtype != y.dtype:
        return TensorDiff(name, False, float("inf"), f"shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
    equal = torch.equal(x, y)
    if equal:
        return TensorDiff(name, True, 0.0)
    diff = (x.double() - y.double()).abs()
    return TensorDiff(name, False, float(diff.max()) if diff.numel() else 0.0)


def compare_tensors(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], *, a_name: str = "a", b_name: str = "b"
) -> ParityReport:
    report = ParityReport(a_name, b_name)
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            report.diffs.append(TensorDiff(k, False, float("inf"), f"missing in {a_name if k not in a else b_name}"))
            continue
        report.diffs.append(diff_tensors(k, a[k], b[k]))
    return report


def compare_traces(a: StepTrace, b: StepTrace, *, a_name: str = "a", b_name: str = "b") -> ParityReport:
    """Compare losses and gradients step by step."""
    if len(a.losses) != len(b.losses):
        raise ValueError(f"{a_name} ran {len(a.losses)} steps but {b_name} ran {len(b.losses)}")
    report = ParityReport(a_name, b_name)
    for step, (la, lb, ga, gb) in enumerate(zip(a.losses, b.losses, a.grads, b.grads, strict=True)):
        report.diffs.append(diff_tensors(f"step{step}/loss", la, lb))
        sub = compare_tensors(ga, gb, a_name=a_name, b_name=b_name)
        report.diffs.extend(TensorDiff(f"step{step}/grad:{d.name}", d.equal, d.max_abs, d.note) for d in sub.diffs)
    return report


def merge_reports(reports: Sequence[ParityReport], prefixes: Sequence[str]) -> ParityReport:
    """One report out of several (e.g. one per rank), names prefixed."""
    if not reports:
        raise ValueError("no reports to merge")
    out = ParityReport(reports[0].a, reports[0].b)
    for prefix, r in zip(prefixes, reports, strict=True):
        out.diffs.extend(TensorDiff(f"{prefix}/{d.name}", d.equal, d.max_abs, d.note) for d in r.diffs)
    return out
