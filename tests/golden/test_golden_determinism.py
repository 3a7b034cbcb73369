"""The same golden text comes out of any process: hash seed and group creation order do not leak.

One side runs in this process, the other in a fresh interpreter with another PYTHONHASHSEED and
three unrelated process groups created first (so every mesh group name shifts). The test checks
that the two processes really hashed strings differently and named their groups differently.
"""

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel.mesh import fake_world
from verify.goldens import graph_golden_text
from verify.stages.scenario import Scenario

HASH_PROBE = "autoparallel golden determinism"
# The fresh interpreter runs golden_text() of this very file.
SCRIPT = "import json, runpy, sys; f = runpy.run_path(sys.argv[1])['golden_text']; print(json.dumps(f(int(sys.argv[2]))))"


def golden_text(shift: int) -> tuple[str, list[str], int]:
    """The joint graph's golden text after ``shift`` unrelated groups, the mesh's group names, and
    this process's hash of HASH_PROBE."""
    sc = Scenario(preset="tiny", plan="fsdp_tp", mesh="dp=2,tp=2")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        for _ in range(shift):
            dist.new_group([0, 1])  # unrelated groups first: every mesh group name shifts
        with fake_world(sc.mesh_spec) as mesh, sc.trace(mesh) as jg:
            text = graph_golden_text("determinism", {"stage": "joint"}, jg.gm)
            return text, sorted(mesh.group_dims), hash(HASH_PROBE)
    finally:
        dist.destroy_process_group()


# Fresh interpreters are the point (hash seeds, group creation order): ~15 CPU-s of imports and
# traces. CI runs it in its slow step (.ci/run: pytest -m slow --ap-run-slow).
@pytest.mark.slow
def test_same_golden_across_hash_seeds_and_group_creation_order():
    seed = "12345" if os.environ.get("PYTHONHASHSEED") != "12345" else "54321"
    env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(  # runs while this process traces
        [sys.executable, "-c", SCRIPT, __file__, "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        text_a, groups_a, probe_a = golden_text(0)
    finally:
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    text_b, groups_b, probe_b = json.loads(out.splitlines()[-1])
    assert probe_a != probe_b, "the second process must hash strings differently (another PYTHONHASHSEED)"
    assert groups_a != groups_b, "the second process must see different process-group names"
    assert text_a.startswith("# autoparallel golden v1")
    assert text_a == text_b
