"""What the adapter needs from a Kimi-K3 `config.json`, checked before anything is loaded.

The adapter, planner, warm-up model and exporter read only the real config.json's keys
(`kimi_k3_config.json`). A config that lacks one of them, or that carries a value they do not implement
(another activation, router or expert grouping), is refused with every problem named: key, value and what
is supported. Values not listed here are taken as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Keys of the public text_config that transformers 4.56 wrote for every config (generation defaults) and
# transformers 5 moves to the generation config; and the vision tower's attention-kernel choice, which
# transformers 5 keeps out of a sub-config's dict. No code reads them (docs/standin.md).
NOT_KEPT_BY_TRANSFORMERS_5 = {
    "text_config": {
        "bad_words_ids", "begin_suppress_tokens", "diversity_penalty", "do_sample", "early_stopping",
        "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "forced_bos_token_id",
        "forced_eos_token_id", "length_penalty", "max_length", "min_length", "no_repeat_ngram_size",
        "num_beam_groups", "num_beams", "num_return_sequences", "output_scores", "remove_invalid_values",
        "repetition_penalty", "return_dict_in_generate", "suppress_tokens", "temperature", "top_k", "top_p",
        "transformers_version", "typical_p",
    },
    "vision_config": {"_attn_implementation"},
}

# text_config keys the adapter, planner and warm-up read (sizes and layer schedule).
TEXT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "rms_norm_eps", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "num_experts", "num_experts_per_token", "moe_intermediate_size", "num_shared_experts",
    "first_k_dense_replace", "moe_layer_freq", "routed_expert_hidden_size", "latent_moe_use_norm",
    "routed_scaling_factor", "moe_renormalize", "activation_situ_beta", "activation_situ_linear_beta",
    "attn_res_block_size", "linear_attn_config",
)
LINEAR_ATTN_KEYS = ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size")
VISION_KEYS = (
    "vt_hidden_size", "vt_intermediate_size", "vt_num_hidden_layers", "vt_num_attention_heads", "patch_size",
    "init_pos_emb_height", "init_pos_emb_width", "merge_kernel_size", "mm_hidden_size", "text_hidden_size",
)
# key -> (values the adapter implements, what they mean). A missing key is refused unless DEFAULTS gives
# the real code's default for it.
SUPPORTED_TEXT = {
    "hidden_act": (("situ",), "SiTU-GLU experts, dense MLP and shared experts"),
    "topk_method": (("noaux_tc",), "the bias-corrected sigmoid top-k router"),
    "moe_router_activation_func": (("sigmoid",), "sigmoid router scores"),
    "num_expert_group": ((1,), "one expert group (no group-limited routing)"),
    "topk_group": ((1,), "one expert group (no group-limited routing)"),
    "mla_use_nope": ((True,), "MLA without rotary embedding"),
    "num_nextn_predict_layers": ((0,), "no multi-token-prediction layers"),
}
SUPPORTED_LINEAR_ATTN = {"use_full_rank_gate": ((True,), "the full-rank KDA gates f_a/f_b and g_proj")}
SUPPORTED_VISION = {
    "mm_projector_type": (("patchmergerv2",), "the patch merger with a post RMSNorm"),
    "merge_type": (("sd2_tpool",), "2x2 spatial merge with temporal pooling"),
    "norm_type": (("rmsnorm", "layernorm"), "the ViT's norms"),
    "mlp_type": (("mlp2",), "the ViT's two-layer MLP"),
    "pos_emb_type": (("divided_fixed",), "the learned 2D position table"),
}
DEFAULTS = {"num_expert_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0, "topk_method": "noaux_tc"}


def _value_problems(section: Mapping[str, Any], where: str, supported: Mapping) -> list[str]:
    problems = []
    for key, (values, meaning) in supported.items():
        if key not in section and key not in DEFAULTS:
            problems.append(f"{where}.{key} is missing; supported: {list(values)} ({meaning})")
            continue
        value = section.get(key, DEFAULTS.get(key))
        if not any(value == v and type(value) is type(v) for v in values):  # True is not 1 here
            problems.append(f"{where}.{key} is {value!r}; supported: {list(values)} ({meaning})")
    return problems


def _missing(section: Mapping[str, Any], where: str, keys) -> list[str]:
    return [f"{where}.{key} is missing" for key in keys if key not in section]


def config_problems(config: Mapping[str, Any]) -> list[str]:
    """Every way a Kimi-K3 `config.json` mapping departs from what the adapter reads and implements."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        return ["text_config is missing or not an object"]
    problems = _missing(text, "text_config", TEXT_KEYS) + _value_problems(text, "text_config", SUPPORTED_TEXT)
    if text.get("routed_expert_hidden_size", 0) is None:
        problems.append("text_config.routed_expert_hidden_size is None; supported: an int (the latent MoE width)")
    lac = text.get("linear_attn_config")
    if isinstance(lac, Mapping):
        problems += _missing(lac, "text_config.linear_attn_config", LINEAR_ATTN_KEYS)
        problems += _value_problems(lac, "text_config.linear_attn_config", SUPPORTED_LINEAR_ATTN)
        n = text.get("num_hidden_layers")
        kda, full = set(lac.get("kda_layers") or ()), set(lac.get("full_attn_layers") or ())
        if isinstance(n, int) and (kda | full != set(range(1, n + 1)) or kda & full):
            missing = sorted(set(range(1, n + 1)) - kda - full)
            problems.append(
                f"text_config.linear_attn_config: kda_layers and full_attn_layers must split the 1-based layers "
                f"1..{n} between them (overlap {sorted(kda & full)}, missing {missing})"
            )
    elif "linear_attn_config" in text:
        problems.append(f"text_config.linear_attn_config is {lac!r}; supported: an object (KDA layers)")
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        problems.append("vision_config is missing or not an object")
    else:
        problems += _missing(vision, "vision_config", VISION_KEYS)
        problems += _value_problems(vision, "vision_config", SUPPORTED_VISION)
    return problems


def check_config(config: Mapping[str, Any], source: str = "config.json") -> None:
    """Raise ValueError listing every problem `config_problems` finds in `source`."""
    problems = config_problems(config)
    if problems:
        raise ValueError(f"{source} is not a Kimi-K3 config modelopt_ext supports: " + "; ".join(problems))
