"""pytest plugin of the equivalence layer (loaded through the ``pytest11`` entry point).

Markers ``gpu`` and ``multigpu(n)`` skip, with a reason, where CUDA or enough GPUs are missing;
``--require-gpu`` turns those skips into failures so a GPU CI job can never pass by skipping.
"""

from __future__ import annotations

import pytest

REQUIRE_GPU = "--require-gpu"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("autoparallel-verify")
    group.addoption(
        REQUIRE_GPU,
        action="store_true",
        default=False,
        help="fail (instead of skip) tests marked gpu/multigpu when CUDA or enough GPUs are missing",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one unless --require-gpu")
    config.addinivalue_line("markers", "multigpu(n): needs n CUDA devices; skipped with fewer unless --require-gpu")


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_gate_reason(item: pytest.Item) -> str | None:
    """Why ``item`` cannot run on this machine (None if it can)."""
    needed = 0
    if item.get_closest_marker("gpu") is not None:
        needed = 1
    marker = item.get_closest_marker("multigpu")
    if marker is not None:
        if not marker.args or not isinstance(marker.args[0], int) or marker.args[0] < 1:
            raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.multigpu(n) with an int n >= 1")
        needed = max(needed, marker.args[0])
    if not needed:
        return None
    have = _cuda_device_count()
    if have >= needed:
        return None
    return f"needs {needed} CUDA device(s), found {have}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = gpu_gate_reason(item)
    if reason is None:
        return
    if item.config.getoption(REQUIRE_GPU):
        pytest.fail(f"{reason} and {REQUIRE_GPU} is set: GPU CI must not pass by skipping", pytrace=False)
    pytest.skip(reason)
