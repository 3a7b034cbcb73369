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
    """Raise :class:`Overrun` in this (main) thread after ``seconds`` of wall-clock time. Off the
    main thread (signals go to it only) or where SIGALRM does not exist, nothing is armed."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(signum, frame):
        raise Overrun()

    old = signal.signal(signal.SIGALRM, fire)
    armed = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, max(float(seconds), 1e-3))
    try:
        yield
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
