"""The oracle's bound for ill-conditioned models: measured, not assumed.

The analytic bound (``verify.parity.compare``) assumes rounding errors grow like a random walk
through ``layers * width`` sums. A model that divides rounding-level differences by a spread of
the same order (batch norm over 2 values per channel, a tiny config's last stage) amplifies them
far beyond that: there single-device fp32 eager is itself farther from the exact result than the
bound allows, so no fp32 program can pass it (docs/failure-classes.md section 4).

When the analytic check fails, the reference runs once more in float32 and in float64, as the
oracle's program runs: with the ranks' dropout masks where it compares the eager program (the
masks change which terms a gradient sums: mobilevit's bias gradients were 100x nearer fp64 with
dropout off, which is not what the oracle compared; docs/oracle-failures.md). A random op that is
not a dropout (``torch.rand`` of a drop path) draws its float32 numbers in the fp64 run too, cast
up (:func:`draws_in_float32`: a CPU generator draws another stream for float64). Every draw of the
fp32 runs must equal the fp64 run's (:func:`recorded_draws`: a dropout's nonzero pattern, any
other random op's values); if one differs, the calibration falls back to random ops off in both,
which draw nothing, and says so. Each tensor's bound becomes

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

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from verify.parity.compare import OracleCheck, OracleReport, OracleTolerance
from verify.parity.random_ops import is_dropout
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


def _is_draw(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _drawn(func, t: torch.Tensor) -> torch.Tensor:
    """What a draw decides: a dropout's nonzero pattern (its output carries the input, which
    differs between dtypes), any other random op's values (a drop path's ``torch.rand``: its
    keep mask is ``floor(rand + keep_prob)``, so every value matters), floats in float64."""
    if is_dropout(func):
        return t.detach() != 0
    return t.detach().to(torch.float64) if t.is_floating_point() else t.detach().clone()


class _Draws(TorchDispatchMode):
    """Keeps what each random op drew (:func:`_drawn`), in draw order."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _is_draw(func):
            self.masks.extend(_drawn(func, t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@contextlib.contextmanager
def recorded_draws() -> Iterator[list[torch.Tensor]]:
    """While open, the list it yields gets what each random op drew (:func:`_drawn`), in order."""
    mode = _Draws()
    with mode:
        yield mode.masks


def _down(v):
    if isinstance(v, torch.Tensor) and v.dtype == torch.float64:
        return v.to(torch.float32)
    return torch.float32 if v is torch.float64 else v


class _DrawsInFloat32(TorchDispatchMode):
    """A random op that is not a dropout, asked for float64 (a ``dtype`` or a tensor argument),
    runs in float32 and its result is cast up; an in-place one writes the cast result back."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_draw(func) or is_dropout(func):
            return func(*args, **kwargs)
        down_args, down_kwargs = tree_map(_down, args), tree_map(_down, kwargs)
        if all(a is b for a, b in zip(tree_leaves((args, kwargs)), tree_leaves((down_args, down_kwargs)), strict=True)):
            return func(*args, **kwargs)  # nothing in float64
        out = func(*down_args, **down_kwargs)
        written = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        for i in written:
            name = func._schema.arguments[i].name
            old, new = (args[i], down_args[i]) if i < len(args) else (kwargs[name], down_kwargs[name])
            old.copy_(new)
        if written:
            i = written[0]
            return args[i] if i < len(args) else kwargs[func._schema.arguments[i].name]
        return tree_map(lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t, out)


@contextlib.contextmanager
def draws_in_float32() -> Iterator[None]:
    """Inside, a random op that is not a dropout draws the numbers it draws in float32, even when
    asked for float64: the fp64 reference then takes the fp32 program's drop paths (a CPU
    generator draws another stream for float64: ``torch.rand``, ``bernoulli_``)."""
    with _DrawsInFloat32():
        yield


def same_draws(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two runs drew the same masks, one for one."""
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def calibrated(report: OracleReport, reference: Callable[[torch.dtype], Mapping[str, torch.Tensor | None]],
               without_draws: Callable[[torch.dtype], Mapping[str, torch.Tensor | None]] | None = None) -> OracleReport:
    """``report`` rechecked on the calibrated bounds; ``reference(dtype)`` gives the single-device
    reference's tensors by check name, computed in ``dtype`` as the oracle's program runs (fp32
    once per count of :data:`THREADS`, the largest distance from fp64 per tensor kept). Where an
    fp32 run draws other masks than the fp64 one, ``without_draws`` (the reference with random ops
    off) is calibrated instead, and the report says so; without it the report stays as it was.
    If the fp64 reference cannot run (a model that hard-codes float32), the report stays as it was
    and says why."""
    try:
        with recorded_draws() as draws64, draws_in_float32():
            r64 = reference(torch.float64)
        measured: dict[str, float] = {}
        for n in THREADS:
            with intra_op_threads(n), recorded_draws() as draws32:
                r32 = reference(torch.float32)
            if not same_draws(draws32, draws64):
                if without_draws is None:
                    report.calibration = "not calibrated: the float32 and float64 references drew different random masks"
                    return report
                out = calibrated(report, without_draws)
                out.calibration += "; with random ops off (float32 and float64 drew different masks)"
                return out
            for name, d in spread(r32, r64).items():
                measured[name] = max(d, measured.get(name, 0.0))
    except Exception as e:  # noqa: BLE001 - any failure leaves the analytic verdict standing
        report.calibration = f"not calibrated: the float64 reference failed ({type(e).__name__}: {str(e)[:200]})"
        return report
    checks = [recheck(c, measured.get(c.name)) for c in report.checks]
    widened = sum(NOTE in c.note for c in checks)
    out = dataclasses.replace(report, checks=checks)
    out.calibration = f"calibrated: {widened} tensor(s) on the ill-conditioned bound (fp32 vs fp64 of the reference)"
    return out
