"""``python -m verify goldens --update|--check``: the one documented way to touch goldens.

Both run the golden tests (every test using the ``golden``/``snapshot`` fixture) from the
repository root with no path arguments, so syrupy sees the whole tree and reports (or, on
update, deletes) goldens that no test uses any more.
"""

from __future__ import annotations

import subprocess
import sys

from verify.goldens.text import GOLDENS_DIR
from verify.repo import repo_root


def main(args) -> int:
    root = repo_root()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "syrupy_snapshot", "-n", str(args.workers)]
    if args.update:
        cmd.append("--snapshot-update")
    cmd += list(args.pytest_args)
    print(f"[verify] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    rc = subprocess.call(cmd, cwd=root)
    if args.update and rc == 0:
        status = subprocess.run(
            ["git", "status", "--short", "--", GOLDENS_DIR], cwd=root, capture_output=True, text=True
        ).stdout
        if status.strip():
            print(f"goldens changed (review with `git diff {GOLDENS_DIR}/`, commit with the change):\n{status}")
        else:
            print("goldens unchanged")
    return rc
