"""``python -m verify {report, plan, goldens, mutate, scale}``: the equivalence layer's command line."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verify", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("report", help="pipeline stages, collectives and parity for one scenario")
    r.add_argument("--preset", default="tiny", help="model preset: tiny, debug, 8b (default: tiny)")
    r.add_argument("--plan", default="fsdp", choices=["fsdp", "fsdp_tp", "ddp"], help="parallel plan (default: fsdp)")
    r.add_argument("--mesh", default="dp=8", help="mesh, e.g. dp=8 or dp=4,tp=2 (default: dp=8)")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    r.add_argument("--no-parity", action="store_true", help="skip the gloo parity run")

    pl = sub.add_parser("plan", help="automatic placement: plan a preset on a fake world with the ILP planner")
    from verify.plan_cli import add_arguments as add_plan_arguments

    add_plan_arguments(pl)

    g = sub.add_parser("goldens", help="regenerate (--update) or check (--check) the golden files")
    mode = g.add_mutually_exclusive_group(required=True)
    mode.add_argument("--update", action="store_true", help="rewrite goldens from the current code, delete unused ones")
    mode.add_argument("--check", action="store_true", help="fail on any changed, missing, corrupt or unused golden")
    g.add_argument("-n", dest="workers", default="auto", help="pytest-xdist workers (default: auto)")
    g.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")

    m = sub.add_parser("mutate", help="disable each registered patch and require its guard tests to fail")
    m.add_argument("--patch", action="append", help="only this patch (repeatable)")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.add_argument("-n", dest="workers", default="0", help="pytest-xdist workers per run (default: 0)")
    m.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per disabled run (default: 300)")
    m.add_argument("--lines", action="store_true", help="line-level mutation of autoparallel/passes with mutmut (slow)")

    sc = sub.add_parser("scale", help="benchmark every pipeline stage on real-size graphs (fake world)")
    sc.add_argument("--preset", default="8b", help="model preset (default: 8b)")
    sc.add_argument("--layers", default=None, help="override n_layers; a list like 2,8,32 prints a scaling table")
    sc.add_argument("--mesh", default="dp=16,tp=8", help="mesh (default: dp=16,tp=8)")
    sc.add_argument("--plan", default="fsdp_tp", choices=["fsdp", "fsdp_tp", "ddp"], help="plan (default: fsdp_tp)")
    sc.add_argument("--repeat", type=int, default=1, help="runs per size; seconds are medians (default: 1)")
    sc.add_argument("--bucket-cap-mb", type=float, default=25.0, help="pre-overlap bucket cap (default: 25)")
    sc.add_argument("--param-dtype", default=None, help="FSDP mixed-precision param dtype, e.g. bf16 (default: none)")
    sc.add_argument("--reduce-dtype", default=None, help="FSDP gradient reduce dtype, e.g. fp32 (default: none)")
    sc.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "report":
            from verify.report import main as report_main

            return report_main(args)
        if args.command == "plan":
            from verify.plan_cli import main as plan_main

            return plan_main(args)
        if args.command == "mutate":
            from verify.mutation import main as mutate_main

            return mutate_main(args)
        if args.command == "scale":
            from verify.scale import main as scale_main

            return scale_main(args)
        if args.command == "goldens":
            from verify.golden_cli import main as goldens_main

            return goldens_main(args)
    except ValueError as e:  # bad preset / plan / mesh: a one-line message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
