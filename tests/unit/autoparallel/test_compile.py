"""autoparallel_backend: overlap settings that outlive the backend call, the AC joint pass installed, scoping;
the second compile's placeholder roles (tangents by AOT's descriptors)."""

import pytest
import torch
import torch._dynamo
from torch import fx, nn

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.compile import OVERLAP_SCHEDULING_PATCHES, autoparallel_backend, second_compile_placeholder_roles
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph, split_batch
from autoparallel.partition import apply_placement

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


@pytest.mark.slow
def test_inductor_backend_smoke(fresh_dynamo, mlp):
    """Inductor compiles both partitions of a ParallelModule on CPU (cold, caches off) with the
    replay partitioner installed, and agrees with the first partition to float tolerance
    (Inductor fuses and reorders, so not bitwise). A two-layer FSDP model keeps the C++ kernel
    count (and the cold compile) small."""
    torch.manual_seed(0)
    make_model, _mse = mlp
    model, plan = make_model(), ParallelPlan.fsdp()
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


# --- the second compile's placeholder roles (patch tangent_roles) -------------------------------------


def _aot_placeholders(with_descriptors: bool, tangents: int = 2):
    """A joint graph's placeholders as AOT names them: a parameter, then the tangents of (with two)
    the parameter's new value and the loss, in AOT's order, with or without their descriptors."""
    from torch._functorch._aot_autograd import descriptors as D

    g = fx.Graph()
    g.placeholder("primals_1").meta[M.DESC] = D.PlainAOTInput(0)
    outputs = [D.InputMutationAOTOutput(D.PlainAOTInput(0)), D.PlainAOTOutput(0)][-tangents:]
    for k, out in enumerate(outputs):
        ph = g.placeholder(roles.aot_tangent_name(k))
        if with_descriptors:
            ph.meta[M.DESC] = D.TangentAOTInput(out)
    g.output(None)
    return fx.GraphModule(nn.Module(), g)


def test_the_second_compile_labels_tangents_by_their_descriptors():
    """AOT puts the tangent of a parameter's new value before the loss's: ``tangents_1`` is not the
    loss's (it was labelled so, and ``tangents_2`` left unlabelled: gemma3n_text's failure)."""
    got = second_compile_placeholder_roles(_aot_placeholders(True), [roles.param("w")])
    assert got == {"primals_1": roles.param("w"), "tangents_1": roles.tangent(roles.mutated("w")),
                   "tangents_2": roles.tangent(roles.LOSS)}


def test_a_tangent_without_a_descriptor_stays_unlabelled_unless_it_is_the_only_one():
    """Two tangents and no descriptors: nothing says which is the loss's, so neither is labelled and
    the executors refuse them by name; a lone tangent is the loss's."""
    got = second_compile_placeholder_roles(_aot_placeholders(False), [roles.param("w")])
    assert got == {"primals_1": roles.param("w")}
    alone = second_compile_placeholder_roles(_aot_placeholders(False, tangents=1), [roles.param("w")])
    assert alone["tangents_1"] == roles.tangent(roles.LOSS)
