"""python -m verify mutate's flags: each level refuses the other's instead of ignoring them."""

from __future__ import annotations

import pytest

from verify.__main__ import _parser
from verify.commands.mutation import patches, zygote
from verify.commands.mutation.cli import main


@pytest.mark.parametrize(("argv", "named"), [
    (["--sample", "5"], "--sample"),
    (["--seed", "3"], "--seed"),
    (["--target", "planner"], "--target"),
    (["--group", "canon"], "--group"),
    (["--target", "planner", "--sample", "5"], "--target, --sample"),
])
def test_line_level_options_without_lines_are_refused(argv, named):
    with pytest.raises(ValueError, match=rf"^{named}: line-level options; add --lines"):
        main(_parser().parse_args(["mutate", *argv]))


def test_jobs_with_lines_is_refused():
    with pytest.raises(ValueError, match=r"^-j/--jobs: patch-level only"):
        main(_parser().parse_args(["mutate", "--lines", "-j", "2"]))


def test_no_preload_with_lines_is_refused():
    with pytest.raises(ValueError, match=r"^--no-preload: patch-level only"):
        main(_parser().parse_args(["mutate", "--lines", "--no-preload"]))


def test_patch_level_runs_fork_from_the_zygote_unless_told_not_to(monkeypatch):
    seen = []
    monkeypatch.setattr(patches, "mutate", lambda *a, **kw: seen.append(kw["preload"]) or [])
    for argv in (["mutate", "--patch", "zero_tangents"], ["mutate", "--patch", "zero_tangents", "--no-preload"]):
        main(_parser().parse_args(argv))
    assert seen == [zygote.PRELOAD, None]
