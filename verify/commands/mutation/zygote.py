"""Guard runs forked from one process that has already imported torch, the project and pytest.

Each disabled run of ``verify mutate`` must be a fresh process: the patch is switched off through
its environment (``AUTOPARALLEL_DISABLE``, which ``autoparallel.patches`` reads when a patch is
asked about, never at import), and no state may leak from one patch's guards into another's. A
fresh ``python -m pytest`` spends most of a short guard run importing: torch, ``torch._dynamo``, the
project, hypothesis and pytest's plugins (a solver guard: 9.6 s as a subprocess, 1.6-2.1 s forked
from a process that had imported them, 2026-11-29). A zygote imports them once, then forks one
child per run. The child is a fresh process as far as the guards can tell: its own session (a
timeout kills its whole process group, rank worlds included), the run's environment and working
directory, stdout and stderr to the run's file, and ``pytest.main``; it writes pytest's exit code
to a file before it exits, so a child that is killed or dies leaves none.

The zygote is single-threaded (it forks), reads one JSON request per line on stdin and answers
each with the child's pid; children are reaped by ignoring SIGCHLD. :class:`Zygote` is the parent's
side, a context manager: the zygote is gone when the ``with`` ends.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

# What every guard run imports anyway; a module that fails to import here is imported by the run
# itself (the zygote only warns), so the list can never decide an outcome.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "pytest", "xdist", "hypothesis", "syrupy",
           "autoparallel.pipeline", "verify.parity.runs", "verify.pytest_plugin")

POLL_S = 0.05


def _child(request: dict) -> None:
    """In the forked child: become the run, then exit with pytest's code (never return)."""
    rc = 3
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote ignores it; the run's own children are waited for
        os.setsid()
        os.chdir(request["cwd"])
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["pytest", *request["args"]]
        import pytest

        rc = int(pytest.main(list(request["args"])))
    except BaseException:  # noqa: BLE001  (anything: the run's output says what, its code is 3)
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            Path(request["rc"]).write_text(str(rc))
        finally:
            os._exit(rc)


def serve(preload: tuple[str, ...]) -> None:
    """The zygote's loop: import ``preload``, say ``ready``, then fork a child per request."""
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            print(f"zygote: not preloaded {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    channel = sys.stdout
    channel.write("ready\n")
    channel.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        channel.write(json.dumps({"pid": pid}) + "\n")
        channel.flush()


class Zygote:
    """The parent's side: ``run(args, env, cwd, timeout_s)`` is ``python -m pytest *args`` as a
    fresh process in ``cwd`` with exactly ``env``, forked from the zygote; it returns
    ``(exit code or None when killed at its limit or dead without one, timed_out, output)``.
    Thread-safe: runs may overlap (``verify mutate -j``)."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, *, tmp: Path):
        self.preload = tuple(preload)
        self.tmp = Path(tmp)
        self._lock = threading.Lock()
        self._count = 0
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Zygote:
        code = f"from verify.commands.mutation.zygote import serve; serve({self.preload!r})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, start_new_session=True)
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            self.__exit__(None, None, None)
            raise RuntimeError(f"the mutation zygote did not start (said {ready!r})")
        return self

    def __exit__(self, *exc) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()

    def _fork(self, request: dict) -> int:
        with self._lock:
            if self._proc is None:
                raise RuntimeError("Zygote.run outside its with block")
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            return int(json.loads(self._proc.stdout.readline())["pid"])

    def run(self, args: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> tuple[int | None, bool, str]:
        with self._lock:
            self._count += 1
            stem = self.tmp / f"run{self._count}"
        out, rc_file = stem.with_suffix(".out"), stem.with_suffix(".rc")
        pid = self._fork({"args": list(args), "env": dict(env), "cwd": str(cwd), "out": str(out), "rc": str(rc_file)})
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while _alive(pid) and not rc_file.exists():
            if time.monotonic() > deadline:
                timed_out = True
                _kill_group(pid)
                break
            time.sleep(POLL_S)
        _wait_gone(pid)  # the code is written before the child exits: let it finish exiting
        code = int(rc_file.read_text()) if rc_file.exists() and not timed_out else None
        output = out.read_text(errors="replace") if out.exists() else ""
        return code, timed_out, output


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int, limit_s: float = 10.0) -> None:
    end = time.monotonic() + limit_s
    while _alive(pid) and time.monotonic() < end:
        time.sleep(POLL_S)
    if _alive(pid):  # wrote its code but hangs on exit (a leftover thread): its group goes
        _kill_group(pid)
