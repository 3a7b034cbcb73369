"""``python -m verify goldens --update|--check``: the one documented way to touch goldens.

Both run the golden tests (``-m syrupy_snapshot``: every test using the ``golden``/``snapshot``
fixture) from the repository root. Unused goldens are found here, not by syrupy: syrupy turns its
unused-snapshot detection off as soon as a run deselects any test, which ``-m`` always does. The
``golden`` fixture reports each golden file it reads (``$AUTOPARALLEL_GOLDENS_LOG``); when the run
collected the whole test tree and every golden test ran and passed, a file under ``goldens/``
that no test read is unused: ``--check`` fails naming it, ``--update`` deletes it. A narrower run
(paths, ``-k``, a skipped or failing golden test) says why it could not check, and deletes nothing.
After a passing ``--update`` it lists the golden files ``git status`` sees changed (or says that git
could not tell, outside a git checkout), for the reviewer to read and commit with their cause.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from verify import repo_root
from verify.goldens.text import GOLDENS_DIR, UPDATE_COMMAND

USAGE_LOG_ENV = "AUTOPARALLEL_GOLDENS_LOG"  # a directory: one JSON file per pytest process


@dataclass
class UnusedCheck:
    unused: list[Path]  # golden files no test read (empty when not checked)
    not_checked: str = ""  # why the check could not be made ("" when it was)
    files: int = 0  # golden files looked at


def find_unused(root: Path, log_dir: Path) -> UnusedCheck:
    """``unused_goldens`` of the usage records a run wrote to ``log_dir`` (one per process)."""
    return unused_goldens(root, [json.loads(p.read_text()) for p in sorted(log_dir.glob("usage-*.json"))])


def unused_goldens(root: Path, records: list[dict]) -> UnusedCheck:
    """Goldens under ``root/goldens`` that a run's processes (their usage records) did not read,
    if the run can tell: it collected the whole test tree and every golden test passed (a test
    that failed, was skipped or deselected may not have read its golden). The one rule for unused
    goldens: this command and a plain pytest run (``verify.pytest_plugin``) both apply it."""
    main = [r for r in records if not r["worker"]]
    if not main:
        return UnusedCheck([], "pytest did not finish its session")
    if not main[0]["whole_tree"]:
        return UnusedCheck([], "the run was given paths, so it did not collect every golden test")
    tests = set().union(*(r["tests"] for r in records))
    passed = set().union(*(r["passed"] for r in records))
    missing = sorted(tests - passed)
    if missing:
        return UnusedCheck([], f"{len(missing)} golden test(s) did not pass (failed, deselected or skipped), "
                               f"e.g. {missing[0]}")
    used = {Path(u) for r in records for u in r["used"]}
    goldens = root / GOLDENS_DIR
    files = sorted(p for p in goldens.rglob("*") if p.is_file() and not p.name.startswith("."))  # none: no goldens/
    return UnusedCheck([p for p in files if p.resolve() not in used], files=len(files))


def run_goldens(root: Path, *, update: bool, workers: str = "auto", pytest_args=()) -> int:
    """Run the golden tests of the project at ``root``; check or update, unused goldens included."""
    try:
        import pytest  # noqa: F401
        import syrupy  # noqa: F401
    except ImportError as e:
        raise ValueError(f"python -m verify goldens runs the golden tests and needs {e.name}: "
                         f"pip install -e '.[test]'") from None
    # --ap-run-slow: every golden, also those of the scenarios the quick tier leaves to CI's slow
    # step (tests/conftest.py SLOW_GROUPS): a check or update covers them all.
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "syrupy_snapshot", "--ap-run-slow", "-n", str(workers)]
    if update:
        cmd.append("--snapshot-update")
    cmd += list(pytest_args)
    print(f"[verify] {' '.join(cmd[2:])}", file=sys.stderr)  # line-buffered: out before pytest's
    with tempfile.TemporaryDirectory(prefix="ap-goldens-") as log_dir:
        env = dict(os.environ, **{USAGE_LOG_ENV: log_dir})
        rc = subprocess.call(cmd, cwd=root, env=env)
        check = find_unused(root, Path(log_dir))
    if check.not_checked:
        print(f"unused goldens: not checked ({check.not_checked})")
    elif check.unused and update:
        for p in check.unused:
            p.unlink()
            print(f"deleted unused golden {p.relative_to(root)} (no test reads it)")
    elif check.unused:
        print(f"{len(check.unused)} unused golden(s): no test reads them; `{UPDATE_COMMAND}` deletes them:")
        for p in check.unused:
            print(f"  {p.relative_to(root)}")
        rc = rc or 1
    else:
        print(f"unused goldens: none (every one of the {check.files} golden files was read)")
    if update and rc == 0:
        status = subprocess.run(
            ["git", "status", "--short", GOLDENS_DIR], cwd=root, capture_output=True, text=True
        )
        if status.returncode:  # not a git checkout: it cannot tell, and must not say "unchanged"
            print(f"goldens changed or not: `git status` could not tell (exit status {status.returncode}: "
                  f"{status.stderr.strip()}); compare {GOLDENS_DIR}/ by hand")
        elif status.stdout.strip():
            print(f"goldens changed (review with `git diff {GOLDENS_DIR}/`, commit with the change):\n{status.stdout}")
        else:
            print("goldens unchanged")
    return rc


def main(args) -> int:
    return run_goldens(repo_root(), update=args.update, workers=args.workers, pytest_args=args.pytest_args)
