"""Shared fixtures. The verify pytest plugin (fixtures, markers, --require-gpu) is loaded through
its pytest11 entry point; this file only holds helpers specific to this repository's tests."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_world_leaks():
    """A test must not leave a default process group behind (it would break forked gloo worlds)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a default process group initialized")
