"""pytest plugin (``-p verify.commands.mutation.subprocess_hits``) for mutmut's runs of ``mutate --lines``.

mutmut learns which tests reach which mutated function by recording calls in its own process, so
a test that runs the code under test in a subprocess (``python -m pytest`` on a throwaway project,
as the pytest plugin's and the goldens command's tests do) would count as reaching nothing, and
its function's mutants as "no coverage". The scratch directory puts a ``sitecustomize`` on the
subprocesses' path (``verify.commands.mutation.lines.SUBPROCESS_BRIDGE``): while mutmut collects coverage,
each Python process a test starts writes the mutated functions it ran to ``$AP_MUTATION_HITS``.
Here, before mutmut files the test's calls, those are added to them. Mutants themselves reach the
subprocesses through the environment (``MUTANT_UNDER_TEST``) and the path (the bridge puts
``$AP_MUTATION_MUTANTS`` first on it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HITS_ENV = "AP_MUTATION_HITS"


def collect_subprocess_hits(directory: Path) -> set[str]:
    """The function names the subprocesses wrote to ``directory`` (the files are removed)."""
    names: set[str] = set()
    for f in sorted(directory.glob("*.txt")):
        names.update(line for line in f.read_text().splitlines() if line)
        f.unlink()
    return names


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    directory = os.environ.get(HITS_ENV)
    if not directory or os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    from mutmut.state import state  # only inside mutmut's own runs

    state()._stats.update(collect_subprocess_hits(Path(directory)))
