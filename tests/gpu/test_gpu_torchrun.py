"""The launched world on NCCL: ``torchrun --standalone --nproc-per-node 2`` on two GPUs.

Each rank binds ``cuda:<LOCAL_RANK>`` and joins the launched world through ``run_gated`` (the
entry point every multigpu test and parity world shares; ``verify.parity.launched_probe``); the
CPU twin with gloo is tests/parity/test_launched_world.py. Skipped without two GPUs (the
``multigpu(2)`` marker); ``.ci/gpu`` runs it on a multi-GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _torchrun(*probe_args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "verify.parity.launched_probe", *probe_args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.multigpu(2)
@pytest.mark.timeout(300)
def test_torchrun_world_on_nccl_and_a_raising_rank_is_named():
    ok = _torchrun()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "probe ok: 3 on 2 ranks (nccl)" in ok.stdout, ok.stdout + ok.stderr
    bad = _torchrun("--fault", "raise", "--fault-rank", "1", "--timeout", "60")
    assert bad.returncode != 0
    assert "rank 1 of the launched world raised ValueError" in bad.stderr, bad.stderr
