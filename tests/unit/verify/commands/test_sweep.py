"""python -m verify sweep with a fake runner (no model is built): the table, the reason classes,
-j, the per-cell timeout and the totals; the cell process's verdicts with a fake check_model."""

from __future__ import annotations

import io
import json
import sys
import threading
import types

import pytest
import torch

from verify.__main__ import _parser
from verify.commands import sweep, sweep_cell
from verify.commands.sweep import (
    CLASS_NAMES,
    Cell,
    CellResult,
    classify,
    render_json,
    render_markdown,
    results_from_json,
    run_sweep,
    select_cells,
    subprocess_runner,
    totals,
)

# One reason per class, as the stack words it (autoparallel/parallelize/plan.py, joint.py,
# planner/problem.py, planner/strategies.py, passes/random_order.py, verify/parity/random_ops.py).
REASONS = {
    "timeout": "timeout after 300 s",
    "NOT bitwise": "NOT bitwise: first_partition: 3 of 40 tensors differ",
    "frozen parameter": "parameter 'model.layers.1.mlp.expert_bias' does not require grad; plans shard trainable parameters only",
    "unused parameter": "parameter(s) ['model.pooler.dense.weight'] do not contribute to the loss, so they get no gradient; the parallel",
    "lifted constant": "node 'x' reads a tensor constant (get_attr '_tensor_constant0': ... lifted into the graph as get_attr); plan='auto' does not",
    "no strategy": "NoStrategyError: op aten.as_strided.default at node 'as_strided' (...) has no sharding strategy: DTensor's",
    "random op": "RandomOpError: random op aten.randperm.default (node randperm) is not a dropout: the oracle cannot switch it",
    "undivisible dim": "parameter 'model.lm_head.weight': dim 0 of size 7 is not divisible by mesh dim 'tp' of size 2",
    "RNG reseed": ("the model reseeds the global RNG in forward (torch.seed() at modeling_reformer.py:1515 "
                   "(self.attention_seed = int(torch.seed() % sys.maxsize))): a traced graph cannot replay a reseed (its random ops "
                   "draw from the generator as it stands when the graph runs)"),
    "solver time limit": "the solver found no plan within the time limit of 120.0 s (548339 variables, 62164 constraints); raise the time limit",
    "collective mismatch": ("RankFailedError: rank 0 of the world raised CollectiveMismatchError during fn: ... the ranks' "
                            "graphs issue different collectives, which the backend would abort on: graph 'joint', collective #11"),
    "data-dependent": "the model is not traceable: aten._local_scalar_dense.default at m.py:579 (if p < self.layerdrop:) reads a tensor's value",
    "value guard": ("RankFailedError: rank 1 of the world raised ValueGuardError during fn: value guard: m.py:178 "
                    "(if self.x_min.min() > -1.1e-5): traced with True; this batch gives False"),
    "other": "RuntimeError: something nobody foresaw",
}
META = {"transformers": "5.24.0", "commit": "abc123", "date": "2026-11-28 00:00 UTC", "command": "python -m verify sweep", "note": ""}


def fake_runner(table: dict[str, tuple[str, str]]):
    return lambda cell, timeout: table[cell.model_type]


@pytest.mark.parametrize("name", CLASS_NAMES)
def test_each_reason_class_is_recognised_from_the_stacks_message(name):
    assert classify("FAIL", REASONS[name]) == name
    assert classify("REFUSED", REASONS[name]) == name


def test_pass_and_not_built_have_no_class_and_an_unknown_reason_is_other():
    assert classify("PASS", "") is None
    assert classify("NOT BUILT", REASONS["frozen parameter"]) is None
    assert classify("FAIL", "KeyError: 'full_attention'") == "other"


def test_sweep_runs_every_cell_and_reports_each_on_stderr_in_cell_order():
    cells = [Cell("a", "fsdp"), Cell("b", "fsdp"), Cell("c", "fsdp")]
    runner = fake_runner({"a": ("PASS", ""), "b": ("REFUSED", REASONS["lifted constant"]), "c": ("NOT BUILT", "KeyError: x")})
    progress = io.StringIO()
    seen = []
    results = run_sweep(cells, runner, progress=progress, on_result=lambda rs: seen.append(len(rs)))
    assert [(r.model_type, r.verdict, r.reason_class) for r in results] == [
        ("a", "PASS", None), ("b", "REFUSED", "lifted constant"), ("c", "NOT BUILT", None)]
    lines = progress.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("1/3 a fsdp PASS ") and lines[0].endswith("s")
    assert lines[1].startswith("2/3 b fsdp REFUSED ") and "tensor constant" in lines[1]
    assert seen == [1, 2, 3]  # the page is rewritten after every cell


def test_jobs_run_cells_at_once_and_one_job_runs_them_one_by_one():
    """With -j 2 two cells meet at a barrier; with -j 1 the first waits for a partner in vain."""
    def runner_meeting(barrier):
        def run(cell, timeout):
            try:
                barrier.wait(timeout=2)
            except threading.BrokenBarrierError:
                return "FAIL", "alone"
            return "PASS", ""
        return run

    cells = [Cell("a", "fsdp"), Cell("b", "fsdp")]
    both = run_sweep(cells, runner_meeting(threading.Barrier(2)), jobs=2, progress=io.StringIO())
    assert [r.verdict for r in both] == ["PASS", "PASS"]
    one = run_sweep(cells, runner_meeting(threading.Barrier(2)), jobs=1, progress=io.StringIO())
    assert [r.verdict for r in one] == ["FAIL", "FAIL"]


def test_a_cell_past_its_timeout_is_killed_and_fails_as_timeout():
    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    verdict, reason = subprocess_runner(Cell("a", "fsdp"), 1.0, argv=slow)
    assert (verdict, reason) == ("FAIL", "timeout after 1 s")
    assert classify(verdict, reason) == "timeout"


def test_the_runner_reads_the_cells_verdict_and_names_a_crash():
    ok = [sys.executable, "-c", "print('noise'); print('{\"verdict\": \"REFUSED\", \"reason\": \"no\"}')"]
    assert subprocess_runner(Cell("a", "fsdp"), 30, argv=ok) == ("REFUSED", "no")
    crash = [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"]
    assert subprocess_runner(Cell("a", "fsdp"), 30, argv=crash) == ("FAIL", "crashed (exit code 3): boom")
    junk = [sys.executable, "-c", "print('{\"verdict\": \"MAYBE\"}')"]
    assert subprocess_runner(Cell("a", "fsdp"), 30, argv=junk)[1].startswith("crashed (exit code 0)")


def _results():
    return [CellResult("a", "fsdp", "PASS", "", None, 1.0),
            CellResult("b", "fsdp", "FAIL", REASONS["NOT bitwise"], "NOT bitwise", 2.0),
            CellResult("c", "fsdp", "NOT BUILT", "KeyError: 'x'", None, 0.5),
            CellResult("a", "auto", "REFUSED", REASONS["no strategy"], "no strategy", 3.0),
            CellResult("b", "auto", "REFUSED", "a | b", "other", 4.0)]


def test_totals_count_verdicts_and_classes_per_plan_with_not_built_in_the_denominator():
    t = totals(_results())
    assert t["fsdp"]["cells"] == 3 and t["fsdp"]["verdicts"] == {"PASS": 1, "REFUSED": 0, "FAIL": 1, "NOT BUILT": 1}
    assert t["fsdp"]["classes"]["NOT bitwise"] == 1 and sum(t["fsdp"]["classes"].values()) == 1
    assert t["auto"]["verdicts"]["REFUSED"] == 2 and t["auto"]["classes"]["no strategy"] == t["auto"]["classes"]["other"] == 1
    assert t["fsdp"]["seconds"] == 3.5


def test_markdown_names_the_run_and_has_a_row_per_cell():
    md = render_markdown(_results(), {**META, "note": "fsdp over every type"})
    assert "transformers 5.24.0, commit abc123, 2026-11-28 00:00 UTC." in md
    assert "Command: `python -m verify sweep`" in md and "fsdp over every type." in md
    assert "| fsdp dp=2 | 3 | 1 | 0 | 1 | 1 | 4 |" in md  # seconds 3.5 rounds to 4
    assert "| auto dp=2,tp=2 | 2 | 0 | 2 | 0 | 0 | 7 |" in md
    assert "| model type | plan | verdict | class | reason | seconds |" in md
    assert "| b | auto | REFUSED | other | a \\| b | 4.0 |" in md  # a '|' in a reason does not split the row
    assert "| c | fsdp | NOT BUILT |  | KeyError: 'x' | 0.5 |" in md
    assert "Partial" not in md
    assert "Partial: 5 of 9 cells finished." in render_markdown(_results(), {**META, "partial": "5 of 9 cells finished"})


def test_json_round_trips_and_is_classified_anew():
    data = json.loads(render_json(_results(), META))
    assert data["transformers"] == "5.24.0" and data["totals"]["auto"]["cells"] == 2 and len(data["cells"]) == 5
    data["cells"][1]["reason"] = REASONS["random op"]  # as if an older sweep had classed it otherwise
    results, info = results_from_json(json.dumps(data))
    assert results[1].reason_class == "random op" and info["commit"] == "abc123"


def test_cells_are_filtered_by_type_and_plan_and_unknown_names_are_refused():
    known = ["bert", "gpt2", "llama"]
    assert select_cells(None, ["fsdp"], known) == [Cell(t, "fsdp") for t in known]
    assert select_cells(["gpt2"], ["fsdp", "auto"], known) == [Cell("gpt2", "fsdp"), Cell("gpt2", "auto")]
    with pytest.raises(ValueError, match=r"unknown model type\(s\) \['gpt3'\]"):
        select_cells(["gpt3"], ["fsdp"], known)
    with pytest.raises(ValueError, match=r"unknown plan\(s\) \['ddp'\]"):
        select_cells(None, ["ddp"], known)


def test_the_command_writes_the_page_and_its_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "model_types", lambda: ["a", "b", "c"])
    out = tmp_path / "cov"
    argv = ["sweep", "--types", "a,b", "--plans", "fsdp,auto", "-j", "2", "--timeout", "5", "--out", str(out)]
    args = _parser().parse_args(argv)
    args.argv = argv[1:]
    runner = fake_runner({"a": ("PASS", ""), "b": ("FAIL", REASONS["undivisible dim"])})
    assert sweep.main(args, runner) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [(c["model_type"], c["plan"]) for c in data["cells"]] == [("a", "fsdp"), ("b", "fsdp"), ("a", "auto"), ("b", "auto")]
    assert data["totals"]["auto"]["classes"]["undivisible dim"] == 1 and "partial" not in data
    assert "--types a,b" in out.with_suffix(".md").read_text()
    err = capsys.readouterr().err
    assert "4/4 " in err and "fsdp: PASS 1, REFUSED 0, FAIL 1, NOT BUILT 0 of 2" in err


def test_from_json_merges_sweeps_and_a_later_cell_replaces_an_earlier_one(tmp_path, capsys):
    first, later = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(render_json(_results(), META))
    later.write_text(render_json([CellResult("b", "fsdp", "PASS", "", None, 9.0)], {**META, "commit": "def456", "command": "again"}))
    out = tmp_path / "merged"
    args = _parser().parse_args(["sweep", "--from-json", str(first), "--from-json", str(later), "--out", str(out)])
    assert sweep.main(args, runner=None) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    cells = {(c["model_type"], c["plan"]): c["verdict"] for c in data["cells"]}
    assert len(cells) == len(data["cells"]) == 5 and cells[("b", "fsdp")] == "PASS"
    assert data["commit"] == "abc123; def456" and data["command"] == "python -m verify sweep; again"


def test_merging_a_merged_page_again_names_each_run_once(tmp_path):
    """Failed before: every re-merge of docs/hf-coverage.json over its own parts repeated their
    commands, commits and notes in the page header (the committed page held one sweep's command three times)."""
    first, later, merged = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "merged"
    first.write_text(render_json(_results(), META))
    later.write_text(render_json([CellResult("b", "fsdp", "PASS", "", None, 9.0)], {**META, "commit": "def456", "command": "again"}))
    for sources in ([first, later], [merged.with_suffix(".json"), later, first]):
        argv = ["sweep", *[a for p in sources for a in ("--from-json", str(p))], "--out", str(merged)]
        assert sweep.main(_parser().parse_args(argv), runner=None) == 0
    data = json.loads(merged.with_suffix(".json").read_text())
    assert data["commit"] == "abc123; def456" and data["command"] == "python -m verify sweep; again"


def test_a_merged_page_says_how_many_sweeps_in_its_header_and_lists_them_at_the_end():
    """Failed before: the header of docs/hf-coverage.md held every merged sweep's commit, date,
    command and note as four "; "-joined walls, thousands of characters before the first table."""
    info = {**META, "commit": "abc123; def456 (with uncommitted changes); abc123",
            "date": "2026-11-28 05:00 UTC; 2026-11-27 23:59 UTC",
            "command": "python -m verify sweep --plans fsdp; python -m verify sweep --plans auto --note a; b",
            "note": "first; second", "partial": "5 of 9 cells finished"}
    md = render_markdown(_results(), info)
    head, tail = md.split("## Sweeps merged")
    assert "merges 2 sweeps, run from 2026-11-27 23:59 UTC to 2026-11-28 05:00 UTC on 2 commits" in head
    assert "python -m verify sweep" not in head and "abc123" not in head and "Partial" not in head
    assert "1. `python -m verify sweep --plans fsdp`" in tail
    assert "2. `python -m verify sweep --plans auto --note a; b`" in tail  # a command's own "; " stays in it
    assert "Commits: abc123, def456." in tail and "- first" in tail and "- 5 of 9 cells finished" in tail
    assert md.index("| model type |") < md.index("## Sweeps merged")


@pytest.mark.parametrize("flag", [["--plans", ""], ["-j", "0"], ["--timeout", "-1"]])
def test_bad_flags_are_one_line_errors(flag, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["sweep", *flag])
    assert "argument" in capsys.readouterr().err


# The cell process: its verdicts, with check_model faked (the build step runs for real on gpt2).

def _check(result=None, error=None):
    def check_model(case, **kw):
        if error is not None:
            raise error
        return result
    return check_model


def _result(bitwise=True, oracle_ok=True, model_branch=False, reads=()):
    """A ModelCheck's outline: ``model_branch`` is a stage not bitwise with eager but bitwise with
    eager run as traced (the model's own is_compiling() branch), which failures() leaves out."""
    rep = types.SimpleNamespace(bitwise=bitwise)
    failing = not bitwise and not model_branch
    failures = (["first_partition: 3 of 40 tensors differ"] if failing else []) + ([] if oracle_ok else ["oracle: loss beyond 1e-4"])
    return types.SimpleNamespace(parity={"first_partition": rep}, failures=lambda: failures,
                                 model_branch=lambda stage: not bitwise and model_branch,
                                 specialised_reads=lambda: tuple(reads))


@pytest.mark.parametrize(("check", "expected"), [
    (_check(_result()), {"verdict": "PASS", "reason": ""}),
    (_check(error=ValueError("parameter 'w' does not require grad\nmore")), {"verdict": "REFUSED", "reason": "parameter 'w' does not require grad"}),
    (_check(error=RuntimeError("Class validation error:\n  ValueError: bad\n")), {"verdict": "FAIL", "reason": "RuntimeError: Class validation error: ValueError: bad"}),
    (_check(error=RuntimeError("rank 0 of the world raised RuntimeError during fn:\n\nTraceback (most recent call last):\n"
                                "  File x, line 1\nRuntimeError: shapes differ\n")),
     {"verdict": "FAIL", "reason": "RuntimeError: rank 0 of the world raised RuntimeError during fn: RuntimeError: shapes differ"}),
    (_check(_result(bitwise=False)), {"verdict": "FAIL", "reason": "NOT bitwise: first_partition: 3 of 40 tensors differ"}),
    (_check(_result(oracle_ok=False)), {"verdict": "FAIL", "reason": "oracle: loss beyond 1e-4"}),
    # the model's own branch passes as in check_model (it crashed the cell: failures() was empty)
    (_check(_result(bitwise=False, model_branch=True)), {"verdict": "PASS", "reason": ""}),
    (_check(_result(bitwise=False, model_branch=True, oracle_ok=False)), {"verdict": "FAIL", "reason": "oracle: loss beyond 1e-4"}),
    # a PASS names the values the graphs hold as traced (patch value_guards)
    (_check(_result(reads=("m m.py:3 (if t.any():): traced with True",))),
     {"verdict": "PASS", "reason": "1 value reads specialised and guarded: m m.py:3 (if t.any():): traced with True"}),
])
def test_the_cell_turns_check_models_outcome_into_a_verdict(check, expected, monkeypatch):
    monkeypatch.setattr(sweep_cell, "check_model", check)
    assert sweep_cell.run_cell("gpt2", "fsdp", "dp=2") == expected


def test_a_model_that_does_not_build_is_not_built_and_check_model_never_runs(monkeypatch):
    monkeypatch.setattr(sweep_cell, "check_model", _check(error=AssertionError("must not run")))
    out = sweep_cell.run_cell("no_such_type", "fsdp", "dp=2")
    assert out["verdict"] == "NOT BUILT" and out["reason"].startswith("ValueError: unknown Hugging Face model type 'no_such_type'")


def test_the_cells_world_gets_the_sweeps_timeout(monkeypatch, capsys):
    """Failed before: the parity world had a fixed 180 s inside any --timeout (mobilevit under a
    loaded box: 'the world of 2 ranks did not finish within timeout_s=180 s' in a 600 s cell)."""
    seen = {}

    def check(case, **kw):
        seen.update(kw)
        return _result()

    monkeypatch.setattr(sweep_cell, "check_model", check)
    assert sweep_cell.main(["gpt2", "fsdp", "dp=2", "--world-timeout", "600"]) == 0
    assert seen["world_timeout_s"] == 600.0 and json.loads(capsys.readouterr().out)["verdict"] == "PASS"


class _MaskOnlyWhenEager(torch.nn.Module):
    """transformers' pattern (longt5, switch_transformers): the default all-ones mask is made
    only when not compiling, and the compiled branch reads the mask it did not make."""

    def forward(self, x, mask=None):
        if mask is None and not torch.compiler.is_compiling():
            mask = torch.ones_like(x)
        return x * mask[:, None]


def test_a_forward_that_fails_only_as_compiled_is_seen_before_the_trace():
    x = torch.ones(2, 3)
    assert sweep_cell._runs_as_compiled(torch.nn.Linear(3, 3), (x,))
    assert not sweep_cell._runs_as_compiled(_MaskOnlyWhenEager(), (x,))
    assert sweep_cell._runs_as_compiled(_MaskOnlyWhenEager(), (x, torch.ones(2, 3)))


def test_a_tokens_only_case_that_needs_a_mask_when_compiled_gets_one():
    """Failed before: longt5's cell traced tokens-only and stopped on "'NoneType' object has no
    attribute 'shape'" in the library's compiled branch."""
    assert sweep_cell.build_step("longt5").name.endswith("+mask")
    assert not sweep_cell.build_step("gpt2").name.endswith("+mask")
