"""The README's main job runs on the base install: every verify module the command line uses
imports with pytest, syrupy, hypothesis, xdist and mutmut missing (blocked on sys.meta_path in a
fresh interpreter), and the commands that need them say what to install."""

import json
import subprocess
import sys

import pytest

import verify

SCRIPT = r"""
import importlib, importlib.abc, importlib.machinery, json, pkgutil, sys

BLOCKED = set(json.loads(sys.argv[1]))
ALLOWED = set(json.loads(sys.argv[2]))


class Missing(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r}", name=spec.name)

    def exec_module(self, module):
        raise AssertionError("unreachable")


class Block(importlib.abc.MetaPathFinder):
    # A spec with no origin: importing it fails like a missing package, while
    # importlib.util.find_spec (torch._dynamo probes third-party packages with it) gets an answer.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return importlib.machinery.ModuleSpec(name, Missing())
        return None


sys.meta_path.insert(0, Block())
import verify

out = {"imported": [], "refused": {}, "failed": {}}
for info in pkgutil.walk_packages(verify.__path__, "verify."):
    try:
        importlib.import_module(info.name)
        out["imported"].append(info.name)
    except ImportError as e:
        (out["refused"] if info.name in ALLOWED else out["failed"])[info.name] = f"{type(e).__name__}: {e}"
from verify.__main__ import main
for cmd in (["goldens", "--check"], ["mutate", "--patch", "fsdp_chain_recompute"]):
    out[" ".join(cmd)] = main(cmd)
print(json.dumps(out))
"""


# A fresh interpreter imports every verify module (~4 s): CI's slow step. CI's first step also runs
# the README's main job on a base install.
@pytest.mark.slow
def test_cli_modules_import_without_test_packages(capfd):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(verify.TEST_ONLY_PACKAGES), json.dumps(verify.TEST_ONLY_MODULES)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["failed"] == {}, "only verify.TEST_ONLY_MODULES may import a test-only package at module level"
    assert {"verify.__main__", "verify.commands.report", "verify.commands.scale", "verify.goldens.catalog", "verify.goldens.cli",
            "verify.commands.mutation.cli", "verify.stages.pipeline_run"} <= set(out["imported"])
    # The blocker works: each allowed exception really needs its package.
    assert sorted(out["refused"]) == sorted(verify.TEST_ONLY_MODULES), out["refused"]
    assert out["goldens --check"] == 2 and out["mutate --patch fsdp_chain_recompute"] == 2
    assert "python -m verify goldens runs the golden tests and needs pytest: pip install -e '.[test]'" in proc.stderr
    assert "python -m verify mutate runs the guard tests and needs pytest" in proc.stderr
