"""autoparallel_backend: overlap settings that outlive the backend call, the AC joint pass, scoping."""

import pytest
import torch
import torch._dynamo
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel.compile import OVERLAP_SCHEDULING_PATCHES, ac_joint_pass, autoparallel_backend
from autoparallel.fx_utils import ALL_GATHER, WAIT

aten = torch.ops.aten
_overlap = torch._inductor.config.aten_distributed_optimizations


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile_and_step(backend):
    torch.manual_seed(0)
    mod = _MLP()
    loss = torch.compile(mod, backend=backend)(torch.randn(2, 8))
    after_forward = _overlap.enable_overlap_scheduling
    loss.backward()
    return mod, after_forward


def test_overlap_config_in_force_when_backward_compiles(fresh_dynamo):
    """#483: the backward is compiled lazily, on the first .backward(), after the backend returned.
    The overlap settings must be in force at that moment, and nowhere else."""
    seen = {}

    def on_compile(stage, gm):
        seen[stage] = {k.partition(".")[2]: getattr(_overlap, k.partition(".")[2]) for k in OVERLAP_SCHEDULING_PATCHES}

    assert _overlap.enable_overlap_scheduling is False
    _, after_forward = _compile_and_step(autoparallel_backend(overlap_scheduling=True, on_compile=on_compile))
    assert set(seen) == {"forward", "backward"}, "the backward was not compiled lazily on .backward()"
    assert after_forward is False  # not leaked into the caller between forward and backward
    expected = {k.partition(".")[2]: v for k, v in OVERLAP_SCHEDULING_PATCHES.items()}
    assert seen["forward"] == expected
    assert seen["backward"] == expected
    assert _overlap.enable_overlap_scheduling is False


def test_overlap_off_by_default(fresh_dynamo):
    seen = {}
    _compile_and_step(autoparallel_backend(on_compile=lambda stage, gm: seen.setdefault(stage, _overlap.enable_overlap_scheduling)))
    assert seen == {"forward": False, "backward": False}


def test_backend_scopes_its_config_and_matches_eager(fresh_dynamo):
    mod, _ = _compile_and_step(autoparallel_backend(enable_ac=True))
    assert torch._functorch.config.joint_custom_pass is None
    assert torch._inductor.config.custom_partitioner_fn is None
    torch.manual_seed(0)
    ref = _MLP()
    ref(torch.randn(2, 8)).backward()
    for (name, p), q in zip(mod.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_unknown_compiler_is_an_error():
    with pytest.raises(ValueError, match="unknown compiler 'eager'"):
        autoparallel_backend(compiler="eager")


def _joint_for_ac():
    """fwd: ag(w)->wait->t ; mm(x, t) ; mm(., t2) ; sdpa-free ; bwd: uses every forward value."""
    g = fx.Graph()

    def ph(name, *shape):
        n = g.placeholder(name)
        n.meta[M.VAL] = torch.empty(*shape, device="meta")
        return n

    def op(target, args, *shape):
        n = g.call_function(target, args)
        n.meta[M.VAL] = torch.empty(*shape, device="meta")
        return n

    w, x, tan = ph("primals_1", 2, 4), ph("primals_2", 3, 4), ph("tangents_1", 3, 4)
    ag = op(ALL_GATHER, (w, 2, "dp"), 4, 4)
    ag.meta[M.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    ag.meta[M.AC_GRAPH_ID] = M.AP_AC_GRAPH_ID
    wait = op(WAIT, (ag,), 4, 4)
    t = op(aten.t.default, (wait,), 4, 4)
    mm1 = op(aten.mm.default, (x, t), 3, 4)
    act = op(aten.relu.default, (mm1,), 3, 4)
    mm2 = op(aten.mm.default, (act, t), 3, 4)
    mm3 = op(aten.mm.default, (mm2, t), 3, 4)
    bw = op(aten.mul.Tensor, (tan, mm3), 3, 4)
    bw2 = op(aten.mul.Tensor, (bw, act), 3, 4)
    bw3 = op(aten.mul.Tensor, (bw2, mm2), 3, 4)
    g.output((mm3, bw3))
    return fx.GraphModule(nn.Module(), g), dict(ag=ag, wait=wait, t=t, mm1=mm1, act=act, mm2=mm2, mm3=mm3, bw=bw)


def test_ac_joint_pass_policy():
    gm, n = _joint_for_ac()
    ac_joint_pass(gm)
    policy = {k: v.meta.get(M.RECOMPUTE) for k, v in n.items()}
    assert policy["ag"] is CheckpointPolicy.MUST_RECOMPUTE  # pre-existing tags are kept
    assert policy["wait"] is None  # collectives are never AC candidates
    assert policy["mm1"] is CheckpointPolicy.MUST_SAVE and policy["mm3"] is CheckpointPolicy.MUST_SAVE
    assert policy["mm2"] is CheckpointPolicy.PREFER_RECOMPUTE  # every other mm is recomputed
    assert policy["act"] is CheckpointPolicy.PREFER_RECOMPUTE and policy["t"] is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy["bw"] is None  # backward nodes are never tagged
    assert all(v.meta[M.AC_GRAPH_ID] == M.AP_AC_GRAPH_ID for k, v in n.items() if v.meta.get(M.RECOMPUTE) and k != "ag")


class _FSDPToy(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mse(out, target):
    return ((out - target) ** 2).mean()


@pytest.mark.slow
def test_inductor_backend_smoke(fresh_dynamo):
    """Inductor compiles both partitions of a ParallelModule on CPU (cold, caches off) with the
    replay partitioner installed, and agrees with the first partition to float tolerance
    (Inductor fuses and reorders, so not bitwise). A two-layer FSDP model keeps the C++ kernel
    count (and the cold compile) small."""
    from autoparallel.mesh import fake_world
    from autoparallel.parallelize import (
        ParallelPlan,
        ParallelProgram,
        build_joint_graph,
        split_batch,
    )
    from autoparallel.partition import apply_placement

    torch.manual_seed(0)
    model, plan = _FSDPToy(), ParallelPlan.fsdp()
    batch = (torch.randn(4, 16), torch.randn(4, 8))
    partitions = []
    with fake_world("dp=1") as mesh:  # one rank: the collectives are identities
        program = ParallelProgram(model, plan, mesh, _mse)
        params = {k: v.detach().clone() for k, v in program.local_parameters().items()}
        mod = apply_placement(build_joint_graph(model, plan, mesh, batch, _mse), params)
        inputs = split_batch(batch, plan, mesh.spec, mesh.coordinate())
        ref = mod(*inputs)
        ref.backward()
        ref_grads = {k: p.grad.clone() for k, p in mod.local_parameters().items()}
        mod.zero_grad(set_to_none=True)
        backend = autoparallel_backend(compiler="inductor", on_partition=lambda fw, bw: partitions.append(fw))
        with torch._inductor.config.patch(force_disable_caches=True, compile_threads=1):
            loss = torch.compile(mod, backend=backend)(*inputs)
            loss.backward()
    assert len(partitions) == 1
    assert torch._inductor.config.custom_partitioner_fn is None
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for k, p in mod.local_parameters().items():
        torch.testing.assert_close(p.grad, ref_grads[k], rtol=1e-4, atol=1e-6)
