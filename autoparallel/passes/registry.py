"""Every patch of the compile stack, in one list, with the tests that guard it.

A *patch* is a pass or behaviour change that replaces what upstream PyTorch would do. Each entry
says what it does, what running without it means (the upstream behaviour it replaces), and which
tests must fail when it is disabled. ``AUTOPARALLEL_DISABLE=name1,name2`` disables patches for a
run (the mutation harness uses this); ``disabled(...)`` does the same for a scope in-process.
Code asks ``enabled(name)`` at the point where it would apply the patch.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass

ENV_VAR = "AUTOPARALLEL_DISABLE"


@dataclass(frozen=True)
class Patch:
    name: str
    summary: str
    when_disabled: str  # the upstream / pre-fix behaviour that runs instead
    guards: tuple[str, ...]  # pytest node ids, relative to the repository root


PATCHES: dict[str, Patch] = {}


def _register(name: str, summary: str, when_disabled: str, guards: tuple[str, ...]) -> None:
    if name in PATCHES:
        raise ValueError(f"patch {name!r} registered twice")
    PATCHES[name] = Patch(name, summary, when_disabled, guards)


# --- registered patches (keep in pipeline order) ----------------------------------------------

# Entries are added by the issues that build each pass; see tests/unit/test_registry.py.


# --- enable / disable -------------------------------------------------------------------------

_scoped: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("autoparallel_disabled", default=frozenset())


def _check_names(names, source: str) -> frozenset[str]:
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"unknown patch name(s) {unknown} in {source}; known patches: {sorted(PATCHES)}")
    return frozenset(names)


def disabled_from_env() -> frozenset[str]:
    raw = os.environ.get(ENV_VAR, "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    return _check_names(names, f"${ENV_VAR}")


def enabled(name: str) -> bool:
    """Whether patch ``name`` is in force (not disabled by the environment or a scope)."""
    if name not in PATCHES:
        raise ValueError(f"unknown patch {name!r}; known patches: {sorted(PATCHES)}")
    return name not in disabled_from_env() and name not in _scoped.get()


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[None]:
    """Disable patches within a scope (this thread/context only); restored on exit."""
    token = _scoped.set(_scoped.get() | _check_names(names, "disabled(...)"))
    try:
        yield
    finally:
        _scoped.reset(token)
