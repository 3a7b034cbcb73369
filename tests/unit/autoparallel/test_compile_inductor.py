"""autoparallel_backend(compiler="inductor") on CPU in seconds: Inductor's inner compile is stubbed
(it runs the graph it is given, so no C++ toolchain or triton is needed); everything before it -
Dynamo, AOT, Inductor's decompositions and joint-graph passes, our partitioner, the config patches
handed to compile_fx - is the real code path."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.compile_fx
from functorch.compile import make_boxed_func
from torch import nn

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.compile import OVERLAP_PATCH, OVERLAP_SCHEDULING_PATCHES, autoparallel_backend

_overlap = torch._inductor.config.aten_distributed_optimizations
EXPECTED = {k.partition(".")[2]: v for k, v in OVERLAP_SCHEDULING_PATCHES.items()}


class _SumNet(nn.Sequential):
    """Linear -> ReLU -> Linear, summed: a loss whose backward AOT compiles lazily (ReLU: its
    decomposed backward is exact, so the stubbed compile is bitwise equal to eager)."""

    def __init__(self):
        super().__init__(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return super().forward(x).sum()


class StubInnerCompile:
    """Stands in for ``torch._inductor.compile_fx.compile_fx_inner``: records what each compile
    saw (stage, the overlap settings in force, the graph) and runs the graph as it is."""

    def __init__(self):
        self.compiles: list[dict] = []

    def __call__(self, gm, example_inputs, **kwargs):
        self.compiles.append(
            {
                "stage": "backward" if kwargs.get("is_backward") else "forward",
                "overlap": {k: getattr(_overlap, k) for k in EXPECTED},
                "partitioner": torch._inductor.config.custom_partitioner_fn,
                "gm": gm,
            }
        )
        return make_boxed_func(gm.forward)

    def stages(self) -> list[str]:
        return [c["stage"] for c in self.compiles]


@pytest.fixture
def inner(monkeypatch):
    stub = StubInnerCompile()
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", stub)
    torch._dynamo.reset()
    # no cache: a cache hit would skip the partitioner and the inner compile this test observes
    with torch._inductor.config.patch(force_disable_caches=True):
        yield stub
    torch._dynamo.reset()


def _step(backend, on_forward=None):
    torch.manual_seed(0)
    mod = _SumNet()
    loss = torch.compile(mod, backend=backend)(torch.randn(2, 8))
    if on_forward is not None:
        on_forward()
    loss.backward()
    return mod, loss


def test_inductor_overlap_config_in_force_when_the_lazy_backward_compiles(inner):
    """#483 on the Inductor path: compile_fx gets the overlap settings as config_patches, so they
    are in force when AOT compiles the backward on the first .backward(), and nowhere else."""
    between = {}

    def after_forward():
        between["stages"] = inner.stages()
        between["overlap"] = _overlap.enable_overlap_scheduling

    assert _overlap.enable_overlap_scheduling is False
    _step(autoparallel_backend(compiler="inductor", overlap_scheduling=True), after_forward)
    assert between == {"stages": ["forward"], "overlap": False}  # backward still to compile; not leaked
    assert inner.stages() == ["forward", "backward"]
    for c in inner.compiles:
        assert c["overlap"] == EXPECTED, c["stage"]
    assert _overlap.enable_overlap_scheduling is False


def test_without_the_patch_the_backward_compiles_without_overlap(inner):
    """What the guard above catches: the pre-fix context manager has exited by the backward."""
    with patches.disabled(OVERLAP_PATCH):
        _step(autoparallel_backend(compiler="inductor", overlap_scheduling=True))
    forward, backward = inner.compiles
    assert forward["overlap"] == EXPECTED
    assert backward["overlap"]["enable_overlap_scheduling"] is False


def test_inductor_partitioner_wiring(inner):
    """Our partitioner is installed for this compile only, its labelled graphs are what Inductor's
    inner compile receives, and the compiled step computes what eager does."""
    partitions, compiled_by_stage = [], {}
    backend = autoparallel_backend(
        compiler="inductor",
        enable_ac=True,
        on_partition=lambda fw, bw: partitions.append((fw, bw)),
        on_compile=lambda stage, gm: compiled_by_stage.setdefault(stage, gm),
    )
    mod, loss = _step(backend)
    assert len(partitions) == 1 and inner.stages() == ["forward", "backward"]
    fw, bw = partitions[0]
    for compiled, ours in zip(inner.compiles, (fw, bw), strict=True):  # AOT hands over a copy
        assert str(compiled["gm"].graph) == str(ours.graph)
        assert compiled["gm"].meta[M.GM_STAGE] == ours.meta[M.GM_STAGE] == f"second_compile/{compiled['stage']}"
        assert compiled_by_stage[compiled["stage"]] is compiled["gm"]  # on_compile wraps the inner compile
    roles = [n.meta.get(M.ROLE) for n in fw.graph.find_nodes(op="placeholder")]
    assert roles == ["param:0.weight", "param:0.bias", None, "param:2.weight", "param:2.bias"]  # x: no role
    assert type(inner.compiles[0]["partitioner"]).__name__ == "_Partitioner"  # installed while compiling
    assert inner.compiles[1]["partitioner"] is None  # gone by the lazy backward compile
    assert torch._inductor.config.custom_partitioner_fn is None
    assert torch._functorch.config.joint_custom_pass is None
    torch.manual_seed(0)
    ref = _SumNet()
    ref_loss = ref(torch.randn(2, 8))
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, p), q in zip(mod.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
