"""models/kimi_k3/engine_rules.py: what the engines' Kimi-K3 model code adds to their ModelOpt loaders."""

from __future__ import annotations

from modelopt_ext.export.engine_names import RULES_WITHOUT_LOADER_SOURCE, SOURCES, EngineView
from modelopt_ext.models.kimi_k3.engine_rules import SOURCES as K3_SOURCES
from modelopt_ext.models.kimi_k3.engine_rules import sglang_key, trtllm_expert_keys, trtllm_names
from modelopt_ext.models.kimi_k3.spec import KIMI_K3


def test_sglang_key():
    assert sglang_key("language_model.layers.3.block_sparse_moe.experts") == "language_model.model.layers.3.mlp.experts"
    assert sglang_key("language_model.model.layers.3.self_attn.q_proj") == "language_model.model.layers.3.self_attn.q_proj"


def test_trtllm_expert_keys():
    assert trtllm_expert_keys(2) == [
        "language_model.model.layers.2.block_sparse_moe.experts", "language_model.model.layers.2.mlp.experts",
        "model.layers.2.block_sparse_moe.experts", "model.layers.2.mlp.experts",
        "layers.2.block_sparse_moe.experts", "layers.2.mlp.experts",
    ]


def test_trtllm_names():
    bank = "language_model.model.layers.2.block_sparse_moe.experts"
    mixed = EngineView("MIXED_PRECISION", {"model.layers.2.mlp.experts": "NVFP4"}, ())
    assert trtllm_names({bank: "NVFP4"}, mixed, {"x.q_proj": "FP8_PB_WO"}) == []
    problems = trtllm_names({bank: "FP8"}, EngineView("MIXED_PRECISION", {}, ()), {"x.q_proj": "FP8"})
    assert problems == [
        f"{bank} carries FP8: the Kimi-K3 runtime loads routed experts as NVFP4 only",
        f"{bank}: no exact quantized_layers key language_model.model.layers.2.block_sparse_moe.experts | "
        "language_model.model.layers.2.mlp.experts | ...: TensorRT-LLM defaults the experts to W4A8_MXFP4_MXFP8",
        "x.q_proj carries FP8: the Kimi-K3 runtime builds it in bf16 and dequantizes only FP8 block weights",
    ]
    assert trtllm_names({bank: "NVFP4"}, EngineView("FP8", {}, ()), {}) == [
        f"{bank} carries NVFP4 but the top-level quant_algo is FP8"]


def test_every_rule_has_a_source_and_the_family_spec_carries_these():
    serving = KIMI_K3.serving
    assert (serving.sglang_key, serving.trtllm_names, serving.sources) == (sglang_key, trtllm_names, K3_SOURCES)
    assert set(RULES_WITHOUT_LOADER_SOURCE) <= set(K3_SOURCES)
    assert not set(RULES_WITHOUT_LOADER_SOURCE) & set(SOURCES)
