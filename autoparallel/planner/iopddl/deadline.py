"""A hard wall-clock stop for the IOPDDL solve, and the plan it falls back on.

Every phase of ``solve`` checks its deadline, but not at a fine enough grain on a loaded machine:
at load ~17 the command overran its 120 s by up to 22 s on C and Q (star moves, end-of-run work).
:func:`alarm` raises :class:`Overrun` from a SIGALRM when the wall-clock time is up, wherever
the solve is in Python; :class:`Incumbent` holds a copy of the best feasible plan taken at each
phase's end, which the solve then returns. The previous handler and timer (an enclosing solve's) are restored on exit.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

import numpy as np


class Overrun(Exception):
    """The solve's hard deadline passed."""


@contextmanager
def alarm(seconds: float):
    """Raise :class:`Overrun` in this (main) thread after ``seconds`` of wall-clock time; yields
    a function that moves the alarm to a given number of seconds from now. Off the main thread (signals go to it only) or where SIGALRM does not exist, nothing is armed."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield lambda left: None
        return

    def fire(signum, frame):
        raise Overrun()

    def rearm(left: float) -> None:  # move the alarm to ``left`` seconds from now
        signal.setitimer(signal.ITIMER_REAL, max(float(left), 1e-3))

    old = signal.signal(signal.SIGALRM, fire)
    armed = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, max(float(seconds), 1e-3))
    try:
        yield rearm
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer > 0:  # an enclosing alarm (a nested solve): re-arm what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - armed), 1e-3))


class Incumbent:
    """The best plan known to fit the limit, copied when kept (phases change plans in place, so
    the one being changed when the alarm fires may be half-moved and over the limit), and that
    plan itself (``live``: the solve checks it in full before taking it: a descent's single
    moves keep it within the limit, a star move's several do not until all are made)."""

    def __init__(self, bound: float):
        self.x, self.cost, self.method, self.bound, self.live = None, np.inf, "descent", bound, None

    def keep(self, x, plan_cost: float, method: str | None = None) -> None:
        """Remember ``x`` (a plan within the limit) when it is the first or no dearer; the
        phases that follow work on ``x`` in place."""
        self.live = x
        if self.x is None or plan_cost <= self.cost:
            self.x, self.cost = np.array(x, dtype=np.int64), float(plan_cost)
            if method is not None:
                self.method = method


# The closing's measured wall time is multiplied by this (a load burst at the end, a plan whose
# check costs more than the one measured), and this many seconds are kept whatever it measures.
CLOSING_SAFETY = 2.0
CLOSING_FLOOR = 0.25


class Closing:
    """What must run after the hard deadline, measured on this instance and this machine's load:
    the solve's closing (the kept plans' checks and exact cost: ``cpu`` seconds, measured on a
    real plan) and the caller's work after the solve returns (the evaluator's check and the
    output: ``after`` times the closing's CPU), both slowed by the wall seconds this process gets
    per CPU second (measured over its busy stretches: at load 15 a nice-10 process saw 10 s of
    wall time for well under 1 CPU s, and D's command returned 12.7 s past its 120).
    :meth:`seconds` is the reserve the hard deadline keeps before the time limit."""

    def __init__(self, after: float = 0.0, floor: float = CLOSING_FLOOR, clock=time.perf_counter):
        self.after, self.floor, self.clock = float(after), float(floor), clock
        self.cpu, self.busy_wall, self.busy_cpu = 0.0, 0.0, 0.0

    def busy(self, wall: float, cpu: float) -> None:
        """Count a stretch in which this process wanted the CPU throughout (reading, descent)."""
        self.busy_wall += max(0.0, wall)
        self.busy_cpu += max(0.0, cpu)

    @contextmanager
    def stretch(self):
        """A busy stretch, measured."""
        w, c = self.clock(), time.process_time()
        try:
            yield
        finally:
            self.busy(self.clock() - w, time.process_time() - c)

    def slowdown(self) -> float:
        """Wall seconds per CPU second of this process so far (at least 1)."""
        return max(1.0, self.busy_wall / self.busy_cpu) if self.busy_cpu > 0.02 else 1.0

    def measure(self, work) -> None:
        """Run ``work`` (the closing on a real plan) and keep the largest CPU time it took."""
        c = time.process_time()
        work()
        self.cpu = max(self.cpu, time.process_time() - c)

    def seconds(self) -> float:
        """The reserve: ``floor`` + safety x slowdown x (closing + the caller's share) CPU seconds."""
        return self.floor + CLOSING_SAFETY * self.slowdown() * self.cpu * (1.0 + self.after)
