"""models/deepseek_v3/engine_rules.py: what the engines' DeepSeek-V3 model code adds to their ModelOpt loaders."""

from __future__ import annotations

from modelopt_ext.export.engine_names import RULES_WITHOUT_LOADER_SOURCE, SOURCES, EngineView
from modelopt_ext.models.deepseek_v3.engine_rules import SOURCES as DS_SOURCES
from modelopt_ext.models.deepseek_v3.engine_rules import (
    sglang_key,
    trtllm_expert_key,
    trtllm_module_name,
    trtllm_names,
)

BANK = "model.layers.3.mlp.experts"


def test_sglang_key_is_the_identity():
    for key in (BANK, "model.layers.3.self_attn.q_a_proj", "lm_head"):
        assert sglang_key(key) == key


def test_trtllm_names_of_modules():
    assert trtllm_expert_key(3) == BANK
    assert trtllm_module_name("model.layers.3.self_attn.q_a_proj") == "model.layers.3.self_attn.kv_a_proj_with_mqa"
    assert trtllm_module_name("model.layers.0.mlp.up_proj") == "model.layers.0.mlp.gate_up_proj"
    assert trtllm_module_name("model.layers.3.mlp.shared_experts.gate_proj") == (
        "model.layers.3.mlp.shared_experts.gate_up_proj")
    assert trtllm_module_name("model.layers.3.self_attn.o_proj") == "model.layers.3.self_attn.o_proj"


def test_single_algorithm_export_is_accepted():
    view = EngineView("NVFP4", {}, ())
    assert trtllm_names({BANK: "NVFP4"}, view, {}) == []
    assert trtllm_names({BANK: "NVFP4"}, EngineView("FP8", {}, ()), {}) == [
        f"{BANK} carries NVFP4 but the top-level quant_algo is FP8"]


def test_mixed_precision_is_refused_and_keys_must_be_exact():
    o_proj = "model.layers.3.self_attn.o_proj"
    view = EngineView("MIXED_PRECISION", {BANK: "NVFP4", o_proj: "FP8_PB_WO"}, ())
    assert trtllm_names({BANK: "NVFP4"}, view, {o_proj: "FP8_PB_WO"}) == [
        "top-level quant_algo MIXED_PRECISION: TensorRT-LLM's DeepseekV3DecoderLayer asserts its layer quant "
        "config is not MIXED_PRECISION (\"MIXED_PRECISION is ambiguous\")"]
    problems = trtllm_names({BANK: "NVFP4", "model.layers.4.mlp.experts": "NVFP4"},
                            EngineView("MIXED_PRECISION", {"model.layers.4.mlp.experts": "FP8"}, ()), {})
    assert problems[1:] == [
        f"{BANK}: no exact quantized_layers key {BANK}: TensorRT-LLM's DeepSeek-V3 falls back to the global quant "
        "config for the experts",
        "model.layers.4.mlp.experts carries NVFP4 but model.layers.4.mlp.experts says FP8",
    ]


def test_mla_projections_read_by_the_models_own_loader():
    q_a = "model.layers.3.self_attn.q_a_proj"
    problems = trtllm_names({}, EngineView("FP8_PB_WO", {}, ()), {q_a: "FP8_PB_WO"})
    assert problems == [f"{q_a} carries FP8_PB_WO: TensorRT-LLM's DeepseekV3WeightLoader loads q_a_proj itself and "
                        "reads only weight and DeepSeek's weight_scale_inv, not ModelOpt's scales"]
    gate = "model.layers.0.mlp.gate_proj"
    view = EngineView("MIXED_PRECISION", {"model.layers.0.mlp.gate_up_proj": "FP8_PB_WO"}, ())
    assert trtllm_names({}, view, {gate: "FP8_PB_WO"})[1:] == []
    assert trtllm_names({}, view, {gate: "NVFP4"})[1:] == [
        f"{gate} carries NVFP4 but the exact key model.layers.0.mlp.gate_up_proj says FP8_PB_WO"]


def test_every_rule_without_a_loader_source_has_a_model_source():
    assert set(RULES_WITHOUT_LOADER_SOURCE) <= set(DS_SOURCES)
    assert not set(RULES_WITHOUT_LOADER_SOURCE) & set(SOURCES)
    assert all(engine in ("vllm", "sglang", "trtllm") and text for (engine, _), text in DS_SOURCES.items())
