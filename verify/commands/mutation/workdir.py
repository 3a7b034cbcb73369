"""The scratch directory a line-mutation run happens in (``python -m verify mutate --lines``): the
copied sources, the generated ``[tool.mutmut]`` table, the subprocess bridge and mutmut's
environment (verify/commands/mutation/lines.py runs mutmut there)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from verify.commands.mutation.pytest_hook import MAX_EXAMPLES_ENV
from verify.commands.mutation.results import module_file

# Written as sitecustomize.py into the scratch directory, on the path of every process a test starts
# (see verify/commands/mutation/subprocess_hits.py): while mutmut collects coverage, remember the mutated
# functions this process runs and leave them in $AP_MUTATION_HITS when it exits.
SUBPROCESS_BRIDGE = '''"""Written by verify.commands.mutation.workdir (python -m verify mutate --lines)."""
import atexit
import os
import sys

# The mutants go first on the path here, not through $PYTHONPATH: mutmut's own process starts
# before mutants/ exists, and Python would cache that path as "nothing to import from" for good.
_mutants = os.environ.get("AP_MUTATION_MUTANTS", "")
if _mutants and os.path.isdir(_mutants) and _mutants not in sys.path:
    sys.path.insert(0, _mutants)

if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("AP_MUTATION_HITS"):
    import mutmut.mutation.trampoline as _trampoline

    _hits = set()
    _original = [_trampoline.record_trampoline_hit]

    def _record(name, caller=None):
        _hits.add(name)
        if _original:  # mutmut's own process: its bookkeeping too (it fails outside mutmut's cwd)
            try:
                _original[0](name, caller)
            except Exception:
                _original.clear()

    def _dump():
        if _hits:
            path = os.path.join(os.environ["AP_MUTATION_HITS"], f"{os.getpid()}.txt")
            with open(path, "w") as f:
                f.write("\\n".join(sorted(_hits)))

    _trampoline.record_trampoline_hit = _record
    atexit.register(_dump)
'''
BRIDGE_DIR = "ap-subprocess-bridge"
HITS_DIR = "ap-subprocess-hits"
DEFAULT_TIMEOUT_MULTIPLIER = 5.0
DEFAULT_TIMEOUT_CONSTANT = 5.0


def _toml_list(items: Iterable[str]) -> str:
    return "[" + ", ".join(json.dumps(str(i)) for i in items) + "]"


def source_packages(files: Sequence[str]) -> list[str]:
    """The top-level packages the mutated files live in (mutmut's ``source_paths``)."""
    return sorted({Path(f).parts[0] for f in files})


def mutated_pytest_plugins(root: Path, files: Sequence[str]) -> list[str]:
    """The names of the ``pytest11`` entry points (``[project.entry-points.pytest11]`` of
    ``root/pyproject.toml``) whose module is one of ``files``: pytest plugins that the pytest runs
    judging the mutants must not load (see the module docstring)."""
    import tomllib

    path = root / "pyproject.toml"
    if not path.exists():
        return []
    entry_points = tomllib.loads(path.read_text()).get("project", {}).get("entry-points", {}).get("pytest11", {})
    mutated = set(files)
    return sorted(name for name, target in entry_points.items() if module_file(target.partition(":")[0]) in mutated)


def mark_args(markexpr: str | None) -> list[str]:
    """``-m EXPR`` for a marker expression, nothing without one."""
    return ["-m", markexpr] if markexpr else []


def outer_pytest_args(blocked_plugins: Sequence[str]) -> list[str]:
    """``-p no:NAME`` for each blocked plugin."""
    return [arg for name in blocked_plugins for arg in ("-p", f"no:{name}")]


def mutmut_config(files: Sequence[str], tests: Sequence[str], deselect: Sequence[str] = (), *,
                  blocked_plugins: Sequence[str] = (), run_slow: Sequence[str] = (), markexpr: str | None = None,
                  timeout_multiplier: float = DEFAULT_TIMEOUT_MULTIPLIER,
                  timeout_constant: float = DEFAULT_TIMEOUT_CONSTANT) -> str:
    """The ``[tool.mutmut]`` table written into the scratch directory's pyproject.toml. ``goldens``
    is copied next to the mutants: code under ``verify`` finds the repository root from its own
    path (``verify.repo_root``), which is mutmut's ``mutants/`` there. ``blocked_plugins``: pytest
    plugins mutmut's own pytest runs leave out (:func:`mutated_pytest_plugins`); ``run_slow``:
    :func:`verify.commands.mutation.run_slow_args` of the project (its ``slow`` tests run too);
    ``markexpr``: a pytest ``-m`` expression every run of mutmut's applies (:data:`QUICK_TIER`)."""
    selection = [*tests]
    for nodeid in deselect:
        selection += ["--deselect", nodeid]
    pytest_args = ["-p", "no:cacheprovider", "-p", "verify.commands.mutation.pytest_hook", "-p", "verify.commands.mutation.subprocess_hits",
                   *run_slow, *outer_pytest_args(blocked_plugins), *mark_args(markexpr)]
    return "\n".join([
        "[tool.mutmut]",
        f"source_paths = {_toml_list(source_packages(files))}",
        'also_copy = ["goldens"]',
        f"only_mutate = {_toml_list(files)}",
        f"pytest_add_cli_args_test_selection = {_toml_list(selection)}",
        f"pytest_add_cli_args = {_toml_list(pytest_args)}",
        'process_isolation = "forkserver"',
        'forkserver_warmup = "collect"',
        f"timeout_multiplier = {float(timeout_multiplier)}",
        f"timeout_constant = {float(timeout_constant)}",
        "use_git_change_detection = false",
        "",
    ])


def read_config(workdir: Path) -> tuple[list[str], list[str], list[str]]:
    """``(files, tests, deselected ids)`` from the ``[tool.mutmut]`` table a run wrote into ``workdir``."""
    import tomllib

    cfg = tomllib.loads((workdir / "pyproject.toml").read_text())["tool"]["mutmut"]
    tests, deselect = [], []
    args = iter(cfg.get("pytest_add_cli_args_test_selection", []))
    for a in args:
        if a == "--deselect":
            deselect.append(next(args))
        else:
            tests.append(a)
    return list(cfg.get("only_mutate", [])), tests, deselect


def _strip_table(toml: str, header: str) -> str:
    """``toml`` without the table ``[header]`` (so a generated one can be appended)."""
    out, skip = [], False
    for line in toml.splitlines():
        s = line.strip()
        if s.startswith("[") and not s.startswith("[["):
            skip = s == f"[{header}]" or s.startswith(f"[{header}.")
        if not skip:
            out.append(line)
    return "\n".join(out).rstrip() + "\n"


def prepare_workdir(root: Path, workdir: Path) -> None:
    """Copy what mutmut and the tests need from ``root`` into ``workdir`` (no old ``mutants/``)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("autoparallel", "verify", "tests", "goldens"):
        if not (root / name).exists():
            continue
        if (workdir / name).exists():
            shutil.rmtree(workdir / name)
        shutil.copytree(root / name, workdir / name, ignore=ignore)
    if (workdir / "mutants").exists():  # a kept workdir: start over, results must be fresh
        shutil.rmtree(workdir / "mutants")
    for name in (BRIDGE_DIR, HITS_DIR):
        shutil.rmtree(workdir / name, ignore_errors=True)
        (workdir / name).mkdir()
    (workdir / BRIDGE_DIR / "sitecustomize.py").write_text(SUBPROCESS_BRIDGE)


def write_config(root: Path, workdir: Path, config: str) -> None:
    pyproject = _strip_table((root / "pyproject.toml").read_text(), "tool.mutmut")
    (workdir / "pyproject.toml").write_text(pyproject + "\n" + config)


def mutmut_env(max_examples: int, workdir: Path | None = None) -> dict[str, str]:
    """mutmut's environment; with ``workdir``, also what lets the processes a test starts run the
    mutants and report coverage (the bridge on ``PYTHONPATH``; it puts the mutants first on the path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST_", "MUTANT_UNDER_TEST"))}
    env[MAX_EXAMPLES_ENV] = str(max_examples)
    if workdir is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(workdir / BRIDGE_DIR), env.get("PYTHONPATH", "")) if p)
        env["AP_MUTATION_MUTANTS"] = str(workdir / "mutants")
        env["AP_MUTATION_HITS"] = str(workdir / HITS_DIR)
    return env

