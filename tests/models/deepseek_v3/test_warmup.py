"""models/deepseek_v3/warmup.py: the warm-up model (a dense and a MoE layer at the checkpoint's widths)."""

from __future__ import annotations

import json

import pytest
import torch


def test_warmup_model_bytes_are_the_size_formulas(ds_tiny):
    """`warmup_bytes` (the fit against the plan) is what the built warm-up model holds, to the byte; at full
    size the warm-up model is about 2 GiB."""
    from transformers import DeepseekV3Config

    from modelopt_ext.models.deepseek_v3.sizes import BUNDLED_CONFIG, KIMI_K2_CONFIG
    from modelopt_ext.models.deepseek_v3.warmup import build_warmup_model, warmup_bytes

    config = DeepseekV3Config.from_dict(json.loads((ds_tiny / "config.json").read_text()))
    model = build_warmup_model(config, torch.device("cpu"), torch.bfloat16)
    assert sum(t.numel() * t.element_size() for t in model.state_dict().values()) == warmup_bytes(config)
    for path, gib in ((BUNDLED_CONFIG, 2.3), (KIMI_K2_CONFIG, 2.0)):
        full = DeepseekV3Config.from_dict(json.loads(path.read_text()))
        assert warmup_bytes(full) / 2**30 == pytest.approx(gib, abs=0.05)


def test_warmup_input_ids_are_below_the_warmup_vocabulary(ds_tiny):
    from transformers import DeepseekV3Config

    from modelopt_ext.models.deepseek_v3.warmup import VOCAB, warmup_input_ids

    config = DeepseekV3Config.from_dict(json.loads((ds_tiny / "config.json").read_text()))
    ids = warmup_input_ids(config, 2, 16, torch.device("cpu"))
    assert ids.shape == (2, 16) and ids.dtype == torch.long
    assert 0 <= int(ids.min()) and int(ids.max()) < min(VOCAB, config.vocab_size)


def test_warmup_config_keeps_a_dense_and_a_moe_layer_at_the_checkpoints_widths():
    from transformers import DeepseekV3Config

    from modelopt_ext.models.deepseek_v3.sizes import BUNDLED_CONFIG
    from modelopt_ext.models.deepseek_v3.warmup import VOCAB, warmup_config

    full = DeepseekV3Config.from_dict(json.loads(BUNDLED_CONFIG.read_text()))
    cfg = warmup_config(full)
    assert (cfg.num_hidden_layers, cfg.first_k_dense_replace) == (2, 1)
    assert cfg.n_routed_experts == full.num_experts_per_tok == 8 and cfg.n_group == cfg.topk_group == 1
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.kv_lora_rank) == (7168, 2048, 512)
    assert cfg.vocab_size == VOCAB and not hasattr(cfg, "quantization_config")
    assert full.num_hidden_layers == 61  # the checkpoint's config is left alone
