"""DeepSeek-V3 sizes (modelopt_ext.models.deepseek_v3.sizes): counts against the model transformers builds
(meta device) at tiny and full size, totals against the public tensor tables, bytes against the stand-in."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from modelopt_ext.models.deepseek_v3 import sizes as S
from modelopt_ext.models.deepseek_v3.standin.generate import TinySizes, build_config
from modelopt_ext.plan import OPTIONAL_SIZES, REQUIRED_SIZES

DSV3 = json.loads(S.BUNDLED_CONFIG.read_text())
K2 = json.loads(S.KIMI_K2_CONFIG.read_text())
IDS = {"[BOS]": 0, "[EOS]": 1}

# Independent classification of transformers' parameter names (first match wins).
PART_PATTERNS = [
    ("routed_experts", r"\.mlp\.experts\.(gate_up_proj|down_proj)$"),
    ("shared_experts", r"\.mlp\.shared_experts\."),
    ("routers", r"\.mlp\.gate\.(weight|e_score_correction_bias)$"),
    ("mla_attention", r"\.self_attn\."),
    ("dense_mlp", r"\.mlp\.(gate|up|down)_proj\.weight$"),
    ("norms", r"(input_layernorm|post_attention_layernorm)\.weight$|^model\.norm\.weight$"),
    ("embeddings", r"^model\.embed_tokens\.weight$"),
    ("lm_head", r"^lm_head\.weight$"),
]


def _transformers_counts(config: dict) -> dict[str, int]:
    """numel per part of `DeepseekV3ForCausalLM` built on the meta device (tied weights counted once; the
    router's correction bias, a persistent buffer, counted)."""
    cfg = DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")})
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    tensors = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    counts = dict.fromkeys(S.EXPERT_PARTS + S.DENSE_PARTS, 0)
    for name, tensor in tensors:
        part = next((p for p, pattern in PART_PATTERNS if re.search(pattern, name)), None)
        assert part is not None, f"unclassified tensor {name}"
        counts[part] += tensor.numel()
    return counts


def _other_config() -> dict:
    """Every knob the formulas read moved off the defaults: no query LoRA, tied embeddings, 2 shared experts,
    2 dense layers, no quantization."""
    config = build_config(TinySizes(num_layers=5, first_k_dense_replace=2, num_experts=8, n_group=2, topk_group=1,
                                    top_k=2, num_heads=4, vocab_size=300), IDS)
    config.update(q_lora_rank=None, tie_word_embeddings=True, n_shared_experts=2, qk_nope_head_dim=32,
                  qk_rope_head_dim=16, v_head_dim=48, num_nextn_predict_layers=0)
    del config["quantization_config"]
    return config


CONFIGS = {
    "standin": build_config(TinySizes(), IDS),
    "other": _other_config(),
    "deepseek_v3": DSV3,
    "kimi_k2": K2,
}


def test_plan_sizes_has_exactly_the_required_and_optional_keys():
    assert set(S.plan_sizes(DSV3)) == set(REQUIRED_SIZES) | set(OPTIONAL_SIZES)
    assert S.sizes is S.plan_sizes


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_counts_equal_the_model_transformers_builds(name):
    assert S.parameter_counts(CONFIGS[name]) == _transformers_counts(CONFIGS[name])


def test_deepseek_v3_counts_671b_without_the_mtp_layer():
    counts = S.parameter_counts(DSV3)
    assert sum(counts.values()) == 671_026_419_200  # the public "671B total parameters"
    assert counts["routed_experts"] == 58 * 256 * 3 * 2048 * 7168
    mtp = S.mtp_parameters(DSV3)
    assert 11.5e9 < mtp["unique"] < 11.7e9  # README_WEIGHTS.md: "11.5B unique parameters"
    assert mtp["shared"] == 2 * 129280 * 7168
    sizes = S.plan_sizes(DSV3)
    assert (sizes["num_experts"], sizes["num_moe_layers"], sizes["num_layers"], sizes["top_k"]) == (256, 58, 61, 8)
    assert (sizes["hidden_size"], sizes["latent_size"], sizes["expert_intermediate_size"]) == (7168, 7168, 2048)
    assert sizes["expert_params"] + sizes["dense_params"] == 671_026_419_200


def test_kimi_k2_counts():
    assert sum(S.parameter_counts(K2).values()) == 1_026_408_232_448  # the public "1T total parameters"
    assert S.mtp_parameters(K2) == {"unique": 0, "shared": 0}
    assert S.plan_sizes(K2)["num_moe_layers"] == 60


def test_checkpoint_totals_equal_the_public_tables():
    """DeepSeek-R1's table (DeepSeek-V3's layout) and Kimi-K2-Instruct's (plus its 61 unread inv_freq [56] bf16)."""
    assert S.checkpoint_totals(DSV3) == {"elements": 684_531_386_000, "bytes": 688_574_839_360}
    assert round(688_574_839_360 / 2**30, 2) == 641.29
    k2 = S.checkpoint_totals(K2)
    assert k2["elements"] + 61 * 56 == 1_026_470_731_056
    assert round((k2["bytes"] + 61 * 56 * 2) / 2**30, 2) == 958.49


def test_fp8_source_bytes_are_one_a_weight_plus_four_a_block():
    sizes = S.plan_sizes(DSV3)
    per_expert = 3 * 2048 * 7168 + 4 * (2 * 16 * 56 + 56 * 16)
    assert sizes["expert_bytes"] == 58 * 256 * per_expert
    attention = (1536 * 7168 + 24576 * 1536 + 576 * 7168 + 32768 * 512 + 7168 * 16384
                 + 4 * (12 * 56 + 192 * 12 + 5 * 56 + 256 * 4 + 56 * 128) + 2 * (1536 + 512))
    shared = 3 * 2048 * 7168 + 4 * (2 * 16 * 56 + 56 * 16)
    router = 256 * 7168 * 2 + 256 * 4
    assert sizes["largest_dense_unit_bytes"] == 129280 * 7168 * 2  # embeddings (= lm_head) beat any layer
    moe_layer = attention + shared + router + 2 * 7168 * 2
    dense_layer = attention + 3 * 18432 * 7168 + 4 * (2 * 144 * 56 + 56 * 144) + 2 * 7168 * 2
    assert sizes["dense_bytes"] == 58 * moe_layer + 3 * dense_layer + 2 * 129280 * 7168 * 2 + 7168 * 2


def test_without_quantization_config_the_bytes_are_bf16():
    config = {k: v for k, v in DSV3.items() if k != "quantization_config"}
    sizes = S.plan_sizes(config)
    assert sizes["expert_bytes"] == sizes["expert_params"] * 2
    assert sizes["dense_bytes"] == (sizes["dense_params"] - 58 * 256) * 2 + 58 * 256 * 4  # fp32 correction bias


def test_bytes_equal_the_generated_stand_in(ds_tiny: Path):
    """The stand-in's tensors, read back by name: routed experts of the decoder layers, MTP layer, the rest."""
    config = json.loads((ds_tiny / "config.json").read_text())
    index = json.loads((ds_tiny / "model.safetensors.index.json").read_text())
    n = config["num_hidden_layers"]
    groups = {"experts": 0, "mtp": 0, "dense": 0}
    elements = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(ds_tiny / shard, "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                size = {"F8_E4M3": 1, "BF16": 2, "F32": 4}[t.get_dtype()]
                layer = int(key.split(".")[2]) if key.startswith("model.layers.") else -1
                group = "mtp" if layer >= n else "experts" if ".mlp.experts." in key else "dense"
                groups[group] += numel * size
                elements += numel
    assert groups == {"experts": S.expert_bytes(config), "mtp": S.mtp_bytes(config), "dense": S.dense_bytes(config)}
    assert index["metadata"]["total_size"] == sum(groups.values()) == S.checkpoint_totals(config)["bytes"]
    assert elements == S.checkpoint_totals(config)["elements"]


def test_a_missing_key_is_named():
    config = dict(DSV3)
    del config["moe_intermediate_size"]
    with pytest.raises(ValueError, match="no 'moe_intermediate_size'"):
        S.plan_sizes(config)


def test_the_distribution_planner_takes_the_sizes():
    """`modelopt_ext.plan` with these sizes (the registered family): the FP8 experts are held dequantized (bf16)
    after loading, so DeepSeek-V3 does not fit 8 H200s (152 GiB of experts a rank) and fits 16; each rank reads the
    stored FP8 bytes."""
    from modelopt_ext.plan import resolve_distribution_plan

    with pytest.raises(ValueError, match=r"experts 152.2 GiB \+ dense"):
        resolve_distribution_plan(DSV3, 8, device_memory_bytes=141 * 10**9, tokens_per_rank=2048)
    plan = resolve_distribution_plan(DSV3, 16, device_memory_bytes=141 * 10**9, tokens_per_rank=2048)
    assert (plan.family, plan.ep_size, plan.experts_per_rank, plan.num_experts) == ("deepseek_v3", 16, 16, 256)
    assert plan.expert_storage == "dense" and plan.dense == "replicate"
    assert plan.expert_total_bytes == S.expert_bytes(DSV3) and plan.dense_total_bytes == S.dense_bytes(DSV3)
    assert plan.estimate.read_bytes == -(-S.expert_bytes(DSV3) // 16) + S.dense_bytes(DSV3)  # dense replicated
    sizes = S.plan_sizes(DSV3)
    assert plan.estimate.expert_bytes == sizes["expert_params"] * 2 // 16
    assert plan.estimate.dense_bytes == sizes["loaded_dense_bytes"]


def test_loaded_dense_bytes_are_bf16_with_an_fp32_router():
    sizes, counts = S.plan_sizes(DSV3), S.parameter_counts(DSV3)
    dense_params = sum(counts[p] for p in S.DENSE_PARTS)
    assert sizes["dense_params"] == dense_params
    assert sizes["loaded_dense_bytes"] == dense_params * 2 + counts["routers"] * 2  # router weight + bias fp32
    assert sizes["loaded_dense_bytes"] == 34_448_187_392  # vs 19,082,195,296 stored (FP8 + scales)
