"""What the serving engines' DeepSeek-V3 model code adds to their generic ModelOpt loaders (`export.engine_names`):
SGLang's weight-name mapping (none), TensorRT-LLM's DeepSeek-V3 rules, and the model files each rule comes from.

- SGLang (`sglang/srt/models/deepseek_v2.py`, `DeepseekV2ForCausalLM.load_weights`) has no weight-name mapper for
  `quantized_layers` keys: `sglang_key` is the identity.
- TensorRT-LLM (`tensorrt_llm/_torch/models/modeling_deepseekv3.py`):
  - the routed experts of layer N take `quant_config_dict.get("model.layers.N.mlp.experts", quant_config)`: an
    exact key, else the global config (`Deepseekv3MoE._get_experts_quant_config`);
  - every decoder layer asserts that its quant config (the global one, or none for a layer listed in
    `exclude_modules`) is not MIXED_PRECISION, "MIXED_PRECISION is ambiguous"
    (`DeepseekV3DecoderLayer.__init__`, `_get_decoder_layer_quant_config`);
  - q_a_proj + kv_a_proj_with_mqa (fused into its `kv_a_proj_with_mqa`) and kv_b_proj are loaded by the model's
    own loader, which reads `weight` and DeepSeek's `weight_scale_inv` only (`DeepseekV3WeightLoader.load_weights`,
    `load_kv_b_proj_and_k_b_proj_trans`): ModelOpt's `weight_scale` / `weight_scale_2` / `input_scale` are not read;
  - `quantized_layers` keys are module names (`DeepseekV3ForCausalLM.__init__` renames a legacy
    `...self_attn.fused_a` key to `...self_attn.kv_a_proj_with_mqa`); other modules are taken here to resolve by
    their exact name, as the experts do (their per-module lookup in `modeling_utils` was not traced).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the family registers without importing the export checks
    from modelopt_ext.export.engine_names import EngineView

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# modules TensorRT-LLM's DeepSeek-V3 loader reads itself, weight and weight_scale_inv only
TRTLLM_OWN_LOADER = ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# checkpoint leaf -> TensorRT-LLM's module (GatedMLP fuses gate/up)
_TRTLLM_LEAF = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

_VLLM_DS = "vllm/model_executor/models/deepseek_v2.py"
_SGL_DS = "sglang/srt/models/deepseek_v2.py"
_TRT_DS = "tensorrt_llm/_torch/models/modeling_deepseekv3.py"
# (engine, rule) -> the DeepSeek-V3 model files behind the rule, beside the generic loader's (engine_names.SOURCES)
SOURCES: Mapping[tuple[str, str], str] = {
    ("vllm", "names"): f"{_VLLM_DS}: DeepseekV2ForCausalLM.packed_modules_mapping, load_weights",
    ("vllm", "fused-groups"): f"{_VLLM_DS}: DeepseekV2MLAAttention.__init__ (fused_qkv_a_proj), DeepseekV2MLP "
                              "(gate_up_proj)",
    ("vllm", "never-quantized"): f"{_VLLM_DS}: DeepseekV2MoE.__init__ (gate: GateLinear without quant_config); "
                                 "vllm/model_executor/models/deepseek_mtp.py (eh_proj)",
    ("sglang", "names"): f"{_SGL_DS}: DeepseekV2ForCausalLM.load_weights (no weight-name mapper)",
    ("sglang", "fused-groups"): f"{_SGL_DS}: DeepseekV2AttentionMLA.__init__, DeepseekV2ForCausalLM.load_weights "
                                "(fused_qkv_a_proj_with_mqa, gate_up_proj, shared experts into mlp.experts)",
    ("sglang", "never-quantized"): f"{_SGL_DS}: MoEGate (plain weight parameter)",
    ("trtllm", "names"): f"{_TRT_DS}: Deepseekv3MoE._get_experts_quant_config, DeepseekV3DecoderLayer.__init__ "
                         "(MIXED_PRECISION assertion), DeepseekV3ForCausalLM.__init__ (fused_a key rename), "
                         "DeepseekV3WeightLoader.load_weights",
    ("trtllm", "fused-groups"): f"{_TRT_DS}: DeepseekV3Attention.__init__, DeepseekV3WeightLoader.load_weights "
                                "(q_a_proj into kv_a_proj_with_mqa; params_map gate_up_proj)",
    ("trtllm", "never-quantized"): f"{_TRT_DS}: DeepseekV3Gate (plain parameters), DeepseekV3MTP.eh_proj "
                                   "(Linear without quant_config)",
    ("trtllm", "scales"): f"{_TRT_DS}: DeepseekV3WeightLoader.load_weights (weight_scale_inv only for "
                          "kv_a_proj_with_mqa / q_a_proj / kv_b_proj)",
}


def sglang_key(key: str) -> str:
    """A `quantized_layers` key as SGLang's DeepSeek-V3 model holds it: unchanged (it has no weight mapper)."""
    return key


def trtllm_expert_key(layer: int) -> str:
    """The exact key TensorRT-LLM's DeepSeek-V3 looks the routed experts of decoder layer `layer` up by."""
    return f"model.layers.{layer}.mlp.experts"


def trtllm_module_name(module: str) -> str:
    """A checkpoint module as TensorRT-LLM's DeepSeek-V3 names the module it builds for it (q_a_proj: the fused
    kv_a_proj_with_mqa; gate/up_proj: gate_up_proj)."""
    parent, _, leaf = module.rpartition(".")
    if leaf == "q_a_proj":
        return f"{parent}.kv_a_proj_with_mqa"
    return f"{parent}.{_TRTLLM_LEAF.get(leaf, leaf)}"


# TensorRT-LLM's DeepSeek-V3 asserts a non-MIXED_PRECISION quant config and reads q_a/kv_a/kv_b's scales only as
# weight_scale_inv (`trtllm_names`), and SGLang takes FP8_PB_WO only inside MIXED_PRECISION: the production recipe's
# export (NVFP4 experts + FP8 attention) is for vLLM and SGLang, fp8_all's for vLLM; nvfp4_experts_only loads in all
# three (each checked on the stand-in's exports: tests/models/deepseek_v3/test_ptq.py).
RECIPE_ENGINES = {"deepseek_v3/nvfp4_experts-fp8_attention": ("vllm", "sglang"), "deepseek_v3/fp8_all": ("vllm",)}


def trtllm_names(banks: Mapping[str, str], view: EngineView, others: Mapping[str, str]) -> list[str]:
    """TensorRT-LLM's DeepSeek-V3: no MIXED_PRECISION top level; routed experts banks (name -> format their tensors
    have) under the exact key `model.layers.N.mlp.experts` or the top-level algorithm; q_a / kv_a / kv_b
    projections unquantized (its loader reads DeepSeek's weight_scale_inv only); other quantized modules
    (`others`) under their exact TensorRT-LLM name."""
    from modelopt_ext.export.engine_names import MIXED

    problems = []
    mixed = view.algo == MIXED
    if mixed:
        problems.append("top-level quant_algo MIXED_PRECISION: TensorRT-LLM's DeepseekV3DecoderLayer asserts its "
                        "layer quant config is not MIXED_PRECISION (\"MIXED_PRECISION is ambiguous\")")
    for bank, have in banks.items():
        if not mixed:
            if view.algo != have:
                problems.append(f"{bank} carries {have} but the top-level quant_algo is {view.algo}")
            continue
        layer = _LAYER.search(bank)
        key = trtllm_expert_key(int(layer.group(1))) if layer else None
        if key is None or key not in view.layers:
            problems.append(f"{bank}: no exact quantized_layers key {key}: TensorRT-LLM's DeepSeek-V3 falls back to "
                            "the global quant config for the experts")
        elif view.layers[key] != have:
            problems.append(f"{bank} carries {have} but {key} says {view.layers[key]}")
    for unit, have in others.items():
        leaf = unit.rpartition(".")[2]
        if leaf in TRTLLM_OWN_LOADER:
            problems.append(f"{unit} carries {have}: TensorRT-LLM's DeepseekV3WeightLoader loads {leaf} itself and "
                            "reads only weight and DeepSeek's weight_scale_inv, not ModelOpt's scales")
            continue
        name = trtllm_module_name(unit)
        if not mixed:
            if view.algo != have:
                problems.append(f"{unit} carries {have} but the top-level quant_algo is {view.algo}")
        elif view.layers.get(name) != have:
            problems.append(f"{unit} carries {have} but the exact key {name} says {view.layers.get(name)}")
    return problems
