"""The Kimi-K3 warm-up model: every layer kind at the checkpoint's widths and dtypes, built without touching
the RNG; `load(warmup_tokens=...)` runs it during the read and changes nothing of the loaded model."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import modelopt_ext
from modelopt_ext import loader
from modelopt_ext.models.kimi_k3 import adapter
from modelopt_ext.models.kimi_k3.warmup import VOCAB, build_warmup_model, warmup_config, warmup_input_ids
from modelopt_ext.testing.checkpoints import copy_checkpoint


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt, tmp_path_factory):
    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("warmup"), "warmup")


@pytest.fixture(scope="module")
def loaded(ckpt):
    return modelopt_ext.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.bfloat16)


def _kinds(text_config) -> list[tuple[str, str]]:
    return [("mla" if not text_config.is_kda_layer(i) else "kda", "moe" if text_config.is_moe_layer(i) else "dense")
            for i in range(text_config.num_hidden_layers)]


def test_the_config_keeps_every_layer_kind_and_width(loaded):
    original = loaded.config.text_config
    before = original.to_dict()
    text = warmup_config(loaded.config).text_config
    assert original.to_dict() == before  # a copy: the model's own config is untouched
    assert set(_kinds(text)) == set(_kinds(original)) and len(_kinds(text)) == 3
    assert text.num_experts == original.num_experts_per_token
    assert text.vocab_size == min(original.vocab_size, VOCAB)
    for width in ("hidden_size", "intermediate_size", "moe_intermediate_size", "routed_expert_hidden_size", "kv_lora_rank"):
        assert getattr(text, width) == getattr(original, width)


def test_the_config_refuses_a_top_k_the_experts_cannot_fill(loaded):
    config = loaded.config.__class__.from_dict(loaded.config.to_dict())
    config.text_config.num_experts_per_token = config.text_config.num_experts + 1
    with pytest.raises(ValueError, match="does not fit"):
        warmup_config(config)


def test_its_parameters_match_the_loaded_model_but_for_the_expert_count(loaded):
    """Same names (of the layers it keeps), dtypes (fp32 where from_pretrained keeps fp32) and shapes, except
    the routed experts' count; the global RNG state is left as it was."""
    state = torch.random.get_rng_state()
    warm = build_warmup_model(type(loaded), loaded.config, storage="mxfp4", device=torch.device("cpu"),
                              dtype=torch.bfloat16)
    assert torch.equal(torch.random.get_rng_state(), state)
    real = dict(loaded.named_parameters())
    experts = loaded.config.text_config.num_experts
    top_k = loaded.config.text_config.num_experts_per_token
    checked = 0
    for name, param in warm.named_parameters():
        if "vision_tower" in name or "embed_tokens" in name or "lm_head" in name:
            continue
        other = real[name]
        assert param.dtype == other.dtype, name
        shape = list(other.shape)
        if "block_sparse_moe.gate" in name or "block_sparse_moe.experts" in name:
            assert shape[0] == experts
            shape[0] = top_k
        assert list(param.shape) == shape, name
        checked += 1
    assert checked > 50
    assert any(p.dtype == torch.float32 for p in warm.parameters())


def test_its_forward_runs_and_the_ids_are_fixed(loaded):
    warm = build_warmup_model(type(loaded), loaded.config, storage="mxfp4", device=torch.device("cpu"),
                              dtype=torch.bfloat16)
    ids = warmup_input_ids(loaded.config, 2, 32, torch.device("cpu"))
    assert torch.equal(ids, warmup_input_ids(loaded.config, 2, 32, torch.device("cpu")))
    assert int(ids.max()) < min(loaded.config.text_config.vocab_size, VOCAB)
    with torch.no_grad():
        logits = warm(input_ids=ids, use_cache=False).logits
    assert logits.shape[:2] == (2, 32) and torch.isfinite(logits).all()


def test_load_with_a_warmup_gives_the_same_model(ckpt, loaded):
    warmed = modelopt_ext.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.bfloat16, warmup_tokens=(2, 32))
    assert isinstance(warmed.modelopt_ext_warmup_s, float) and loaded.modelopt_ext_warmup_s is None
    ids = torch.arange(40).reshape(2, 20) % loaded.config.text_config.vocab_size
    with torch.no_grad():
        assert torch.equal(warmed(input_ids=ids, use_cache=False).logits, loaded(input_ids=ids, use_cache=False).logits)


@pytest.mark.parametrize("tokens", [(0, 16), (2,), (2, 16.0), "2x16"])
def test_load_refuses_bad_warmup_tokens_before_anything_else(ckpt, tokens, monkeypatch):
    monkeypatch.setattr(adapter, "prepare", lambda *a, **k: pytest.fail("prepared after a bad argument"))
    with pytest.raises(adapter.CheckpointError, match="must be two positive sizes"):
        loader.load(adapter.prepare_load, ckpt, trust_remote_code=True, warmup_tokens=tokens)


def test_a_failing_warmup_does_not_fail_the_load(ckpt, monkeypatch, caplog):
    class Broken(torch.nn.Module):
        def forward(self, **kwargs):
            raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(adapter, "build_warmup_model", lambda *a, **k: Broken())
    with caplog.at_level(logging.WARNING):
        model = modelopt_ext.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.bfloat16, warmup_tokens=(1, 8))
    assert model.modelopt_ext_warmup_s is None
    assert "warm-up forward failed" in caplog.text and "out of memory (simulated)" in caplog.text


def test_the_warmup_is_skipped_when_it_does_not_fit_the_plan(loaded, caplog):
    """Under a distribution plan the warm-up runs only if its parameters fit beside the plan's resident
    estimate in the usable memory; at Kimi-K3's widths they are about 4.9 GiB."""
    from types import SimpleNamespace

    from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG
    from modelopt_ext.models.kimi_k3.warmup import warmup_bytes
    from modelopt_ext.plan import USABLE_FRACTION

    need = warmup_bytes(loaded.config)
    assert 0 < need < sum(p.numel() * p.element_size() for p in loaded.parameters())

    def plan(total: int, device: int):
        return SimpleNamespace(estimate=SimpleNamespace(total_bytes=total), device_memory_bytes=device)

    device = 10 * 2**30
    room = int(USABLE_FRACTION * device)
    hooks = loader.WarmupHooks(build=None, input_ids=None, nbytes=warmup_bytes)
    assert loader.warmup_fits(plan(room - need, device), loaded.config, hooks)
    with caplog.at_level(logging.INFO):
        assert not loader.warmup_fits(plan(room - need + 1, device), loaded.config, hooks)
    assert "no warm-up forward" in caplog.text
    full = loaded.config.__class__.from_dict(json.loads(BUNDLED_CONFIG.read_text()))
    assert 4.5 * 2**30 < warmup_bytes(full) < 5.5 * 2**30


def test_a_warmup_model_that_cannot_be_built_does_not_fail_the_load(ckpt, monkeypatch, caplog):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(adapter, "build_warmup_model", oom)
    with caplog.at_level(logging.WARNING):
        model = modelopt_ext.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.bfloat16, warmup_tokens=(1, 8))
    assert model.modelopt_ext_warmup_s is None
    assert "building its model failed" in caplog.text and "out of memory (simulated)" in caplog.text


def test_the_warmup_runs_on_the_device_the_model_goes_to():
    cuda = torch.device
    assert loader.warmup_device("cuda", on_gpu=False) == cuda("cpu")
    assert loader.warmup_device("cuda", on_gpu=True, current=3) == cuda("cuda", 3)
    assert loader.warmup_device("cuda:1", on_gpu=True, current=0) == cuda("cuda", 1)
    assert loader.warmup_device(cuda("cuda", 2), on_gpu=True) == cuda("cuda", 2)
    assert loader.warmup_device(1, on_gpu=True) == cuda("cuda", 1)
    assert loader.warmup_device(None, on_gpu=True, current=1) == cuda("cuda", 1)  # EP ranks: their own device
    assert loader.warmup_device({"": 0}, on_gpu=True, current=0) == cuda("cuda", 0)
