"""The same golden text comes out of any process: hash seed and group creation order do not leak."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from autoparallel.mesh import fake_world
    from verify.goldens import graph_golden_text
    from verify.scenario import Scenario

    shift = int(sys.argv[1])
    sc = Scenario(preset="tiny", plan="fsdp_tp", mesh="dp=2,tp=2")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    for _ in range(shift):
        dist.new_group([0, 1])  # unrelated groups first: every mesh group name shifts
    with fake_world(sc.mesh_spec) as mesh:
        print(sorted(mesh.group_dims), file=sys.stderr)
        with sc.trace(mesh) as jg:
            sys.stdout.write(graph_golden_text("determinism", {"stage": "joint"}, jg.gm))
    dist.destroy_process_group()
    """
)


def _start(hash_seed: str, shift: int) -> subprocess.Popen:
    env = {"PYTHONHASHSEED": hash_seed, "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(shift)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return out, err.strip().splitlines()[-1]


def test_same_golden_across_hash_seeds_and_group_creation_order():
    procs = [_start("0", 0), _start("12345", 3)]  # concurrently: each pays torch's import
    (text_a, groups_a), (text_b, groups_b) = (_result(p) for p in procs)
    assert groups_a != groups_b, "the second process must see different process-group names"
    assert text_a.startswith("# autoparallel golden v1")
    assert text_a == text_b
