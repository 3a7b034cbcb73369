"""``python -m verify solve``: tables on stdout, progress on stderr, one-line errors for bad input."""

from __future__ import annotations

import json

import pytest

from verify.__main__ import main

pytestmark = pytest.mark.xdist_group("planner-tiny")  # shares the tiny trace with the goldens


def test_plan_prints_the_parameter_table_and_progress(capsys):
    assert main(["solve", "--preset", "tiny", "--mesh", "dp=8", "--explain", "layers.0.attention.wq.weight"]) == 0
    out, err = capsys.readouterr()
    assert "objective" in out and "parameter" in out and "layers.1.feed_forward.w2.weight" in out
    assert "ILP:" in out and "variables" in out and "fixed by reduced cost" in out
    assert "why:" in out  # the explanation
    assert "[plan" in err and "solved in" in err  # progress goes to stderr


def test_plan_json_and_text_outputs(capsys, tmp_path):
    path = tmp_path / "p.json"
    assert main(["solve", "--preset", "tiny", "--mesh", "dp=8", "--json", "--save", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "autoparallel.plan/1" and json.loads(path.read_text())["params"] == data["params"]
    assert main(["solve", "--preset", "tiny", "--mesh", "dp=8", "--text"]) == 0
    assert capsys.readouterr().out.startswith("model: llama3 tiny")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--profile", "h101"], "unknown device profile 'h101'"),
        (["--mesh", "dp=x"], "argument --mesh: bad mesh"),
        (["--preset", "huge"], "argument --preset: unknown preset 'huge'"),
        (["--memory-budget", "-1"], "--memory-budget must be >= 0"),
        (["--param-dtype", "fp8"], "argument --param-dtype: unknown dtype 'fp8'"),
        (["--layers", "0"], "argument --layers: takes a positive int"),
        (["--trace-blocks", "x"], "argument --trace-blocks: takes an int >= 0"),
    ],
)
def test_bad_input_is_one_line_naming_what_is_wrong(argv, message, capsys):
    try:
        rc = main(["solve", *argv])
    except SystemExit as e:  # argparse rejects a flag where it is parsed
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_infeasible_budget_is_reported_with_the_smallest_feasible_one(capsys):
    assert main(["solve", "--preset", "tiny", "--mesh", "dp=8", "--memory-budget", "0.00000001"]) == 2
    err = capsys.readouterr().err
    assert "constraint group 'param_memory' cannot be met" in err and "raise the budget to at least" in err


def test_plan_is_an_alias_that_runs_exactly_as_solve(capsys):
    """README and issue 42 run ``python -m verify plan``: the alias gives solve's output and errors."""
    got = {}
    for command in ("solve", "plan"):
        assert main([command, "--model", "ln_mlp", "--mesh", "dp=2", "--text"]) == 0
        out = capsys.readouterr().out
        with pytest.raises(SystemExit) as e:  # a preset's size flag with --model: the same check
            main([command, "--model", "ln_mlp", "--layers", "2"])
        got[command] = (out, e.value.code, capsys.readouterr().err)
    assert got["plan"] == got["solve"]
    assert got["solve"][0].startswith("model: ") and got["solve"][1] == 2 and "--layers: sizes a LLaMA-3 preset" in got["solve"][2]
