"""The DeepSeek-V3 recipes (recipes/deepseek_v3/): they load, keep the family's exclusions, quantize every
engine-fused group alike and leave the KV cache alone; a recipe that splits a group or quantizes the KV cache is
refused before anything is loaded."""

from __future__ import annotations

import json

import pytest
import yaml

from modelopt_ext.quant import recipes as R
from modelopt_ext.quant.fused_groups import check_fused_groups, quantizer_states
from modelopt_ext.quant.kv_cache import check_kv_cache, enabled_kv_quantizers

from .test_serving import spec

SHIPPED = ["deepseek_v3/fp8_all", "deepseek_v3/nvfp4_experts-fp8_attention", "deepseek_v3/nvfp4_experts_only"]
FP8_BLOCK = "FP8 E4M3, 128x128 blocks"


@pytest.fixture(scope="module")
def real():
    from modelopt_ext.models.deepseek_v3.sizes import BUNDLED_CONFIG

    return json.loads(BUNDLED_CONFIG.read_text())


def _user_recipe(tmp_path, entries):
    data = {
        "imports": {"base_disable_all": "configs/ptq/units/base_disable_all",
                    "deepseek_v3_exclusions": "units/deepseek_v3_exclusions", "fp8": "configs/numerics/fp8"},
        "metadata": {"recipe_type": "ptq", "description": "test"},
        "quantize": {"algorithm": "max", "quant_cfg": [{"$import": "base_disable_all"}, *entries,
                                                       {"$import": "deepseek_v3_exclusions"}]},
    }
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_passes_the_checks(name, real):
    assert name in R.available_recipes()
    quant = R.quant_config(R.load(name), real)
    serving = spec()
    check_fused_groups(quant["quant_cfg"], real, serving, name)
    check_kv_cache(quant["quant_cfg"], real, serving, name, quant.sources)
    assert enabled_kv_quantizers(quant["quant_cfg"], serving.kv_cache.attention_modules(real)) == {}
    # the recipes import the family's unit: nothing is appended
    assert R.family_exclusion_entries(list(R.load(name)["quantize"]["quant_cfg"]), real) == []


def _described(name, real, modules):
    from modelopt_ext.quant.fused_groups import describe

    quant = R.quant_config(R.load(name), real)
    states = quantizer_states(quant["quant_cfg"], [f"{m}.{q}" for m in modules
                                                   for q in ("weight_quantizer", "input_quantizer")])
    return {m: (describe(states[f"{m}.weight_quantizer"]), describe(states[f"{m}.input_quantizer"]))
            for m in modules}


def test_production_recipe_quantizes_attention_only_outside_the_experts(real):
    a, m = "model.layers.3.self_attn.", "model.layers.3.mlp."
    attention = [a + p for p in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")]
    bf16 = [m + "shared_experts.gate_proj", m + "shared_experts.up_proj", m + "shared_experts.down_proj",
            "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj", m + "gate", "lm_head"]
    got = _described("deepseek_v3/nvfp4_experts-fp8_attention", real, attention + bf16)
    assert {k: v for k, v in got.items() if k in attention} == dict.fromkeys(attention, (FP8_BLOCK, "unquantized"))
    assert {k: v for k, v in got.items() if k in bf16} == dict.fromkeys(bf16, ("unquantized", "unquantized"))


def test_fp8_all_quantizes_every_engine_linear(real):
    modules = ["model.layers.3.self_attn.q_a_proj", "model.layers.3.self_attn.kv_b_proj",
               "model.layers.0.mlp.up_proj", "model.layers.3.mlp.shared_experts.down_proj"]
    assert _described("deepseek_v3/fp8_all", real, modules) == dict.fromkeys(modules, (FP8_BLOCK, "unquantized"))
    assert _described("deepseek_v3/fp8_all", real, ["model.layers.3.mlp.gate", "lm_head"]) == dict.fromkeys(
        ["model.layers.3.mlp.gate", "lm_head"], ("unquantized", "unquantized"))


def test_a_recipe_splitting_mla_latent_projections_is_refused(tmp_path, real):
    path = _user_recipe(tmp_path, [{"quantizer_name": "*self_attn.q_a_proj.weight_quantizer",
                                    "cfg": {"$import": "fp8", "block_sizes": {-1: 128, -2: 128}}}])
    quant = R.quant_config(R.load(path), real)
    with pytest.raises(ValueError) as err:
        check_fused_groups(quant["quant_cfg"], real, spec(), str(path))
    text = str(err.value)
    assert ("MLA latent down projections (vllm fused_qkv_a_proj, sglang fused_qkv_a_proj_with_mqa, "
            "trtllm kv_a_proj_with_mqa) in layers [0, 1, 2") in text
    assert f"q_a_proj: weights {FP8_BLOCK}, inputs unquantized; kv_a_proj_with_mqa: weights unquantized" in text


def test_a_recipe_splitting_shared_gate_up_is_refused(tmp_path, real):
    path = _user_recipe(tmp_path, [{"quantizer_name": "*shared_experts.up_proj.weight_quantizer",
                                    "cfg": {"$import": "fp8"}}])
    quant = R.quant_config(R.load(path), real)
    with pytest.raises(ValueError, match=r"shared experts gate/up \(vllm gate_up_proj, sglang gate_up_proj, "
                                         r"trtllm gate_up_proj\) in layers \[3, 4, "):
        check_fused_groups(quant["quant_cfg"], real, spec(), str(path))


def test_a_kv_cache_recipe_is_refused(tmp_path, real):
    path = _user_recipe(tmp_path, [{"quantizer_name": "*[kv]_bmm_quantizer",
                                    "cfg": {"num_bits": [4, 3], "axis": None}}])
    quant = R.quant_config(R.load(path), real)
    with pytest.raises(ValueError, match=r"quantizes the KV cache, whose calibrated scales vllm, sglang, trtllm "
                                         r"cannot use: .* enables model\.layers\.0\.self_attn\.k_bmm_quantizer "
                                         r"and 121 more"):
        check_kv_cache(quant["quant_cfg"], real, spec(), str(path), quant.sources)


def test_qformat_mapping():
    table = R.qformat_recipes()["deepseek_v3"]
    assert table == {"fp8_2d_blockwise_weight_only": "deepseek_v3/fp8_all",
                     "nvfp4_experts_only": "deepseek_v3/nvfp4_experts_only"}
    assert R.recipe_for_qformat("nvfp4_experts_only", family="deepseek_v3") == R.resolve_recipe(
        "deepseek_v3/nvfp4_experts_only")


def test_the_wheel_lists_the_recipe_folder():
    from pathlib import Path

    root = Path(R.__file__).resolve().parents[2]
    assert '"modelopt_ext.recipes.deepseek_v3" = ["*.yaml"]' in (root / "pyproject.toml").read_text()
    assert '"modelopt_ext.recipes.deepseek_v3"' in (root / "setup.py").read_text()


@pytest.mark.parametrize("name", SHIPPED)
def test_every_pattern_of_a_shipped_recipe_matches_the_model(name, ds_tiny):
    """ModelOpt's conversion of the loaded stand-in with each recipe: every entry matches what it is meant for
    (`check_patterns_match`, which ptq runs after the first batch: a pattern that matches nothing fails the run),
    and the router, norms, embeddings and lm_head stay unquantized."""
    import modelopt.torch.quantization as mtq
    import torch

    import modelopt_ext
    from modelopt_ext.quant.patterns import quantizers

    model = modelopt_ext.from_pretrained(ds_tiny, dtype=torch.float32)
    cfg = dict(R.quant_config(R.load(name), model.config))
    cfg["algorithm"] = None  # conversion only
    model = mtq.quantize(model, cfg, None)
    R.check_patterns_match(R.quant_config(R.load(name), model.config), model)
    enabled = [n for n, q in quantizers(model).items() if q.is_enabled]
    assert enabled and not [n for n in enabled if ".mlp.gate." in n or "norm" in n or "lm_head" in n
                            or "embed_tokens" in n]
