"""AOTAutograd renders its joint, forward and backward graphs as text only for a listener.

``aot_module_simplified`` (the second compile's backend) and ``aot_compile_joint_with_descriptors``
(the first partition) build their ``AOTConfig`` with ``enable_log=True`` and no way to pass
``False``. With it, ``_log_joint_graph`` and ``_log_fw_bw_graphs`` call ``print_readable`` on the
joint graph and on both partitions on every compile, keep the strings for a structured-trace
artifact and an AOTAutograd cache entry, and drop them when nobody listens: FX code generation
of the largest graphs of the run, twice per pipeline.

Patch ``aot_graph_text_only_when_logged``: inside :func:`aot_graph_text_only_when_logged` the two
functions run upstream's code when a structured-trace handler listens (``TORCH_TRACE``, a test's
capture) or their artifact logger is on (``TORCH_LOGS=aot_joint_graph`` / ``aot_graphs``), and
otherwise return what upstream returns with ``enable_log=False`` (no strings). The artifacts a
listener gets are unchanged. The swap is of module attributes (``graph_compile`` looks them up
at call time), scoped and restored on exit, exceptions included.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from autoparallel import patches
from autoparallel.trace import structured_trace_listens

PATCH = "aot_graph_text_only_when_logged"


def _listens(logger: logging.Logger) -> bool:
    return structured_trace_listens() or logger.isEnabledFor(logging.INFO)


@contextlib.contextmanager
def aot_graph_text_only_when_logged() -> Iterator[None]:
    """AOTAutograd's graph text is rendered only for a listener (unless the patch is disabled)."""
    if not patches.enabled(PATCH):
        yield
        return
    import torch._functorch._aot_autograd.graph_compile as graph_compile

    upstream_joint = graph_compile._log_joint_graph
    upstream_fw_bw = graph_compile._log_fw_bw_graphs

    def log_joint_graph(fx_g, aot_config):
        if _listens(graph_compile.aot_joint_log):
            return upstream_joint(fx_g, aot_config)
        return None

    def log_fw_bw_graphs(fw_module, bw_module, maybe_subclass_meta, fw_metadata, aot_config):
        if _listens(graph_compile.aot_graphs_log):
            return upstream_fw_bw(fw_module, bw_module, maybe_subclass_meta, fw_metadata, aot_config)
        return None, None

    graph_compile._log_joint_graph = log_joint_graph
    graph_compile._log_fw_bw_graphs = log_fw_bw_graphs
    try:
        yield
    finally:
        graph_compile._log_joint_graph = upstream_joint
        graph_compile._log_fw_bw_graphs = upstream_fw_bw


__all__ = ["PATCH", "aot_graph_text_only_when_logged"]
