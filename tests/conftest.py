"""Shared fixtures. The verify pytest plugin (fixtures, markers, --ap-* options) is loaded through
its pytest11 entry point and switched on by ``autoparallel_verify = true`` in pyproject.toml; this
file only holds helpers specific to this repository's tests."""

import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

import pytest

from autoparallel.gc_pauses import fewer_collections

# pytester runs the plugin, golden and workflow tests' throwaway projects in this process
# (``inner_pytest``): a pytest subprocess pays ~1 s of imports each time.
pytest_plugins = ("pytester",)


@pytest.fixture(autouse=True)
def _no_world_leaks():
    """A test must not leave a default process group behind (it would break forked gloo worlds),
    nor collectives nobody waited on: ProcessGroup's work registry keeps their outputs alive and
    warns at exit ("there are still N unwaited collective calls") with no word of which test."""
    before = _unwaited_collectives()
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a default process group initialized")
    left = _unwaited_collectives() - before
    if left > 0:
        pytest.fail(f"test left {left} collective call(s) unwaited (c10d_functional.wait_tensor never ran "
                    f"on their outputs)")


def _unwaited_collectives() -> int:
    """Works in this process's c10d work registry (0 before anything imported torch.distributed)."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    return c10d._get_work_registry_size() if c10d is not None else 0


# Fixtures import torch and first-party modules when a test asks for them: this file is loaded by
# every pytest process (each xdist worker, --collect-only, the goldens CLI's runs) before any test
# needs them, and xdist's controller, which runs no test, starts its workers ~1.8 s sooner without
# torch.


@pytest.fixture
def bucket_traces():
    """The trace key of every make_fx trace upstream bucketing makes during the test (its
    ``_trace``; a trace ``reused_bucket_traces`` reuses is none), in order."""
    from torch._inductor.fx_passes import bucketing

    from autoparallel.passes.reused_bucket_traces import trace_key

    keys: list = []
    upstream = bucketing._trace

    def recording(fn, inps):
        keys.append(trace_key(fn, inps))
        return upstream(fn, inps)

    bucketing._trace = recording
    try:
        yield keys
    finally:
        bucketing._trace = upstream


@pytest.fixture
def mesh(request):
    """A fake world (``autoparallel.mesh.fake_world``) of the test module's ``MESH`` string, else
    dp=4,tp=2; torn down after the test."""
    from autoparallel.mesh import fake_world

    with fake_world(getattr(request.module, "MESH", "dp=4,tp=2")) as m:
        yield m


@pytest.fixture(scope="session")
def layernorm_mlp():
    """``(LayerNormMLP class, mse loss)``: a model that is not LLaMA (LayerNorm with weight and bias,
    biased Linears, GELU, a bias-free head, a residual), for checks that must hold beyond LLaMA."""
    import torch
    from torch import nn

    class LayerNormMLP(nn.Module):
        def __init__(self, dim=32, hidden=64, out=16):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, hidden)
            self.down = nn.Linear(hidden, dim)
            self.head = nn.Linear(dim, out, bias=False)

        def forward(self, x):
            return self.head(x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))

    def mse(out, target):
        return ((out.float() - target) ** 2).mean()

    return LayerNormMLP, mse


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    on a 2-core box shared by 2 xdist workers, intra-op threads spin against each other (one
    debug-preset step took 0.7-2.3 s with 2 threads, 0.13 s with 1); results are bitwise the same."""
    from verify.parity.trainer import intra_op_threads

    with intra_op_threads(1):
        yield


class TraceRecords:
    """Structured-trace records (``torch._logging.trace_structured``) captured in memory."""

    def __init__(self):
        import logging

        self.records: list[tuple[dict, object]] = []
        outer = self

        class _Handler(logging.Handler):
            def emit(self, record):
                outer.records.append((record.metadata, record.payload))

        self.handler = _Handler()

    def artifacts(self, prefix: str = "") -> list[tuple[str, object]]:
        """``(name, payload)`` of every artifact whose name starts with ``prefix``, in order."""
        return [(m["artifact"]["name"], p) for m, p in self.records
                if "artifact" in m and m["artifact"]["name"].startswith(prefix)]


@pytest.fixture
def structured_trace():
    """Captures the structured trace (what ``TORCH_TRACE`` writes) while the test runs; the
    handler is removed afterwards."""
    from torch._logging._internal import trace_log

    captured = TraceRecords()
    trace_log.addHandler(captured.handler)
    try:
        yield captured
    finally:
        trace_log.removeHandler(captured.handler)


@dataclass
class InnerRun:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def inner_pytest(pytester, monkeypatch):
    """``inner_pytest(*args, env=None) -> InnerRun``: ``pytest *args`` on the throwaway project in
    ``pytester.path`` (write its files there), run in this process; its output is also echoed to
    this test's stdout.

    In this process rather than a subprocess where the test is about what pytest and the plugin
    do, not about a fresh interpreter (that costs ~1 s of imports per run). The run sees none of
    this run's ``PYTEST_*`` / ``XDIST_*`` variables (an inner pytest that finds them behaves like
    an xdist worker) nor ``AUTOPARALLEL_*`` (``env`` sets variables for one run); no bytecode is
    cached, so a test file rewritten within the same second is never read from a stale .pyc.
    """
    monkeypatch.setattr(sys, "dont_write_bytecode", True)

    def run(*args: str, env: dict[str, str] | None = None) -> InnerRun:
        with pytest.MonkeyPatch.context() as mp:
            for key in list(os.environ):
                if key.startswith(("PYTEST_", "XDIST_", "AUTOPARALLEL_")) and key != "PYTEST_DEBUG_TEMPROOT":
                    mp.delenv(key)
            for key, value in (env or {}).items():
                mp.setenv(key, value)
            with _syrupy_globals_kept():
                res = pytester.runpytest_inprocess(*args)
        return InnerRun(int(res.ret), "\n".join(res.outlines), "\n".join(res.errlines))

    return run


@contextlib.contextmanager
def _syrupy_globals_kept():
    """syrupy keeps the running session in a module global (``syrupy._syrupy``, which records
    each test's outcome) and the snapshot directory in a class attribute, and an in-process pytest
    replaces both: every test of this run after an inner run was recorded in the inner session,
    so the outer one thought its skipped golden tests never ran and called their goldens unused
    (the "74 snapshots unused" of a plain ``pytest -n 0``). Restored after each inner run."""
    try:
        import syrupy
        from syrupy.extensions.base import SnapshotCollectionStorage as storage
    except ImportError:
        yield
        return
    kept = syrupy._syrupy, storage.snapshot_dirname
    try:
        yield
    finally:
        syrupy._syrupy, storage.snapshot_dirname = kept


@pytest.fixture(scope="session")
def two_norm_mlp():
    """``(model, loss_fn, (inputs, target))`` for ``autoparallel.pipeline.run_pipeline``: the
    two-LayerNorm MLP (seeded), an MSE loss, a batch of 16 (divisible by meshes up to 16 ranks).
    (``layernorm_mlp`` above gives the one-norm model's class, for tests that build their own.)"""
    import torch
    from torch import nn

    class TwoNormMLP(nn.Module):
        """Not LLaMA: two LayerNorms (native_layer_norm saves mean and rstd, getitems 1 and 2, for
        its backward), biased Linears, GELU, a residual, an output head."""

        def __init__(self, dim: int = 32, hidden: int = 64, out: int = 16):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, hidden)
            self.down = nn.Linear(hidden, dim)
            self.norm2 = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, out, bias=False)

        def forward(self, x):
            h = x + self.down(nn.functional.gelu(self.up(self.norm(x))))
            return self.head(self.norm2(h))

    def mse_loss(out, target):
        return ((out - target) ** 2).mean()

    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TwoNormMLP()
    return model, mse_loss, (torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g))


MLP_MESH = "dp=8"
MLP_BUCKET_CAP_MB = 0.001  # 1 KB buckets: the 9 parameters do not fit one, both bucketing passes merge


@pytest.fixture(scope="session")
def mlp_pipeline_run(two_norm_mlp):
    """The LayerNorm MLP through every stage of ``autoparallel.pipeline`` (fsdp over ``MLP_MESH``,
    ``MLP_BUCKET_CAP_MB`` buckets), once per process (the modules that read it share an xdist
    group, MODULE_GROUPS below). Read-only."""
    from autoparallel.parallelize import ParallelPlan
    from autoparallel.pipeline import run_pipeline
    from verify.stages.pipeline_run import pipeline_options

    model, loss, batch = two_norm_mlp
    return run_pipeline(model, loss, batch, ParallelPlan.fsdp(), MLP_MESH, pipeline_options(MLP_BUCKET_CAP_MB, alternatives=False))


LLAMA_FSDP_DP2_GROUP = "joint-parity-fsdp-dp2"


@pytest.fixture(scope="session")
def llama_fsdp_dp2_world():
    """``list[RankParity]``: the tiny LLaMA under fsdp on a gloo world of dp=2, three AdamW steps,
    of the eager program, the joint graph, the first partition's module and its torch.compile'd
    version (``verify.parity.runs.run_stage_parity``). The joint graph's and the compile stack's
    parity tests read it (both in xdist group ``LLAMA_FSDP_DP2_GROUP``): one pipeline run, one
    world and one eager program serve both, which each used to start for itself. Read-only."""
    from autoparallel.pipeline import JOINT
    from verify.parity.runs import COMPILE_EXECUTORS, EAGER, run_stage_parity
    from verify.stages.scenario import Scenario

    executors = (EAGER, JOINT, *(e for e in COMPILE_EXECUTORS if e != EAGER))
    return run_stage_parity(Scenario(plan="fsdp", mesh="dp=2"), 3, executors=executors)


@pytest.fixture(scope="session")
def shared_pipeline_runs():
    """run_pipeline builds each scenario once in this process (read-only runs; see
    verify.stages.pipeline_run.reuse_pipeline_runs): the golden tests and the report test share them."""
    from verify.stages.pipeline_run import reuse_pipeline_runs

    with reuse_pipeline_runs():
        yield


# --- xdist_group that works on pytest >= 9.2 -------------------------------------------------------
#
# ``--dist loadgroup`` (pyproject addopts) keeps the tests of one ``xdist_group`` on one worker, so
# a trace or pipeline run cached in that worker (functools.cache, module fixtures) is built once.
# pytest-xdist 3.8 marks a group by appending ``@group`` to ``item._nodeid`` on the worker; pytest
# 9.2 keeps node ids in ``item._id``, so the suffix never reaches the controller and every test
# became its own unit: each worker rebuilt every cached trace it touched. Here the workers write
# {node id: group} to a directory the controller hands them (public xdist hooks only), and the
# controller's scheduler reads it; node ids (and so report names and syrupy's goldens) stay as
# they are.

_GROUPS_DIR = "ap_xdist_groups_dir"  # workerinput key
_GROUPS_KEY = pytest.StashKey[str]()  # the controller's directory


def _loadgroup_run(config) -> bool:
    return config.pluginmanager.hasplugin("xdist") and config.getvalue("dist") == "loadgroup"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "hf_full: a Hugging Face matrix cell outside CI's fixed subset (tests/parity/test_hf_parity.py "
        "CI_SUBSET); run them with pytest -m hf_full --ap-run-slow, or every model type with python -m verify sweep")
    config.addinivalue_line(
        "markers", "slow_full: a slow test outside CI's slow step (.ci/run keeps it under 30 minutes): a world size, "
        "model or cell whose class another test of CI (the tier or that step) already covers; each marking says which. Run them "
        "with pytest -m slow_full --ap-run-slow")
    if _loadgroup_run(config) and not hasattr(config, "workerinput") and config.getvalue("numprocesses"):
        config.stash[_GROUPS_KEY] = tempfile.mkdtemp(prefix="ap-xdist-groups-")
    config.stash[_GC_KEY] = stack = contextlib.ExitStack()
    # A cleanup, not pytest_unconfigure: pytest's own closing collections (its unraisable-exception
    # plugin collects in its unconfigure and again in its cleanup) then still find the heap frozen.
    # Cleanups run last-in first-out and this configure hook runs before those plugins' ones, so
    # this restore runs after their collections.
    config.add_cleanup(stack.close)
    stack.enter_context(fewer_collections())


def pytest_unconfigure(config):
    path = config.stash.get(_GROUPS_KEY, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


# --- the collector in a test process --------------------------------------------------------
# A worker keeps every shared pipeline run alive, so each of CPython's full collections walks
# torch's import graph plus every graph built so far: at the default thresholds the two workers
# of the README test line spent 12.8 and 10.7 s collecting (29 full collections each, 0.3-0.4 s
# apiece). For the session: the pipeline's thresholds (autoparallel.gc_pauses), and what exists
# once the tests are collected (imports, test items) frozen out of every later collection. The
# line then took 166-167 CPU-s instead of 178-195 (interleaved A/B; the workers collected for
# 4.6-6.4 s). Restored at the session's end, except in an xdist worker: its process ends with the
# session, and there what the session built is frozen too, so pytest's closing collections and the
# interpreter's last one skip it. Unfrozen, those walks kept the README line's controller waiting
# about 7 s for its two workers to exit; frozen, about 1 s (tests/test_session_collector.py).

_GC_KEY = pytest.StashKey[contextlib.ExitStack]()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    stack = session.config.stash.get(_GC_KEY, None)
    if stack is not None and gc.get_freeze_count() == 0:  # someone else's freeze is theirs to undo
        gc.freeze()
        if not _process_ends_with_session(session.config):
            stack.callback(gc.unfreeze)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if session.config.stash.get(_GC_KEY, None) is not None and _process_ends_with_session(session.config):
        gc.freeze()  # what the session built, too: out of pytest's closing collections and the interpreter's last


def _process_ends_with_session(config) -> bool:
    """An xdist worker: its process exits when its session ends (xdist runs the session as the
    worker's last act), so nothing runs after it that a frozen heap could leak on."""
    return hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    path = node.config.stash.get(_GROUPS_KEY, None)
    if path is not None:
        node.workerinput[_GROUPS_DIR] = path


# Modules whose tests share per-process state across modules, or whose owners keep the module's
# marks elsewhere: each list runs on one worker (an explicit xdist_group mark on a test wins).
MODULE_GROUPS = {
    # verify.parity.trainer caches the traced steps (functools.lru_cache) these modules share.
    "trainer": (
        "tests/golden/test_trainer_goldens.py",
        "tests/parity/test_trainer_parity.py",
        "tests/unit/autoparallel/trainer/test_trainer_memory.py",
        "tests/unit/autoparallel/trainer/test_sac.py",
        "tests/unit/autoparallel/trainer/test_trace.py",
    ),
    # the session fixture ``mlp_pipeline_run`` (tests whose own xdist_group mark names a golden
    # scenario run with that scenario instead).
    "layernorm-mlp": ("tests/golden/test_pass_invariants.py", "tests/unit/verify/commands/test_bisect.py"),
}
_GROUP_OF_MODULE = {m: g for g, mods in MODULE_GROUPS.items() for m in mods}


# --- what the quick tier leaves to CI's slow step ---------------------------------------------------
#
# The tier (the README's test line, ``pytest -n auto``) keeps one representative of every kind of
# check: the goldens, invariants and differential runs of tiny-fsdp-dp8, tiny-fsdp_tp-dp4tp2 (2-D,
# fusion) and tiny-auto-dp8 (the planner); parity on gloo for the joint graph, every stage,
# bucketing, the compiled module, the zoo (gpt2's tied weights, the BatchNorm convnet under DDP)
# and the oracle. Each group below shares one costly pipeline run or gloo world (the tests that
# read it are in its xdist_group); its tests are marked ``slow``, so CI's slow step
# (``pytest -m slow --ap-run-slow``) and ``python -m verify goldens`` run them on every submission.
SLOW_GROUPS: dict[str, str] = {
    # golden scenarios beyond the representatives (their goldens, invariants, differential runs)
    "tiny-ddp-dp8": "DDP's goldens (DDP trains in the tier: zoo convnet-ddp-dp2)",
    "tiny-fsdp-bf16-dp8": "bf16 params / fp32 reduce",
    "tiny-fsdp-dp4-split": "bucket cap and topo span that split buckets",
    "tiny-fsdp-dp3-uneven": "uneven shards' goldens",
    "tiny-auto-dp4tp2": "plan=auto on a 2-D mesh (tiny-auto-dp8 stays in the tier)",
    "gpt2-fsdp-dp2": "gpt2's goldens (its parity, zoo-gpt2-fsdp-dp2, stays in the tier)",
    "gpt2-fsdp_tp-dp2tp2": "gpt2 under fsdp_tp",
    "debug-fsdp-dp8": "collective counts of the debug preset",
    "planner-debug": "plan goldens of the debug preset (the tiny preset's stay in the tier)",
    # parity worlds beyond the representatives
    "joint-parity-ddp-dp2": "DDP joint graph (zoo convnet-ddp-dp2 stays in the tier)",
    "joint-parity-fsdp-bf16-dp2": "bf16 joint graph",
    "bucketing-parity-ddp-dp2": "bucketed DDP all-reduces",
    "bucketing-parity-fsdp-bf16-dp2": "bucketed bf16 all-gathers",
    "zoo-gpt2-fsdp_tp-dp1tp2": "gpt2 TP with a size-1 dim: each rank re-runs the pipeline (2-D group names)",
    "zoo-convnet-fsdp-dp2": "convnet under FSDP (its DDP run stays in the tier)",
    "uneven-fsdp-dp=2": "uneven shards trained on gloo (their padding properties stay in the tier)",
    "uneven-fsdp-dp=4": "uneven shards on 4 ranks, ranks that hold only padding",
    "gradless-parity": "frozen / unreached parameters on the other models and plans (two cells and the negative tests stay in the tier: gradless-parity-tier)",
    "planned-parity": "plan=auto trained on gloo (the tiny-auto-dp8 goldens and invariants stay in the tier)",
    "scale-benchmark": "python -m verify scale end to end (a benchmark; its table formatting stays in the tier)",
    "mutation-harness": "the patch-mutation harness on throwaway projects (CI also runs python -m verify mutate itself)",
}
# Shared pipeline runs of the debug preset (verify.goldens.catalog.run_group names them "run <header>"):
# the tiny preset's runs of the same plans stay in the tier.
SLOW_RUN_PREFIXES = ("run preset=debug ",)


def _is_slow_group(group: str | None) -> bool:
    return group is not None and (group in SLOW_GROUPS or group.startswith(SLOW_RUN_PREFIXES))


@pytest.hookimpl(tryfirst=True, specname="pytest_collection_modifyitems")  # before -m deselects
def pytest_collection_modifyitems_slow_groups(config, items):
    for item in items:
        if _is_slow_group(_xdist_group_of(item)) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


def _xdist_group_of(item) -> str | None:
    """The group xdist would give ``item`` (its ``xdist_group`` names joined), or None."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) if names else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _GROUP_OF_MODULE.get(item.nodeid.split("::", 1)[0])
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    path = getattr(config, "workerinput", {}).get(_GROUPS_DIR)
    if path is None:
        return
    groups = {item.nodeid: g for item in items if (g := _xdist_group_of(item)) is not None}
    tmp = os.path.join(path, f".{config.workerinput['workerid']}.json")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(groups, f)
    os.replace(tmp, os.path.join(path, f"{config.workerinput['workerid']}.json"))  # before collectionfinish


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    path = config.stash.get(_GROUPS_KEY, None)
    if path is None:
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupFileScheduling(LoadGroupScheduling):
        """LoadGroupScheduling whose groups come from the workers' group files."""

        _groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                self._groups = {}
                for name in sorted(os.listdir(path)):
                    if name.endswith(".json") and not name.startswith("."):
                        with open(os.path.join(path, name), encoding="utf-8") as f:
                            self._groups.update(json.load(f))
            group = self._groups.get(nodeid)
            return f"@{group}" if group is not None else super()._split_scope(nodeid)

    return GroupFileScheduling(config, log)
