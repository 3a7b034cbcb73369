"""python -m verify: every bad flag is one line on stderr that names the flag, exit status 2."""

import pytest

from autoparallel.defaults import BUCKET_CAP_MB, PLANS
from verify.__main__ import _parser, _report_defaults, main
from verify.check import check_model
from verify.commands.report import PARITY_MAX_PARAMS, check_parity_size, parity_memory_lower_bound
from verify.stages import defaults
from verify.stages.scenario import Scenario, parameter_count


def run(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse rejects the flag while parsing
        return e.code


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "--mesh", "dp"], "argument --mesh: bad mesh 'dp'"),
        (["report", "--preset", "huge"], "argument --preset: unknown preset 'huge'; valid presets: ['8b', 'debug', 'tiny']"),
        (["report", "--plan", "fsdp_tp", "--mesh", "dp=2,tp=3"],
         "--plan fsdp_tp --mesh dp=2,tp=3 --preset tiny: parameter 'layers.0.attention.wq.weight': dim 0 of size 64 "
         "is not divisible by mesh dim 'tp' of size 3 (TP colwise; FSDP pads dim 0, TP does not pad)"),
        (["report", "--plan", "fsdp_tp", "--mesh", "dp=8"],
         "--plan fsdp_tp --mesh dp=8 --preset tiny: plan 'fsdp_tp': tp mesh dim 'tp' is not in mesh dp=8"),
        (["report", "--preset", "8b"],
         "--preset 8b: parity runs the model for real (8.03 B parameters, above the 1 B limit) and needs at least "
         "119.7 GiB of RAM; pass --no-parity for the graphs only, or --parity-anyway to run it"),
        (["report", "--trainer", "--mesh", "dp=2"],
         "argument --trainer: the graph trainer traces one single-device training step; --mesh does not apply"),
        (["report", "--trainer", "--preset", "8b"],
         "--trainer --preset 8b: the graph trainer runs the training step for real (measured memory, parity) on one "
         "process, 8.03 B parameters, above the 1 B limit; pass --parity-anyway to run it"),
        (["scale", "--layers", "abc"], "argument --layers: takes positive ints like 32 or 2,8,32, got 'abc'"),
        (["scale", "--layers", "2,0"], "argument --layers: takes positive ints like 32 or 2,8,32, got '2,0'"),
        (["scale", "--repeat", "0"], "argument --repeat: takes a positive int, got '0'"),
        (["scale", "--bucket-cap-mb", "x"], "argument --bucket-cap-mb: takes a positive float, got 'x'"),
        (["scale", "--param-dtype", "fp8"], "argument --param-dtype: unknown dtype 'fp8'"),
        (["scale", "--preset", "tiny", "--mesh", "dp=4,tp=3"],
         "--plan fsdp_tp --mesh dp=4,tp=3 --preset tiny: parameter"),
        (["mutate", "--timeout", "-1"], "argument --timeout: takes a positive float, got '-1'"),
        (["mutate", "--timeout", "nan"], "argument --timeout: takes a positive float, got 'nan'"),
        (["mutate", "--patch", "nope"], "--patch: unknown patch(es) ['nope']; known patches: ["),
        (["mutate", "-n", "two"], "argument -n: takes 'auto' or a number of workers >= 0, got 'two'"),
        (["goldens", "--check", "-n", "-1"], "argument -n: takes 'auto' or a number of workers >= 0, got '-1'"),
    ],
)
def test_bad_flag_is_one_line_naming_the_flag(capsys, argv, message):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_unknown_patch_in_the_environment_stops_every_command(capsys, monkeypatch):
    monkeypatch.setenv("AUTOPARALLEL_DISABLE", "replay_saves_partitionr")
    assert run(["report", "--no-parity"]) == 2
    err = capsys.readouterr().err
    assert "unknown patch name(s) ['replay_saves_partitionr'] in $AUTOPARALLEL_DISABLE" in err
    assert "'replay_saves_partitioner'" in err  # the known names, to spot the typo


def test_parity_anyway_lifts_the_size_limit():
    big = Scenario(preset="8b", plan="fsdp", mesh="dp=8")
    assert parameter_count(big) > PARITY_MAX_PARAMS
    check_parity_size(big, anyway=True)  # no error
    check_parity_size(Scenario(preset="debug"), anyway=False)  # small models pass
    assert parity_memory_lower_bound(big, 10) == (2 + 2) * 4 * 10  # 2 gloo ranks (dp=8 -> dp=2)


def test_html_takes_a_directory_it_can_write(capsys, tmp_path):
    file = tmp_path / "page.html"
    file.write_text("")
    assert run(["report", "--html", str(file)]) == 2
    assert f"argument --html: '{file}' is a file; give a directory (the page is written as DIR/index.html)" in capsys.readouterr().err
    assert run(["report", "--html", str(file / "out")]) == 2
    assert f"argument --html: '{file / 'out'}': '{file}' is a file, so the directory cannot be created" in capsys.readouterr().err



def test_parser_and_scenario_defaults_come_from_their_homes():
    p = _parser()
    bisect, scale = p.parse_args(["bisect"]), p.parse_args(["scale"])
    assert bisect.bucket_cap_mb == scale.bucket_cap_mb == BUCKET_CAP_MB
    assert (bisect.preset, bisect.plan, bisect.mesh) == (defaults.PRESET, defaults.PLAN, defaults.MESH)
    assert (Scenario().preset, Scenario().plan, Scenario().mesh) == (defaults.PRESET, defaults.PLAN, defaults.MESH)
    report = p.parse_args(["report", "--no-parity"])
    _report_defaults(p, report)
    assert (report.preset, report.plan, report.mesh) == (defaults.PRESET, defaults.PLAN, defaults.MESH)
    with pytest.raises(SystemExit):
        p.parse_args(["bisect", "--plan", PLANS[-1]])  # auto: not a hand plan


def test_report_hf_takes_any_model_type_and_names_an_unknown_one(capsys):
    pytest.importorskip("transformers")
    args = _parser().parse_args(["report", "--hf", "mistral"])  # not one of verify.hf.ARCHS: the generic rule
    assert args.model.name == "hf-mistral"
    with pytest.raises(SystemExit):
        _parser().parse_args(["report", "--hf", "gpt3"])
    assert "argument --hf: unknown Hugging Face model type 'gpt3'" in capsys.readouterr().err


# --- one model selector: --preset | --model | --hf, the same for every command that runs a model ---------

MODEL_COMMANDS = ("report", "plan", "bisect", "scale")


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_model_command_takes_the_same_selector(command, capsys):
    p = _parser()
    args = p.parse_args([command, "--model", "ln_mlp"])
    assert args.model == "ln_mlp"
    assert p.parse_args([command, "--preset", "debug"]).preset == "debug"
    assert p.parse_args([command, "--preset", "debug"]).model is None
    with pytest.raises(SystemExit):
        p.parse_args([command, "--preset", "debug", "--model", "ln_mlp"])
    assert "argument --model: not allowed with argument --preset" in capsys.readouterr().err
    assert run([command, "--model", "no_such_pkg:case"]) == 2
    err = capsys.readouterr().err
    assert "argument --model: --model 'no_such_pkg:case': cannot import module 'no_such_pkg'" in err, err


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_model_command_takes_a_hugging_face_type(command):
    pytest.importorskip("transformers")
    assert _parser().parse_args([command, "--hf", "gpt2"]).model.name == "hf-gpt2"


@pytest.mark.parametrize("argv", [["solve", "--model", "ln_mlp", "--layers", "2"], ["solve", "--model", "ln_mlp", "--seq", "8"],
                                  ["scale", "--model", "ln_mlp", "--layers", "2"]])
def test_a_presets_size_flags_refuse_a_model_case(argv, capsys):
    assert run(argv) == 2
    flag = argv[3]
    assert f"argument {flag}: sizes a LLaMA-3 preset; a model given by --model or --hf brings its own sizes" in capsys.readouterr().err


def test_check_model_takes_what_model_takes():
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg'"):
        check_model("no_such_pkg:case")
    with pytest.raises(ValueError, match=r"'GPT2' is a type; it must be a verify.ModelCase"):
        check_model("verify.zoo:GPT2")


def test_plan_runs_a_model_case_end_to_end(capsys):
    assert run(["solve", "--model", "ln_mlp", "--mesh", "dp=2", "--compare-hand", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan for ln_mlp batch=4 on mesh dp=2 (h100)")
    assert "hand plan fsdp under the same cost model:" in out


@pytest.mark.slow  # two pipeline runs of a model case on a fake world (about 15 s of CPU): the tier runs plan's
def test_bisect_and_scale_run_a_model_case_end_to_end(capsys):
    assert run(["bisect", "--model", "ln_mlp", "--mesh", "dp=2", "--plan", "ddp"]) == 0
    assert "first stage that differs" not in capsys.readouterr().out
    assert run(["scale", "--model", "ln_mlp", "--mesh", "dp=2", "--plan", "fsdp"]) == 0
    assert capsys.readouterr().out.startswith("scale: model=ln_mlp mesh=dp=2 plan=fsdp")
