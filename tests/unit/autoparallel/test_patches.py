"""Every registered patch is described and guarded by tests that exist."""

import ast
import os
from pathlib import Path

import pytest
import torch

from autoparallel import patches
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, build_joint_graph
from autoparallel.patches import PATCHES, disabled, enabled
from autoparallel.pipeline import run_pipeline

ROOT = Path(__file__).resolve().parents[3]


def _test_names(path: Path) -> set[str]:
    """Top-level test functions and Class::method names defined in a test file."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}::{item.name}")
    return names


def missing_guards(patches) -> list[str]:
    """'patch: guard id' for each guard whose file or test function does not exist."""
    out = []
    for patch in patches:
        for guard in patch.guards:
            file, _, test = guard.partition("::")
            path = ROOT / file
            test = test.split("[", 1)[0]
            if not path.is_file() or not test or test not in _test_names(path):
                out.append(f"{patch.name}: {guard}")
    return out


@pytest.mark.parametrize("name", sorted(PATCHES))
def test_patch_is_described_and_guarded(name):
    patch = PATCHES[name]
    assert patch.summary.strip(), f"patch {name!r} has no summary"
    assert patch.when_disabled.strip(), f"patch {name!r} does not say what runs when it is disabled"
    assert patch.guards, f"patch {name!r} has no guard tests"


def test_every_guard_id_exists():
    missing = missing_guards(PATCHES.values())
    assert not missing, "guard ids that no longer exist (patch: id):\n" + "\n".join(missing)


def test_missing_guard_check_names_the_patch():
    fake = patches.Patch("fake_patch", "s", "d", ("tests/unit/autoparallel/test_patches.py::test_gone",))
    assert missing_guards([fake]) == ["fake_patch: tests/unit/autoparallel/test_patches.py::test_gone"]


def test_unknown_patch_names_are_errors_listing_the_known_ones(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown patch 'nope'; known patches: \["):
        enabled("nope")
    with pytest.raises(ValueError, match=r"unknown patch name\(s\) \['nope'\] in disabled"):
        with disabled("nope"):
            pass
    monkeypatch.setenv(patches.ENV_VAR, "nope, also_nope")
    with pytest.raises(ValueError, match=r"\['also_nope', 'nope'\] in \$AUTOPARALLEL_DISABLE; known patches"):
        patches.disabled_from_env()


@pytest.mark.skipif(not PATCHES, reason="no patches registered yet")
def test_env_and_scope_disable_and_restore(monkeypatch):
    name = sorted(PATCHES)[0]
    monkeypatch.delenv(patches.ENV_VAR, raising=False)
    assert enabled(name)
    with disabled(name):
        assert not enabled(name)
    assert enabled(name)
    monkeypatch.setenv(patches.ENV_VAR, f" {name} ,")
    assert not enabled(name)
    assert os.environ[patches.ENV_VAR] == f" {name} ,"


def test_a_misspelt_disable_name_stops_the_joint_trace_and_the_pipeline(monkeypatch, layernorm_mlp):
    """Both read no patch before the passes, so a typo in $AUTOPARALLEL_DISABLE went unnoticed
    there (the CLI and pytest caught it; a Python caller did not)."""
    cls, loss = layernorm_mlp
    batch = (torch.randn(4, 32), torch.randn(4, 16))
    monkeypatch.setenv(patches.ENV_VAR, "pre_overlap_buckting")
    with pytest.raises(ValueError, match=r"unknown patch name\(s\) \['pre_overlap_buckting'\] in \$AUTOPARALLEL_DISABLE"):
        run_pipeline(cls(), loss, batch, ParallelPlan.fsdp(), "dp=2")
    with fake_world("dp=2") as mesh, pytest.raises(ValueError, match="pre_overlap_buckting"):
        build_joint_graph(cls(), ParallelPlan.fsdp(), mesh, batch, loss)
