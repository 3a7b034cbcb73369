"""The README and docs/*.md run as written: every fenced code block runs, or says why it does not,
and every relative link and anchor resolves.

A block's language says what it is: ``bash`` and ``python`` blocks are commands and run (bash with
``-euo pipefail``, both in a scratch directory with this interpreter's ``python`` first on PATH);
``text`` blocks are output or pictures and never run; a block without a language is an error. A
comment line right above the fence (other comment lines may sit between) changes that:

* ``<!-- not-run: why -->``: never run; the reason is required (a block that installs, rewrites
  the checkout, or runs for minutes);
* ``<!-- slow-run: why -->``: run only in CI's slow step (``--ap-run-slow``), the reason required.

Links: ``[text](target)`` outside code, relative targets only; a ``#anchor`` must name a heading
of the target page (GitHub's slugs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_LANGS = ("bash", "python")
SHOWN_LANGS = ("text",)
MARKERS = ("not-run", "slow-run")
BLOCK_TIMEOUT = 300  # seconds: a hang guard, far above what any runnable block takes

FENCE = re.compile(r"^```(\S*)\s*$")
COMMENT = re.compile(r"^<!--\s*(.*?)\s*-->$")
LINK = re.compile(r"(?<!\\)\[[^\]\n]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    mark: str | None  # "not-run", "slow-run" or None
    why: str

    def __str__(self) -> str:
        return f"{self.path.name}:{self.line}"


def doc_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` with their markers; ValueError for a block that says nothing
    of how to read it (no language, an unknown one, a marker without its reason)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{path}:{start + 1}: the code block is never closed")
        mark, why = None, ""
        j = start - 1
        while j >= 0 and (c := COMMENT.match(lines[j].strip())):
            name, _, reason = c.group(1).partition(":")
            if name.strip() in MARKERS:
                mark, why = name.strip(), reason.strip()
                if not why:
                    raise ValueError(f"{path}:{j + 1}: <!-- {name.strip()}: ... --> needs the reason the block does not run here")
            j -= 1
        if lang not in RUN_LANGS + SHOWN_LANGS:
            raise ValueError(f"{path}:{start + 1}: a code block needs a language: {', '.join(RUN_LANGS)} (it runs) "
                             f"or text (output, not run); got {lang or 'none'!r}")
        out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n", mark, why))
        i = end + 1
    return out


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = ["bash", "-euo", "pipefail", "-c", block.code] if block.lang == "bash" else [sys.executable, "-c", block.code]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT)


def block_failure(block: Block, cwd: Path) -> str | None:
    """None when the block runs and exits 0, else what went wrong."""
    done = run_block(block, cwd)
    if done.returncode == 0:
        return None
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    return (f"{block}: the {block.lang} block exited {done.returncode}; fix it, or mark it "
            f"<!-- not-run: why --> or <!-- slow-run: why -->:\n{tail}")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, seen = set(), {}
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line) or (in_code and line.strip() == "```"):
            in_code = not in_code
            continue
        if not in_code and (m := re.match(r"^#{1,6}\s+(.*)$", line)):
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def prose(path: Path) -> list[tuple[int, str]]:
    """The lines of ``path`` outside code blocks and inline code, numbered."""
    out, in_code = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line) or (in_code and line.strip() == "```"):
            in_code = not in_code
        elif not in_code:
            out.append((n, re.sub(r"`[^`]*`", "", line)))
    return out


def broken_links(path: Path) -> list[str]:
    bad = []
    for n, line in prose(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:: not checked offline
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{path.name}:{n}: {target}: no file {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{path.name}:{n}: {target}: no heading '#{anchor}' in {dest.name}")
    return bad


# --- the checks on this repository ------------------------------------------------------------------

def readable_blocks() -> list[Block]:
    """Every page's blocks; a page that raises is left to the test below, which names it."""
    out = []
    for page in doc_pages():
        try:
            out += blocks(page)
        except ValueError:
            pass
    return out


ALL_BLOCKS = readable_blocks()


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.name)
def test_every_block_says_how_to_read_it(page):
    blocks(page)  # ValueError naming the block: no language, or a marker without its reason


def test_the_readme_example_is_among_the_blocks_that_run():
    assert any(b.path.name == "README.md" and b.lang == "python" and b.mark is None for b in ALL_BLOCKS)


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang in RUN_LANGS and b.mark is None], ids=str)
def test_block_runs(block, tmp_path):
    assert block_failure(block, tmp_path) is None


@pytest.mark.slow  # blocks marked slow-run (the planner on a Hugging Face model, ~15 s of CPU each)
@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang in RUN_LANGS and b.mark == "slow-run"], ids=str)
def test_slow_block_runs(block, tmp_path):
    assert block_failure(block, tmp_path) is None


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.name)
def test_every_link_resolves(page):
    assert broken_links(page) == []


# --- negatives: the checkers fail on bad pages -------------------------------------------------------


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Some `code` heading\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md) [ok](docs/a.md#some-code-heading) [ok](#top) `[not a link](nowhere.md)`\n"
                    "[gone](docs/b.md) [bad anchor](docs/a.md#no-such) [web](https://example.com)\n\n# Top\n")
    assert broken_links(page) == [
        f"README.md:2: docs/b.md: no file {tmp_path / 'docs' / 'b.md'}",
        "README.md:2: docs/a.md#no-such: no heading '#no-such' in a.md",
    ]


def test_an_unmarked_failing_block_fails_and_a_marked_one_is_skipped(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("```bash\nfalse\n```\n\n<!-- not-run: would fail -->\n```bash\nfalse\n```\n\n"
                    "```python\nimport sys; sys.exit(3)\n```\n\n```text\nnot run: output\n```\n")
    found = blocks(page)
    assert [(b.lang, b.mark) for b in found] == [("bash", None), ("bash", "not-run"), ("python", None), ("text", None)]
    assert "README.md:1: the bash block exited 1" in block_failure(found[0], tmp_path)
    assert "README.md:10: the python block exited 3" in block_failure(found[2], tmp_path)
    ok = tmp_path / "ok.md"
    ok.write_text("```python\nprint('hi')\n```\n")
    assert block_failure(blocks(ok)[0], tmp_path) is None


@pytest.mark.parametrize("text, message", [
    ("```\nls\n```\n", "a code block needs a language"),
    ("```sh\nls\n```\n", "got 'sh'"),
    ("<!-- not-run: -->\n```bash\nls\n```\n", "needs the reason"),
    ("```bash\nls\n", "never closed"),
])
def test_a_block_that_says_nothing_of_how_to_read_it_is_an_error(tmp_path, text, message):
    page = tmp_path / "p.md"
    page.write_text(text)
    with pytest.raises(ValueError, match=message):
        blocks(page)
