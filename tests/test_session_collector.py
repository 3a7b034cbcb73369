"""tests/conftest.py's garbage-collector settings for a test session: the pipeline's thresholds and a
heap frozen once the tests are collected, undone where the process goes on after the session and
left in place in an xdist worker, whose process ends with it (so neither pytest's closing
collections nor the interpreter's last one walk every graph the session built)."""

from __future__ import annotations

import contextlib
import gc
import types

import pytest

from autoparallel.gc_pauses import GRAPH_BUILDING_THRESHOLDS


def _tier_conftest(config):
    found = [p for p in config.pluginmanager.get_plugins() if hasattr(p, "_process_ends_with_session")]
    assert len(found) == 1, "tests/conftest.py defines _process_ends_with_session"
    return found[0]


def test_the_session_runs_with_the_pipelines_thresholds_and_its_imports_frozen():
    assert gc.get_threshold()[0] >= GRAPH_BUILDING_THRESHOLDS[0]
    assert gc.get_freeze_count() > 0


@pytest.mark.parametrize("worker", [False, True], ids=["process-goes-on", "xdist-worker"])
def test_only_a_worker_leaves_its_heap_frozen_after_the_session(request, worker):
    conftest = _tier_conftest(request.config)
    config = types.SimpleNamespace(stash=pytest.Stash(), **({"workerinput": {}} if worker else {}))
    config.stash[conftest._GC_KEY] = stack = contextlib.ExitStack()
    session = types.SimpleNamespace(config=config)
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()  # the hook freezes only a heap nobody else froze
    try:
        conftest.pytest_collection_finish(session)
        at_collection = gc.get_freeze_count()
        assert at_collection > 0
        built = [[] for _ in range(100)]  # what the session builds after collection
        conftest.pytest_sessionfinish(session)
        assert (gc.get_freeze_count() >= at_collection + len(built)) is worker
        stack.close()  # the session's last cleanup
        assert (gc.get_freeze_count() > 0) is worker
    finally:
        gc.unfreeze()
        if was_frozen:
            gc.freeze()
