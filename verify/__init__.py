"""The equivalence layer: parity, goldens, stats, mutation and memory checks for autoparallel.

Which modules may import test-only packages (pytest, syrupy, hypothesis, pytest-xdist, mutmut:
the ``test`` and ``mutation`` extras). ``python -m verify report`` and ``scale`` are the README's
main job and run on the base install (``pip install -e .``), so every module of this package
imports only the standard library, torch, numpy and ``autoparallel`` at module level, except:

* ``verify.pytest_plugin`` (pytest): the pytest plugin; loaded only by pytest.
* ``verify.goldens.syrupy_ext`` (syrupy): the storage of goldens as text files, for the
  ``golden`` fixture. Reading and comparing goldens (``verify.goldens.text``) needs no syrupy,
  so the report shows golden status on the base install.
* ``verify.graphs.generators`` (hypothesis): graph generators for the property tests.
* ``verify.commands.mutation.subprocess_hits`` (pytest): a pytest plugin for mutmut's own runs
  (``python -m verify mutate --lines``), loaded with ``-p`` only there.

Elsewhere a test-only package is imported inside the function that needs it, where that code only
runs under pytest or mutmut (``verify.commands.mutation.lines``' pytest hook). ``goldens`` and ``mutate``
run the test suite in a subprocess and say what to install when pytest is missing.
``tests/unit/verify/test_base_install.py`` imports every other module with those packages blocked.
"""

from pathlib import Path

# Modules allowed to import a test-only package at module level (see above).
TEST_ONLY_MODULES = (
    "verify.pytest_plugin",
    "verify.goldens.syrupy_ext",
    "verify.graphs.generators",
    "verify.commands.mutation.subprocess_hits",
)
TEST_ONLY_PACKAGES = ("pytest", "_pytest", "syrupy", "hypothesis", "xdist", "pytest_timeout", "mutmut")


def repo_root() -> Path:
    """The source checkout's root: the commands that run the test suite (goldens, mutate) need it."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "tests").is_dir():
        raise ValueError(f"{root} has no tests/ directory: run from a source checkout (pip install -e .)")
    return root
