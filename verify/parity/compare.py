"""Bitwise loss/gradient comparison, and the report that says where two runs diverge.

Bitwise is the bar between programs that should compute the same floating-point operations in
the same order (eager parallel program vs its traced or compiled graphs). Against single-device
eager only closeness is expected (reduction order differs), so that comparison, the independent
oracle (:class:`OracleReport`), passes or fails against a tolerance derived from the dtype and
the reduction depth (the formula and its derivation are at :data:`ORACLE_SAFETY` below): it is
what catches a lowering bug that the eager parallel program shares with the compiled one.

**What "bitwise equal" means here.** Two tensors are bitwise equal when they have the same shape
and dtype and every element has the same bit pattern. So, unlike ``torch.equal``:

* a NaN equals a NaN with the same bits (a deterministic program reproduces its NaNs), and
  differs from any number and from a NaN with another payload;
* ``-0.0`` differs from ``+0.0`` (``torch.equal`` calls them equal; a sign flip of a zero is
  a different computation and can change a later ``1/x`` or ``copysign``);
* strides, device and ``requires_grad`` do not matter (values are compared on the CPU);
* empty tensors of the same shape and dtype are equal;
* None equals None (a parameter without a gradient on both sides: frozen, or the loss does not
  reach it) and differs from any tensor.

A parameter that got no gradient on the reference side at any step must also end the run with
the value it started with on both: :func:`compare_traces` compares its final value
(``final/param:<fqn>``), so a frozen parameter that one form of the program changes fails.

A mismatch says how many elements differ, how many of them are NaN-vs-number, NaN payload or
signed-zero differences, and the first differing index with both values. ``max_abs`` is the
largest ``|a - b|`` over differing elements, ``inf`` when a NaN is involved, a shape or dtype
differs or a tensor is missing, so a tolerance check on it can never pass those. A report is
bitwise only when it compared at least one tensor and all were equal: a report of nothing
proves nothing.
"""

from __future__ import annotations

import dataclasses
import math
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
    """Bitwise comparison of two tensors (see the module docstring for NaN, signed zeros, None)."""
    if x is None and y is None:
        return TensorDiff(name, True, 0.0, "no gradient on either side")
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
    """Compare losses, gradients and (where either run recorded them) buffers, step by step."""
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
        if a.buffers or b.buffers:
            ba = a.buffers[step] if step < len(a.buffers) else {}
            bb = b.buffers[step] if step < len(b.buffers) else {}
            sub = compare_tensors(ba, bb, a_name=a_name, b_name=b_name)
            report.diffs.extend(dataclasses.replace(d, name=f"step{step}/buffer:{d.name}") for d in sub.diffs)
    for fqn in never_stepped(a):  # no gradient, no update: both must end where they started
        report.diffs.append(diff_tensors(f"final/param:{fqn}", a.params.get(fqn), b.params.get(fqn)))
    return report


def never_stepped(trace: StepTrace) -> list[str]:
    """The parameters that got no gradient at any step of ``trace`` (frozen, or the loss does not
    reach them), sorted: AdamW never updated them."""
    if not trace.grads:
        return []
    names = set().union(*trace.grads)
    return sorted(k for k in names if all(g.get(k) is None for g in trace.grads))


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


# --- the independent oracle: single-device eager within a stated tolerance ---------------------
#
# Bitwise parity compares the compiled program with the eager *parallel* program, so a lowering
# bug both share (a rowwise bias added on every TP rank, a DDP reduce of "sum" for "avg") passes
# it. The oracle compares the parallel program with the unsharded model on one process, which
# rounds differently (other summation orders, fused vs unfused ops), so it needs a tolerance. It
# is derived, not tuned:
#
#     |parallel - single| <= ORACLE_SAFETY * u(dtype) * sqrt(layers * width) * scale
#
# * u(dtype): the unit roundoff of the dtype the model computes in (the plan's param_dtype if
#   set, else the parameters' dtype): 2^-24 fp32, 2^-8 bf16, 2^-11 fp16, 2^-53 fp64;
# * width: the longest sum whose order parallelism changes: max(the largest fan-in of a weight,
#   the rows one rank's gradient sums over) plus the data-parallel slices averaged at the end;
# * layers: the weight tensors (>= 2 dims) the rounding of one sum propagates through; the
#   errors of independent roundings add like a random walk, hence the square root of the
#   depth (layers * width), not the worst-case linear bound, which is loose by orders of
#   magnitude;
# * scale: the reference value's magnitude: |loss|; for a gradient, the largest gradient entry
#   of its module (a bias followed by a normalisation has an exactly-zero gradient made of
#   cancelling terms, so its own magnitude says nothing about the rounding in it); for a buffer,
#   the larger of its largest entry and its module's largest input entry (a running mean of a
#   zero-mean map is ~0 while its rounding scales with what it averages: verify.parity.buffer_scales);
#   integer buffers must match exactly;
# * ORACLE_SAFETY = 4: measured errors on the zoo and the LLaMA presets in fp32 sit at 0.1-0.3
#   of the bound without it (~1e-7 relative), so a correct lowering passes with >10x margin,
#   while the bugs above are off by 1e-2 to 1e0 relative, 10^3x over it.
#
# Only the first step is compared: after it, AdamW turns the last-bit differences of near-zero
# gradients into lr-sized parameter updates (m / sqrt(v) normalises their magnitude away), so
# later steps are no longer a rounding-level comparison. Later steps are covered bitwise.

UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
ORACLE_SAFETY = 4.0


@dataclass(frozen=True)
class OracleTolerance:
    """The oracle's relative tolerance, from the compute dtype and the reduction depth (see the
    formula above)."""

    dtype: torch.dtype
    layers: int
    width: int
    safety: float = ORACLE_SAFETY

    @property
    def rtol(self) -> float:
        if self.dtype not in UNIT_ROUNDOFF:
            raise ValueError(f"no unit roundoff for {self.dtype}; floating dtypes: {sorted(map(str, UNIT_ROUNDOFF))}")
        return self.safety * UNIT_ROUNDOFF[self.dtype] * math.sqrt(max(1, self.layers * self.width))

    def describe(self) -> str:
        u = UNIT_ROUNDOFF.get(self.dtype, float("nan"))
        return (
            f"{self.safety:g} * u({str(self.dtype).removeprefix('torch.')})={u:.2e} * sqrt({self.layers} layers * "
            f"width {self.width}) = {self.rtol:.2e} of the scale"
        )

    def to_dict(self) -> dict:
        return {"dtype": str(self.dtype).removeprefix("torch."), "layers": self.layers, "width": self.width,
                "safety": self.safety, "rtol": self.rtol}


def oracle_tolerance(
    model: torch.nn.Module, slice_inputs: Sequence[torch.Tensor], slices: int, compute_dtype: torch.dtype | None = None
) -> OracleTolerance:
    """The tolerance for ``model`` on one data-parallel slice's model inputs, ``slices`` slices."""
    weights = [p for p in model.parameters() if p.dim() >= 2]
    fan_in = max((math.prod(p.shape[1:]) for p in weights), default=1)
    rows = max((t.numel() for t in slice_inputs), default=1)
    dtype = compute_dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return OracleTolerance(dtype, max(1, len(weights)), max(fan_in, rows) + slices)


@dataclass(frozen=True)
class OracleCheck:
    """One tensor against the oracle: ``max_abs`` |parallel - single| (inf: missing, other shape
    or dtype, or a NaN on one side), allowed up to ``bound`` (tolerance x ``scale``)."""

    name: str
    max_abs: float
    bound: float
    scale: float
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.max_abs <= self.bound


@dataclass
class OracleReport:
    """The parallel program (``parallel``: the executor compared) vs single-device eager."""

    tolerance: OracleTolerance
    parallel: str = "eager"
    reference: str = "single-device"
    checks: list[OracleCheck] = field(default_factory=list)
    calibration: str = ""  # set when the analytic bound failed (verify.parity.calibration)

    @property
    def passed(self) -> bool:
        """At least one tensor checked, and every one within its bound."""
        return bool(self.checks) and all(c.passed for c in self.checks)

    def failures(self) -> list[OracleCheck]:
        return [c for c in self.checks if not c.passed]

    @property
    def max_abs(self) -> float:
        return max((c.max_abs for c in self.checks), default=0.0)

    @property
    def worst_ratio(self) -> float:
        """The largest |diff| / bound (<= 1 passes)."""
        return worst_ratio(self.checks)

    def summary(self, limit: int = 10) -> str:
        verdict = "PASS" if self.passed else f"FAIL: {len(self.failures())} of {len(self.checks)} beyond tolerance"
        if not self.checks:
            verdict = "FAIL: nothing compared"
        lines = [
            f"{self.parallel} vs {self.reference} eager: {len(self.checks)} tensors, {verdict}; worst |diff| / bound "
            f"{self.worst_ratio:.2e}; tolerance {self.tolerance.describe()}"
            + (f"; {self.calibration}" if self.calibration else "")
        ]
        for c in self.failures()[:limit]:
            lines.append(f"  {c.name}: |diff| {c.max_abs:.3e} > bound {c.bound:.3e} (scale {c.scale:.3e}){'; ' + c.note if c.note else ''}")
        return "\n".join(lines)

    def assert_passed(self) -> None:
        if not self.passed:
            raise AssertionError(self.summary())

    def to_dict(self) -> dict:
        return {
            "parallel": self.parallel,
            "passed": self.passed,
            "tensors": len(self.checks),
            "failures": len(self.failures()),
            "max_abs_diff": self.max_abs,
            "worst_ratio": self.worst_ratio,
            "tolerance": self.tolerance.to_dict(),
            "calibration": self.calibration,
        }


def worst_ratio(checks: Sequence[OracleCheck]) -> float:
    """The largest |diff| / bound among ``checks`` (<= 1: every one passes; inf: a mismatch of
    shape, dtype or a NaN, or a difference where the bound is 0)."""
    return max((c.max_abs / c.bound if c.bound else (0.0 if c.max_abs == 0 else _INF) for c in checks), default=0.0)


def check_within(
    name: str, reference: torch.Tensor | None, got: torch.Tensor | None, rtol: float, scale: float | None = None
) -> OracleCheck:
    """``got`` against ``reference`` within ``rtol * scale`` (``scale``: default max |reference|);
    integer tensors exactly. Both None (no gradient on either side) passes."""
    if reference is None and got is None:
        return OracleCheck(name, 0.0, 0.0, 0.0, "no gradient on either side")
    if reference is None or got is None:
        return OracleCheck(name, _INF, 0.0, 0.0, f"missing in the {'reference' if reference is None else 'parallel run'}")
    if reference.shape != got.shape or reference.dtype != got.dtype:
        return OracleCheck(name, _INF, 0.0, 0.0, f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(reference.shape)} {reference.dtype}")
    ref, out = reference.detach().cpu().to(torch.float64), got.detach().cpu().to(torch.float64)
    if not reference.is_floating_point():
        return OracleCheck(name, float((ref - out).abs().max()) if ref.numel() else 0.0, 0.0, 0.0, "integers: exact")
    if bool(torch.isnan(ref).any() or torch.isnan(out).any()):
        return OracleCheck(name, _INF, 0.0, 0.0, "NaN")
    if scale is None:
        scale = float(ref.abs().max()) if ref.numel() else 0.0
    max_abs = float((ref - out).abs().max()) if ref.numel() else 0.0
    return OracleCheck(name, max_abs, rtol * scale, scale)


def module_scales(grads: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per gradient, the largest entry of any gradient of the same module (see the formula)."""
    by_module: dict[str, float] = {}
    for fqn, g in grads.items():
        owner = fqn.rpartition(".")[0]
        size = float(g.detach().abs().max()) if g is not None and g.numel() else 0.0  # None: no gradient
        by_module[owner] = max(by_module.get(owner, 0.0), size)
    return {fqn: by_module[fqn.rpartition(".")[0]] for fqn in grads}
