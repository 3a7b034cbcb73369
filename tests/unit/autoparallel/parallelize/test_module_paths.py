"""annotate_module_paths: every traced node says which module's forward created it; hooks are scoped."""

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import parametrize

from autoparallel import meta as M
from autoparallel.parallelize.module_paths import annotate_module_paths


class _Double(nn.Module):
    def forward(self, w):
        return w * 2


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4, bias=False), nn.ReLU())
        self.head = nn.Linear(4, 2, bias=False)
        parametrize.register_parametrization(self.head, "weight", _Double(), unsafe=True)
        self.inner.register_forward_pre_hook(lambda m, args: (args[0] + 1,))  # e.g. a TP input hook

    def forward(self, x):
        return self.head(self.inner(x)).sum()


def _paths(net, width=4):
    with fx_traceback.preserve_node_meta(), annotate_module_paths(net):
        gm = make_fx(net)(torch.randn(3, width))
    return {n.name: (n.meta.get(M.CUSTOM) or {}).get(M.MODULE_PATH) for n in gm.graph.nodes if n.op == "call_function"}


def test_nodes_carry_the_innermost_module_path():
    paths = _paths(_Net())
    by_op = {}
    for name, path in paths.items():
        by_op.setdefault(name.rstrip("_0123456789"), set()).add(path)
    assert by_op["add"] == {"inner"}  # the user's pre-hook runs inside the module's scope
    assert by_op["relu"] == {"inner.1"}
    assert by_op["mul"] == {"head.weight"}  # a parametrization is named after its parameter
    assert by_op["sum"] == {None}  # the root's own ops: no module
    assert {"inner.0", "head"} <= {p for ps in by_op.values() for p in ps}


def test_hooks_are_removed_and_annotations_unwound_on_error():
    net = _Net()
    hooks_before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in net.modules()]
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        _paths(net, width=5)  # fails inside inner.0's forward
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in net.modules()] == hooks_before
    assert M.MODULE_PATH not in fx_traceback.current_meta.get("custom", {})
    _paths(net)  # and it can trace again
