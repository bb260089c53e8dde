"""How the serving engines build Kimi-K3: fused projections, modules they never quantize, their names.

Facts read in the engines' sources (docs/export.md, "Serving engines", lists the files), written as data:

- **Fused groups.** vLLM loads a KDA layer's q/k/v/g/f_a/b projections into one GEMM (`in_proj_qkvgfab`),
  SGLang q/k/v/g (`fused_qkvg_proj`); both fuse MLA's q_a_proj and kv_a_proj_with_mqa
  (`fused_qkv_a_proj`, `fused_qkv_a_proj_with_mqa`) and the dense MLP's and the shared experts' gate/up
  (`gate_up_proj`). A fused GEMM has one quantization method, so the members must share one. The routed
  experts' w1/w3 are fused by every engine (`w13`); in this project's fused layout they already share one
  quantizer per expert (`gate_up_proj`).
- **Never quantized by any engine** (built with no quantization config): the router `gate`, the latent
  projections `routed_expert_{down,up}_proj`, the AttnRes projections, the KDA short convolutions, the
  vision tower and the projector. A quantized weight there is loaded as if it were bf16.
- **Names.** vLLM and TensorRT-LLM name modules as the checkpoint does (`language_model.model.layers.N...`);
  SGLang builds the text model with an empty prefix (`model.layers.N...`) and renames `block_sparse_moe`
  to `mlp`, and looks `quantized_layers` keys up under its own names only.
- **KV cache** (`KV_CACHE`, docs/export.md "KV cache"): only the MLA layers have one (KDA keeps a recurrent
  state); every engine caches MLA's compressed latent, and none loads calibrated KV scales for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from modelopt_ext.families import FusedGroup, KVCacheServing

from .inventory import layer_schedule

TEXT_LAYERS = "language_model.model.layers."
ENGINES = ("vllm", "sglang", "trtllm")
# (group name, members in the engines' fused order, layer kind, {engine: fused module name}); the member and
# fused names are relative to the decoder layer
_GROUPS = (
    ("KDA input projections", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.g_proj",
                               "self_attn.f_a_proj", "self_attn.b_proj"), "kda",
     {"vllm": "self_attn.in_proj_qkvgfab", "sglang": "self_attn.fused_qkvg_proj"}),
    ("MLA latent down projections", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), "mla",
     {"vllm": "self_attn.fused_qkv_a_proj", "sglang": "self_attn.fused_qkv_a_proj_with_mqa"}),
    ("dense MLP gate/up", ("mlp.gate_proj", "mlp.up_proj"), "dense",
     {"vllm": "mlp.gate_up_proj", "sglang": "mlp.gate_up_proj", "trtllm": "mlp.gate_up_proj"}),
    ("shared experts gate/up", ("block_sparse_moe.shared_experts.gate_proj",
                                "block_sparse_moe.shared_experts.up_proj"), "moe",
     {"vllm": "block_sparse_moe.shared_experts.gate_up_proj", "sglang": "mlp.shared_experts.gate_up_proj",
      "trtllm": "block_sparse_moe.shared_experts.gate_up_proj"}),
)
# SGLang's fused members are a prefix of the group (q/k/v/g); the rest (f_a, b) stay separate there
_SGLANG_MEMBERS = {"KDA input projections": 4}
# module-name regexes (checkpoint naming) no engine quantizes
NEVER_QUANTIZED = (
    r"(^|\.)block_sparse_moe\.gate$",
    r"(^|\.)block_sparse_moe\.routed_expert_(down|up)_proj$",
    r"(^|\.)(self_attention|mlp|output_attn)_res_proj$",
    r"(^|\.)self_attn\.[qkv]_conv1d$",
    r"^vision_tower\.",
    r"^mm_projector\.",
)


def fused_groups(config: Mapping[str, Any]) -> tuple[FusedGroup, ...]:
    """Every fused group of a raw config.json (sizes and layer schedule from the config)."""
    schedule = layer_schedule(config)
    kinds = {"kda": schedule.kda, "mla": schedule.mla, "dense": schedule.dense, "moe": schedule.moe}
    groups = []
    for name, members, kind, fused in _GROUPS:
        for i in kinds[kind]:
            prefix = f"{TEXT_LAYERS}{i}."
            full = tuple(prefix + m for m in members)
            per_engine = {}
            for engine, f in fused.items():
                fused_members = full[: _SGLANG_MEMBERS.get(name, len(full))] if engine == "sglang" else full
                per_engine[engine] = (engine_name(prefix + f, engine), fused_members)
            groups.append(FusedGroup(name, i, full, per_engine))
    return tuple(sorted(groups, key=lambda g: (g.layer, g.name)))


def never_quantized(module: str) -> bool:
    """Whether no engine quantizes this module (checkpoint naming)."""
    return any(re.search(p, module) for p in NEVER_QUANTIZED)


def engine_name(module: str, engine: str) -> str:
    """A checkpoint module name as `engine` names the module it builds for it."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    if engine == "sglang" and module.startswith("language_model.model."):
        return "model." + module.removeprefix("language_model.model.").replace("block_sparse_moe", "mlp")
    if engine == "sglang" and module.startswith("language_model."):
        return module.removeprefix("language_model.")
    return module


def layer_aliases(module: str) -> tuple[str, ...]:
    """The names under which `quantized_layers` lists a quantized module so that every engine finds it: the
    checkpoint name (vLLM, TensorRT-LLM) and SGLang's."""
    return tuple(dict.fromkeys((module, engine_name(module, "sglang"))))


def linear_shape(config: Mapping[str, Any], module: str) -> tuple[int, int] | None:
    """(out, in) of an attention projection of the text model, from the config; None for others."""
    text = config.get("text_config", config)
    lac = text.get("linear_attn_config") or {}
    hidden = int(text["hidden_size"])
    kda = int(lac.get("num_heads", 0)) * int(lac.get("head_dim", 0))
    heads = int(text["num_attention_heads"])
    qk_head = int(text["qk_nope_head_dim"]) + int(text["qk_rope_head_dim"])
    leaf = module.rpartition(".")[2]
    if leaf in ("g_proj", "o_proj"):  # KDA's gate and output are heads x head_dim wide, MLA's heads x v_head_dim
        layer = int(module.removeprefix(TEXT_LAYERS).split(".")[0])
        width = kda if layer in layer_schedule(config).kda else heads * int(text["v_head_dim"])
        return (width, hidden) if leaf == "g_proj" else (hidden, width)
    shapes = {
        "q_proj": (kda, hidden), "k_proj": (kda, hidden), "v_proj": (kda, hidden),
        "f_a_proj": (int(lac.get("head_dim", 0)), hidden), "b_proj": (int(lac.get("num_heads", 0)), hidden),
        "q_a_proj": (int(text["q_lora_rank"]), hidden),
        "kv_a_proj_with_mqa": (int(text["kv_lora_rank"]) + int(text["qk_rope_head_dim"]), hidden),
        "q_b_proj": (heads * qk_head, int(text["q_lora_rank"])),
        "kv_b_proj": (heads * (int(text["qk_nope_head_dim"]) + int(text["v_head_dim"])), int(text["kv_lora_rank"])),
    }
    return shapes.get(leaf)


def mla_attention_modules(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The MLA attention modules (checkpoint names): the only layers with a KV cache."""
    return tuple(f"{TEXT_LAYERS}{i}.self_attn" for i in layer_schedule(config).mla)


KV_CACHE = KVCacheServing(
    attention_modules=mla_attention_modules,
    cached="the MLA latent, kv_a_layernorm(kv_c) and k_pe (kv_lora_rank + qk_rope_head_dim values per token, "
           "one vector shared by all heads, one FP8 scale for it); KDA layers keep a recurrent state, not a KV cache",
    engines={
        "vllm": "its Kimi-K3 MLA layer (vllm/models/kimi_k3/nvidia/mla.py) is no Attention/MLAAttention, so the "
                "ModelOpt config gives it no KV-cache method and the checkpoint's self_attn.k_proj.k_scale / "
                "v_proj.v_scale are remapped to self_attn.attn.k_scale, which does not exist, and dropped; the FP8 "
                "latent cache uses scale 1.0. kv_cache_quant_algo FP8 in the export would switch that FP8 cache on "
                "by itself (--kv-cache-dtype auto follows the checkpoint)",
        "sglang": "models/kimi_k3.py maps self_attn.k_proj.k_scale to self_attn.attn.k_scale (its MLA has attn_mqa / "
                  "attn_mha), does not find it and skips it; the FP8 latent cache uses scale 1.0",
        "trtllm": "not known to load one: its Kimi-K3 MLA (KimiK3MLAAttention, a thin subclass of the shared MLA "
                  "module) has no self_attn.k_proj / v_proj to carry ModelOpt's names, and no loading of a KV scale "
                  "for it was found (not traced further)",
    },
    measured="ModelOpt 0.47 attaches k_bmm_quantizer / v_bmm_quantizer to the MLA attention module and measures "
             "them on the decompressed per-head keys and values (kv_b_proj's output with k_pe), not on the latent "
             "the engines cache (the adapter registers its MLA class with ModelOpt, models/kimi_k3/mla.py; ModelOpt's "
             "own source rewrite of the remote code had swapped them); the export names them "
             "self_attn.k_proj.k_scale / v_proj.v_scale, modules MLA does not have",
    alternative="remove the entry (or disable it: quantizer_name '*[kv]_bmm_quantizer', enable: false) and serve "
                "with the engine's own FP8 KV cache: vLLM or SGLang --kv-cache-dtype fp8_e4m3, TensorRT-LLM "
                "kv_cache_config dtype fp8; vLLM and SGLang quantize the latent with scale 1.0 there",
)
