"""Guards run even where the quick tier marks them slow (verify/mutation/patches.py
``_run_slow_flag``): found by CI, where three patches' guards were skipped and reported as errors."""

from verify.mutation.patches import _run_slow_flag


def test_guards_run_slow_tests_in_a_project_that_opts_in(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\nautoparallel_verify = true\n")
    assert _run_slow_flag(tmp_path) == ["--ap-run-slow"]


def test_a_project_that_has_not_opted_in_gets_no_option_it_would_refuse(tmp_path):
    assert _run_slow_flag(tmp_path) == []
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\nautoparallel_verify = false\n")
    assert _run_slow_flag(tmp_path) == []
    (tmp_path / "pyproject.toml").write_text("not toml [")
    assert _run_slow_flag(tmp_path) == []
