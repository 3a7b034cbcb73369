"""Hugging Face transformers architectures (``verify.hf``: tiny configs, the library's defaults,
dropout on) through every stage on gloo: bitwise against the eager parallel program, and the
oracle. The matrix is CI's slow step (two architectures also run in the tier); an architecture
that cannot pass is a strict xfail carrying the reason, never a silent skip. README: the table.
"""

from __future__ import annotations

import importlib.util

import pytest
from torch import nn

from verify.hf import ARCHS, hf_case

# Looked up, not imported: importing transformers costs each xdist worker ~0.5 s of collection,
# and only the worker that runs the tier's cells (one xdist group, TIER_GROUP) needs it.
if importlib.util.find_spec("transformers") is None:
    pytest.skip("the Hugging Face matrix needs the hf extra: pip install -c constraints.txt -e '.[hf]'", allow_module_level=True)

# Why an architecture cannot pass a plan yet (measured with transformers 5.24.0); absent: it passes.
NOT_YET: dict[str, dict[str, str]] = {
    "fsdp dp=2": {},
    "auto dp=2,tp=2": {
        **dict.fromkeys(("gpt_neo", "falcon"), (
            "the planner cannot place a lifted tensor constant (get_attr '_tensor_constant0': a tensor the model "
            "builds from Python data in forward)")),
        **dict.fromkeys(("mixtral", "qwen2_moe"), (
            "the planner has no sharding strategy for transformers.grouped_mm_fallback (the MoE experts' custom op)")),
        "swin": "the planner has no sharding strategy for aten.as_strided",
    },
}
# In the tier: a decoder LM through transformers' mask code with its default dropout on (the cheapest
# such: opt, bert, distilbert cost more), and a BatchNorm image model.
TIER = ("gpt2", "resnet")
TIER_GROUP = "hf-tier"  # one worker imports transformers for the tier


def _cases():
    for label, reasons in NOT_YET.items():
        plan, mesh = label.split()
        for arch in ARCHS:
            tier = plan == "fsdp" and arch in TIER
            marks = [pytest.mark.xdist_group(TIER_GROUP if tier else f"hf-{arch}")]
            if not tier:
                marks.append(pytest.mark.slow)
            if arch in reasons:
                marks.append(pytest.mark.xfail(strict=True, reason=reasons[arch]))
            yield pytest.param(arch, plan, mesh, marks=marks, id=f"{arch}-{plan}-{mesh}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("arch", "plan", "mesh"), list(_cases()))
def test_architecture_is_bitwise_at_every_stage_and_passes_the_oracle(arch, plan, mesh, model_check):
    model_check(hf_case(arch), plan=plan, mesh=mesh)


@pytest.mark.xdist_group(TIER_GROUP)
def test_the_tier_trains_an_architecture_that_draws_dropout_at_its_defaults():
    """The models users bring train with dropout on; so does one of the tier's cells (falcon and
    resnet, the tier's cells before, draw none at their library defaults)."""
    drawing = [a for a in TIER if any(isinstance(m, nn.Dropout) and m.p > 0 for m in hf_case(a).build().modules())]
    assert drawing, f"no architecture of the tier {TIER} draws dropout at its defaults"
