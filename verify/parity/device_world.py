"""Stage parity on one accelerator: every rank of a gloo world on the same device.

One GPU answers the compile stack's questions about CUDA: do the second compile's graphs, run on
CUDA tensors, still train bitwise like the eager parallel program, and how far do Inductor's
(Triton) kernels move losses and gradients? Every rank of a gloo world binds the same device
(NCCL refuses two ranks on one device); the collectives on CUDA tensors run on host copies
(:func:`host_staged_collectives`), the reductions rank-ordered. Each
rank builds its own mesh (device type ``cuda``), traces and compiles for itself, in a process of
its own (``spawn``: CUDA cannot be used in a process forked after the parent initialised it), and
trains ``steps`` steps (AdamW between) from the same parameters with each executor:

==================  ==============================================================================
``eager``           the eager parallel program, the reference
``eager again``     the same program once more: a device whose kernels are not deterministic
                    would make nothing bitwise, and this says so before any verdict blames a pass
``aot_eager``       the pipeline's second compile (``PipelineOptions.compiler="aot_eager"``): the
                    graphs run as traced, bitwise with ``eager``
``inductor``        the same pipeline with ``compiler="inductor"``: fused and reordered kernels,
                    compared within a tolerance (:func:`tolerance_checks`), random ops falling
                    back to ATen's (``fallback_random``) so that dropout draws eager's masks
==================  ==============================================================================

Ranks run with deterministic algorithms (``warn_only``) and cuBLAS's deterministic workspace.
A compiler that fails is recorded with its error, and the other executors' results still come
back. ``device="cpu"`` runs the same code on forked ranks: what CI, without a GPU, checks of it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch._dynamo
import torch.distributed as dist

from autoparallel.compile import SECOND_COMPILE
from autoparallel.mesh import build_mesh
from autoparallel.parallelize import ParallelProgram
from autoparallel.pipeline import run_pipeline
from autoparallel.runtime import to_cpu
from autoparallel.runtime.steps import StepTrace
from verify.hf import hf_case
from verify.parity.compare import (
    OracleCheck,
    ParityReport,
    check_within,
    module_scales,
    worst_ratio,
)
from verify.parity.ordered_collectives import RANK_ORDERED, run_parity_world
from verify.parity.runs import compare_with_eager, rank_seed
from verify.stages.pipeline_run import pipeline_options
from verify.stages.rank_context import RankContext
from verify.stages.registry import build_executor
from verify.stages.scenario import Scenario

EAGER, EAGER_AGAIN = "eager", "eager again"
COMPILERS = ("aot_eager", "inductor")
HF_PREFIX = "hf:"
# Inductor against eager: |diff| <= INDUCTOR_RTOL x the loss, or x the largest entry of any
# gradient of the same module (verify.parity.compare.module_scales). Inductor on CPU reached 0.45
# of 1e-4 (tiny LLaMA, fsdp dp=2, 2 steps); docs/gpu.md's table gives what each CUDA cell reached.
INDUCTOR_RTOL = 2e-4


@dataclass(frozen=True)
class DeviceCell:
    """A model, plan and mesh to run on one device. ``model``: a LLaMA preset name, or
    ``"hf:<arch>"`` for a ``verify.hf`` architecture at its library defaults (tokens and their mask). Plain strings, so the
    cell crosses to spawned ranks (a ModelCase's factory is a closure)."""

    model: str = "tiny"
    plan: str = "fsdp"
    mesh: str = "dp=2"
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.model} {self.plan} {self.mesh}"

    def scenario(self) -> Scenario:
        if self.model.startswith(HF_PREFIX):
            return Scenario(plan=self.plan, mesh=self.mesh, seed=self.seed, case=hf_case(self.model[len(HF_PREFIX):], attention_mask=True))
        return Scenario(preset=self.model, plan=self.plan, mesh=self.mesh, seed=self.seed)


@dataclass
class DeviceRank:
    """One rank's results: its traces by executor (on CPU), wall seconds, peak memory in bytes
    (``allocated``/``reserved`` per executor; CUDA only), the errors of compilers that failed,
    and what ran it (process-group backend and device)."""

    rank: int
    backend: str
    device: str
    traces: dict[str, StepTrace]
    seconds: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def run_device_parity(
    cell: DeviceCell,
    compilers: Sequence[str] = COMPILERS,
    *,
    device: str = "cuda",
    steps: int = 2,
    timeout_s: float = 900.0,
) -> list[DeviceRank]:
    """Train ``cell`` with ``eager``, ``eager again`` and each of ``compilers`` on a gloo world
    whose ranks all use ``device`` (module docstring; ``"cuda"``: the current CUDA device); the
    ranks' results, by rank."""
    unknown = sorted(set(compilers) - set(COMPILERS))
    if unknown:
        raise ValueError(f"unknown compilers {unknown}; compilers: {list(COMPILERS)}")
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected cpu or cuda")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"  # one device, named: every rank binds it
    spec = cell.scenario().mesh_spec
    start = "spawn" if torch.device(device).type == "cuda" else "fork"
    # Rank-ordered reductions always: their all-gathers and all-to-alls are what the host stages.
    return run_parity_world(_rank, spec.world_size, args=(cell, tuple(compilers), device, steps),
                            timeout_s=timeout_s, start_method=start, mode=RANK_ORDERED)


@contextlib.contextmanager
def deterministic_kernels() -> Iterator[None]:
    """Deterministic algorithms (warnings only where an op has none) inside; the setting before is
    restored after. cuBLAS reads its workspace setting once: set it before the first CUDA call."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


_c10d = torch.ops._c10d_functional


def _on_host(op, input: torch.Tensor, *args) -> torch.Tensor:
    """``op`` (a functional collective) run on a host copy of ``input``; the result, waited for,
    back on ``input``'s device."""
    return _c10d.wait_tensor(op(input.cpu(), *args)).to(input.device)


def _all_gather(input, group_size, group_name):
    return _on_host(_c10d.all_gather_into_tensor, input, group_size, group_name)


def _all_gather_out(input, group_size, group_name, *, out):
    return out.copy_(_all_gather(input, group_size, group_name))


def _all_gather_coalesced(inputs, group_size, group_name):
    return [_all_gather(t, group_size, group_name) for t in inputs]


def _all_to_all(input, output_split_sizes, input_split_sizes, group_name):
    return _on_host(_c10d.all_to_all_single, input, output_split_sizes, input_split_sizes, group_name)


def _broadcast(input, src, group_name):
    return _on_host(_c10d.broadcast, input, src, group_name)


def _broadcast_inplace(input, src, group_name):
    return input.copy_(_broadcast(input, src, group_name))


# The collectives that move bytes and add nothing; the reductions are the rank-ordered mode's
# (verify.parity.ordered_collectives), which exchanges contributions through these two.
STAGED_KERNELS = {
    "all_gather_into_tensor": _all_gather,
    "all_gather_into_tensor_out": _all_gather_out,
    "all_gather_into_tensor_coalesced": _all_gather_coalesced,
    "all_to_all_single": _all_to_all,
    "broadcast": _broadcast,
    "broadcast_": _broadcast_inplace,
}


@contextlib.contextmanager
def host_staged_collectives() -> Iterator[None]:
    """Inside, the functional collectives on CUDA tensors run gloo's CPU path on host copies.
    gloo's own CUDA all-gather crashed the rank (SIGSEGV in ``wait_tensor``, torch 2.11, two ranks
    on one H100); staging through the host is what gloo does for CUDA tensors anyway. The kernels
    go when the scope ends."""
    lib = torch.library.Library("_c10d_functional", "IMPL")
    try:
        for name, kernel in STAGED_KERNELS.items():
            if hasattr(_c10d, name):  # all of them since torch 2.6; a torch without one never calls it
                lib.impl(name, kernel, "CUDA")
        yield
    finally:
        lib._destroy()


def _rank(rank: int, world_size: int, cell: DeviceCell, compilers: tuple[str, ...], device: str, steps: int) -> DeviceRank:
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # this rank's own process
        torch.cuda.set_device(torch.device(device))
    with deterministic_kernels(), host_staged_collectives() if on_cuda else contextlib.nullcontext():
        return _train_every_executor(rank, cell, compilers, device, steps)


def _train_every_executor(rank: int, cell: DeviceCell, compilers: tuple[str, ...], device: str, steps: int) -> DeviceRank:
    scenario = cell.scenario()
    plan = scenario.plan_obj()
    device_type = torch.device(device).type
    mesh = build_mesh(scenario.mesh_spec, device_type)
    program = ParallelProgram(scenario.model(device=device), plan, mesh, scenario.loss_fn)
    batches = [tuple(t.to(device) for t in b) for b in scenario.batches(steps)]
    ctx = RankContext.for_program(program, mesh, batches, seed=rank_seed(scenario, mesh.coordinate()))
    out = DeviceRank(rank, dist.get_backend(), device, {})

    def train(name: str, executor) -> None:
        if device_type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trace = ctx.train(executor)
        if device_type == "cuda":
            torch.cuda.synchronize()
            out.peaks[name] = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
        out.seconds[name] = time.perf_counter() - t0
        out.traces[name] = to_cpu(trace)  # off the device before the next executor's peak

    eager = ctx.eager()
    train(EAGER, eager)
    train(EAGER_AGAIN, eager)
    loss_fn = None if scenario.model_case is None else scenario.loss_fn
    example = tuple(t.to(device) for t in scenario.example_inputs())
    for compiler in compilers:
        torch._dynamo.reset()
        # One graph per rank for every step here (no re-trace per step: verify.parity.retrace is
        # the gloo world's): a model whose reads differ between slices stays refused at trace time.
        options = replace(pipeline_options(keep_compiled=True, alternatives=False, reads_per_rank=False), compiler=compiler)
        # Inductor replaces random ops by its own generator unless told to fall back to ATen's.
        config = {"fallback_random": True} if compiler == "inductor" else {}
        try:
            with torch._inductor.config.patch(config):
                t0 = time.perf_counter()
                ctx.run = run_pipeline(scenario.model(device=device), loss_fn, example, plan, mesh, options, until=SECOND_COMPILE)
                compile_s = time.perf_counter() - t0
                train(compiler, build_executor(SECOND_COMPILE, ctx))
                out.seconds[f"{compiler} pipeline"] = compile_s
        except Exception:  # the other compilers' verdicts still come back; the caller sees this one's error
            out.errors[compiler] = traceback.format_exc()
        finally:
            torch._dynamo.reset()
    return out


def error_line(traceback_text: str) -> str:
    """The line of a formatted traceback that names the exception (the last one that does: Dynamo
    appends advice after it), else its last line."""
    lines = [line.strip() for line in traceback_text.strip().splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt)\b.*:", line)]
    return (named or lines or ["(empty traceback)"])[-1]


def bitwise_report(ranks: Sequence[DeviceRank], executor: str) -> ParityReport:
    """``executor`` against ``eager``, bitwise, on every rank; an executor that did not run is an
    error quoting why."""
    missing = [r.rank for r in ranks if executor not in r.traces]
    if missing:
        errors = "; ".join(error_line(r.errors[executor]) if executor in r.errors else "no error recorded"
                           for r in ranks if r.rank in missing)
        raise AssertionError(f"{executor} did not run on rank(s) {missing}: {errors}")
    return compare_with_eager(ranks, executor)


def tolerance_checks(reference: StepTrace, got: StepTrace, rtol: float = INDUCTOR_RTOL) -> list[OracleCheck]:
    """Each step's loss and gradients of ``got`` against ``reference`` within ``rtol`` times the
    loss's magnitude, or the largest entry of any gradient of the same module (a gradient that is
    nearly zero everywhere is judged by its module's scale, not by its own)."""
    if len(reference.losses) != len(got.losses):
        raise ValueError(f"the reference ran {len(reference.losses)} steps, the other run {len(got.losses)}")
    checks = []
    for step, (la, lb, ga, gb) in enumerate(zip(reference.losses, got.losses, reference.grads, got.grads, strict=True)):
        checks.append(check_within(f"step{step}/loss", la, lb, rtol))
        scales = module_scales(ga)
        for fqn in sorted(set(ga) | set(gb)):
            checks.append(check_within(f"step{step}/grad:{fqn}", ga.get(fqn), gb.get(fqn), rtol, scales.get(fqn)))
    return checks


def peak_summary(ranks: Sequence[DeviceRank]) -> str:
    """A line per rank and executor: peak allocated and reserved MiB (CUDA ranks only)."""
    lines = []
    for r in ranks:
        for name, p in r.peaks.items():
            lines.append(f"rank {r.rank} {name}: allocated {p['allocated'] / 2**20:.1f} MiB, reserved {p['reserved'] / 2**20:.1f} MiB")
    return "\n".join(lines)


def summary(cell: DeviceCell, ranks: Sequence[DeviceRank]) -> str:
    """What a world of ``cell`` showed: backend and device per rank, each executor's verdict
    against ``eager`` (bitwise, or Inductor's worst |diff| / bound), errors, seconds and peaks."""
    lines = [f"{cell.label}: " + ", ".join(f"rank {r.rank} on {r.device} over {r.backend}" for r in ranks)]
    for name in (EAGER_AGAIN, *COMPILERS):
        if not all(name in r.traces for r in ranks):
            errors = [error_line(r.errors[name]) for r in ranks if name in r.errors]
            if errors:
                lines.append(f"  {name}: FAILED: {errors[0]}")
            continue
        report = bitwise_report(ranks, name)
        verdict = "bitwise" if report.bitwise else f"NOT bitwise ({len(report.mismatches())} of {len(report.diffs)} tensors differ, max |diff| {report.max_abs:.3e})"
        if name == "inductor":
            worst = max(worst_ratio(tolerance_checks(r.traces[EAGER], r.traces[name])) for r in ranks)
            verdict += f"; worst |diff| / ({INDUCTOR_RTOL:g} x scale) = {worst:.3f}"
        seconds = ", ".join(f"{r.seconds.get(name, 0):.1f}" + (f" (+{r.seconds[name + ' pipeline']:.1f} pipeline)" if name + " pipeline" in r.seconds else "") for r in ranks)
        lines.append(f"  {name}: {verdict}; seconds per rank {seconds}")
    peaks = peak_summary(ranks)
    if peaks:
        lines.extend("  " + line for line in peaks.splitlines())
    return "\n".join(lines)
