"""``python -m verify.commands.iopddl.bench DIR [--time-limit S] [--only A,B] [--save FILE]``:
solve every IOPDDL instance in DIR (``*.json`` / ``*.json.gz``, e.g. google/iopddl's benchmarks
folder) with ``python -m verify solve --iopddl``'s code path, each answer checked by the
independent evaluator, and print the table: instance, nodes, our cost, cost / best, seconds,
proven optimal; then the geometric mean of cost / best and the instances where we beat the best.

The bests are the contest's final results for the benchmarks folder (issue 43, from
``iopddl_final_results.csv`` in ti2-group/iopddl_experiments; P's is XLA's own).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
import time

from verify.commands.iopddl.cli import run

BEST = {
    "A": 6_548_641_531, "B": 532_843, "C": 84_102_445_260, "D": 313_613_524_736, "G": 217_039,
    "K": 2_274_276_676, "L": 1_970_993_742, "M": 49_928_460_991, "N": 202_739_586_553,
    "P": 651_833_115_436, "Q": 526_776_842_042, "R": 371_899_551_572, "S": 1_534_613_444,
    "T": 682_895_254_913, "U": 2_569_342_178, "V": 1_632_051,
}


def letter(path: str) -> str:
    m = re.search(r"iopddl-([A-Z])\.json", os.path.basename(path))
    return m.group(1) if m else os.path.basename(path)


def table(rows: list) -> str:
    lines = ["| instance | nodes | our cost | cost / best | seconds | proven optimal |", "|---|---:|---:|---:|---:|---|"]
    ratios, beaten = [], []
    for r in rows:
        if r["cost"] is None:
            lines.append(f"| {r['letter']} | - | failed: {r['error']} | - | {r['seconds']:.1f} | no |")
            continue
        best = BEST.get(r["letter"])
        ratio = r["cost"] / best if best else None
        if ratio is not None:
            ratios.append(ratio)
            if r["cost"] < best:
                beaten.append(r["letter"])
        lines.append(f"| {r['letter']} | {r['nodes']:,} | {r['cost']:,} | {'-' if ratio is None else f'{ratio:.4f}'} | "
                     f"{r['seconds']:.1f} | {'yes' if r['optimal'] else 'no'} |")
    if ratios:
        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        lines.append("")
        lines.append(f"geometric mean of cost / best over {len(ratios)} instances: {gm:.4f}")
        lines.append(f"beat the best: {', '.join(beaten) if beaten else 'none'}")
    failed = [r["letter"] for r in rows if r["cost"] is None]
    if failed:
        lines.append(f"no feasible plan: {', '.join(failed)} (not in the geometric mean)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m verify.commands.iopddl.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="directory of IOPDDL instances (*.json or *.json.gz)")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per instance, reading included (default: 120)")
    p.add_argument("--only", default=None, help="comma-separated instance letters, e.g. B,G")
    p.add_argument("--save", default=None, metavar="FILE", help="also write the rows as JSON to FILE")
    args = p.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.dir, "*.json")) + glob.glob(os.path.join(args.dir, "*.json.gz")))
    if args.only:
        keep = set(args.only.split(","))
        paths = [q for q in paths if letter(q) in keep]
    if not paths:
        print(f"error: no *.json or *.json.gz instances in {args.dir}", file=sys.stderr)
        return 2
    rows = []
    t0 = time.perf_counter()
    for path in paths:
        def say(msg, name=letter(path)):
            print(f"[bench {time.perf_counter() - t0:7.1f}s {name}] {msg}", file=sys.stderr, flush=True)

        t = time.perf_counter()
        try:
            out = run(path, args.time_limit, say)
            out.pop("solution")
            say(f"cost {out['cost']} in {out['seconds']}s ({out['method']})")
        except ValueError as e:  # no plan (or a rejected one): a row that says so, then the next instance
            say(f"FAILED: {e}")
            out = {"instance": os.path.basename(path), "nodes": None, "cost": None, "optimal": False,
                   "seconds": round(time.perf_counter() - t, 2), "error": str(e)}
        out["letter"] = letter(path)
        rows.append(out)
        if args.save:
            with open(args.save, "w") as f:
                json.dump(rows, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
