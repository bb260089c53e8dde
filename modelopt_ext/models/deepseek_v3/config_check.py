"""What the DeepSeek-V3 family needs from a config.json (DeepSeek-V3/R1 `deepseek_v3`, Kimi-K2 `kimi_k2`),
checked before anything is loaded.

The family loads with transformers' native `DeepseekV3ForCausalLM` (no remote code), whose router is always
the sigmoid, bias-corrected (`noaux_tc`), group-limited top-k with renormalisation and scaling, whose MLPs
are SiLU-gated, and which reads neither `scoring_func`, `topk_method` nor `moe_layer_freq`. A config that says
otherwise would load silently into a different model, so it is refused here, every problem named (key,
value, what is supported). The checkpoints' own remote code defaults differ from transformers' for
`scoring_func` ("softmax"), `topk_method` ("greedy"), `norm_topk_prob` (False) and `routed_scaling_factor`
(1.0), so those keys must be present: a missing one is not taken as transformers' default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ARCHITECTURE = "DeepseekV3ForCausalLM"

# Keys the sizes, layout, stand-in and the model transformers builds read (integers unless noted).
INT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_shared_experts", "n_routed_experts", "num_experts_per_tok", "first_k_dense_replace",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
)
OTHER_KEYS = ("q_lora_rank", "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps")
# key -> (values implemented, what they mean). A missing key is refused unless DEFAULTS has it.
SUPPORTED = {
    "scoring_func": (("sigmoid",), "sigmoid router scores (transformers' DeepseekV3TopkRouter)"),
    "topk_method": (("noaux_tc",), "the bias-corrected, group-limited top-k router"),
    "hidden_act": (("silu",), "SiLU-gated MLPs and experts"),
    "moe_layer_freq": ((1,), "every layer from first_k_dense_replace on is MoE (transformers ignores the key)"),
    "attention_bias": ((False,), "MLA projections without biases"),
}
# The real configs' values, and what the checkpoints' remote code assumes without the key.
DEFAULTS = {"moe_layer_freq": 1, "attention_bias": False, "hidden_act": "silu"}
# The one quantization_config of the public checkpoints (README_WEIGHTS.md), key for key.
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _value_problems(config: Mapping[str, Any]) -> list[str]:
    problems = []
    for key, (values, meaning) in SUPPORTED.items():
        if key not in config and key not in DEFAULTS:
            problems.append(f"{key} is missing; supported: {list(values)} ({meaning})")
            continue
        value = config.get(key, DEFAULTS.get(key))
        if not any(value == v and type(value) is type(v) for v in values):  # False is not 0 here
            problems.append(f"{key} is {value!r}; supported: {list(values)} ({meaning})")
    return problems


def _quantization_problems(config: Mapping[str, Any]) -> list[str]:
    qc = config.get("quantization_config")
    if qc is None:
        return []  # a bf16 checkpoint (e.g. DeepSeek's fp8_cast_bf16.py output)
    if not isinstance(qc, Mapping):
        return [f"quantization_config is {qc!r}; supported: none, or {FP8_QUANTIZATION}"]
    if str(qc.get("quant_method", "")).startswith("modelopt"):
        return []  # a ModelOpt export (this family's `ptq` output): `verify` checks it against hf_quant_config.json
    def same(key) -> bool:
        value, expected = qc.get(key), FP8_QUANTIZATION[key]
        if isinstance(expected, list):  # [128, 128] or (128, 128)
            return isinstance(value, (list, tuple)) and list(value) == expected
        return value == expected

    differing = {k: qc.get(k) for k in set(qc) | set(FP8_QUANTIZATION) if k not in FP8_QUANTIZATION or not same(k)}
    if not differing:
        return []
    shown = ", ".join(f"{k}={_short(differing[k])}" for k in sorted(differing))
    return [f"quantization_config has {shown}; supported: none, exactly {FP8_QUANTIZATION} (FP8 E4M3 weights "
            "with float32 128x128 block scales, as DeepSeek-V3 and Kimi-K2 ship), or a ModelOpt export's "
            "(quant_method modelopt*)"]


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...}"


def _structure_problems(config: Mapping[str, Any]) -> list[str]:
    """Sizes that transformers' DeepSeek-V3 model or its router cannot take."""
    problems = []
    bad = [k for k in INT_KEYS if k in config and not (_is_int(config[k]) and config[k] > 0)]
    bad = [k for k in bad if not (k == "first_k_dense_replace" and _is_int(config[k]) and config[k] == 0)]
    problems += [f"{k} is {config[k]!r}; supported: a positive int" for k in bad]
    q = config.get("q_lora_rank", 0)
    if "q_lora_rank" in config and q is not None and not (_is_int(q) and q > 0):
        problems.append(f"q_lora_rank is {q!r}; supported: a positive int, or null (no query LoRA)")
    if bad or not all(k in config for k in INT_KEYS):
        return problems
    E, groups, chosen, k = (config["n_routed_experts"], config["n_group"], config["topk_group"],
                            config["num_experts_per_tok"])
    if E % groups:
        problems.append(f"n_routed_experts ({E}) is not divisible by n_group ({groups})")
    elif E // groups < 2:
        problems.append(f"n_group ({groups}) leaves {E // groups} expert(s) per group; the router scores a group by "
                        "its top 2 experts, so a group needs at least 2")
    if chosen > groups:
        problems.append(f"topk_group ({chosen}) exceeds n_group ({groups})")
    elif not E % groups and k > chosen * (E // groups):
        problems.append(f"num_experts_per_tok ({k}) exceeds the {chosen * (E // groups)} experts of the "
                        f"topk_group ({chosen}) groups a token may use")
    if config["first_k_dense_replace"] > config["num_hidden_layers"]:
        problems.append(f"first_k_dense_replace ({config['first_k_dense_replace']}) exceeds num_hidden_layers "
                        f"({config['num_hidden_layers']})")
    return problems


def config_problems(config: Mapping[str, Any]) -> list[str]:
    """Every way a config.json mapping departs from what the family reads and implements."""
    problems = []
    if config.get("model_type") not in MODEL_TYPES:
        problems.append(f"model_type is {config.get('model_type')!r}; supported: {list(MODEL_TYPES)}")
    architectures = config.get("architectures")
    if architectures is not None and list(architectures) != [ARCHITECTURE]:
        problems.append(f"architectures is {architectures!r}; supported: [{ARCHITECTURE!r}]")
    problems += [f"{key} is missing" for key in (*INT_KEYS, *OTHER_KEYS) if key not in config]
    problems += _value_problems(config)
    if "norm_topk_prob" in config and not isinstance(config["norm_topk_prob"], bool):
        problems.append(f"norm_topk_prob is {config['norm_topk_prob']!r}; supported: true or false")
    factor = config.get("routed_scaling_factor")
    if "routed_scaling_factor" in config and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                              or factor <= 0):
        problems.append(f"routed_scaling_factor is {factor!r}; supported: a positive number")
    mtp = config.get("num_nextn_predict_layers", 0)
    if not (_is_int(mtp) and mtp >= 0):
        problems.append(f"num_nextn_predict_layers is {mtp!r}; supported: an int >= 0 (MTP layers are not loaded)")
    problems += _structure_problems(config)
    problems += _quantization_problems(config)
    return problems


def check_config(config: Mapping[str, Any], source: str = "config.json") -> None:
    """Raise ValueError listing every problem `config_problems` finds in `source`."""
    problems = config_problems(config)
    if problems:
        raise ValueError(f"{source} is not a DeepSeek-V3 config modelopt_ext supports: " + "; ".join(problems))
