"""Shared fixtures."""

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """Run a module on one intra-op thread: its tensors are tiny, and on a shared two-core machine
    extra threads only wait for each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """The embedded default checkpoint (seed 0), written once per test session into a pytest temp
    folder (never the user cache). Treat it as read-only: other tests share it."""
    from dsv41.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "checkpoint", seed=0, progress=False)
