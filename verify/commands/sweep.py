"""``python -m verify sweep``: every model type of the installed transformers through ``check_model``.

Each cell (a model type on a plan: ``fsdp`` on dp=2, ``auto`` on dp=2,tp=2; ``build``: only the
tiny model's eager training step) runs in its own process (``verify.commands.sweep_cell``),
``-j`` at once, each within ``--timeout`` seconds (``build`` cells run in this process); one line per finished cell goes to stderr. The
table (``docs/hf-coverage.md`` and its JSON) says per cell PASS, REFUSED with the stack's one-line
reason, FAIL with a named reason, or NOT BUILT (these count in the denominator), and the
seconds; totals per plan and per reason class (:data:`REASON_CLASSES`) say what to fix next.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from verify.commands import sweep_cell
from verify.hf import model_types

PLANS: dict[str, tuple[str, str]] = {"fsdp": ("fsdp", "dp=2"), "auto": ("auto", "dp=2,tp=2"), "build": ("build", "-")}
DEFAULT_PLANS = ("fsdp", "auto")
VERDICTS = ("PASS", "REFUSED", "FAIL", "NOT BUILT")

# Reason classes of REFUSED and FAIL cells, matched against the reason in this order (the
# stack's own messages: autoparallel/parallelize/joint.py, plan.py, planner/problem.py,
# planner/strategies.py, passes/random_order.py, verify/parity/random_ops.py); the first match wins.
REASON_CLASSES: tuple[tuple[str, str], ...] = (
    ("timeout", r"^timeout\b"),
    ("NOT bitwise", r"^NOT bitwise\b"),
    ("frozen parameter", r"does not require grad|requires_grad=False|\bfrozen\b"),
    ("unused parameter", r"do(es)? not contribute to the loss|loss does not use|get no gradient|has no gradient"),
    ("lifted constant", r"lifted (tensor )?constant|_tensor_constant\d*"),
    ("no strategy", r"no sharding strategy|no strategy"),
    # before "random op": the reseed refusal says why its random ops cannot be replayed
    ("RNG reseed", r"reseeds the global RNG"),  # a forward calling torch.seed / torch.manual_seed
    ("random op", r"\brandom ops?\b"),
    ("undivisible dim", r"not divisible|divisible by"),
    # the ranks' graphs would issue different collectives (verify.graphs.collective_agreement)
    ("collective mismatch", r"\bCollectiveMismatchError\b"),
    ("solver time limit", r"no plan within the time limit"),  # plan="auto": the ILP found no plan in time
    ("data-dependent", r"not traceable|reads a tensor's value"),  # .item() / a branch on a tensor in forward
    # a read traced with one value (and guarded) gives another at a later step: the graph holds the traced one
    ("value guard", r"\bValueGuardError\b"),
)
OTHER = "other"
CLASS_NAMES = tuple(name for name, _ in REASON_CLASSES) + (OTHER,)


def classify(verdict: str, reason: str) -> str | None:
    """The reason class of a REFUSED or FAIL cell (None for PASS and NOT BUILT)."""
    if verdict not in ("REFUSED", "FAIL"):
        return None
    for name, pattern in REASON_CLASSES:
        if re.search(pattern, reason):
            return name
    return OTHER


@dataclass(frozen=True)
class Cell:
    model_type: str
    plan: str  # a key of PLANS

    @property
    def mesh(self) -> str:
        return PLANS[self.plan][1]


@dataclass(frozen=True)
class CellResult:
    model_type: str
    plan: str
    verdict: str
    reason: str
    reason_class: str | None
    seconds: float


Runner = Callable[[Cell, float], tuple[str, str]]


def subprocess_runner(cell: Cell, timeout: float, argv: Sequence[str] | None = None) -> tuple[str, str]:
    """Run ``cell`` in a child process (``verify.commands.sweep_cell``; ``argv`` replaces its
    command line), killed with its process group after ``timeout`` seconds; its gloo world gets the
    same budget (``--world-timeout``), so ``--timeout`` is what bounds a slow cell."""
    plan, mesh = PLANS[cell.plan]
    argv = list(argv or [sys.executable, "-m", "verify.commands.sweep_cell", cell.model_type, plan, mesh,
                         "--world-timeout", f"{timeout:g}"])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the cell's process and the gloo ranks it spawned
        proc.communicate()
        return "FAIL", f"timeout after {timeout:g} s"
    lines = out.strip().splitlines()
    try:
        verdict = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        verdict = None
    if not isinstance(verdict, dict) or verdict.get("verdict") not in VERDICTS:
        tail = (err.strip().splitlines() or ["no output"])[-1]
        return "FAIL", f"crashed (exit code {proc.returncode}): {tail}"
    return verdict["verdict"], verdict.get("reason", "")


def in_process_runner(cell: Cell, timeout: float) -> tuple[str, str]:
    """Run ``cell`` in this process (the ``build`` plan: a tiny model's eager step, a fraction of
    a second once transformers is imported, against seconds to start a process). No timeout."""
    out = sweep_cell.run_cell(cell.model_type, *PLANS[cell.plan])
    return out["verdict"], out["reason"]


def default_runner(cell: Cell, timeout: float) -> tuple[str, str]:
    """``build`` cells in this process, the plans' cells each in its own (:func:`subprocess_runner`)."""
    return (in_process_runner if cell.plan == "build" else subprocess_runner)(cell, timeout)


def run_sweep(cells: Sequence[Cell], runner: Runner = default_runner, *, jobs: int = 1, timeout: float = 600.0,
              progress=None, on_result: Callable[[list[CellResult]], None] | None = None) -> list[CellResult]:
    """Every cell through ``runner``, ``jobs`` at once; a line per finished cell on ``progress``
    (``n/total type plan verdict seconds``), and ``on_result(results so far)`` (in the order of
    ``cells``). Results in the order of ``cells``."""
    progress = sys.stderr if progress is None else progress

    def one(cell: Cell) -> CellResult:
        t0 = time.perf_counter()
        verdict, reason = runner(cell, timeout)
        return CellResult(cell.model_type, cell.plan, verdict, reason, classify(verdict, reason),
                          round(time.perf_counter() - t0, 1))

    done: dict[Cell, CellResult] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(one, c): c for c in cells}
        for future in as_completed(futures):
            r = future.result()
            done[futures[future]] = r
            why = f"  {r.reason}" if r.reason else ""
            print(f"{len(done)}/{len(cells)} {r.model_type} {r.plan} {r.verdict} {r.seconds:.1f}s{why}", file=progress, flush=True)
            if on_result is not None:
                on_result([done[c] for c in cells if c in done])
    return [done[c] for c in cells]


def totals(results: Sequence[CellResult]) -> dict[str, dict]:
    """Per plan: cells, the count of each verdict and of each reason class."""
    out: dict[str, dict] = {}
    for plan in dict.fromkeys(r.plan for r in results):
        mine = [r for r in results if r.plan == plan]
        verdicts = Counter(r.verdict for r in mine)
        classes = Counter(r.reason_class for r in mine if r.reason_class)
        out[plan] = {"cells": len(mine), "verdicts": {v: verdicts.get(v, 0) for v in VERDICTS},
                     "classes": {c: classes.get(c, 0) for c in CLASS_NAMES},
                     "seconds": round(sum(r.seconds for r in mine), 1)}
    return out


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _items(info: dict, key: str) -> list[str]:
    """The entries of one header field: a merged page joins each field's entries with "; "
    (``_joined``); a command holds no "; " of its own, a note may, so commands split only where
    the next one starts."""
    text = info.get(key) or ""
    pattern = r"; (?=python -m verify sweep)" if key == "command" else r"; "
    return [part for part in re.split(pattern, text) if part]


def _run_lines(info: dict) -> tuple[list[str], list[str]]:
    """The page's header and, for a page merged from several sweeps, its closing list of them.
    One sweep names its commit, date and command in the header; merged sweeps would make that
    header a wall of "; "-joined fields, so it says how many and when, and the list closes the page."""
    commands = _items(info, "command")
    if len(commands) <= 1:
        head = [f"transformers {info['transformers']}, commit {info['commit']}, {info['date']}.", "",
                f"Command: `{info['command']}`", ""]
        for key in ("partial", "note"):
            if info.get(key):
                head += [f"{'Partial: ' if key == 'partial' else ''}{info[key]}.".replace("..", "."), ""]
        return head, []
    dates = sorted(_items(info, "date"))
    commits = list(dict.fromkeys(c.replace(" (with uncommitted changes)", "") for c in _items(info, "commit")))
    head = [f"transformers {info['transformers']}. This page merges {len(commands)} sweeps, run from {dates[0]} to "
            f"{dates[-1]} on {len(commits)} commits; where two sweeps ran the same cell, the later one's verdict "
            "is kept. The sweeps are listed at the end of the page.", ""]
    tail = ["", "## Sweeps merged", "", "Commands, in merge order:", ""]
    tail += [f"{i}. `{c}`" for i, c in enumerate(commands, 1)]
    tail += ["", "Commits: " + ", ".join(commits) + ".", ""]
    for title, key in (("Notes", "note"), ("Stopped before the end", "partial")):
        if _items(info, key):
            tail += [f"{title}:", ""] + [f"- {_cell_text(n)}" for n in _items(info, key)] + [""]
    return head, tail[:-1]


def render_markdown(results: Sequence[CellResult], meta: dict) -> str:
    """The coverage page: what ran (version, commit, date, command), totals per plan and per
    reason class, then one row per cell."""
    head, tail = _run_lines(meta)
    lines = ["# Hugging Face coverage", "", *head]
    tot = totals(results)
    lines += ["| plan | cells | " + " | ".join(VERDICTS) + " | seconds |",
              "|---|---:|" + "---:|" * len(VERDICTS) + "---:|"]
    for plan, t in tot.items():
        mesh = PLANS[plan][1] if plan in PLANS else ""
        label = f"{plan} {mesh}" if mesh and mesh != "-" else plan
        lines.append(f"| {label} | {t['cells']} | " + " | ".join(str(t["verdicts"][v]) for v in VERDICTS) + f" | {t['seconds']:.0f} |")
    lines += ["", "Reasons of REFUSED and FAIL cells, by class:", "",
              "| plan | " + " | ".join(CLASS_NAMES) + " |", "|---|" + "---:|" * len(CLASS_NAMES)]
    for plan, t in tot.items():
        lines.append(f"| {plan} | " + " | ".join(str(t["classes"][c]) for c in CLASS_NAMES) + " |")
    lines += ["", "| model type | plan | verdict | class | reason | seconds |", "|---|---|---|---|---|---:|"]
    for r in results:
        lines.append(f"| {r.model_type} | {r.plan} | {r.verdict} | {r.reason_class or ''} | {_cell_text(r.reason)} | {r.seconds:.1f} |")
    return "\n".join(lines + tail) + "\n"


def render_json(results: Sequence[CellResult], meta: dict) -> str:
    return json.dumps({**meta, "totals": totals(results), "cells": [asdict(r) for r in results]}, indent=1) + "\n"


def _commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


def meta(argv: Sequence[str], note: str = "") -> dict:
    return {"transformers": importlib.metadata.version("transformers"), "commit": _commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python -m verify sweep " + " ".join(argv), "note": note}


def select_cells(types: Sequence[str] | None, plans: Sequence[str], known: Sequence[str]) -> list[Cell]:
    """The cells of ``types`` (default: every known type) on ``plans``, plan by plan; ValueError
    naming unknown types or plans."""
    unknown = sorted(set(types or ()) - set(known))
    if unknown:
        raise ValueError(f"--types: unknown model type(s) {unknown}; `python -m verify sweep --list` lists them")
    bad = sorted(set(plans) - set(PLANS))
    if bad:
        raise ValueError(f"--plans: unknown plan(s) {bad}; known: {', '.join(PLANS)}")
    return [Cell(t, p) for p in plans for t in (types or known)]


def results_from_json(text: str) -> tuple[list[CellResult], dict]:
    """A sweep's cells and its run's facts from its JSON, each cell classified anew (the
    classes may have grown since it ran)."""
    data = json.loads(text)
    cells = [CellResult(c["model_type"], c["plan"], c["verdict"], c["reason"], classify(c["verdict"], c["reason"]), c["seconds"])
             for c in data["cells"]]
    info = {k: data.get(k, "") for k in ("transformers", "commit", "date", "command", "note", "partial")}
    return cells, info


def _joined(values) -> str:
    """One header field of merged sweeps: each entry once. A merged page's field is itself a
    "; "-joined list, so merging it again with one of its parts must not repeat that part."""
    return "; ".join(dict.fromkeys(part for v in values if v for part in v.split("; ")))


def main(args, runner: Runner = default_runner) -> int:
    if args.from_json:
        parts = [results_from_json(Path(p).read_text()) for p in args.from_json]
        merged: dict[tuple[str, str], CellResult] = {}
        for rs, _ in parts:
            merged.update({(r.model_type, r.plan): r for r in rs})  # a later sweep's cell replaces an earlier one
        results = list(merged.values())
        infos = [i for _, i in parts]
        info = {**infos[0], **{k: _joined(i[k] for i in infos) for k in ("commit", "date", "command", "note", "partial")}}
        out = Path(args.out)
        out.with_suffix(".md").write_text(render_markdown(results, info))
        out.with_suffix(".json").write_text(render_json(results, info))
        print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')} from {', '.join(args.from_json)}", file=sys.stderr)
        return 0
    known = model_types()
    if args.list:
        print("\n".join(known))
        return 0
    cells = select_cells(args.types, args.plans, known)
    print(f"sweep: {len(cells)} cells, -j {args.jobs}, timeout {args.timeout:g} s", file=sys.stderr, flush=True)
    info = meta(args.argv, args.note)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(results: list[CellResult]) -> None:
        """The table so far (a long sweep's page is readable while it runs, and kept if it is stopped)."""
        part = {} if len(results) == len(cells) else {"partial": f"{len(results)} of {len(cells)} cells finished"}
        out.with_suffix(".md").write_text(render_markdown(results, {**info, **part}))
        out.with_suffix(".json").write_text(render_json(results, {**info, **part}))

    results = run_sweep(cells, runner, jobs=args.jobs, timeout=args.timeout, on_result=write)
    write(results)
    for plan, t in totals(results).items():
        print(f"{plan}: " + ", ".join(f"{v} {n}" for v, n in t["verdicts"].items()) + f" of {t['cells']}", file=sys.stderr)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}", file=sys.stderr)
    return 0
