"""Record, while tracing, which module's forward created each node (``custom[MODULE_PATH]``).

``aot_export_joint_with_descriptors`` traces without ``nn_module_stack``, and Dynamo's re-trace in
the second compile would replace it with its own. A ``custom`` annotation survives both: the
tracer copies it onto every node created under it, re-traces under ``preserve_node_meta`` keep it,
and backward nodes inherit their forward node's. Canonical golden text numbers nodes per op
within this path, so a node inserted into one layer renames nothing outside that layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.fx.traceback as fx_traceback
from torch import nn

from autoparallel import meta as M
from autoparallel.parallelize.program import clean_fqn

__all__ = ["annotate_module_paths"]


@contextlib.contextmanager
def annotate_module_paths(root: nn.Module) -> Iterator[None]:
    """Within: every submodule call of ``root`` annotates the nodes it traces with its path.

    Paths are the user's (``clean_fqn``): ``model.`` dropped, a parametrization named after its
    parameter. The pre-hooks run before any other pre-hook (a TP region's input collective lands
    inside its module), the post-hooks also when the forward raises. Hooks are removed on exit.
    """
    handles = []
    active: list[contextlib.AbstractContextManager] = []

    def enter(path: str):
        def hook(module, args):
            cm = fx_traceback.annotate({M.MODULE_PATH: path})
            cm.__enter__()
            active.append(cm)

        return hook

    def leave(module, args, output):
        active.pop().__exit__(None, None, None)

    try:
        for name, module in root.named_modules():
            if name:
                handles.append(module.register_forward_pre_hook(enter(clean_fqn(name)), prepend=True))
                handles.append(module.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()
        while active:
            active.pop().__exit__(None, None, None)
