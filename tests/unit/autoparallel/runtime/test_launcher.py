"""Tests for autoparallel.runtime.launcher: real gloo worlds of local processes on CPU."""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from autoparallel.runtime import RankFailedError, WorldTimeoutError, launcher, run_on_world, to_cpu
from autoparallel.runtime.steps import StepTrace

# Module-level rank functions (picklable, so the spawn test can use them too).


def _collectives(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    gathered = torch.empty(2 * world_size)
    dist.all_gather_single(gathered, torch.full((2,), float(rank)))
    parts = [torch.empty(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(parts, torch.tensor([rank * 10]))
    return {"sum": t, "gathered": gathered, "parts": torch.cat(parts)}


def _rank_tensor(rank: int, world_size: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 1000 * rank


def _raise_in_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()


def _exit_in_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _kill_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _sleep_in_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def _world_info(rank: int, world_size: int) -> tuple[int, int, int, str]:
    return (dist.get_rank(), dist.get_world_size(), torch.get_num_threads(), dist.get_backend())


def _mixed_result(rank: int, world_size: int) -> dict:
    base = torch.arange(100.0, requires_grad=True)
    view = (base * 2)[rank : rank + 3]  # a non-leaf view of a larger storage
    return {"rank": rank, "items": [view, "text", None], "pair": (rank, torch.ones(2, 2))}


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_results(world_size: int) -> None:
    results = run_on_world(_collectives, world_size)
    assert len(results) == world_size
    total = float(sum(range(1, world_size + 1)))
    expected_gather = torch.arange(world_size, dtype=torch.float32).repeat_interleave(2)
    for res in results:
        assert torch.equal(res["sum"], torch.tensor([total]))
        assert torch.equal(res["gathered"], expected_gather)
        assert torch.equal(res["parts"], torch.arange(world_size) * 10)


def test_results_in_rank_order_and_large_payload() -> None:
    n = 2_000_000  # 8 MB per rank: far beyond a pipe buffer, would deadlock a naive queue
    results = run_on_world(_rank_tensor, 2, args=(n,))
    for rank, t in enumerate(results):
        assert t.shape == (n,)
        assert t[0].item() == 1000 * rank and t[-1].item() == n - 1 + 1000 * rank


def test_world_size_one_and_settings() -> None:
    assert run_on_world(_world_info, 1) == [(0, 1, 1, "gloo")]
    assert run_on_world(_world_info, 2, num_threads=1) == [(0, 2, 1, "gloo"), (1, 2, 1, "gloo")]


@pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info(), reason="fork hazard is OpenMP-specific"
)
def test_fork_with_several_threads_is_refused() -> None:
    # Forked ranks with >1 OpenMP thread deadlock once the parent has used its thread pool.
    with pytest.raises(ValueError, match="spawn"):
        run_on_world(_world_info, 2, num_threads=2)
    if torch.get_num_threads() > 1:
        with pytest.raises(ValueError, match="num_threads=1"):
            run_on_world(_world_info, 2, num_threads=None)


def test_tensors_detached_and_compact() -> None:
    results = run_on_world(_mixed_result, 2)
    for rank, res in enumerate(results):
        view = res["items"][0]
        assert not view.requires_grad and view.grad_fn is None
        assert torch.equal(view, torch.arange(rank, rank + 3, dtype=torch.float32) * 2)
        assert view.untyped_storage().nbytes() == 3 * 4  # copied, not the 100-element storage
        assert res["items"][1:] == ["text", None]
        assert res["pair"][0] == rank and torch.equal(res["pair"][1], torch.ones(2, 2))


@dataclasses.dataclass(frozen=True)
class _Frozen:
    inner: StepTrace
    label: str


def test_to_cpu_descends_into_dataclasses_and_keeps_container_types() -> None:
    """A rank's result may be a dataclass holding dicts of tensors (``RankParity``, a device
    world's ``DeviceRank`` with its ``StepTrace``s): every tensor in it leaves the rank detached
    and compact, at any depth."""
    w = torch.arange(10.0, requires_grad=True) * 2
    trace = StepTrace(losses=[w.sum()], grads=[{"w": w[2:4]}], params={"w": w})
    pair = collections.namedtuple("pair", "a b")(w[:1], 3)
    value = {"trace": _Frozen(trace, "eager"), "order": collections.OrderedDict(w=w[:2]), "pair": pair,
             "by": collections.defaultdict(list, {"x": [w[5:6]]})}
    out = to_cpu(value)
    got = out["trace"].inner
    assert isinstance(out["trace"], _Frozen) and out["trace"].label == "eager" and got is not trace
    assert got.grads[0]["w"].untyped_storage().nbytes() == 2 * 4 and not got.params["w"].requires_grad
    assert torch.equal(got.losses[0], w.sum().detach()) and trace.grads[0]["w"].requires_grad  # the input is untouched
    assert type(out["order"]) is collections.OrderedDict and type(out["by"]) is collections.defaultdict
    assert out["by"]["missing"] == [] and type(out["pair"]) is type(pair) and out["pair"].b == 3
    assert out["pair"].a.untyped_storage().nbytes() == 4


def test_closure_with_fork() -> None:
    scale = 3.0

    def fn(rank: int, world_size: int) -> float:
        t = torch.tensor([scale * rank])
        dist.all_reduce(t)
        return t.item()

    assert run_on_world(fn, 2) == [3.0, 3.0]


def test_exception_in_rank_1() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_on_world(_raise_in_rank_1, 2, timeout_s=120)
    # Reported when rank 1 dies, not at the world's limit; the margin holds on a loaded machine.
    assert time.monotonic() - t0 < 60
    msg = str(info.value)
    assert "rank 1" in msg
    assert "ValueError: boom from rank one" in msg
    assert "Traceback (most recent call last)" in msg
    assert 'raise ValueError("boom from rank one")' in msg  # the source line of the raise
    assert info.value.rank == 1 and info.value.exitcode == 1
    assert "boom from rank one" in info.value.remote_traceback
    assert isinstance(info.value, RuntimeError)


def test_os_exit_reports_exit_code() -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_world(_exit_in_rank_1, 2, timeout_s=60)
    msg = str(info.value)
    assert msg.startswith("rank 1 ")
    assert "exited with code 3" in msg
    assert info.value.rank == 1 and info.value.exitcode == 3
    assert info.value.remote_traceback is None


def test_signal_death_reports_signal() -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_world(_kill_rank_1, 2, timeout_s=60)
    assert str(info.value).startswith("rank 1 ")
    assert "SIGKILL" in str(info.value)
    assert info.value.exitcode == -signal.SIGKILL


@pytest.mark.slow  # waits out its 3 s limit with a core idle: CI's slow step
def test_timeout_kills_world() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorldTimeoutError) as info:
        run_on_world(_sleep_in_rank_1, 2, timeout_s=3)
    elapsed = time.monotonic() - t0
    assert elapsed < 60  # killed at the limit, not after the rank's hour of sleep (any load)
    assert info.value.running_ranks == [0, 1]  # rank 0 waits for rank 1 in the final barrier
    msg = str(info.value)
    assert "timeout_s=3" in msg
    assert "still inside fn or setup: [1]" in msg and "waiting for the others: [0]" in msg
    assert isinstance(info.value, TimeoutError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"world_size": 0},
        {"world_size": -1},
        {"world_size": 2.0},
        {"world_size": True},
        {"backend": "mpi"},
        {"backend": "fake"},
        {"timeout_s": 0},
        {"timeout_s": float("inf")},
        {"start_method": "thread"},
        {"num_threads": 0},
        {"args": 5},
    ],
)
def test_bad_arguments(kwargs: dict) -> None:
    kwargs = {"world_size": 2, **kwargs}
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError):
        run_on_world(_world_info, world_size, **kwargs)


def test_not_callable() -> None:
    with pytest.raises(ValueError, match="callable"):
        run_on_world(42, 2)  # type: ignore[arg-type]


def test_spawn_requires_picklable_fn() -> None:
    with pytest.raises(ValueError, match="picklable"):
        run_on_world(lambda rank, ws: rank, 2, start_method="spawn")


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() >= 2,
    reason="this machine has enough CUDA devices for a 2-rank NCCL world",
)
def test_nccl_without_gpus_is_clear_error() -> None:
    with pytest.raises(RuntimeError, match="nccl") as info:
        run_on_world(_world_info, 2, backend="nccl")
    assert "gloo" in str(info.value)  # points at the CPU alternative


def test_live_default_pg_in_parent_is_refused() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="destroy_process_group") as info:
            run_on_world(_world_info, 2)
        assert "fake" in str(info.value)
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_port_race_is_retried_once(monkeypatch: pytest.MonkeyPatch) -> None:
    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))
    thief.listen()
    try:
        ports = [thief.getsockname()[1]]
        real = launcher._find_free_port

        def fake_find_free_port() -> int:
            return ports.pop(0) if ports else real()

        monkeypatch.setattr(launcher, "_find_free_port", fake_find_free_port)
        assert run_on_world(_world_info, 2, timeout_s=30) == [
            (0, 2, 1, "gloo"),
            (1, 2, 1, "gloo"),
        ]
        assert ports == []  # the taken port was tried first

        taken = thief.getsockname()[1]
        monkeypatch.setattr(launcher, "_find_free_port", lambda: taken)
        with pytest.raises(RankFailedError, match="EADDRINUSE") as info:
            run_on_world(_world_info, 2, timeout_s=30)
        assert info.value.rank == 0
    finally:
        thief.close()


def test_no_state_left_in_parent() -> None:
    threads = torch.get_num_threads()
    env = dict(os.environ)
    run_on_world(_world_info, 2, num_threads=1)
    assert not dist.is_initialized()
    assert torch.get_num_threads() == threads
    assert dict(os.environ) == env


@pytest.mark.slow  # a fresh interpreter per rank imports torch (~1.5 s): CI's slow step
def test_spawn_start_method() -> None:
    # Slow (the rank imports torch afresh), so a single rank: it still covers pickling fn/args,
    # the child entry point, init_process_group and the result file. Spawned ranks may use
    # several threads (fork may not, see test_fork_with_several_threads_is_refused).
    torch.ones(1 << 20).add_(1)  # the parent has used its thread pool
    results = run_on_world(_world_info, 1, start_method="spawn", num_threads=2, timeout_s=60)
    assert results == [(0, 1, 2, "gloo")]


class _FinalizedGarbage:
    """A reference cycle whose finalizer records the process it ran in."""

    def __init__(self, path):
        self.path = path
        self.me = self

    def __del__(self):
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")


def _collect_in_rank(rank: int, world_size: int) -> int:
    gc.collect()
    return os.getpid()


def test_a_rank_never_runs_the_launchers_finalizers(tmp_path):
    """A forked rank holds a copy of the launcher's cyclic garbage: collecting it there ran the
    launcher's finalizers in every rank (a TemporaryDirectory's would delete the launcher's
    directory). Ranks freeze what they inherit."""
    path = tmp_path / "finalized"
    enabled = gc.isenabled()
    gc.disable()  # the cycle must still be uncollected garbage when the ranks fork
    try:
        _FinalizedGarbage(path)
        rank_pids = run_on_world(_collect_in_rank, 2)
    finally:
        if enabled:
            gc.enable()
    gc.collect()
    assert path.read_text(encoding="utf-8").split() == [str(os.getpid())], f"ranks were {rank_pids}"
