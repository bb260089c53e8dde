"""Tests of modelopt_ext/loading.py: `from_pretrained`'s argument refusals and how it hands over to the loader."""

from __future__ import annotations

import json
import types

import pytest
from torch import nn

import modelopt_ext.loading as loading
from modelopt_ext.models.kimi_k3 import spec
from modelopt_ext.options import DEFAULT, ExpertsOptions


@pytest.fixture
def config_only(tmp_path, monkeypatch):
    """A folder holding only the bundled Kimi-K3 `config.json`; loading, planning and process groups fail the test."""
    (tmp_path / "config.json").write_text(spec.BUNDLED_CONFIG.read_text())
    monkeypatch.setattr(loading.loader, "load", lambda *a, **k: pytest.fail("loaded despite a refused argument"))
    monkeypatch.setattr(loading, "init_distributed", lambda *a, **k: pytest.fail("joined a process group"))
    return tmp_path


@pytest.mark.parametrize("options", [{"chunks": 2}, None, "chunks=2"])
def test_experts_options_of_a_wrong_type_is_refused_before_reading(options, tmp_path, monkeypatch):
    monkeypatch.setattr(loading.Checkpoint, "read", lambda *a, **k: pytest.fail("read the config"))
    with pytest.raises(TypeError) as err:
        loading.from_pretrained(tmp_path / "missing", experts_options=options)
    assert str(err.value) == f"experts_options must be a modelopt_ext.options.ExpertsOptions, got {options!r}"


@pytest.mark.parametrize("dense", ["fsdp", "replicate"])
def test_dense_without_ep_size_is_refused(config_only, dense):
    with pytest.raises(ValueError) as err:
        loading.from_pretrained(config_only, dense=dense)
    assert str(err.value) == f"dense={dense!r} needs ep_size: it places the dense modules of an EP run"


def test_ep_size_with_distributed_config_is_refused(config_only):
    with pytest.raises(ValueError) as err:
        loading.from_pretrained(config_only, ep_size=2, distributed_config=object())
    assert str(err.value) == ("pass either ep_size (modelopt_ext resolves the plan) or distributed_config, "
                              "not both")


def test_unknown_family_is_refused_before_loading(config_only):
    (config_only / "config.json").write_text(json.dumps({"model_type": "not_a_family"}))
    with pytest.raises(ValueError, match="not_a_family"):
        loading.from_pretrained(config_only)


def test_without_ep_the_family_hook_loads_and_the_options_are_set(config_only, monkeypatch):
    class Experts(nn.Module):
        options = DEFAULT

    model = nn.Sequential(nn.Linear(2, 2), Experts(), Experts())
    calls = []

    def load(prepare, path, **kwargs):
        calls.append((prepare, path, kwargs))
        return types.SimpleNamespace(model=model, bytes_read={"a.safetensors": 12}, warmup_s=0.5)

    monkeypatch.setattr(loading.loader, "load", load)
    options = ExpertsOptions(chunks=3)
    got = loading.from_pretrained(config_only, experts_options=options, dtype="float32")
    assert got is model
    assert calls == [(spec.KIMI_K3.prepare, config_only, {"distribution_plan": None, "dtype": "float32"})]
    assert model.modelopt_ext_bytes_read == {"a.safetensors": 12} and model.modelopt_ext_warmup_s == 0.5
    assert [m.options for m in model if isinstance(m, Experts)] == [options, options]
    assert not hasattr(model, "modelopt_ext_plan")


def test_load_checkpoint_takes_the_read_checkpoint_and_the_plans_options(config_only, monkeypatch):
    """`ptq`'s path: the checkpoint validation read and the plan the ranks agreed on go to the loader as they
    are (nothing read again), the plan's experts options win, and what the load measured comes back on the
    result, not on the model."""
    from modelopt_ext.families import Checkpoint
    from modelopt_ext.plan import resolve_distribution_plan

    class Experts(nn.Module):
        options = DEFAULT

    model = nn.Sequential(Experts())
    checkpoint = Checkpoint.read(config_only)
    plan = resolve_distribution_plan(checkpoint.config, 64, family=checkpoint.family, ep_size=64,
                                     device_memory_bytes=2**40, experts_options=ExpertsOptions(chunks=5))
    calls = []

    def load(prepare, path, **kwargs):
        calls.append((prepare, path, kwargs))
        return types.SimpleNamespace(model=model, bytes_read={"experts": 3}, warmup_s=None)

    monkeypatch.setattr(loading.loader, "load", load)
    monkeypatch.setattr(loading.Checkpoint, "read", lambda *a, **k: pytest.fail("read the config again"))
    monkeypatch.setattr(loading, "register_torch_a2a", lambda: calls.append("a2a"))
    loaded = loading.load_checkpoint(checkpoint, plan=plan, experts_options=ExpertsOptions(chunks=7), dtype="x")
    assert calls == ["a2a", (spec.KIMI_K3.prepare, config_only, {"distribution_plan": plan, "dtype": "x"})]
    assert (loaded.model, loaded.plan, loaded.bytes_read, loaded.warmup_s) == (model, plan, {"experts": 3}, None)
    assert model[0].options == ExpertsOptions(chunks=5)
    assert not hasattr(model, "modelopt_ext_plan") and not hasattr(model, "modelopt_ext_bytes_read")
