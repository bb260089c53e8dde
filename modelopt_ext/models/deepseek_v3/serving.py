"""How the serving engines build DeepSeek-V3 (and Kimi-K2): fused projections, modules they never quantize, names.

Facts read in the engines' DeepSeek-V3 model files (`engine_rules.SOURCES` names file and function), as data:

- **Fused groups.** With a q LoRA (`q_lora_rank` set): vLLM builds `self_attn.fused_qkv_a_proj` from q_a_proj +
  kv_a_proj_with_mqa (`DeepseekV2MLAAttention.__init__`, `packed_modules_mapping`), SGLang concatenates the two
  checkpoint tensors into `self_attn.fused_qkv_a_proj_with_mqa` (`DeepseekV2ForCausalLM.load_weights`),
  TensorRT-LLM concatenates them into its `self_attn.kv_a_proj_with_mqa` (q_a rows first;
  `DeepseekV3WeightLoader.load_weights`, `DeepseekV3Attention.__init__`). Without a q LoRA nothing is fused
  there. The dense MLP's and the shared experts' gate/up are one `gate_up_proj` in every engine (vLLM / SGLang
  `DeepseekV2MLP`, TensorRT-LLM `GatedMLP` with `params_map`). A fused GEMM has one quantization method, so the
  members must share one. The routed experts' gate/up are fused by every engine (w13) inside one experts bank.
- **SGLang also fuses the shared experts into the routed experts bank** by default (`DeepseekV2MoE.__init__`:
  `num_fused_shared_experts = n_shared_experts` unless `--disable-shared-experts-fusion`; `load_weights` renames
  `mlp.shared_experts` to `mlp.experts.{n_routed_experts}`), loading them with the routed experts' method. A
  recipe whose shared experts differ from the routed ones needs that flag in SGLang (not modelled as a group:
  the routed experts are one fused bank here, not per-projection modules; `SGLANG_SHARED_EXPERTS` says it).
- **Never quantized by any engine**: the router `mlp.gate` (vLLM `GateLinear` built without a quantization
  config, SGLang `MoEGate` and TensorRT-LLM `DeepseekV3Gate` plain parameters) and the MTP layer's `eh_proj`
  (TensorRT-LLM `DeepseekV3MTP` plain `Linear`; vLLM `deepseek_mtp.py`).
- **Names.** All three engines name modules as the checkpoint does (`model.layers.N...`, `lm_head`); SGLang's
  DeepSeek-V2/V3 model has no weight-name mapper.
- **KV cache** (`KV_CACHE`): every layer is MLA; the engines cache the compressed latent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from modelopt_ext.families import FusedGroup, KVCacheServing

LAYERS = "model.layers."
ENGINES = ("vllm", "sglang", "trtllm")
# (group name, members in the engines' fused order, layer kind, {engine: fused module name}); names relative to
# the decoder layer. "mla_lora": layers of a config with q_lora_rank; "dense" / "moe": `first_k_dense_replace`.
_GROUPS = (
    ("MLA latent down projections", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), "mla_lora",
     {"vllm": "self_attn.fused_qkv_a_proj", "sglang": "self_attn.fused_qkv_a_proj_with_mqa",
      "trtllm": "self_attn.kv_a_proj_with_mqa"}),
    ("dense MLP gate/up", ("mlp.gate_proj", "mlp.up_proj"), "dense",
     {"vllm": "mlp.gate_up_proj", "sglang": "mlp.gate_up_proj", "trtllm": "mlp.gate_up_proj"}),
    ("shared experts gate/up", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), "moe",
     {"vllm": "mlp.shared_experts.gate_up_proj", "sglang": "mlp.shared_experts.gate_up_proj",
      "trtllm": "mlp.shared_experts.gate_up_proj"}),
)
# module-name regexes (checkpoint naming) no engine quantizes
NEVER_QUANTIZED = (
    r"(^|\.)mlp\.gate$",
    r"(^|\.)eh_proj$",
)
SGLANG_SHARED_EXPERTS = (
    "SGLang fuses the shared experts into the routed experts bank (mlp.experts.{n_routed_experts}) unless started "
    "with --disable-shared-experts-fusion, loading them with the routed experts' quantization method")


def _layer_kinds(config: Mapping[str, Any]) -> dict[str, range | list[int]]:
    layers = int(config["num_hidden_layers"])
    first_dense = int(config["first_k_dense_replace"])
    return {
        "mla_lora": range(layers) if config.get("q_lora_rank") is not None else [],
        "dense": range(min(first_dense, layers)),
        "moe": range(first_dense, layers),  # layout.Dims.is_moe: MoE from first_k_dense_replace on
    }


def fused_groups(config: Mapping[str, Any]) -> tuple[FusedGroup, ...]:
    """Every fused group of the decoder layers of a raw config.json (the MTP layers are not exported)."""
    kinds = _layer_kinds(config)
    groups = []
    for name, members, kind, fused in _GROUPS:
        for i in kinds[kind]:
            prefix = f"{LAYERS}{i}."
            full = tuple(prefix + m for m in members)
            per_engine = {engine: (engine_name(prefix + f, engine), full) for engine, f in fused.items()}
            groups.append(FusedGroup(name, i, full, per_engine))
    return tuple(sorted(groups, key=lambda g: (g.layer, g.name)))


def never_quantized(module: str) -> bool:
    """Whether no engine quantizes this module (checkpoint naming)."""
    return any(re.search(p, module) for p in NEVER_QUANTIZED)


def engine_name(module: str, engine: str) -> str:
    """A checkpoint module name as `engine` names the module it builds for it: the same name in all three."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return module


def layer_aliases(module: str) -> tuple[str, ...]:
    """The names under which `quantized_layers` lists a quantized module so that every engine finds it."""
    return (module,)


def linear_shape(config: Mapping[str, Any], module: str) -> tuple[int, int] | None:
    """(out, in) of an attention or MLP projection of a decoder layer, from the config (layout.py's shapes);
    None for others (the routed experts, the router)."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    nope, rope, v = (int(config[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    kv_lora = int(config["kv_lora_rank"])
    q_lora = config.get("q_lora_rank")
    leaf = module.rpartition(".")[2]
    if ".mlp.experts." in module or module.endswith(".mlp.experts"):
        return None
    if ".mlp." in module and leaf in ("gate_proj", "up_proj", "down_proj"):
        width = (int(config["moe_intermediate_size"]) * int(config["n_shared_experts"])
                 if ".shared_experts." in module else int(config["intermediate_size"]))
        return (hidden, width) if leaf == "down_proj" else (width, hidden)
    shapes = {
        "q_proj": (heads * (nope + rope), hidden),
        "kv_a_proj_with_mqa": (kv_lora + rope, hidden),
        "kv_b_proj": (heads * (nope + v), kv_lora),
        "o_proj": (hidden, heads * v),
    }
    if q_lora is not None:
        shapes["q_a_proj"] = (int(q_lora), hidden)
        shapes["q_b_proj"] = (heads * (nope + rope), int(q_lora))
    return shapes.get(leaf) if ".self_attn." in module else None


def attention_modules(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The attention modules (checkpoint names) whose keys and values are cached: every decoder layer's MLA."""
    return tuple(f"{LAYERS}{i}.self_attn" for i in range(int(config["num_hidden_layers"])))


KV_CACHE = KVCacheServing(
    attention_modules=attention_modules,
    cached="the MLA latent, kv_a_layernorm(kv_c) and the rotated k_pe (kv_lora_rank + qk_rope_head_dim = 576 "
           "values per token at full size, one vector shared by all heads, one FP8 scale for it)",
    engines={
        "vllm": "deepseek_v2.py load_weights remaps ModelOpt's self_attn.k_proj.k_scale / v_proj.v_scale with "
                "maybe_remap_kv_scale_name to self_attn.attn.k_scale / v_scale; its MLA layer sits under "
                "self_attn.mla_attn (MultiHeadLatentAttentionWrapper), so whether that name exists was not traced; "
                "either way the scale would be applied to the latent cache it was not measured on",
        "sglang": "deepseek_v2.py load_weights renames self_attn.k_proj.k_scale to self_attn.attn_mqa.k_scale "
                  "(\"modelopt attn kv scale is named differently\") and loads it into the latent-cache attention "
                  "(RadixAttention attn_mqa): the scale of the decompressed keys applied to the latent",
        "trtllm": "not known to load one: DeepseekV3WeightLoader.load_weights walks the model's own modules and "
                  "reads only their weights; nothing reads self_attn.k_proj.k_scale (not traced further)",
    },
    measured="ModelOpt 0.47 attaches k_bmm_quantizer / v_bmm_quantizer to transformers' DeepseekV3Attention "
             "(register_hf_attentions_on_the_fly, _QuantAttention._quantized_attention) and measures the key and "
             "value states passed to the attention function: the decompressed per-head keys (kv_b_proj's k_nope "
             "with k_pe) and values, not the latent the engines cache; the export names them "
             "self_attn.k_proj.k_scale / v_proj.v_scale, modules MLA does not have",
    alternative="remove the entry (or disable it: quantizer_name '*[kv]_bmm_quantizer', enable: false) and serve "
                "with the engine's own FP8 KV cache: vLLM or SGLang --kv-cache-dtype fp8_e4m3, TensorRT-LLM "
                "kv_cache_config dtype fp8",
)
