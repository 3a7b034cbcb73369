"""``python -m verify solve``: the automatic placement planner on a model (a LLaMA preset, a
``ModelCase`` or a Hugging Face model type: ``verify.__main__.add_model_selector``), on a fake world.

Progress goes to stderr; stdout gets the plan summary and the per-parameter placement table
(or, with ``--json``, the plan as JSON). ``--explain NODE`` (a canonical key, an FX node name or
a parameter FQN; repeatable) prints why that node got its placement; ``--compare-hand fsdp_tp``
prices a hand plan under the same cost model and prints how the two differ.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from autoparallel.defaults import HAND_PLANS

GIB = 2**30


def add_arguments(p: argparse.ArgumentParser, *, mesh=str, dtype=str, count=int, seconds=float, blocks=int) -> None:
    """The ``plan`` subcommand's flags besides the model's; the ``type`` callables (``python -m
    verify`` passes ones that reject a bad value naming the flag) check each value where it is parsed."""
    p.add_argument("--mesh", default="dp=8", type=mesh, help="mesh, e.g. dp=8 or dp=4,tp=2 (default: dp=8)")
    p.add_argument("--layers", type=count, default=None, help="override the preset's n_layers")
    p.add_argument("--batch", type=count, default=None, help="global batch (default: the first mesh dim's size)")
    p.add_argument("--seq", type=count, default=None, help="sequence length (default: the preset's max_seq_len)")
    p.add_argument("--memory-budget", type=float, default=None, help="per-rank parameter memory budget in GiB (default: fully sharded)")
    p.add_argument("--peak-memory-budget", type=float, default=None,
                   help="per-rank peak memory budget in GiB: parameters, activations and gradients live at any point of the step (default: none)")
    p.add_argument("--profile", default="h100", help="device profile name or a .json file (default: h100)")
    p.add_argument("--param-dtype", default=None, type=dtype, help="mixed precision compute dtype of parameters, e.g. bf16")
    p.add_argument("--time-limit", type=seconds, default=120.0, help="solver time limit in seconds (default: 120)")
    p.add_argument("--trace-blocks", type=blocks, default=None,
                   help="trace only this many identical blocks (>= 4) and expand; 0: trace every block (default: automatic)")
    p.add_argument("--no-cluster", action="store_true", help="do not share variables between identical blocks")
    p.add_argument("--explain", action="append", default=[], metavar="NODE", help="explain a node's placement (repeatable)")
    p.add_argument("--compare-hand", default=None, choices=HAND_PLANS, help="also price this hand plan and diff")
    p.add_argument("--save", default=None, metavar="FILE", help="write the plan as JSON to FILE")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.add_argument("--text", action="store_true", help="print the canonical plan text (what goldens hold) instead of tables")
    p.add_argument("--iopddl", default=None, metavar="FILE", help="solve this IOPDDL contest instance (JSON, may be gzipped) instead")


def main(args: argparse.Namespace) -> int:
    if args.iopddl:
        from verify.commands.iopddl.cli import main as iopddl_main

        return iopddl_main(args)
    t_start = time.perf_counter()
    from autoparallel.mesh import MeshSpec, fake_world
    from autoparallel.models.llama3 import model_args
    from autoparallel.parallelize import ParallelPlan
    from autoparallel.planner import PlannerConfig, diff, evaluate_hand_plan, get_profile
    from verify.stages import plan_cases
    from verify.stages.scenario import Scenario, parse_dtype

    def say(msg: str) -> None:
        print(f"[plan {time.perf_counter() - t_start:7.2f}s] {msg}", file=sys.stderr, flush=True)

    spec = MeshSpec.parse(args.mesh)
    get_profile(args.profile)  # an unknown profile fails before any tracing
    overrides = {"n_layers": args.layers} if args.layers else {}
    margs = model_args(args.preset, **overrides)
    seq = args.seq or margs.max_seq_len
    batch = args.batch or spec.shape[0]
    if args.memory_budget is not None and not args.memory_budget >= 0:
        raise ValueError(f"--memory-budget must be >= 0 GiB, got {args.memory_budget}")
    if args.peak_memory_budget is not None and not args.peak_memory_budget >= 0:
        raise ValueError(f"--peak-memory-budget must be >= 0 GiB, got {args.peak_memory_budget}")
    config = PlannerConfig(
        profile=args.profile,
        memory_budget=None if args.memory_budget is None else args.memory_budget * GIB,
        peak_memory_budget=None if args.peak_memory_budget is None else args.peak_memory_budget * GIB,
        param_dtype=parse_dtype(args.param_dtype) if args.param_dtype else None,
        cluster=not args.no_cluster,
        time_limit=args.time_limit,
        trace_blocks=args.trace_blocks,
    )
    if args.peak_memory_budget is not None and args.trace_blocks is None:
        args.trace_blocks = 0  # a peak over the step needs every block's activations
    case = getattr(args, "model", None)
    if case is None:
        planner = plan_cases.planner(args.preset, args.layers, batch, args.trace_blocks, args.param_dtype, args.seq, say)
    else:
        planner = plan_cases.case_planner(case, str(spec), args.trace_blocks, args.param_dtype, say)
    say(f"{planner.description} on mesh {spec}, profile {args.profile}")
    with fake_world(spec) as mesh:
        plan = planner.plan(mesh, config, progress=say)
        hand = None
        if args.compare_hand:
            say(f"pricing the hand plan {args.compare_hand} under the same cost model")
            if case is None:
                model, inputs = plan_cases.model_and_inputs(args.preset, args.layers, batch, seq)
                hand_plan, loss_fn = ParallelPlan.preset(args.compare_hand), None
            else:
                scenario = Scenario(case=case, plan=args.compare_hand, mesh=str(spec))
                model, loss_fn, inputs, hand_plan, _ = scenario.pipeline_inputs()
            hand = evaluate_hand_plan(model, mesh, inputs, hand_plan, loss_fn, config=config, planner=planner, progress=say)
        explained = [plan.explain(node) for node in args.explain]
    total = time.perf_counter() - t_start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    plan.stats["total_seconds"] = total
    plan.stats["peak_rss_gib"] = rss
    say(f"done in {total:.2f}s, peak RSS {rss:.2f} GiB")
    if args.save:
        plan.save(args.save)
        say(f"plan written to {args.save}")
    if args.text:
        print(plan.text(), end="")
        return 0
    if args.json:
        out = plan.to_json()
        if hand is not None:
            out["hand"] = hand.to_json()
        if explained:
            out["explain"] = explained
        print(json.dumps(out, indent=1))
        return 0
    print(f"plan for {plan.model} on mesh {spec} ({plan.profile})")
    print(plan.summary())
    st = plan.stats
    print(
        f"time: trace {st['trace_seconds']:.2f}s, strategies {st['strategy_seconds']:.2f}s, problem {st['problem_seconds']:.2f}s, "
        f"solve {st['solve_seconds']:.2f}s + LP {st['lp_seconds']:.2f}s ({st.get('lp_iterations', 0)} simplex iterations; heuristic incumbent {st.get('incumbent_seconds', 0.0):.2f}s); "
        f"total {total:.2f}s, peak RSS {rss:.2f} GiB"
    )
    print(
        f"ILP: {st['graph_nodes']} nodes -> {st['classes']} choice classes ({st['eliminated']} solved in closed form); "
        f"variables {st['variables_before']} -> {st['variables_after']}, constraints {st['constraints_before']} -> {st['constraints_after']}, "
        f"{st['fixed_by_reduced_cost']} fixed by reduced cost"
    )
    print()
    print(plan.param_table())
    if hand is not None:
        print()
        print(f"hand plan {args.compare_hand} under the same cost model:")
        print(hand.summary())
        print()
        print(f"diff hand {args.compare_hand} -> auto:")
        print(diff(hand, plan))
    for text in explained:
        print()
        print(text, end="")
    return 0
