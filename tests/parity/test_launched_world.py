"""Parity worlds inside a launched job (torchrun), on this CPU with gloo.

Every parity world goes through ``verify.parity.ordered_collectives.run_parity_world``, which runs
the same per-rank body on the launched world under torchrun (``autoparallel.runtime.launched``)
and forks one otherwise. Each torchrun run is a fresh session of processes: after it, none of
them may be left (``_survivors``). The quick tier keeps the environment's parsing, the mesh
mismatch and one 4-rank standalone job; the faults and the two-agent world are ``slow``
(torchrun starts in seconds on each).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoparallel.runtime.launched import LaunchedWorld, check_world_size, launched_world
from verify.commands.report import parity_mesh
from autoparallel.mesh import MeshSpec

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PROBE = ["-m", "verify.parity.launched_probe"]
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _survivors(sid: int) -> list[str]:
    """The processes of session ``sid`` still alive (zombies included), from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            out.append(f"{d.name} {stat[:stat.rindex(')') + 1]}")
    return out


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ENV_KEYS}


def _launch(*argvs: list[str], timeout: float) -> list[tuple[int, str, float]]:
    """Run each argv (torchrun agents) in its own session, at once; (exit status, output,
    seconds) each. Fails when one outlives ``timeout`` or leaves a process behind."""
    t0 = time.monotonic()
    procs = [subprocess.Popen(a, cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for a in argvs]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            pytest.fail(f"{' '.join(p.args)} did not end within {timeout} s")
        out.append((p.returncode, text, time.monotonic() - t0))
    time.sleep(0.5)  # the agent reaps its workers before it exits; give the kernel a moment
    for p in procs:
        left = _survivors(p.pid)
        assert not left, f"processes left behind by {' '.join(p.args)}:\n" + "\n".join(left)
    return out


# --- no torchrun: the environment and the mesh ------------------------------------------------------


def test_the_launched_world_is_read_from_torchruns_environment(monkeypatch):
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    assert launched_world() is None
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "job7"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launched_world() == LaunchedWorld(3, 4, 1, "node0:29500", "job7")
    assert parity_mesh(MeshSpec.parse("dp=4,tp=2")) == MeshSpec.parse("dp=4,tp=2"), "a launched job runs its whole mesh"
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ValueError, match="MASTER_ADDR missing"):
        launched_world()


def test_the_forked_report_cuts_the_mesh_unless_asked_for_all_of_it(monkeypatch):
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    spec = MeshSpec.parse("dp=4,tp=2")
    assert parity_mesh(spec) == MeshSpec.parse("dp=2,tp=2")
    assert parity_mesh(spec, full=True) == spec


def test_a_mesh_that_is_not_the_launched_world_is_one_line_naming_both():
    world = LaunchedWorld(0, 2, 0, "localhost:1", "r")
    check_world_size(world, 2)
    with pytest.raises(ValueError) as info:
        check_world_size(world, 4, "--mesh dp=4")
    msg = str(info.value)
    assert "\n" not in msg and "--mesh dp=4 needs 4 ranks" in msg and "WORLD_SIZE=2" in msg


# --- torchrun on this CPU ------------------------------------------------------------------------------

needs_torchrun = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("true") is None,
                                    reason="torchrun fault tests read /proc (Linux)")


@needs_torchrun
@pytest.mark.timeout(180)
def test_standalone_torchrun_runs_the_world_on_its_own_four_ranks():
    ((rc, out, _),) = _launch([*TORCHRUN, "--standalone", "--nproc-per-node", "4", *PROBE], timeout=150)
    assert rc == 0, out
    assert "probe ok: 10 on 4 ranks (gloo)" in out, out  # 1+2+3+4, printed by rank 0 alone
    assert out.count("probe ok") == 1, out


@needs_torchrun
@pytest.mark.slow
@pytest.mark.slow_full  # 21 s of torchrun start-up; the refusal's line: the tier's test above, in process
@pytest.mark.timeout(180)
def test_the_report_refuses_a_mesh_that_is_not_the_launched_world_on_every_rank():
    ((rc, out, _),) = _launch([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "verify", "report",
                               "--preset", "tiny", "--mesh", "dp=4"], timeout=150)
    assert rc != 0
    assert out.count("error: --mesh dp=4 needs 4 ranks but this job launched WORLD_SIZE=2") == 2, out


@needs_torchrun
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_torchrun_agents_make_one_world():
    port = _free_port()
    agent = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"two-agents-{port}", *PROBE]
    (rc0, out0, _), (rc1, out1, _) = _launch(agent, agent, timeout=180)
    assert (rc0, rc1) == (0, 0), out0 + out1
    assert (out0 + out1).count("probe ok: 10 on 4 ranks (gloo)") == 1, out0 + out1


FAULTS = {
    # fault: (what names the rank, the timeout given); "exit"'s peers are stopped by the agent at once
    "raise": ("rank 2 of the launched world raised ValueError: probe fault: rank 2 raises", 30),
    "kill": ("exitcode  : -9", 30),
    "hang": ("rank(s) [2] of the launched world stopped answering", 5),
}


@needs_torchrun
@pytest.mark.slow
@pytest.mark.timeout(180)
# kill outside CI's slow step (slow_full, 13 s): torchrun's own summary names the rank that died;
# raise and hang keep our code's naming of a failing rank in CI.
@pytest.mark.parametrize("fault", [pytest.param(f, marks=[pytest.mark.slow_full] if f == "kill" else []) for f in FAULTS])
def test_a_failing_rank_ends_the_job_on_every_rank_and_is_named(fault):
    named, timeout = FAULTS[fault]
    ((rc, out, seconds),) = _launch([*TORCHRUN, "--standalone", "--nproc-per-node", "4", *PROBE, "--fault", fault,
                                     "--fault-rank", "2", "--timeout", str(timeout)], timeout=150)
    assert rc != 0, out
    assert named in out, out
    root = out[out.index("Root Cause"):]
    assert "rank      : 2" in root or fault == "hang", out  # torchrun's own summary names the rank that died
    print(f"{fault}: failed after {seconds:.1f} s (timeout {timeout} s)")


@needs_torchrun
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_node_that_never_joins_ends_the_agent_within_its_join_timeout():
    port = _free_port()
    ((rc, out, seconds),) = _launch([*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                     "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"never-{port}",
                                     "--rdzv-conf", "join_timeout=5", *PROBE], timeout=120)
    assert rc != 0
    assert "RendezvousTimeoutError" in out, out
    assert "probe ok" not in out
    print(f"node never joins: the agent failed after {seconds:.1f} s (join_timeout 5 s)")
