"""Run a Python callable on a real ``torch.distributed`` world of N local processes.

``run_on_world(fn, world_size)`` starts ``world_size`` processes, each of which joins a real
process group (gloo on CPU, NCCL on GPUs) over ``tcp://127.0.0.1:<free port>``, calls
``fn(rank, world_size, *args)``, tears the group down and hands its result back. The parent
returns the results as a list in rank order.

Design choices, and why:

* **fork by default.** Spawning re-imports torch in every rank (about 3 s per rank on a small CPU
  box, 4.8 s for a 4-rank world) while fork starts a 4-rank gloo world in about 0.1 s. That
  difference decides whether multi-rank tests are cheap enough to run everywhere. ``"spawn"``
  and ``"forkserver"`` are available for code that is not fork-safe; with those, ``fn`` and
  ``args`` must be picklable (module-level functions, no lambdas or closures), which is checked
  before anything starts. Because forked ranks inherit the parent's memory, the parent must not
  hold a default process group (e.g. a fake one used for tracing) when forking, and must not
  have initialized CUDA when forking NCCL ranks; both are refused with a clear error.
* **One thread per rank (``num_threads=1``) by default**, so N ranks do not oversubscribe a
  small machine. It is also *required* with fork where torch's intra-op backend is GNU OpenMP
  (the Linux wheels): once the parent has run any parallel region (any sizeable tensor op with
  more than one thread), a forked child deadlocks in its first multi-threaded op. Fork with
  more than one thread per rank is therefore refused; use spawn/forkserver for that.
* **The inherited heap is frozen in every rank** (``gc.freeze()`` first thing): a forked rank
  holds a copy of the launcher's objects, its cyclic garbage included, and collecting that copy
  would run the launcher's finalizers in the rank (a ``TemporaryDirectory`` deleting the
  launcher's directory, a file flushed twice) and walk a heap the rank never uses.
* **Files for results and errors.** Every rank ``torch.save``s its result (tensors detached and
  copied to CPU) to its own file in a temporary directory, and writes its formatted traceback to
  an error file when it raises. The parent reads them only after the ranks have exited, so a
  large payload can never deadlock the way a ``multiprocessing.Queue`` can (a child blocks on a
  full pipe while the parent blocks on ``join``). The directory is always removed.
* **Every wait is bounded.** The parent waits on the process sentinels with a deadline of
  ``timeout_s`` for the whole world (the same value is the process-group timeout). When a rank
  fails, the remaining ranks are terminated (SIGTERM, then SIGKILL after a short grace period)
  and :class:`RankFailedError` is raised with the failing rank's full traceback, or with its
  exit code / signal when it died without a Python exception. When the deadline passes, all
  ranks are killed and :class:`WorldTimeoutError` names the ranks that were still running.
  On Linux, ranks also get ``PR_SET_PDEATHSIG`` so they die if the parent is killed.
* **Only torch.distributed between ranks.** There is no hand-made transport; the launcher just
  picks the port (binding port 0) and retries once with a fresh port if rank 0 finds the port
  taken by the time it binds it.

Children inherit the parent's stdout/stderr, so their prints stay visible (and pytest captures
them as usual). Nothing is left behind in the parent: no process group, no environment
variables, no thread settings.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import gc
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankFailedError", "WorldTimeoutError", "run_on_world"]

_BACKENDS = ("gloo", "nccl")
_START_METHODS = ("fork", "spawn", "forkserver")
#: Seconds a rank gets to exit after SIGTERM before it is SIGKILLed.
_TERM_GRACE_S = 2.0
#: After the first failure, how long to keep collecting other ranks' exits before terminating
#: them, so that near-simultaneous failures can be ordered by time and the root cause reported.
_FAILURE_SETTLE_S = 0.2


class RankFailedError(RuntimeError):
    """A rank raised an exception or exited abnormally.

    Attributes: ``rank`` (the failing rank reported as the cause), ``exitcode`` (its process exit
    code; negative for a signal), ``remote_traceback`` (its formatted traceback, or ``None`` when
    it died without a Python exception).
    """

    def __init__(
        self, message: str, *, rank: int, exitcode: int | None, remote_traceback: str | None
    ):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback


class WorldTimeoutError(TimeoutError):
    """The world did not finish within ``timeout_s``; ``running_ranks`` lists the laggards."""

    def __init__(self, message: str, *, running_ranks: list[int]):
        super().__init__(message)
        self.running_ranks = running_ranks


# --------------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------------


def _result_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.result.pt")


def _error_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.error.json")


def _atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor detached and copied to CPU memory: tensors inside lists,
    tuples, dicts and dataclasses (a rank's results, a ``StepTrace``), at any depth; a dataclass
    comes back as a shallow copy of itself with its fields converted.

    Copying also drops the rest of a view's storage, which ``torch.save`` would otherwise write.
    Pending functional-collective results are waited on first.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(value, torch.Tensor):
        if isinstance(value, AsyncCollectiveTensor):
            value = value.wait()
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict | list):  # subclasses too (an OrderedDict, a defaultdict)
        out = copy.copy(value)
        for k in range(len(value)) if isinstance(value, list) else value:
            out[k] = to_cpu(value[k])
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_cpu(v) for v in value))
    if isinstance(value, tuple):
        return tuple(to_cpu(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(out, f.name, to_cpu(getattr(value, f.name)))  # frozen ones too
        return out
    return value


_PEER_LOSS_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote worker crashing",
)


def is_collateral(exc: BaseException) -> bool:
    """True for errors a rank typically gets *because* a peer died (lost connections)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_LOSS_MARKERS)


def _is_port_in_use(exc: BaseException) -> bool:
    text = str(exc)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def _set_parent_death_signal(parent_pid: int | None) -> None:
    """Linux only, best effort: SIGKILL this rank if its parent process dies.

    ``parent_pid`` is the launching process for fork/spawn; ``None`` for forkserver, where the
    parent is the fork server (which itself exits when the launching process goes away).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 == PR_SET_PDEATHSIG
    except Exception:
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        # The launcher died before prctl took effect.
        print("autoparallel launcher: parent process is gone, rank exits", file=sys.stderr)
        os._exit(1)


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _rank_main(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple,
    backend: str,
    port: int,
    timeout_s: float,
    num_threads: int | None,
    workdir: str,
    parent_pid: int | None,
) -> None:
    """Entry point of one rank process. Never returns: exits with 0 on success, 1 on error."""
    _set_parent_death_signal(parent_pid)
    gc.freeze()  # the inherited heap: no finalizer of the launcher's runs here (module docstring)
    stage = "setup"
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        stage = "init_process_group"
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        stage = "fn"
        result = to_cpu(fn(rank, world_size, *args))
        stage = "save_result"
        tmp = _result_path(workdir, rank) + ".tmp"
        torch.save(result, tmp)
        os.replace(tmp, _result_path(workdir, rank))
        stage = "teardown"
        if dist.is_initialized():  # fn may have torn the group down itself
            # Keep every rank (rank 0 hosts the TCP store) alive until all are done with fn.
            if backend == "nccl":
                dist.barrier(device_ids=[rank])
            else:
                dist.barrier()
            dist.destroy_process_group()
    except BaseException as exc:
        # Report first, and exit without tearing down: the group may be wedged, and peers
        # blocked in collectives are terminated by the parent anyway.
        record = {
            "rank": rank,
            "time": time.time(),
            "stage": stage,
            "exc_type": type(exc).__name__,
            "traceback": traceback.format_exc(),
            "collateral": is_collateral(exc),
            "port_in_use": stage == "init_process_group" and rank == 0 and _is_port_in_use(exc),
        }
        with contextlib.suppress(BaseException):
            _atomic_write_bytes(_error_path(workdir, rank), json.dumps(record).encode())
        _flush_std_streams()
        os._exit(1)
    _flush_std_streams()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def _find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _validate(
    fn: Any,
    world_size: Any,
    args: Any,
    backend: Any,
    timeout_s: Any,
    start_method: Any,
    num_threads: Any,
) -> None:
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(args, tuple | list):
        raise ValueError(f"args must be a tuple, got {type(args).__name__}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    if start_method not in _START_METHODS:
        raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}")
    if start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start_method {start_method!r} is not available on this platform")
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ValueError(f"num_threads must be None or an int >= 1, got {num_threads!r}")


def _aten_uses_openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _check_environment(
    backend: str, world_size: int, start_method: str, num_threads: int | None
) -> None:
    if start_method == "fork":
        effective = torch.get_num_threads() if num_threads is None else num_threads
        if effective > 1 and _aten_uses_openmp():
            raise ValueError(
                f"start_method='fork' needs num_threads=1 (got {num_threads!r}, i.e. "
                f"{effective} threads per rank): torch's intra-op backend here is GNU OpenMP, "
                "and once the parent has run any parallel region, a forked child deadlocks in "
                "its first multi-threaded op. Use num_threads=1, or start_method='spawn' / "
                "'forkserver' for multi-threaded ranks."
            )
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    if start_method == "fork" and dist.is_initialized():
        pg_backend = dist.get_backend()
        raise RuntimeError(
            f"run_on_world(start_method='fork') was called while a default process group "
            f"(backend {pg_backend!r}) is initialized in the parent process; forked ranks would "
            "inherit it. Exit the fake world first (torch.distributed.destroy_process_group()), "
            "or use start_method='spawn'."
        )
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError(
                "backend='nccl' requested but this torch build has no NCCL support "
                f"(torch {torch.__version__}); use backend='gloo' on CPU"
            )
        # device_count() goes through NVML when it can, so it does not initialize CUDA here.
        n_gpus = torch.cuda.device_count()
        if n_gpus < world_size:
            raise RuntimeError(
                f"backend='nccl' with world_size={world_size} needs {world_size} CUDA devices "
                f"(one per rank), but {n_gpus} are visible; use backend='gloo' on CPU"
            )
        if start_method == "fork" and torch.cuda.is_initialized():
            raise RuntimeError(
                "CUDA is already initialized in the parent process, so forked NCCL ranks cannot "
                "use it; use start_method='spawn' (or avoid touching CUDA before launching)"
            )


@dataclass
class _Outcome:
    kind: str  # "failed", "timeout", "port_in_use"
    error: BaseException | None = None


def _describe_exitcode(code: int | None) -> str:
    if code is None:
        return "was still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code}, exit code {code})"
    return f"exited with code {code}"


def _read_error(workdir: str, rank: int) -> dict | None:
    try:
        with open(_error_path(workdir, rank), "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def _terminate(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """SIGTERM every live process, SIGKILL those still alive after the grace period, reap all."""
    alive = [p for p in procs if p.exitcode is None]
    for p in alive:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + _TERM_GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.exitcode is None:
            with contextlib.suppress(Exception):
                p.kill()
    for p in alive:
        p.join(5.0)


def _failure_error(
    workdir: str,
    failed: dict[int, int | None],
    seen_at: dict[int, float],
    terminated: list[int],
) -> tuple[BaseException, bool]:
    """Build the RankFailedError for ``failed`` ({rank: exitcode}); also return port_in_use.

    The rank reported as the cause is the earliest failure that is not a lost-connection error
    (those are what peers of a dead rank get), using the rank's own timestamp when it wrote an
    error record and the time the parent saw it exit otherwise.
    """
    records = {r: _read_error(workdir, r) for r in failed}

    def cause_key(r: int) -> tuple[bool, float, int]:
        rec = records[r]
        if rec is None:
            return (False, seen_at[r], r)
        return (bool(rec.get("collateral")), rec["time"], r)

    primary = min(failed, key=cause_key)
    rec = records[primary]
    code = failed[primary]
    if rec is not None:
        msg = (
            f"rank {primary} of the world raised {rec['exc_type']} during {rec['stage']}:\n\n"
            f"{rec['traceback'].rstrip()}"
        )
        remote_tb = rec["traceback"]
    else:
        msg = (
            f"rank {primary} {_describe_exitcode(code)} without raising a Python exception "
            "(os._exit, a signal, or a crash in native code; its stderr may have details)"
        )
        remote_tb = None
    others = []
    for r in sorted(failed):
        if r == primary:
            continue
        other = records[r]
        if other is not None:
            last = other["traceback"].rstrip().splitlines()[-1]
            if len(last) > 240:
                last = last[:240] + "..."
            others.append(f"rank {r} also failed: {last}")
        else:
            others.append(f"rank {r} {_describe_exitcode(failed[r])}")
    if terminated:
        others.append(f"ranks {terminated} were terminated by the launcher")
    if others:
        msg += "\n\nOther ranks: " + "; ".join(others)
    port_in_use = bool(rec and rec.get("port_in_use"))
    err = RankFailedError(msg, rank=primary, exitcode=code, remote_traceback=remote_tb)
    return err, port_in_use


def _run_once(
    ctx: multiprocessing.context.BaseContext,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    backend: str,
    timeout_s: float,
    num_threads: int | None,
    deadline: float,
    port: int,
    workdir: str,
) -> _Outcome | list[Any]:
    procs: list[multiprocessing.process.BaseProcess] = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    world_size,
                    fn,
                    args,
                    backend,
                    port,
                    timeout_s,
                    num_threads,
                    workdir,
                    None if ctx.get_start_method() == "forkserver" else os.getpid(),
                ),
                name=f"autoparallel-rank{rank}",
                daemon=False,  # ranks may start their own worker processes
            )
            p.start()
            procs.append(p)

        pending = {p.sentinel: rank for rank, p in enumerate(procs)}
        failed: dict[int, int | None] = {}
        seen_at: dict[int, float] = {}
        settle_until: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if settle_until is None else min(deadline, settle_until)
            if now >= limit:
                break
            ready = multiprocessing.connection.wait(list(pending), timeout=limit - now)
            for sentinel in ready:
                rank = pending.pop(sentinel)
                procs[rank].join(1.0)  # the sentinel fired, so this returns at once
                code = procs[rank].exitcode
                if code != 0:
                    failed[rank] = code
                    seen_at[rank] = time.time()
                    if settle_until is None:
                        settle_until = time.monotonic() + _FAILURE_SETTLE_S

        if failed:
            still_running = sorted(pending.values())
            _terminate(procs)
            err, port_in_use = _failure_error(workdir, failed, seen_at, still_running)
            return _Outcome("port_in_use" if port_in_use else "failed", err)
        if pending:
            running = sorted(pending.values())
            _terminate(procs)
            # A rank that saved its result was only waiting for the others in the final barrier.
            done_fn = [r for r in running if os.path.exists(_result_path(workdir, r))]
            in_fn = [r for r in running if r not in done_fn]
            err = WorldTimeoutError(
                f"the world of {world_size} ranks did not finish within timeout_s={timeout_s:g} s; "
                f"ranks still running (killed): {running}; of those, still inside fn or setup: "
                f"{in_fn}, done with fn and waiting for the others: {done_fn}",
                running_ranks=running,
            )
            return _Outcome("timeout", err)

        results = []
        for rank in range(world_size):
            path = _result_path(workdir, rank)
            if not os.path.exists(path):
                return _Outcome(
                    "failed",
                    RankFailedError(
                        f"rank {rank} exited with code 0 but wrote no result "
                        "(did fn call os._exit(0) or sys.exit()?)",
                        rank=rank,
                        exitcode=0,
                        remote_traceback=None,
                    ),
                )
            results.append(torch.load(path, map_location="cpu", weights_only=False))
        return results
    finally:
        # Reached on success (no-op), on error, and on KeyboardInterrupt in the parent.
        _terminate(procs)


def run_on_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
    start_method: str = "fork",
    num_threads: int | None = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return results by rank.

    Each rank is a fresh process (``start_method``) that sets ``torch.set_num_threads(num_threads)``
    (``None`` keeps the inherited setting), for ``"nccl"`` binds ``cuda:rank``, joins a default
    process group of ``backend`` via ``tcp://127.0.0.1:<free port>`` with ``timeout_s``, runs
    ``fn``, and destroys the group. Results may be any picklable value; tensors inside
    lists/tuples/dicts/dataclasses are detached and copied to CPU (:func:`to_cpu`).

    With ``start_method="spawn"`` or ``"forkserver"``, ``fn`` and ``args`` must be picklable
    (e.g. a module-level function) and the ranks pay a fresh ``import torch`` (seconds); those
    methods also start multiprocessing's helper process (resource tracker / fork server), which
    lives until the parent exits. ``"fork"`` (the default, ~0.1 s per world) accepts closures
    but needs ``num_threads=1`` (see the module docstring).

    Raises:
        ValueError: bad arguments; ``fn``/``args`` not picklable for spawn/forkserver; fork with
            more than one thread per rank under OpenMP.
        RuntimeError: a default process group is live in the parent while forking; NCCL without
            enough CUDA devices; CUDA already initialized in the parent while forking NCCL ranks.
        RankFailedError: a rank raised (message has its rank and full traceback) or died
            (message has its exit code or signal). The other ranks are terminated.
        WorldTimeoutError: the world did not finish within ``timeout_s`` (all ranks killed).
    """
    _validate(fn, world_size, args, backend, timeout_s, start_method, num_threads)
    args = tuple(args)
    _check_environment(backend, world_size, start_method, num_threads)
    if start_method != "fork":
        try:
            pickle.dumps((fn, args))
        except Exception as exc:
            raise ValueError(
                f"with start_method={start_method!r}, fn and args must be picklable "
                f"(use a module-level function, or start_method='fork'): {exc}"
            ) from exc

    ctx = multiprocessing.get_context(start_method)
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="autoparallel-world-", ignore_cleanup_errors=True) as d:
        for attempt in range(2):
            workdir = os.path.join(d, f"attempt{attempt}")
            os.mkdir(workdir)
            outcome = _run_once(
                ctx,
                fn,
                world_size,
                args,
                backend,
                timeout_s,
                num_threads,
                deadline,
                _find_free_port(),
                workdir,
            )
            if isinstance(outcome, list):
                return outcome
            if outcome.kind == "port_in_use" and attempt == 0:
                continue  # the free port was taken before rank 0 bound it: retry once
            assert outcome.error is not None
            raise outcome.error
    raise AssertionError("unreachable")
