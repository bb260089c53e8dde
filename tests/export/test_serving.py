"""modelopt_ext.export.serving: the quantization config as the engines parse it (algorithm names, aliases under
each engine's naming, fused names, exclusions that exclude nothing quantized, modelopt_mixed), the engines'
exclusion matching, and the FP8 block report at real Kimi-K3 sizes."""

from __future__ import annotations

import json

import pytest

from modelopt_ext.export import serving as X
from modelopt_ext.families import family_for_config
from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG
from modelopt_ext.quant import recipes as R

L = "language_model.model.layers."


@pytest.fixture(scope="module")
def real():
    return json.loads(BUNDLED_CONFIG.read_text())


@pytest.fixture(scope="module")
def spec(real):
    return family_for_config(real, source="test").serving


@pytest.mark.parametrize("pattern, module, hits", [
    (f"{L}1.self_attn.q", f"{L}1.self_attn.q_proj", ["vllm substring"]),  # a prefix of the name
    (f"{L}1.self_attn.q_proj", f"{L}1.self_attn.q_proj", ["vllm exact", "vllm substring", "vllm fnmatch",
                                                          "sglang dotted path",
                                                          "sglang regex", "trtllm fnmatch"]),
    (f"{L}1.self_attn*", f"{L}1.self_attn.q_proj", ["vllm substring", "vllm fnmatch", "sglang regex",
                                                    "trtllm fnmatch"]),
    (f"{L}*.block_sparse_moe.gate", f"{L}1.block_sparse_moe.gate", ["vllm fnmatch", "sglang regex",
                                                                    "trtllm fnmatch"]),
    (f"{L}*.block_sparse_moe.gate", f"{L}1.block_sparse_moe.experts", []),
    ("gate", f"{L}1.block_sparse_moe.shared_experts.gate_proj", ["vllm substring"]),
    ("gate_proj", f"{L}1.block_sparse_moe.shared_experts.gate_proj", ["vllm substring", "sglang regex",
                                                                       "sglang dotted path"]),
    (f"{L}1.block_sparse_moe", f"{L}1.block_sparse_moe.experts", ["vllm substring", "sglang dotted path",
                                                                  "trtllm fnmatch"]),
    (f"{L}1.self_attn.q_proj", f"{L}11.self_attn.q_proj", []),
    ("re:.*experts", f"{L}1.block_sparse_moe.experts", ["trtllm regex"]),
])
def test_exclusion_hits(pattern, module, hits, spec):
    assert sorted(X.exclusion_hits(pattern, module, spec)) == sorted(hits)


def _modelopt_mixed(real, layers=(1, 3)):
    """What ModelOpt 0.47's get_quant_config writes for the production recipe (lower-case fp8_pb_wo, no
    exclusions), for two layers: a KDA one and an MLA one."""
    q = {}
    for i in layers:
        kda = str(i + 1) in map(str, real["text_config"]["linear_attn_config"]["kda_layers"])
        leaves = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj", "o_proj") if kda else (
            "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "g_proj", "o_proj")
        q.update({f"{L}{i}.self_attn.{p}": {"quant_algo": "fp8_pb_wo"} for p in leaves})
        q[f"{L}{i}.block_sparse_moe.experts"] = {"quant_algo": "NVFP4", "group_size": 16}
    return {"producer": {"name": "modelopt", "version": "0.47.0"},
            "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": q}}


def _linears(layers=(1, 3)):
    out = ["language_model.lm_head", "mm_projector.proj.0", "vision_tower.encoder.blocks.0.wqkv",
           "vision_tower.encoder.blocks.1.wqkv"]
    for i in layers:
        out += [f"{L}{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj",
                                                  "o_proj", "f_b_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
                                                  "kv_b_proj")]
        out += [f"{L}{i}.block_sparse_moe.{p}" for p in ("gate", "routed_expert_down_proj", "routed_expert_up_proj",
                                                         "shared_experts.gate_proj", "shared_experts.up_proj")]
        out += [f"{L}{i}.mlp_res_proj"]
    return out


def test_serving_quant_config(real, spec):
    hf = X.serving_quant_config(_modelopt_mixed(real), spec, real, _linears())
    q = hf["quantization"]
    layers = q["quantized_layers"]
    assert layers[f"{L}1.self_attn.q_proj"] == {"quant_algo": "FP8_PB_WO", "group_size": 128}
    assert layers["model.layers.1.self_attn.q_proj"] == layers[f"{L}1.self_attn.q_proj"]  # SGLang's name
    assert layers[f"{L}1.self_attn.in_proj_qkvgfab"]["quant_algo"] == "FP8_PB_WO"  # vLLM's fused KDA input
    assert layers["model.layers.1.self_attn.fused_qkvg_proj"]["quant_algo"] == "FP8_PB_WO"
    assert layers[f"{L}3.self_attn.fused_qkv_a_proj"]["quant_algo"] == "FP8_PB_WO"
    assert layers["model.layers.3.self_attn.fused_qkv_a_proj_with_mqa"]["quant_algo"] == "FP8_PB_WO"
    assert layers["model.layers.1.mlp.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert q["group_size"] == 16 and q["kv_cache_quant_algo"] is None
    assert f"{L}*.block_sparse_moe.gate" in q["exclude_modules"] and "vision_tower.encoder.blocks.*.wqkv" in (
        q["exclude_modules"])
    quantized = [k for k in layers if k.startswith("language_model.")]
    for pattern in q["exclude_modules"]:
        for module in quantized:
            assert X.exclusion_hits(pattern, module, spec) == [], (pattern, module)


def test_an_exclusion_glob_that_would_hit_a_quantized_module_falls_back_to_names(real, spec):
    """f_b_proj of layer 1 unquantized, f_b_proj of layer 3 quantized: the glob over layers would exclude the
    quantized one, so the exclusion names layer 1's module only."""
    modelopt = _modelopt_mixed(real)
    modelopt["quantization"]["quantized_layers"][f"{L}3.self_attn.f_b_proj"] = {"quant_algo": "fp8_pb_wo"}
    q = X.serving_quant_config(modelopt, spec, real, _linears())["quantization"]
    assert f"{L}1.self_attn.f_b_proj" in q["exclude_modules"]
    assert f"{L}*.self_attn.f_b_proj" not in q["exclude_modules"]


def test_a_split_group_gets_no_fused_name(real, spec):
    modelopt = _modelopt_mixed(real)
    del modelopt["quantization"]["quantized_layers"][f"{L}1.self_attn.b_proj"]
    layers = X.serving_quant_config(modelopt, spec, real, _linears())["quantization"]["quantized_layers"]
    assert f"{L}1.self_attn.in_proj_qkvgfab" not in layers  # b_proj differs: vLLM's fused GEMM has no one format
    assert "model.layers.1.self_attn.fused_qkvg_proj" in layers  # SGLang fuses q/k/v/g only: still one format


def test_single_format_is_kept_with_upper_case_algo(real, spec):
    hf = {"quantization": {"quant_algo": "fp8", "exclude_modules": ["lm_head"], "kv_cache_quant_algo": None}}
    assert X.serving_quant_config(hf, spec, real, [])["quantization"] == {
        "quant_algo": "FP8", "exclude_modules": ["lm_head"], "kv_cache_quant_algo": None}


def test_flat_config_is_marked_modelopt_mixed(real, spec):
    hf = X.serving_quant_config(_modelopt_mixed(real), spec, real, _linears())
    flat = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "ignore": [],
            "config_groups": {"group_0": {"quant_algo": "fp8_pb_wo", "targets": ["x"]}}}
    out = X.flat_quant_config(flat, hf)
    q = hf["quantization"]
    assert out["quant_method"] == "modelopt_mixed" and out["quantized_layers"] == q["quantized_layers"]
    assert out["ignore"] == q["exclude_modules"] and out["group_size"] == 16 and out["kv_cache_quant_algo"] is None
    assert out["config_groups"]["group_0"]["quant_algo"] == "FP8_PB_WO"
    assert out["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]


def test_fp8_block_report_at_real_size(real, spec):
    cfg = R.quant_config(R.load("kimi_k3/nvfp4_experts-fp8_attention"), real)["quant_cfg"]
    assert X.fp8_block_report(real, spec, cfg) == [
        "KDA input projections: q_proj 12288 + k_proj 12288 + v_proj 12288 + g_proj 12288 + f_a_proj 128 + b_proj 96 "
        "= 49376 rows = 385 blocks + 96 rows; partial block in b_proj (the group's last member: the scale grids "
        "concatenate)",
        "MLA latent down projections: q_a_proj 1536 + kv_a_proj_with_mqa 576 = 2112 rows = 16 blocks + 64 rows; "
        "partial block in kv_a_proj_with_mqa (the group's last member: the scale grids concatenate)",
    ]
    assert X.fp8_block_report(real, spec, R.quant_config(R.load("kimi_k3/fp8_all"), real)["quant_cfg"]) == []


def test_fp8_block_report_flags_a_block_that_straddles_members(real, spec):
    odd = json.loads(json.dumps(real))
    odd["text_config"]["q_lora_rank"] = 1500
    cfg = R.quant_config(R.load("kimi_k3/nvfp4_experts-fp8_attention"), odd)["quant_cfg"]
    mla = [line for line in X.fp8_block_report(odd, spec, cfg) if line.startswith("MLA")]
    assert mla == ["MLA latent down projections: q_a_proj 1500 + kv_a_proj_with_mqa 576 = 2076 rows = 16 blocks + "
                   "28 rows; partial block in q_a_proj, kv_a_proj_with_mqa (NOT only at the group's end: a fused "
                   "block would straddle two members)"]
