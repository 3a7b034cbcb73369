"""Check your own model (verify/check.py, the model_check fixture, report --model): the README's
example, taken from README.md so it cannot drift, run through the fixture and the command line;
ModelCase references and check_model's input errors.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from autoparallel.parallelize import ParallelPlan
from autoparallel.pipeline import STAGE_NAMES
import verify.check as check
from verify import zoo
from verify.__main__ import main
from verify.check import ModelCheck, check_model
from verify.model_case import ModelCase, load_case
from verify.parity.compare import OracleReport, OracleTolerance, check_within, compare_tensors
from verify.parity.planned import planned_case
from verify.stages.scenario import Scenario

README = Path(__file__).resolve().parents[3] / "README.md"
MODULE = "ap_readme_models"  # the README calls it my_models.py


def readme_block(marker: str, lang: str) -> str:
    """The fenced ``lang`` block after ``<!-- marker -->`` in README.md."""
    text = README.read_text(encoding="utf-8")
    m = re.search(rf"<!-- {re.escape(marker)} -->\n```{lang}\n(.*?)```", text, re.S)
    assert m, f"README.md has no ```{lang} block after <!-- {marker} -->"
    return m.group(1)


@pytest.fixture(scope="module")
def readme_module(tmp_path_factory):
    """The README's example as an importable module (``ap_readme_models``)."""
    code = readme_block("check-own-model", "python")
    assert len(code.splitlines()) < 30, "the README promises a complete example under 30 lines"
    path = tmp_path_factory.mktemp("readme")
    (path / f"{MODULE}.py").write_text(code, encoding="utf-8")
    sys.path.insert(0, str(path))
    try:
        yield importlib.import_module(MODULE)
    finally:
        sys.path.remove(str(path))
        sys.modules.pop(MODULE, None)


pytestmark = pytest.mark.xdist_group("readme-model")  # one pipeline run serves the module


def test_readme_example_passes_through_the_fixture(readme_module, model_check, shared_pipeline_runs):
    readme_module.test_tiny_convnet(model_check)  # fails the test unless every stage is bitwise and the oracle passes


def test_readme_command_line_runs_the_same_model(readme_module, capsys, shared_pipeline_runs):
    argv = readme_block("check-own-model-cli", "bash").split()
    assert argv[:3] == ["python", "-m", "verify"] and "my_models:case" in argv
    argv = [a.replace("my_models", MODULE) for a in argv[3:]]
    assert main([*argv, "--no-parity", "--json"]) == 0  # parity: the fixture test above
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "tiny_convnet" and report["preset"] is None and report["mesh"] == "dp=2"
    assert report["params"] == {"count": 6, "fsdp_sharded": 6, "without_grad": {}}
    assert [s["name"] for s in report["stages"]][:3] == ["joint", "cleanup", "fsdp_tagging"]


def test_model_check_keeps_a_golden_per_stage(readme_module, model_check, golden, shared_pipeline_runs):
    result = model_check(readme_module.case, plan="fsdp", mesh="dp=2", parity=False, golden=golden)
    assert list(result.golden_texts()) == list(STAGE_NAMES)
    assert "model: tiny_convnet" in result.golden_texts()["joint"]


def test_load_case_names_what_is_wrong():
    assert load_case("gpt2") is zoo.gpt2 and load_case("verify.zoo:convnet") is zoo.convnet
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg'"):
        load_case("no_such_pkg:case")
    with pytest.raises(ValueError, match=r"module 'verify.zoo' has no attribute 'resnet'"):
        load_case("resnet")
    with pytest.raises(ValueError, match=r"'GPT2' is a type; it must be a verify.ModelCase or a function returning one"):
        load_case("verify.zoo:GPT2")  # a model class is not a case: the loss and batches are missing


def test_check_model_input_errors_are_named():
    with pytest.raises(ValueError, match="give the loss and the batch factory, or a ModelCase"):
        check_model(zoo.GPT2)
    with pytest.raises(ValueError, match="over mesh dims 'dp' and 'tp'"):
        check_model(zoo.gpt2, plan=ParallelPlan.fsdp("data"))
    llama_regions = ModelCase("gpt2", zoo.GPT2, zoo.token_cross_entropy, zoo.gpt2_batch,
                              tp_rules=dict(zoo.gpt2.tp_rules), tp_regions=("layers.*.attention",))
    with pytest.raises(ValueError, match=r"--model gpt2: .*TP region 'layers.\*.attention' matches no module"):
        check_model(llama_regions, plan="fsdp_tp", mesh="dp=1,tp=2")
    with pytest.raises(TypeError, match="factory returned int, not an nn.Module"):
        ModelCase("bad", lambda: 3, zoo.mse_loss, zoo.ln_mlp_batch).build()
    with pytest.raises(TypeError, match=r"batch\(2\) must return a tuple of tensors"):
        ModelCase("bad", zoo.LNMLP, zoo.mse_loss, lambda n: torch.randn(n, 16)).batches(2, 1)


def test_model_check_lists_every_failure():
    scenario = Scenario(case=zoo.ln_mlp, plan="ddp", mesh="dp=2")
    good = compare_tensors({"w": torch.ones(1)}, {"w": torch.ones(1)}, a_name="eager", b_name="joint")
    bad = compare_tensors({"w": torch.ones(1)}, {"w": torch.zeros(1)}, a_name="eager", b_name="second_compile")
    oracle = OracleReport(OracleTolerance(torch.float32, 1, 1), checks=[check_within("loss", torch.tensor(1.0), torch.tensor(2.0), 1e-6)])
    result = ModelCheck(scenario, run=None, parity={"joint": good, "second_compile": bad}, oracle=oracle)
    assert not result.ok
    failures = result.failures()
    assert len(failures) == 2 and failures[0].startswith("second_compile: eager vs second_compile")
    assert "loss: |diff| 1.000e+00 > bound" in failures[1]
    with pytest.raises(AssertionError, match="model=ln_mlp plan=ddp"):
        result.assert_ok()
    assert ModelCheck(scenario, run=None, parity={"joint": good}, oracle=None).ok



# --- plan="auto" for any model ------------------------------------------------------------------------


def test_plan_auto_runs_a_users_model_with_its_own_loss(readme_module, model_check):
    """The README's convnet (BatchNorm buffers updated in place, its own loss) under plan="auto":
    the plan stage, then every later stage (the lowered joint graph, the clean-up, FSDP tags, the
    first partition, the second compile, the collective passes) bitwise against the plan's
    placements run eagerly, and the oracle. Failed before: 'unknown
    planner option(s) ['tp_regions', 'tp_rules']', then the reference's loss was output 0 (a
    BatchNorm buffer) and it applied no buffer update."""
    result = model_check(readme_module.case, plan="auto", mesh="dp=2")
    assert result.run.names[0] == "plan" and set(result.run.names[1:]) == set(STAGE_NAMES)
    assert set(result.parity) == {"joint", "cleanup", "fsdp_tagging", "first_partition", "second_compile", "collective_passes"}
    assert all(rep.bitwise for rep in result.parity.values()) and result.oracle.passed
    names = {c.name for c in result.oracle.checks}
    assert "loss" in names and "grad:bn.weight" in names


def test_plan_auto_takes_the_cases_loss_never_a_default():
    case = planned_case(Scenario(case=zoo.convnet, plan="auto", mesh="dp=2"))
    assert case.loss_fn is zoo.label_smoothing_loss
    assert Scenario(case=zoo.gpt2, plan="auto").plan_obj().tp_rules == {}  # the case's fsdp_tp rules stay out


def test_tp_rules_with_plan_auto_point_to_pins():
    with pytest.raises(ValueError, match=r"plan='auto' chooses every placement itself.*pin it \(ParallelPlan.auto\(pins="):
        check_model(zoo.ln_mlp, plan="auto", tp_rules={"blocks.*.up.weight": "colwise"})


# check_model with plan="auto" runs in the tier on a user's model with its own loss
# (test_plan_auto_runs_a_users_model_with_its_own_loss) and in the slow step on Hugging Face's gpt2
# (tests/parity/test_hf_parity.py, gpt2-auto-dp=2,tp=2): here the report's own planned path.
@pytest.mark.slow  # a planned pipeline and parity world (~12 s)
def test_plan_auto_through_the_report_on_gpt2(capsys):
    assert main(["report", "--model", "gpt2", "--plan", "auto", "--mesh", "dp=2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "gpt2" and report["planning"] is not None
    assert report["parity"]["oracle"]["passed"] and all(r["bitwise"] for r in report["parity"]["vs_eager"].values())


class _WorldStarted(Exception):
    pass


@pytest.mark.parametrize(("given", "passed"), [(900.0, {"timeout_s": 900.0}), (None, {})])
def test_plan_auto_gives_the_world_the_callers_timeout(monkeypatch, given, passed):
    """A sweep cell's --timeout bounds the planned world too (segformer's auto cell was killed by
    a fixed 300 s world limit at load 57 with 900 s given); None keeps the world's default."""
    seen = {}

    def world(case, steps, **kwargs):
        seen.update(kwargs)
        raise _WorldStarted

    monkeypatch.setattr(check, "run_scenario", lambda scenario, **kwargs: None)
    monkeypatch.setattr(check, "planned_case", lambda scenario: None)
    monkeypatch.setattr(check, "run_planned_parity", world)
    with pytest.raises(_WorldStarted):
        check_model(ModelCase("ln_mlp", zoo.LNMLP, zoo.mse_loss, zoo.ln_mlp_batch), plan="auto", mesh="dp=2,tp=2",
                    world_timeout_s=given)
    assert seen == passed
