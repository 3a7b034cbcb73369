"""Check the text of ``python -m verify report`` (the README's main job) on stdin.

It must show a table row for every pipeline stage (``<stage>`` or ``<stage> fwd`` and
``<stage> bwd``), golden status with every golden matching, and each parity line bitwise equal.
Prints what is missing and exits 1; exits 0 when the report is complete.
Usage: ``python -m verify report | python .ci/check_report.py``.
"""

from __future__ import annotations

import sys

from autoparallel.pipeline import STAGE_NAMES

PARITY_STAGES = ("joint", "first_partition", "second_compile")


def problems(text: str, stages=STAGE_NAMES) -> list[str]:
    lines = text.splitlines()
    out = []
    if not any(line.startswith("autoparallel report:") for line in lines):
        out.append("no 'autoparallel report:' header line")
    rows = {line.split("  ")[0].strip() for line in lines if line and not line.startswith((" ", "goldens:", "parity"))}
    for stage in stages:
        if stage not in rows and not {f"{stage} fwd", f"{stage} bwd"} <= rows:
            out.append(f"no table row for stage {stage!r}")
    goldens = [line for line in lines if line.startswith("goldens: ")]
    if not goldens:
        out.append("no 'goldens:' line")
    else:
        entries = [e.strip() for e in goldens[0][len("goldens: "):].split(",")]
        bad = [e for e in entries if not e.endswith(" matches")]
        if bad or len(entries) < len(stages):
            out.append(f"goldens do not all match: {goldens[0]}")
    for stage in PARITY_STAGES:
        parity = [line for line in lines if line.strip().startswith(f"{stage} ") and "bitwise" in line]
        if not parity or "NOT bitwise" in parity[0]:
            out.append(f"parity of {stage!r} is not reported bitwise equal")
    return out


def main() -> int:
    found = problems(sys.stdin.read())
    for p in found:
        print(f"ci: main job report: {p}", file=sys.stderr)
    if not found:
        print(f"ci: main job report complete: {len(STAGE_NAMES)} stages, goldens match, parity bitwise")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
