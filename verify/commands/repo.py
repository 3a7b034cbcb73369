"""Where the source checkout is: the CLI commands that run the test suite need its root."""

from __future__ import annotations

from pathlib import Path


def repo_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "tests").is_dir():
        raise ValueError(f"{root} has no tests/ directory: run from a source checkout (pip install -e .)")
    return root
