"""Naming the failing rank of a launched world from the records in the job's store, without
torchrun (a HashStore stands for the agent's store; tests/parity/test_launched_world.py runs the
real jobs)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from autoparallel.runtime import RankFailedError
from autoparallel.runtime import launched
from autoparallel.runtime.launched import LaunchedWorld


def _failure(exc: BaseException, records: dict[int, dict], rank: int = 0, size: int = 4) -> RankFailedError:
    store = dist.HashStore()
    for r, rec in records.items():
        store.set(f"error/{r}", json.dumps({"rank": r, "time": rec.get("time", 1.0), "exc_type": "X",
                                             "traceback": rec.get("tb", "Traceback\nX: boom"),
                                             "collateral": rec["collateral"]}))
    try:
        raise exc
    except BaseException as e:
        out = launched._named_failure(store, LaunchedWorld(rank, size, rank, "h:1", "r"), e)
    assert isinstance(out, RankFailedError)
    return out


@pytest.fixture(autouse=True)
def _short_settle(monkeypatch):
    monkeypatch.setattr(launched, "_SETTLE_S", 0.2)


def test_the_rank_that_raised_is_named_not_the_ones_that_lost_it():
    err = _failure(RuntimeError("Connection reset by peer"),
                   {1: {"collateral": True, "time": 1.0}, 2: {"collateral": False, "time": 2.0, "tb": "T\nValueError: bad"},
                    3: {"collateral": True, "time": 3.0}})
    assert err.rank == 2 and "rank 2 of the launched world raised ValueError: bad" in str(err)
    assert "(seen from rank 0)" in str(err)


def test_ranks_without_a_record_are_named_when_every_error_is_a_lost_peer():
    err = _failure(RuntimeError("Timed out waiting 5000ms for recv operation to complete"),
                   {1: {"collateral": True}, 3: {"collateral": True}})
    assert err.rank == 2 and "rank(s) [2] of the launched world stopped answering" in str(err)


def test_an_error_of_this_rank_that_is_its_own_names_this_rank():
    err = _failure(ValueError("my own bug"), {1: {"collateral": True}, 2: {"collateral": True}, 3: {"collateral": True}})
    assert err.rank == 0 and "raised ValueError: my own bug" in str(err)


def test_timeouts_and_lost_connections_are_lost_peers_other_errors_are_not():
    assert launched._lost_peers(RuntimeError("[gloo] Timed out waiting 10000ms for send operation to complete"))
    assert launched._lost_peers(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not launched._lost_peers(ValueError("shape mismatch"))


def test_run_on_launched_world_refuses_outside_a_job_and_a_wrong_size(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="no launched world here"):
        launched.run_on_launched_world(lambda r, n: r, 2)
    with pytest.raises(ValueError, match="needs 4 ranks but this job launched WORLD_SIZE=2"):
        launched.run_on_launched_world(lambda r, n: r, 4, world=LaunchedWorld(0, 2, 0, "h:1", None))
