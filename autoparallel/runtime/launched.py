"""Run a rank's body on a world someone else launched (``torchrun``, ``srun`` + ``torchrun``).

:func:`autoparallel.runtime.run_on_world` forks its own world. Inside a launched job every
process already *is* a rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``; ``TORCHELASTIC_RUN_ID`` under torchrun): forking a world of its own there starts
ranks that wait on a TCP store nobody serves. :func:`run_on_launched_world` is the other
launcher of the same per-rank body ``fn(rank, world_size, *args)``: it joins the launched world
(``env://``), runs ``fn`` on this rank, and gathers every rank's result to every rank, so the code
after it (verdicts, the exit status) computes the same on every rank, as the forked parent does.

Faults are named on every rank, within ``timeout_s`` (the process group's timeout):

* a rank that raises writes a record (its traceback) under ``verify/error/<rank>`` in the job's
  store (the launcher's agent serves it, so it outlives any worker) and waits a moment for the
  others' records before raising;
* a rank that sees an error it got *because* a peer went away (a lost connection, a collective
  timeout) reads the records: the cause is the earliest record that is not such an error, or else
  the ranks that wrote none (they died: ``os._exit``, a signal; or they hang);
* :class:`~autoparallel.runtime.RankFailedError` names that rank; the launcher (torchrun's agent)
  then stops the other workers, so no process is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autoparallel.runtime.launcher import RankFailedError, is_collateral, to_cpu

__all__ = ["LaunchedWorld", "launched_world", "run_on_launched_world", "agree_on_status"]

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: How long a failing rank waits for the other ranks' records before naming the cause.
_SETTLE_S = 2.0


@dataclass(frozen=True)
class LaunchedWorld:
    """This process's place in a launched job, read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master: str
    run_id: str | None

    def describe(self) -> str:
        how = f"torchrun run {self.run_id}" if self.run_id else "a launched job"
        return f"{how}: rank {self.rank} of WORLD_SIZE={self.world_size} (master {self.master})"


def launched_world() -> LaunchedWorld | None:
    """The launched world this process is a rank of, or None (no launcher's environment).

    A partial environment (``RANK`` without ``MASTER_ADDR``, ...) is a ValueError naming what is
    missing: joining half a world would hang."""
    present = [k for k in _ENV if k in os.environ]
    if not present:
        return None
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise ValueError(f"a launched world needs {', '.join(_ENV)} in the environment; {', '.join(missing)} "
                         f"missing (set by torchrun; or unset {', '.join(present)} to fork a world here)")
    env = os.environ
    return LaunchedWorld(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                         f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", env.get("TORCHELASTIC_RUN_ID"))


def check_world_size(world: LaunchedWorld, world_size: int, what: str = "the mesh") -> None:
    """One line naming both sizes when ``world_size`` (what ``what`` needs) is not the launched one."""
    if world_size != world.world_size:
        raise ValueError(f"{what} needs {world_size} ranks but this job launched WORLD_SIZE={world.world_size} "
                         f"({world.describe()}); launch {world_size} processes in all, or pick a mesh of {world.world_size}")


@contextlib.contextmanager
def _joined(world: LaunchedWorld, backend: str, timeout_s: float):
    if dist.is_initialized():
        raise RuntimeError(f"a default process group (backend {dist.get_backend()!r}) is already initialized in "
                           f"rank {world.rank}; the launched world joins its own (exit the other one first)")
    if backend == "nccl":
        torch.cuda.set_device(world.local_rank)
    # The job's store (torchrun's agent serves it) outlives this group, and a group joined on it
    # again would read the last one's addresses: each group gets keys of its own, numbered by
    # this rank's count of groups so far (the same on every rank: each joins in the same order).
    base, _, _ = next(dist.rendezvous("env://", world.rank, world.world_size, timeout=timedelta(seconds=timeout_s)))
    call = base.add(f"verify/launched/joins/{world.rank}", 1)
    store = dist.PrefixStore(f"verify/launched/{call}/", base)
    dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        yield store
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_on_launched_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
    num_threads: int | None = 1,
    world: LaunchedWorld | None = None,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on this rank of the launched world; every rank's result, by
    rank, on every rank (tensors on CPU, as :func:`~autoparallel.runtime.run_on_world` returns them).

    Every rank must call it, in the same order (each call is one collective world). Raises
    ValueError when ``world_size`` is not the launched one, RankFailedError naming the failing rank.
    """
    world = world if world is not None else launched_world()
    if world is None:
        raise RuntimeError("run_on_launched_world: no launched world here (RANK, WORLD_SIZE, ... unset); use run_on_world")
    check_world_size(world, world_size)
    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        with _joined(world, backend, timeout_s) as store:
            try:
                result = to_cpu(fn(world.rank, world_size, *args))
                gathered: list[Any] = [None] * world_size
                dist.all_gather_object(gathered, result)
                return gathered
            except BaseException as exc:
                raise _named_failure(store, world, exc) from exc
    finally:
        torch.set_num_threads(threads)


def _key(rank: int) -> str:
    return f"error/{rank}"


_TIMEOUT_MARKERS = ("timed out", "timeout")


def _lost_peers(exc: BaseException) -> bool:
    """An error a rank gets because a peer went away: a lost connection, or a collective that
    timed out waiting for a rank that hangs (or died without closing its sockets)."""
    return is_collateral(exc) or any(m in str(exc).lower() for m in _TIMEOUT_MARKERS)


def _named_failure(store, world: LaunchedWorld, exc: BaseException) -> BaseException:
    """Record this rank's failure, read the others', and name the cause (module docstring)."""
    if isinstance(exc, KeyboardInterrupt):
        return exc
    mine = {"rank": world.rank, "time": time.time(), "exc_type": type(exc).__name__,
            "traceback": traceback.format_exc(), "collateral": _lost_peers(exc)}
    with contextlib.suppress(Exception):
        store.set(_key(world.rank), json.dumps(mine))
    records = {world.rank: mine}
    deadline = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline and len(records) < world.world_size:
        for r in range(world.world_size):
            if r not in records:
                with contextlib.suppress(Exception):
                    if store.check([_key(r)]):
                        records[r] = json.loads(store.get(_key(r)))
        time.sleep(0.05)
    causes = sorted((rec["time"], r) for r, rec in records.items() if not rec["collateral"])
    silent = [r for r in range(world.world_size) if r not in records]
    if causes:
        rank = causes[0][1]
        rec = records[rank]
        last = rec["traceback"].rstrip().splitlines()[-1]
        msg = f"rank {rank} of the launched world raised {last}"
        tb = rec["traceback"]
    elif silent:
        rank = silent[0]
        msg = (f"rank(s) {silent} of the launched world stopped answering (died: os._exit, a signal, a crash; or hang "
               f"past the process group's timeout); the others lost them: {type(exc).__name__}")
        tb = None
    else:
        rank = world.rank
        msg = f"every rank lost its peers ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        tb = mine["traceback"]
    return RankFailedError(f"{msg} (seen from rank {world.rank})", rank=rank, exitcode=None, remote_traceback=tb)


def agree_on_status(status: int, *, timeout_s: float = 60.0, world: LaunchedWorld | None = None) -> int:
    """The largest exit status of any rank, on every rank (a launched job exits alike everywhere);
    ``status`` itself outside a launched world."""
    world = world if world is not None else launched_world()
    if world is None:
        return status
    with _joined(world, "gloo", timeout_s):
        t = torch.tensor([int(status)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())
