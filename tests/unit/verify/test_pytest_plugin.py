"""The plugin's gates: gpu / multigpu(n) skip with a reason, --require-gpu turns that into a
failure, slow tests run only with --run-slow, and browser tests skip (or, with
--require-browser, fail) where Chromium is missing (checked in a throwaway project)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")

TESTS = textwrap.dedent(
    """
    import pytest

    @pytest.mark.gpu
    def test_needs_gpu():
        pass

    @pytest.mark.multigpu(2)
    def test_needs_two_gpus():
        pass

    @pytest.mark.slow
    def test_slow():
        pass

    def test_plain():
        pass

    @pytest.mark.browser
    def test_in_browser():
        pass
    """
)


def run(project, *args, chromium="/nonexistent/chromium"):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST_"))}
    env["AP_CHROMIUM"] = chromium
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider", *args],
        cwd=project, capture_output=True, text=True, timeout=120, env=env,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("gates")
    # no:hypothesispytest: the inner runs use no hypothesis, and its import is most of pytest's startup.
    (root / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers -p no:hypothesispytest\n")
    (root / "test_gates.py").write_text(TESTS)
    return root


def test_gpu_tests_skip_with_a_reason_without_cuda(project):
    out = run(project)
    assert out.returncode == 0, out.stdout
    assert "1 passed, 4 skipped" in out.stdout
    assert "needs 1 CUDA device(s), found 0" in out.stdout
    assert "needs 2 CUDA device(s), found 0" in out.stdout
    assert "slow (cold Inductor compile): run with --run-slow" in out.stdout
    assert "browser test cannot run: " in out.stdout


def test_require_gpu_and_browser_turn_skips_into_failures_and_order_reverses(project):
    out = run(project, "--require-gpu", "--require-browser", "--run-slow", "--ap-order", "reverse", "-vv")
    assert out.returncode == 1
    assert "2 passed, 3 errors" in out.stdout  # failed in setup: the test cannot run here
    assert "--require-gpu is set: GPU CI must not pass by skipping" in out.stdout
    assert "browser test cannot run: " in out.stdout and "--require-browser is set" in out.stdout
    ran = [line.split("::")[1].split()[0] for line in out.stdout.splitlines() if line.startswith("test_gates.py::")]
    assert ran == ["test_in_browser", "test_plain", "test_slow", "test_needs_two_gpus", "test_needs_gpu"], out.stdout


def test_order_option_rejects_nonsense(project):
    bad = run(project, "--ap-order", "sideways", "--collect-only")
    assert bad.returncode == 4 and "--ap-order takes 'file', 'reverse' or 'shuffle:SEED'" in bad.stderr
