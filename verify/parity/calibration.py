"""The oracle's bound for ill-conditioned models: measured, not assumed.

The analytic bound (``verify.parity.compare``) assumes rounding errors grow like a random walk
through ``layers * width`` sums. A model that divides rounding-level differences by a spread of
the same order (batch norm over 2 values per channel, a tiny config's last stage) amplifies them
far beyond that: there single-device fp32 eager is itself farther from the exact result than the
bound allows, so no fp32 program can pass it (docs/failure-classes.md section 4).

When the analytic check fails, the reference runs once more in float32 and in float64 (random
ops off in both, so both draw nothing), and each tensor's bound becomes

    max(analytic bound, CALIBRATION_SAFETY * max |single-device fp32 - single-device fp64|)

The fp32 reference runs once per intra-op thread count of :data:`THREADS`: the kernels block their
sums by thread, so each count is another summation order, and on a chaotic model one order can
land 10x nearer fp64 than another (levit: the loss 1.475 with 1 thread, 1.410 with 2, 1.418 in
fp64). The gloo ranks run with 1 thread, the oracle's process with its own count; one sample
of fp32's error is no measure of it (docs/oracle-failures.md).

The parallel program and the reference are two fp32 programs of the same depth, so each is about
the reference's own distance from exact away from it, and they are at most the sum apart (2x);
CALIBRATION_SAFETY = 4 leaves the same 2x margin as the analytic bound's safety factor. A tensor
that passes only on the calibrated term says so in its note ("ill-conditioned: ..."), so a PASS
that needed it is never silent. It stays an oracle: a bug larger than fp32's own error on that
tensor still fails (tests/parity/test_oracle_calibration.py plants one in an ill-conditioned
model). Costs nothing where the analytic bound holds: it runs only after a failure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import torch

from verify.parity.compare import OracleCheck, OracleReport, OracleTolerance
from verify.stages.pipeline_run import intra_op_threads

CALIBRATION_SAFETY = 4.0
NOTE = "ill-conditioned"
# Intra-op thread counts of the fp32 reference runs (summation orders): the ranks' count and another.
THREADS = (1, 2)


def applies(tolerance: OracleTolerance, param_dtype: torch.dtype | None) -> bool:
    """Calibrate fp32 programs without mixed precision only (the fp64 reference measures the
    error of fp32 arithmetic, not of a bf16 cast)."""
    return tolerance.dtype == torch.float32 and param_dtype is None


def spread(r32: Mapping[str, torch.Tensor | None], r64: Mapping[str, torch.Tensor | None]) -> dict[str, float]:
    """Per tensor name in both, max |fp32 - fp64| (floating tensors of one shape only)."""
    out = {}
    for name, a in r32.items():
        b = r64.get(name)
        if a is None or b is None or a.shape != b.shape or not a.is_floating_point() or not a.numel():
            continue
        out[name] = float((a.detach().to(torch.float64) - b.detach().to(torch.float64)).abs().max())
    return out


def recheck(check: OracleCheck, measured: float | None) -> OracleCheck:
    """``check`` with its bound widened to the calibrated term where that is larger. Exact checks
    (bound 0 by rule: integers, unchanged parameters, missing or NaN tensors) stay as they are."""
    if check.passed or measured is None or not math.isfinite(check.max_abs) or check.bound == 0.0:
        return check
    widened = CALIBRATION_SAFETY * measured
    if widened <= check.bound:
        return check
    note = (f"{NOTE}: single-device fp32 is {measured:.2e} from fp64 (the farthest of {len(THREADS)} summation orders), "
            f"bound {CALIBRATION_SAFETY:g} x that")
    return dataclasses.replace(check, bound=widened, note="; ".join(filter(None, (check.note, note))))


def calibrated(report: OracleReport, reference: Callable[[torch.dtype], Mapping[str, torch.Tensor | None]]) -> OracleReport:
    """``report`` rechecked on the calibrated bounds; ``reference(dtype)`` gives the single-device
    reference's tensors by check name, computed in ``dtype`` with random ops off (fp32 once per
    count of :data:`THREADS`, the largest distance from fp64 per tensor kept). If the fp64
    reference cannot run (a model that hard-codes float32), the report stays as it was and says why."""
    try:
        r64 = reference(torch.float64)
        measured: dict[str, float] = {}
        for n in THREADS:
            with intra_op_threads(n):
                for name, d in spread(reference(torch.float32), r64).items():
                    measured[name] = max(d, measured.get(name, 0.0))
    except Exception as e:  # noqa: BLE001 - any failure leaves the analytic verdict standing
        report.calibration = f"not calibrated: the float64 reference failed ({type(e).__name__}: {str(e)[:200]})"
        return report
    checks = [recheck(c, measured.get(c.name)) for c in report.checks]
    widened = sum(NOTE in c.note for c in checks)
    out = dataclasses.replace(report, checks=checks)
    out.calibration = f"calibrated: {widened} tensor(s) on the ill-conditioned bound (fp32 vs fp64 of the reference)"
    return out
