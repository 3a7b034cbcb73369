"""python -m verify report: the JSON schema the issue promises, golden status, parity, errors."""

import json

import pytest

from verify.__main__ import main


def test_report_json_schema_and_golden_status(capsys):
    assert main(["report", "--json", "--no-parity"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert set(report) >= {"preset", "plan", "mesh", "params", "stages", "parity", "goldens"}
    assert report["preset"] == "tiny" and report["mesh"] == "dp=8"
    assert report["params"] == {"count": 21, "fsdp_sharded": 21}
    names = [s["name"] for s in report["stages"]]
    assert names[0] == "joint" and "second_compile fwd" in names
    joint = report["stages"][0]
    assert joint["collectives"]["all_gather"]["dp"]["count"] == 21
    assert set(joint["collectives"]["all_gather"]["dp"]) == {"count", "bytes"}
    assert report["goldens"]["joint"] == "matches"
    assert "[verify]" in out.err, "progress goes to stderr"


def test_report_text_with_parity(capsys):
    assert main(["report", "--mesh", "dp=2"]) == 0
    text = capsys.readouterr().out
    for stage in ("joint", "first_partition", "second_compile"):
        assert f"  {stage}" in text and "bitwise equal" in text
    assert "goldens: none for this scenario" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "--mesh", "dp=3"], "not divisible by mesh dim 'dp' of size 3"),
        (["report", "--mesh", "dp"], "bad mesh 'dp'"),
        (["report", "--preset", "huge"], "unknown preset"),
        (["report", "--plan", "fsdp_tp", "--mesh", "dp=8"], "tp mesh dim 'tp' is not in mesh dp=8"),
    ],
)
def test_bad_input_is_one_line_error(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
