"""Mutation testing of the compile stack: does some test notice when code is changed?

``patches`` disables one registered patch at a time (``AUTOPARALLEL_DISABLE``) and requires its
guard tests to fail; ``lines`` runs mutmut's line-level mutants over source files;
``outcome_log`` is the pytest plugin both load in their subprocesses; ``cli`` is
``python -m verify mutate``. Both levels report in the same states, below.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

# Stryker's vocabulary: a guard failed (killed), every guard still passed (survived), nothing
# guards it (no coverage), the run exceeded its limit (timeout), or the run itself is broken (error).
STATES = ("killed", "survived", "no coverage", "timeout", "error")


def run_slow_args(project: Path) -> list[str]:
    """``--ap-run-slow`` where the project opts in to the verify plugin, else nothing. Both levels
    name the tests they run (a patch's guards, a line group's narrowest tests), and the quick
    tier's ``slow`` mark (tests/conftest.py) must not skip them: CI found three patches' guards
    skipped and reported as errors. A project that has not opted in would refuse the option.
    Reads ``pyproject.toml`` only (this package imports without pytest, so not
    verify.pytest_plugin's OPT_IN_INI): a project that opts in elsewhere runs its slow tests
    skipped, which the harnesses report (a patch as error, a line group's baseline as skipped)."""
    try:
        cfg = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return []
    opted = cfg.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("autoparallel_verify")
    return ["--ap-run-slow"] if opted in (True, "true") else []
