"""Shared fixtures. Every test runs offline; remote code modules are cached in a per-run temp dir
(set before transformers is imported, which reads it at import time)."""

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
_MODULES_CACHE = tempfile.mkdtemp(prefix="modelopt_ext_hf_modules-")
os.environ["HF_MODULES_CACHE"] = _MODULES_CACHE


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_MODULES_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The default tiny Kimi-K3 stand-in (seed 0)."""
    from modelopt_ext.testing.checkpoints import tiny_checkpoint

    return tiny_checkpoint("kimi_k3", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def fitted_ckpt(tmp_path_factory):
    """The stand-in fitted to the embedded corpus for 20 steps (`make-tiny --fit 20`, about 20 s on 2 cores):
    its routing and activations are those of a trained model, not of random weights, so quality numbers
    measured on it mean something (docs/standin.md)."""
    from modelopt_ext.testing.checkpoints import tiny_checkpoint

    return tiny_checkpoint("kimi_k3", tmp_path_factory.mktemp("fitted"), fit_steps=20)


@pytest.fixture
def loads(monkeypatch):
    """Calls of `modelopt_ext.from_pretrained`, made to fail: for tests whose input must be refused before
    anything is loaded (assert the list is empty)."""
    import modelopt_ext
    import modelopt_ext.loading

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("from_pretrained called before validation finished")

    monkeypatch.setattr(modelopt_ext, "from_pretrained", refuse)
    monkeypatch.setattr(modelopt_ext.loading, "from_pretrained", refuse)
    monkeypatch.setattr(modelopt_ext.loading, "load_checkpoint", refuse)  # what ptq calls
    return calls


@pytest.fixture
def one_rank_group():
    """A one-process gloo group (torn down afterwards, so no other test sees it); yields its group."""
    import torch.distributed as dist

    from modelopt_ext.testing.multiproc import free_port

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
