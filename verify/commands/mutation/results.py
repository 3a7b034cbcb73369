"""What mutmut reports, read and tabulated (``python -m verify mutate --lines``): its mutant keys,
``mutmut results`` / ``mutmut show`` output, the mutated source line, and the table in the
patch-level harness's vocabulary (verify/commands/mutation/lines.py runs mutmut)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from verify.commands.mutation import STATES

# mutmut's status strings (mutmut/stats.py) -> the patch-level harness's states.
_STATE_OF_STATUS = {
    "killed": "killed",
    "survived": "survived",
    "no tests": "no coverage",
    "timeout": "timeout",
}


# --- parsing mutmut's output -----------------------------------------------------------------


@dataclass
class Mutant:
    """One mutmut mutant: its key (``pkg.mod.x_func__mutmut_3`` or ``pkg.mod.xǁClassǁmeth__mutmut_3``),
    mutmut's status and, for mutants that were not killed, the diff and the source line."""

    name: str
    status: str
    diff: str = ""
    line: int | None = None

    @property
    def state(self) -> str:
        return _STATE_OF_STATUS.get(self.status, "error")

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def function(self) -> str:
        """The mutated function's qualified name within its module, e.g. ``CleanupReport.summary``."""
        return parse_key(self.name)[1]

    @property
    def file(self) -> str:
        return module_file(self.module)

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file

    def changed_lines(self) -> list[str]:
        """The ``-``/``+`` lines of the diff (without the file headers)."""
        return [ln for ln in self.diff.splitlines() if ln[:1] in "-+" and not ln.startswith(("---", "+++"))]

    def to_dict(self) -> dict:
        return {"name": self.name, "file": self.file, "function": self.function, "line": self.line,
                "state": self.state, "mutmut_status": self.status, "diff": self.diff}


def parse_key(name: str) -> tuple[str, str, int]:
    """``(module, qualified function name, mutant number)`` of a mutmut key."""
    module, _, mangled = name.rpartition(".")
    base, sep, num = mangled.rpartition("__mutmut_")
    if not sep or not num.isdigit():
        raise ValueError(f"not a mutmut mutant name: {name!r}")
    if base.startswith("xǁ"):  # method: xǁClassǁmethod
        _, cls, meth = base.split("ǁ", 2)
        qualname = f"{cls}.{meth}"
    elif base.startswith("x_"):
        qualname = base[2:]
    else:
        raise ValueError(f"not a mutmut mutant name: {name!r}")
    return module, qualname, int(num)


def module_file(module: str) -> str:
    """Source path of a dotted module name, relative to the repository root."""
    return module.replace(".", "/") + ".py"


_RESULT_LINE = re.compile(r"^\s*(?P<name>\S+__mutmut_\d+): (?P<status>[a-z ]+?)\s*$")


def parse_results(text: str) -> list[Mutant]:
    """Mutants from ``mutmut results --all true`` (lines ``    <name>: <status>``); other lines
    (warnings, blank lines) are ignored."""
    out = []
    for line in text.splitlines():
        m = _RESULT_LINE.match(line)
        if m:
            out.append(Mutant(m["name"], m["status"]))
    return out


def parse_show(text: str) -> dict[str, tuple[str, str]]:
    """``{name: (status, diff)}`` from the output of ``mutmut show <name>`` (one or several,
    each starting with ``# <name>: <status>``)."""
    shows: dict[str, tuple[str, str]] = {}
    name = status = None
    body: list[str] = []

    def flush():
        if name is not None:
            shows[name] = (status, "\n".join(body).strip("\n\x00"))

    for line in text.splitlines():
        m = re.match(r"^# (\S+__mutmut_\d+): (.+?)\s*$", line)
        if m:
            flush()
            name, status, body = m[1], m[2], []
        elif name is not None and line != "\x00":
            body.append(line)
    flush()
    return shows


def _function_node(tree: ast.Module, qualname: str):
    scope: Iterable[ast.stmt] = tree.body
    node = None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        scope = node.body
    return node


def mutated_line(diff: str, source: str, qualname: str) -> int | None:
    """1-based line in ``source`` of the first line a mutant changes.

    mutmut diffs the function alone (its text starting at the first decorator or ``def``), so the
    hunk offsets are relative to that line. The result is checked against the source text; if it
    does not match (the source changed since), the removed line is searched for in the function.
    """
    removed, offset = None, None
    for line in diff.splitlines():
        m = re.match(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@", line)
        if m:
            offset = int(m[1])
            continue
        if offset is None or line.startswith(("---", "+++")):
            continue
        if line.startswith("-"):
            removed = line[1:]
            break
        if line.startswith("+"):  # pure insertion: report the line it is inserted before
            break
        offset += 1
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    fn = _function_node(tree, qualname)
    if fn is None or offset is None:
        return None
    start = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    lines = source.splitlines()
    guess = start + offset - 1
    if removed is None or (0 < guess <= len(lines) and lines[guess - 1].strip() == removed.strip()):
        return guess
    for i in range(start, (fn.end_lineno or len(lines)) + 1):
        if lines[i - 1].strip() == removed.strip():
            return i
    return None


# --- the report ------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES, 0))

    @property
    def mutants(self) -> int:
        return sum(self.counts.values())


def summarize(mutants: Sequence[Mutant], by: str = "file") -> list[Row]:
    """One row per file (``by="file"``) or per function (``by="function"``, ``file::function``)."""
    rows: dict[str, Row] = {}
    for m in mutants:
        key = m.file if by == "file" else f"{m.file}::{m.function}"
        rows.setdefault(key, Row(key)).counts[m.state] += 1
    return [rows[k] for k in sorted(rows)]


def kill_rate(mutants: Sequence[Mutant]) -> str:
    killed = sum(m.state == "killed" for m in mutants)
    detected = killed + sum(m.state == "timeout" for m in mutants)
    valid = len(mutants) - sum(m.state == "error" for m in mutants)
    rate = 100.0 * killed / len(mutants) if mutants else 0.0
    score = 100.0 * detected / valid if valid else 0.0
    return (f"kill rate: {killed}/{len(mutants)} mutants killed ({rate:.0f}%); "
            f"score (killed + timeout) / (mutants - error): {detected}/{valid} ({score:.0f}%)")


def format_table(mutants: Sequence[Mutant], by: str = "file", diffs: bool = True) -> str:
    """The table, the kill-rate line and every mutant that was not killed (survivors first)."""
    head = ("file" if by == "file" else "function", "mutants", *STATES)
    rows = [head]
    per_row = summarize(mutants, by)
    total = Row("total")
    for r in per_row:
        rows.append((r.name, str(r.mutants), *(str(r.counts[s]) for s in STATES)))
        for s in STATES:
            total.counts[s] += r.counts[s]
    if len(per_row) > 1:
        rows.append((total.name, str(total.mutants), *(str(total.counts[s]) for s in STATES)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(kill_rate(mutants))
    order = {s: i for i, s in enumerate(("survived", "no coverage", "timeout", "error"))}
    rest = sorted((m for m in mutants if m.state != "killed"),
                  key=lambda m: (order[m.state], m.file, m.line or 0, m.name))
    current = None
    for m in rest:
        if m.state != current:
            current = m.state
            lines.append(f"{current} ({sum(x.state == current for x in rest)}):")
        status = f" [mutmut: {m.status}]" if m.state == "error" else ""
        lines.append(f"  {m.location} {m.function}  ({m.name.rpartition('.')[2]}){status}")
        if diffs:
            lines.extend(f"      {ln}" for ln in m.changed_lines())
    return "\n".join(lines)

