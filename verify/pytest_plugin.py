"""pytest plugin of the equivalence layer (loaded through the ``pytest11`` entry point).

Markers ``gpu`` and ``multigpu(n)`` skip, with a reason, where CUDA or enough GPUs are missing;
``--require-gpu`` turns those skips into failures so a GPU CI job can never pass by skipping.
Tests marked ``slow`` (cold Inductor compiles) run only with ``--run-slow``; CI runs them in a
step of their own so the default tier stays fast.
"""

from __future__ import annotations

import pytest

REQUIRE_GPU = "--require-gpu"
RUN_SLOW = "--run-slow"
ORDER = "--ap-order"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("autoparallel-verify")
    group.addoption(
        REQUIRE_GPU,
        action="store_true",
        default=False,
        help="fail (instead of skip) tests marked gpu/multigpu when CUDA or enough GPUs are missing",
    )
    group.addoption(
        RUN_SLOW,
        action="store_true",
        default=False,
        help="also run tests marked slow (cold Inductor compiles); CI runs them in their own step",
    )
    group.addoption(
        ORDER,
        default="file",
        help="test order: 'file' (default), 'reverse', or 'shuffle:SEED'; proves tests do not depend on order",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = config.getoption(ORDER)
    if order == "file":
        return
    if order == "reverse":
        items.reverse()
        return
    kind, _, seed = order.partition(":")
    if kind != "shuffle" or not seed.isdigit():
        raise pytest.UsageError(f"{ORDER} takes 'file', 'reverse' or 'shuffle:SEED', got {order!r}")
    import random

    random.Random(int(seed)).shuffle(items)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"slow: cold Inductor compiles; skipped unless {RUN_SLOW}")
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
    if item.get_closest_marker("slow") is not None and not item.config.getoption(RUN_SLOW):
        pytest.skip(f"slow (cold Inductor compile): run with {RUN_SLOW}; .ci/run runs these in their own step")
    reason = gpu_gate_reason(item)
    if reason is None:
        return
    if item.config.getoption(REQUIRE_GPU):
        pytest.fail(f"{reason} and {REQUIRE_GPU} is set: GPU CI must not pass by skipping", pytrace=False)
    pytest.skip(reason)


# --- goldens ------------------------------------------------------------------------------------
# verify.* is imported inside the functions below, on use: this plugin is loaded by every pytest
# run where the package is installed (pytest11), which must not import torch or syrupy.


class GoldenChecker:
    """Compares text against its golden file; failures name the file and the update command."""

    def __init__(self, snapshot, request: pytest.FixtureRequest):
        from verify.goldens.syrupy_ext import GoldenTextExtension

        self._snapshot = snapshot.use_extension(GoldenTextExtension)
        self._request = request

    def path_for(self, name: str | None = None):
        from pathlib import Path

        snap = self._snapshot(name=name) if name else self._snapshot
        return Path(snap.extension.get_location(test_location=snap.test_location, index=snap.index))

    def check_text(self, text: str, *, name: str | None = None) -> None:
        from verify.goldens import UPDATE_COMMAND, CorruptGoldenError, read_golden

        snap = self._snapshot(name=name) if name else self._snapshot
        path = self.path_for(name)
        updating = bool(self._request.config.option.update_snapshots)
        if not updating and not path.exists():
            pytest.fail(
                f"golden file {path} is missing. Generate it with `{UPDATE_COMMAND}` "
                f"(or `pytest --snapshot-update`), review it, and commit it with the change that needs it.",
                pytrace=False,
            )
        if path.exists():
            try:
                read_golden(path)
            except CorruptGoldenError as e:
                if not updating:
                    pytest.fail(str(e), pytrace=False)
                path.unlink()  # an explicit update replaces a corrupt golden
        matched = snap == text
        if not matched:
            diff = _unified_diff(path, text)
            pytest.fail(
                f"graph changed: golden file {path} differs from what the code produces now.\n"
                f"If the change is intended, run `{UPDATE_COMMAND}`, review the diff and explain it in the "
                f"commit message.\n{diff}",
                pytrace=False,
            )

    def graph(self, graphs, *, header, title: str | None = None, name: str | None = None) -> None:
        """Golden of one GraphModule or a (forward, backward) pair: header, stats, canonical text."""
        from verify.goldens import graph_golden_text

        self.check_text(graph_golden_text(title or self._request.node.nodeid, header, graphs), name=name)

    def counts(self, rows, *, header, title: str | None = None, name: str | None = None) -> None:
        """Golden of collective counts per stage: ``rows`` are (stage name, GraphModule)."""
        from verify.goldens import collective_counts_text, header_text, render_golden

        text = render_golden(
            title or self._request.node.nodeid,
            [("header", header_text(header)), ("collectives", collective_counts_text(rows))],
        )
        self.check_text(text, name=name)


def _unified_diff(path, text: str, limit: int = 200) -> str:
    import difflib

    from verify.goldens import read_golden

    old = read_golden(path).splitlines()
    lines = list(difflib.unified_diff(old, text.splitlines(), f"golden {path.name}", "produced now", lineterm="", n=2))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... {len(lines) - limit} more diff lines"]
    return "\n".join(lines)


@pytest.fixture
def golden(snapshot, request) -> GoldenChecker:
    """Golden files under goldens/; see verify.goldens."""
    return GoldenChecker(snapshot, request)
