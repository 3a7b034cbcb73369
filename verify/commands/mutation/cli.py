"""``python -m verify mutate``: patch-level mutation, or line-level with ``--lines``."""

from __future__ import annotations

import json
import sys
import time

from autoparallel.patches import PATCHES
from verify import repo_root
from verify.commands.mutation import patches as patch_mutation
from verify.commands.mutation import zygote
from verify.commands.mutation.lines import main as lines_main


def _check_level_flags(args) -> None:
    """Flags of one level given to the other are refused, not silently ignored."""
    lines_only = [f for f, given in (("--target", args.target != "passes"), ("--group", bool(args.group)),
                                     ("--sample", args.sample is not None), ("--seed", args.seed != 0)) if given]
    if lines_only and not args.lines:
        raise ValueError(f"{', '.join(lines_only)}: line-level options; add --lines, or leave them out for patch-level mutation")
    if args.jobs != 1 and args.lines:
        raise ValueError("-j/--jobs: patch-level only (line-level runs take -n, mutmut's workers)")
    if args.baseline and args.lines:
        raise ValueError("--baseline: patch-level only")
    if not args.preload and args.lines:
        raise ValueError("--no-preload: patch-level only")


def main(args) -> int:
    try:
        import pytest  # noqa: F401  (the guards run in pytest subprocesses)
    except ImportError:
        raise ValueError("python -m verify mutate runs the guard tests and needs pytest: pip install -e '.[test]'") from None
    names = args.patch or list(PATCHES)
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"--patch: unknown patch(es) {unknown}; known patches: {sorted(PATCHES)}")
    _check_level_flags(args)
    if args.lines:
        return lines_main(args)
    patches = [PATCHES[n] for n in names]
    if not patches:
        print("no patches registered", file=sys.stderr)
        return 1

    def progress(msg: str) -> None:
        print(f"[mutate] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    results = patch_mutation.mutate(patches, workers=args.workers, timeout_s=args.timeout, cwd=repo_root(),
                                    progress=progress, jobs=args.jobs, baselines=args.baseline or (),
                                    preload=zygote.PRELOAD if args.preload else None)
    killed = sum(r.state == "killed" for r in results)
    if args.json:
        print(json.dumps({"patches": [r.to_dict() for r in results], "killed": killed, "total": len(results),
                          "seconds": round(time.perf_counter() - t0, 1)}, indent=2))
    else:
        print(patch_mutation.format_table(results))
        print(f"total: {time.perf_counter() - t0:.1f}s")
    return 0 if killed == len(results) else 1
