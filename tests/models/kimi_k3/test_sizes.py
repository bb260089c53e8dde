"""Kimi-K3 sizes (modelopt_ext.models.kimi_k3.sizes): exact counts against the stand-in model, full-size figures."""

from __future__ import annotations

import json
import re

import pytest
import torch

from modelopt_ext.families import family_for_config
from modelopt_ext.models.kimi_k3 import sizes as S
from modelopt_ext.models.kimi_k3.config_check import NOT_KEPT_BY_TRANSFORMERS_5
from modelopt_ext.models.kimi_k3.standin.configuration_kimi_k3 import KimiK3Config
from modelopt_ext.models.kimi_k3.standin.generate import (
    FP32_KEYS,
    TinySizes,
    build_config,
    quantization_config,
)
from modelopt_ext.models.kimi_k3.standin.modeling_kimi_k3 import KimiK3ForConditionalGeneration
from modelopt_ext.plan import REQUIRED_SIZES
from modelopt_ext.standin import tokenizer as tok

SPECIAL_IDS = {"[BOS]": 1, "[EOS]": 2, "[PAD]": 0, tok.IMAGE_TOKEN: 3}


def _default_config() -> dict:
    d = build_config(TinySizes(), SPECIAL_IDS).to_dict()
    d["text_config"]["quantization_config"] = quantization_config()
    return d


def _other_config() -> dict:
    """Every knob the formulas read moved off the stand-in default."""
    d = build_config(
        TinySizes(num_layers=5, hidden_size=96, latent_size=32, moe_intermediate_size=96, num_experts=6, top_k=2,
                  vocab_size=300), SPECIAL_IDS,
    ).to_dict()
    d["text_config"].update(
        num_shared_experts=2, first_k_dense_replace=2, latent_moe_use_norm=False, tie_word_embeddings=True,
        intermediate_size=80, num_attention_heads=3, q_lora_rank=48, kv_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=24,
        linear_attn_config={"full_attn_layers": [2, 5], "kda_layers": [1, 3, 4], "num_heads": 6, "head_dim": 4,
                            "short_conv_kernel_size": 3, "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    )
    d["text_config"]["mla_use_output_gate"] = False
    d["vision_config"].update(vt_hidden_size=32, mm_hidden_size=32, vt_intermediate_size=48, vt_num_hidden_layers=1,
                              vt_num_attention_heads=2, qkv_hidden_size=None, patch_size=7, merge_kernel_size=[2, 1],
                              init_pos_emb_height=8, init_pos_emb_width=6, norm_type="layernorm", attn_bias=True,
                              linear_bias=True, patch_embed_proj_bias=True)
    d["text_config"]["quantization_config"] = quantization_config()
    return d


# Independent classification of the stand-in's parameter names (first match wins).
PART_PATTERNS = [
    ("vision_tower", r"^vision_tower\."),
    ("mm_projector", r"^mm_projector\."),
    ("routed_experts", r"\.experts\.\d+\.w[123]\.weight$"),
    ("shared_experts", r"\.shared_experts\."),
    ("latent_projections", r"\.routed_expert_(down_proj|up_proj|norm)\."),
    ("routers", r"\.block_sparse_moe\.gate\."),
    ("attn_res", r"(_res_norm|_res_proj)\.weight$"),
    ("dense_mlp", r"layers\.\d+\.mlp\."),
    ("norms", r"(input_layernorm|post_attention_layernorm|model\.norm)\.weight$"),
    ("embeddings", r"embed_tokens\.weight$"),
    ("lm_head", r"lm_head\.weight$"),
]


def _meta_model(config: dict) -> torch.nn.Module:
    # As generate.build_state_dict builds it: the stand-in's classes on the meta device.
    with torch.device("meta"):
        return KimiK3ForConditionalGeneration(KimiK3Config(**config))


def _part(name: str, mla_layers: set[int]) -> str:
    if m := re.search(r"language_model\.model\.layers\.(\d+)\.self_attn\.", name):
        return "mla_attention" if int(m.group(1)) in mla_layers else "kda_attention"
    hits = [part for part, pattern in PART_PATTERNS if re.search(pattern, name)]
    assert hits, f"unclassified parameter {name}"
    return hits[0]


def _counts_of_model(config: dict) -> tuple[dict[str, int], int]:
    """(numel per part over unique parameters, stored bytes of the non-expert parameters)."""
    text = config["text_config"]
    mla = {i - 1 for i in text["linear_attn_config"]["full_attn_layers"]}
    counts = dict.fromkeys(S.EXPERT_PARTS + S.DENSE_PARTS, 0)
    dense_bytes = 0
    for name, param in _meta_model(config).named_parameters():  # tied weights appear once
        part = _part(name, mla)
        counts[part] += param.numel()
        if part != "routed_experts":
            dense_bytes += param.numel() * (4 if FP32_KEYS.search(name) else 2)
    return counts, dense_bytes


@pytest.mark.parametrize("make_config", [_default_config, _other_config], ids=["default-tiny", "other-tiny"])
def test_counts_equal_the_stand_in_model(make_config):
    config = make_config()
    expected, expected_dense_bytes = _counts_of_model(config)
    assert S.parameter_counts(config) == expected
    assert S.dense_bytes(config) == expected_dense_bytes
    n_moe = sum(1 for i in range(config["text_config"]["num_hidden_layers"])
                if i >= config["text_config"]["first_k_dense_replace"])
    assert S.expert_bytes(config, "dense") == 2 * expected["routed_experts"]
    assert S.plan_sizes(config)["num_moe_layers"] == n_moe


def test_other_config_really_differs():
    # The second config exercises the branches the default does not: tied lm_head, no latent norm,
    # two dense layers, A_log padded to num_heads (> head_dim), a non-square merge kernel.
    counts = S.parameter_counts(_other_config())
    assert counts["lm_head"] == 0
    assert counts["dense_mlp"] == 2 * 3 * 96 * 80
    assert counts["latent_projections"] == 3 * 2 * 96 * 32


def test_stored_bytes_equal_the_tiny_checkpoint(tiny_ckpt):
    config = json.loads((tiny_ckpt / "config.json").read_text())
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert S.expert_bytes(config, "mxfp4") + S.dense_bytes(config) == index["metadata"]["total_size"]
    sizes = S.plan_sizes(config)
    assert sizes["expert_bytes"] == S.expert_bytes(config, "mxfp4")


def test_unquantized_checkpoint_stores_bf16_experts():
    config = _default_config()
    del config["text_config"]["quantization_config"]
    assert S.plan_sizes(config)["expert_bytes"] == S.expert_bytes(config, "dense")


def test_refusals_name_the_value():
    config = _default_config()
    with pytest.raises(ValueError, match="'fp8'"):
        S.expert_bytes(config, "fp8")
    config["text_config"]["routed_expert_hidden_size"] = 40
    with pytest.raises(ValueError, match=r"routed_expert_hidden_size \(40\).*group size 32"):
        S.expert_bytes(config, "mxfp4")
    del config["text_config"]["num_experts"]
    with pytest.raises(ValueError, match="'num_experts'"):
        S.parameter_counts(config)


# ----------------------------------------------------------------------------------------------------
# The bundled full-size config


@pytest.fixture(scope="module")
def full() -> dict:
    return json.loads(S.BUNDLED_CONFIG.read_text())


def test_bundled_config_is_the_real_model(full):
    text = full["text_config"]
    assert full["model_type"] == "kimi_k3" and text["model_type"] == "kimi_linear"
    assert full["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert set(full["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    assert full["media_placeholder_token_id"] == 163605
    assert "quantization_config" not in full, "the public config.json keeps it in text_config only"
    assert text["quantization_config"] == quantization_config()
    assert (text["num_hidden_layers"], text["hidden_size"], text["num_experts"]) == (93, 7168, 896)
    assert len(text["linear_attn_config"]["full_attn_layers"]) == 24
    assert family_for_config(full).bundled_configs["kimi-k3"] == S.BUNDLED_CONFIG


def test_full_size_figures_match_the_checkpoint_notes(full):
    counts = S.parameter_counts(full)
    assert counts["routed_experts"] == 92 * 896 * 3 * 3072 * 3584
    assert sum(counts.values()) == pytest.approx(2.8e12, rel=0.05)
    dense = sum(counts[p] for p in S.DENSE_PARTS)
    assert dense == pytest.approx(57e9, rel=0.1)
    assert counts["kda_attention"] + counts["mla_attention"] == pytest.approx(36e9, rel=0.1)
    assert counts["shared_experts"] == pytest.approx(12e9, rel=0.1)
    assert counts["embeddings"] + counts["lm_head"] == pytest.approx(2.3e9, rel=0.1)
    assert S.expert_bytes(full, "mxfp4") == pytest.approx(1.5e12, rel=0.1)
    assert S.expert_bytes(full, "dense") == pytest.approx(5.4e12, rel=0.05)
    assert S.dense_bytes(full) == pytest.approx(114e9, rel=0.1)


def test_plan_sizes_of_the_full_model(full):
    sizes = family_for_config(full).sizes(full)
    assert set(REQUIRED_SIZES) <= set(sizes)
    assert (sizes["num_experts"], sizes["num_moe_layers"], sizes["num_layers"], sizes["top_k"]) == (896, 92, 93, 16)
    assert (sizes["hidden_size"], sizes["latent_size"], sizes["expert_intermediate_size"]) == (7168, 3584, 3072)
    assert sizes["expert_bytes"] == S.expert_bytes(full, "mxfp4")
    # The largest FSDP unit is lm_head (and embed_tokens): bigger than any decoder layer's dense part.
    assert sizes["largest_dense_unit_bytes"] == 163840 * 7168 * 2


def test_the_config_classes_hold_every_model_key_of_the_bundled_config(full):
    # Built from the public config, the stand-in classes keep every key the real file sets with its value and
    # type; their defaults are the real values too (the generator only shrinks sizes).
    built = json.loads(json.dumps(KimiK3Config(**full).to_dict()))
    defaults = json.loads(json.dumps(KimiK3Config().to_dict()))
    for section in (None, "text_config", "vision_config"):
        real, got, default = (d if section is None else d[section] for d in (full, built, defaults))
        dropped = {k for k in real if k not in got}
        assert dropped == NOT_KEPT_BY_TRANSFORMERS_5.get(section, set()), section
        for key, value in real.items():
            if key in dropped or key in ("text_config", "vision_config"):
                continue
            assert got[key] == value and type(got[key]) is type(value), f"{section}.{key}"
            if key in default and key not in ("architectures", "auto_map", "dtype", "_name_or_path",
                                              "image_placeholder", "quantization_config", "bos_token_id",
                                              "eos_token_id", "pad_token_id"):  # as upstream: 1, 2, 0
                assert default[key] == value, f"default of {section}.{key}: {default[key]!r} != {value!r}"
