"""``python -m verify {report, solve (alias: plan), goldens, mutate, scale, bisect, sweep}``: the equivalence layer's command line.

Every flag is checked where it is parsed, so a bad value is one line that names the flag
(``argument --layers: ...``), never a traceback or a bare ``int()`` message. ``$AUTOPARALLEL_DISABLE``
is checked before any command runs.
"""

from __future__ import annotations

import argparse
import sys

from autoparallel.defaults import BUCKET_CAP_MB, DEFAULT_LOWERING, FSDP_TP, HAND_PLANS, LOWERINGS, PLANS
from verify.stages.defaults import MESH, PLAN, PRESET, TRAINER_PRESET


def _flag_type(check, what: str):
    """An argparse ``type`` from ``check(text) -> value`` that raises ValueError; argparse then
    prints ``argument --flag: <message>``."""

    def parse(text: str):
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def _positive(kind):
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"takes a positive {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise ValueError(f"takes a positive {kind.__name__}, got {text!r}")
        return value

    return _flag_type(check, f"positive {kind.__name__}")


def _layer_list(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"takes positive ints like 32 or 2,8,32, got {text!r}")
    return [int(p) for p in parts]


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"takes an int >= 0, got {text!r}")
    return int(text)


def _workers(text: str) -> str:
    if text == "auto" or text.isdigit():
        return text
    raise ValueError(f"takes 'auto' or a number of workers >= 0, got {text!r}")


def _preset(text: str) -> str:
    from autoparallel.models.llama3 import model_args

    model_args(text)  # ValueError naming the valid presets
    return text


def _model_case(text: str) -> str:
    from verify.model_case import load_case

    load_case(text)  # ValueError naming the module or attribute that is wrong
    return text


def _hf_case(text: str):
    from verify.hf import hf_case

    return hf_case(text)  # ValueError naming the known model types, or the missing hf extra


def _mesh(text: str) -> str:
    from autoparallel.mesh import MeshSpec

    return str(MeshSpec.parse(text))


def _dtype(text: str) -> str:
    from verify.stages.scenario import parse_dtype as lookup

    lookup(text)
    return text


def _html_dir(text: str):
    """A directory to write the page into: created if missing; not a file, and writable."""
    import os
    from pathlib import Path

    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{text!r} is a file; give a directory (the page is written as DIR/index.html)")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{text!r}: {str(probe)!r} is a file, so the directory cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{text!r}: directory {str(probe)!r} is not writable")
    return path


def _patch_list(text: str) -> list[str]:
    from autoparallel.patches import PATCHES

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PATCHES))
    if not names or unknown:
        raise ValueError(f"takes registered patch names like fuse_chained_allgathers,pre_overlap_bucketing; "
                         f"unknown: {unknown or [text]}; known: {sorted(PATCHES)}")
    return names


def add_model_selector(p: argparse.ArgumentParser, default: str | None, default_text: str | None = None) -> None:
    """``--preset NAME | --model pkg.mod:name | --hf TYPE``: how every command that runs a model
    names it. ``args.preset`` is the LLaMA-3 preset; ``args.model`` the model case instead (a
    ``package.module:name`` reference, checked here, or the Hugging Face case already built), None
    for the preset. One helper, so the four commands that run a model name it the same way."""
    which = p.add_mutually_exclusive_group()
    which.add_argument("--preset", default=default, type=_flag_type(_preset, "preset"),
                       help=f"LLaMA-3 model preset: tiny, debug, 8b (default: {default_text or default})")
    which.add_argument("--model", default=None, type=_flag_type(_model_case, "model"),
                       help="your model instead of a preset: package.module:name naming a verify.ModelCase "
                            "(or a function returning one), or a verify.zoo name (gpt2, convnet, ln_mlp)")
    which.add_argument("--hf", dest="model", default=None, type=_flag_type(_hf_case, "architecture"),
                       help="a Hugging Face transformers model type (any with a causal-LM, masked-LM, seq2seq-LM or "
                            "image-classification auto class: gpt2, bert, llama, t5, vit, ...) or a config.json path, "
                            "from a tiny config with the library's defaults (verify.hf; needs the hf extra)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verify", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    mesh = _flag_type(_mesh, "mesh")
    dtype = _flag_type(_dtype, "dtype")
    workers = _flag_type(_workers, "workers")

    r = sub.add_parser("report", help="pipeline stages, collectives and parity for one scenario")
    add_model_selector(r, None, "tiny; debug with --trainer")
    r.add_argument("--plan", default=None, choices=PLANS,
                   help="parallel plan; auto: the ILP planner places everything (default: fsdp)")
    r.add_argument("--mesh", default=None, type=mesh, help="mesh, e.g. dp=8 or dp=4,tp=2 (default: dp=8)")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    r.add_argument("--no-parity", action="store_true", help="skip the parity run")
    r.add_argument("-v", "--verbose", action="store_true",
                   help="also show upstream Inductor's INFO lines from the collective passes (one per bucket and rank)")
    r.add_argument("--native-collectives", action="store_true",
                   help="parity with gloo's own reductions, whose sums depend on buffer layout above 2 ranks "
                        "(default: rank-ordered, verify/parity/ordered_collectives.py)")
    r.add_argument("--full-mesh", action="store_true",
                   help="forked parity on the whole mesh, not each dim cut to 2 (a launched job always runs "
                        "the whole mesh: its world), so forked and torchrun digests of any size compare")
    r.add_argument("--no-oracle", action="store_true",
                   help="skip the single-device oracle (the model does not fit one process): the stages are "
                        "still compared bitwise with the eager parallel program; the report says so")
    r.add_argument("--parity-anyway", action="store_true",
                   help="run parity even for a model above the size limit (it runs the model for real)")
    r.add_argument("--html", default=None, metavar="DIR", type=_flag_type(_html_dir, "directory"),
                   help="also write the HTML report, DIR/index.html (created if missing)")
    r.add_argument("--trainer", action="store_true",
                   help="the graph trainer's stages (single-device training step, graph SAC, remat) "
                        "with measured CPU memory, instead of the parallel pipeline")

    pl = sub.add_parser("solve", aliases=["plan"], help="automatic placement: solve a preset's placement on a fake world with the ILP planner (alias: plan)")
    from verify.commands.planning import add_arguments as add_plan_arguments

    add_model_selector(pl, "tiny")
    add_plan_arguments(pl, mesh=mesh, dtype=dtype, count=_positive(int), seconds=_positive(float),
                       blocks=_flag_type(_non_negative_int, "int >= 0"))

    g = sub.add_parser("goldens", help="regenerate (--update) or check (--check) the golden files")
    mode = g.add_mutually_exclusive_group(required=True)
    mode.add_argument("--update", action="store_true", help="rewrite goldens from the current code, delete unused ones")
    mode.add_argument("--check", action="store_true", help="fail on any changed, missing, corrupt or unused golden")
    g.add_argument("-n", dest="workers", default="auto", type=workers, help="pytest-xdist workers (default: auto)")
    g.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")

    m = sub.add_parser("mutate", help="disable each registered patch and require its guard tests to fail")
    m.add_argument("--patch", action="append", help="only this patch (repeatable)")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.add_argument("-n", dest="workers", default="0", type=workers, help="pytest-xdist workers per run (default: 0)")
    m.add_argument("--timeout", type=_positive(float), default=300.0,
                   help="seconds allowed per disabled run (default: 300)")
    m.add_argument("-j", "--jobs", type=_positive(int), default=1,
                   help="patches whose guards run at once, each in its own pytest process (default: 1)")
    m.add_argument("--baseline", action="append", metavar="FILE",
                   help="outcomes of an earlier pytest run on this tree ($AUTOPARALLEL_OUTCOME_LOG): its guards "
                        "are not run again with every patch enabled (repeatable; CI passes its tier and slow step)")
    m.add_argument("--no-preload", dest="preload", action="store_false",
                   help="each guard run a fresh `python -m pytest` (default: forked from one process that imported "
                        "torch, the project and pytest once: verify/commands/mutation/zygote.py)")
    m.add_argument("--lines", action="store_true", help="line-level mutation with mutmut (slow)")
    from verify.commands.mutation.lines import (  # stdlib only, like the rest of the parser
        TARGETS,
        VERIFY_GROUP_NAMES,
        add_sample_args,
    )

    m.add_argument("--target", choices=TARGETS, default="passes",
                   help="with --lines: autoparallel/passes, autoparallel/planner, or the checkers of verify/ group by group "
                   "(default: passes)")
    m.add_argument("--group", action="append", choices=VERIFY_GROUP_NAMES,
                   help="with --lines --target verify: only this group of checkers (repeatable; default: all)")
    add_sample_args(m)

    b = sub.add_parser("bisect", help="name the first pass whose graphs compute other values (simulated ranks)")
    add_model_selector(b, PRESET)
    b.add_argument("--plan", default=PLAN, choices=HAND_PLANS, help=f"parallel plan (default: {PLAN})")
    b.add_argument("--mesh", default=MESH, type=mesh,
                   help=f"mesh, e.g. dp=8 or dp=4,tp=2; its size is the number of simulated ranks (default: {MESH})")
    b.add_argument("--param-dtype", default=None, type=dtype, help="FSDP mixed-precision param dtype, e.g. bf16")
    b.add_argument("--reduce-dtype", default=None, type=dtype, help="FSDP gradient reduce dtype, e.g. fp32")
    b.add_argument("--bucket-cap-mb", type=_positive(float), default=BUCKET_CAP_MB, help=f"pre-overlap bucket cap (default: {BUCKET_CAP_MB:g})")
    b.add_argument("--disable", default=None, type=_flag_type(_patch_list, "patch list"),
                   help="compare the pipeline with these patches disabled (A, comma list) against as configured (B)")
    b.add_argument("--seed", default=0, type=_flag_type(_non_negative_int, "int >= 0"),
                   help="seed of the random inputs (default: 0)")
    b.add_argument("--json", action="store_true", help="print one JSON object")

    sc = sub.add_parser("scale", help="benchmark every pipeline stage on real-size graphs (fake world)")
    add_model_selector(sc, "8b")
    sc.add_argument("--layers", default=None, type=_flag_type(_layer_list, "layers"),
                    help="override a preset's n_layers; a list like 2,8,32 prints a scaling table")
    sc.add_argument("--mesh", default="dp=16,tp=8", type=mesh, help="mesh (default: dp=16,tp=8)")
    sc.add_argument("--plan", default=FSDP_TP, choices=PLANS,
                    help="plan; auto: plan with the ILP planner, then lower (default: fsdp_tp)")
    sc.add_argument("--repeat", type=_positive(int), default=1, help="runs per size; seconds are medians (default: 1)")
    sc.add_argument("--bucket-cap-mb", type=_positive(float), default=BUCKET_CAP_MB, help=f"pre-overlap bucket cap (default: {BUCKET_CAP_MB:g})")
    sc.add_argument("--param-dtype", default=None, type=dtype, help="FSDP mixed-precision param dtype, e.g. bf16 (default: none)")
    sc.add_argument("--reduce-dtype", default=None, type=dtype, help="FSDP gradient reduce dtype, e.g. fp32 (default: none)")
    sc.add_argument("--lowering", default=DEFAULT_LOWERING, choices=LOWERINGS,
                    help="how the joint stage lowers a plan=auto plan (autoparallel.planner.replay; default: %(default)s)")
    sc.add_argument("--json", action="store_true", help="print one JSON object")
    sw = sub.add_parser("sweep", help="every Hugging Face model type through check_model: docs/hf-coverage.md")
    sw.add_argument("--types", default=None, type=_flag_type(_name_list, "type list"),
                    help="only these model types, comma list (default: every one with a causal-LM, masked-LM, "
                         "seq2seq-LM or image-classification auto class)")
    sw.add_argument("--plans", default=["fsdp", "auto"], type=_flag_type(_name_list, "plan list"),
                    help="comma list of fsdp (dp=2), auto (dp=2,tp=2), build (the tiny model's eager step only) "
                         "(default: fsdp,auto)")
    sw.add_argument("-j", "--jobs", type=_positive(int), default=1, help="cells at once, each its own process (default: 1)")
    sw.add_argument("--timeout", type=_positive(float), default=600.0, help="seconds allowed per cell (default: 600)")
    sw.add_argument("--out", default="docs/hf-coverage", help="output path without suffix: OUT.md and OUT.json "
                    "(default: docs/hf-coverage)")
    sw.add_argument("--note", default="", help="a line for the page saying what this run covered")
    sw.add_argument("--list", action="store_true", help="print the model types and exit")
    sw.add_argument("--from-json", default=None, metavar="PATH", action="append",
                    help="run nothing: write the table again from a sweep's JSON, its reasons classified anew "
                         "(repeatable: one table of several sweeps' cells; a later sweep's cell replaces an earlier one's)")
    return p


def _name_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"takes a comma list of names, got {text!r}")
    return names


REPORT_DEFAULTS = {"preset": PRESET, "plan": PLAN, "mesh": MESH}
# Flags that size a LLaMA-3 preset: a model case (--model, --hf) brings its own sizes.
PRESET_ONLY = {"solve": ("layers", "seq", "batch"), "scale": ("layers",)}


def _preset_only_flags(parser: argparse.ArgumentParser, args) -> None:
    """A preset's size flags given with ``--model`` / ``--hf`` are an error naming them."""
    given = [f"--{k}" for k in PRESET_ONLY.get(args.command, ()) if getattr(args, k, None) is not None]
    if getattr(args, "model", None) is not None and given:
        parser.error(f"argument {given[0]}: sizes a LLaMA-3 preset; a model given by --model or --hf brings its own sizes")


def _report_defaults(parser: argparse.ArgumentParser, args) -> None:
    """Fill in ``report``'s defaults, which depend on ``--trainer`` (flags it cannot take are an
    error naming them)."""
    if args.trainer:
        given = [f"--{k}" for k in ("model", "plan", "mesh") if getattr(args, k, None) is not None]
        if given:
            parser.error(f"argument --trainer: the graph trainer traces one single-device training step; "
                         f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} not apply")
        args.preset = args.preset or TRAINER_PRESET
        return
    for k, v in REPORT_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "plan":  # the alias runs exactly as `solve`
        args.command = "solve"
    if args.command == "report":
        _report_defaults(parser, args)
    _preset_only_flags(parser, args)
    # Each command imports only its own module, here: `python -m verify goldens` and `mutate`
    # start without importing torch (they run pytest in a subprocess).
    try:
        from autoparallel.patches import disabled_from_env

        disabled_from_env()  # an unknown name in $AUTOPARALLEL_DISABLE stops every command here
        if args.command == "report" and args.trainer:
            from verify.commands.trainer_report import main as trainer_report_main

            return trainer_report_main(args)
        if args.command == "report":
            from verify.commands.report import main as report_main

            return report_main(args)
        if args.command == "solve":
            from verify.commands.planning import main as plan_main

            return plan_main(args)
        if args.command == "mutate":
            from verify.commands.mutation.cli import main as mutate_main

            return mutate_main(args)
        if args.command == "scale":
            from verify.commands.scale import main as scale_main

            return scale_main(args)
        if args.command == "bisect":
            from verify.commands.bisect import main as bisect_main

            return bisect_main(args)
        if args.command == "sweep":
            from verify.commands.sweep import main as sweep_main

            args.argv = list(argv if argv is not None else sys.argv[1:])[1:]
            return sweep_main(args)
        if args.command == "goldens":
            from verify.goldens.cli import main as goldens_main

            return goldens_main(args)
    except ValueError as e:  # bad preset / plan / mesh: a one-line message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
