"""The DeepSeek-V3 family's config check (modelopt_ext.models.deepseek_v3.config_check): the public configs
pass; a missing key or a value transformers' DeepseekV3ForCausalLM does not implement is refused, named."""

from __future__ import annotations

import copy
import json

import pytest

from modelopt_ext.models.deepseek_v3.config_check import (
    FP8_QUANTIZATION,
    INT_KEYS,
    OTHER_KEYS,
    check_config,
    config_problems,
)
from modelopt_ext.models.deepseek_v3.sizes import BUNDLED_CONFIG, KIMI_K2_CONFIG

DSV3 = json.loads(BUNDLED_CONFIG.read_text())
K2 = json.loads(KIMI_K2_CONFIG.read_text())


def _with(config: dict, **changes) -> dict:
    out = copy.deepcopy(config)
    for key, value in changes.items():
        if value is KeyError:
            out.pop(key, None)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("config", [DSV3, K2], ids=["deepseek_v3", "kimi_k2"])
def test_the_public_configs_have_no_problems(config):
    assert config_problems(config) == []
    check_config(config)


def test_the_stand_in_config_has_no_problems(ds_tiny):
    assert config_problems(json.loads((ds_tiny / "config.json").read_text())) == []


@pytest.mark.parametrize("key, value, supported", [
    ("scoring_func", "softmax", "['sigmoid']"),
    ("topk_method", "greedy", "['noaux_tc']"),
    ("topk_method", "group_limited_greedy", "['noaux_tc']"),
    ("hidden_act", "gelu", "['silu']"),
    ("moe_layer_freq", 2, "[1]"),
    ("moe_layer_freq", True, "[1]"),  # a bool is not the count 1
    ("attention_bias", True, "[False]"),
])
def test_an_unsupported_value_is_refused_naming_key_value_and_supported(key, value, supported):
    with pytest.raises(ValueError) as exc:
        check_config(_with(DSV3, **{key: value}), "ckpt/config.json")
    message = str(exc.value)
    assert message.startswith("ckpt/config.json is not a DeepSeek-V3 config modelopt_ext supports: ")
    assert f"{key} is {value!r}; supported: {supported}" in message


@pytest.mark.parametrize("key", [*INT_KEYS, *OTHER_KEYS, "scoring_func", "topk_method"])
def test_a_missing_key_is_refused(key):
    problems = config_problems(_with(DSV3, **{key: KeyError}))
    assert any(p.startswith(f"{key} is missing") for p in problems), problems


@pytest.mark.parametrize("key", ["moe_layer_freq", "attention_bias", "hidden_act", "num_nextn_predict_layers",
                                 "quantization_config"])
def test_keys_with_a_known_default_may_be_missing(key):
    assert config_problems(_with(DSV3, **{key: KeyError})) == []


@pytest.mark.parametrize("quantization, shown", [
    ({**FP8_QUANTIZATION, "weight_block_size": [64, 64]}, "weight_block_size=[64, 64]"),
    ({**FP8_QUANTIZATION, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**FP8_QUANTIZATION, "activation_scheme": "static"}, "activation_scheme='static'"),
    ({**FP8_QUANTIZATION, "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "quant_method='compressed-tensors'"),
    ({k: v for k, v in FP8_QUANTIZATION.items() if k != "fmt"}, "fmt=None"),
])
def test_a_quantization_config_other_than_fp8_128x128_is_refused(quantization, shown):
    problems = config_problems(_with(DSV3, quantization_config=quantization))
    assert len(problems) == 1 and problems[0].startswith("quantization_config has ") and shown in problems[0]
    assert "supported: none, exactly" in problems[0] and "or a ModelOpt export's" in problems[0]


def test_a_modelopt_export_config_is_accepted_and_a_long_value_is_cut():
    """The family's own `ptq` output (quant_method modelopt / modelopt_mixed) is read back by `verify`."""
    for method in ("modelopt", "modelopt_mixed"):
        assert config_problems(_with(DSV3, quantization_config={"quant_method": method, "quant_algo": "NVFP4"})) == []
    long = {"quant_method": "other", "config_groups": {f"group_{i}": {"targets": ["x" * 50]} for i in range(20)}}
    problem = config_problems(_with(DSV3, quantization_config=long))[0]
    assert "config_groups={'group_0'" in problem and " ...}" in problem and len(problem) < 600


def test_block_size_as_a_tuple_is_the_same():
    assert config_problems(_with(DSV3, quantization_config={**FP8_QUANTIZATION, "weight_block_size": (128, 128)})) == []


def test_every_problem_is_named_at_once():
    problems = config_problems(_with(DSV3, scoring_func="softmax", topk_method="greedy", norm_topk_prob=KeyError,
                                     model_type="llama", architectures=["LlamaForCausalLM"],
                                     quantization_config={"quant_method": "fp8"}))
    assert [p.split(" ")[0] for p in problems] == [
        "model_type", "architectures", "norm_topk_prob", "scoring_func", "topk_method", "quantization_config"]


@pytest.mark.parametrize("changes, message", [
    ({"n_group": 3}, "n_routed_experts (256) is not divisible by n_group (3)"),
    ({"n_group": 256, "topk_group": 4}, "leaves 1 expert(s) per group"),
    ({"topk_group": 9}, "topk_group (9) exceeds n_group (8)"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok (129) exceeds the 128 experts of the topk_group (4)"),
    ({"first_k_dense_replace": 62}, "first_k_dense_replace (62) exceeds num_hidden_layers (61)"),
    ({"hidden_size": 0}, "hidden_size is 0; supported: a positive int"),
    ({"n_routed_experts": "256"}, "n_routed_experts is '256'; supported: a positive int"),
    ({"q_lora_rank": 0}, "q_lora_rank is 0; supported: a positive int, or null"),
    ({"norm_topk_prob": 1}, "norm_topk_prob is 1; supported: true or false"),
    ({"routed_scaling_factor": -1}, "routed_scaling_factor is -1; supported: a positive number"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers is -1"),
])
def test_structures_the_router_or_model_cannot_take_are_refused(changes, message):
    problems = config_problems(_with(DSV3, **changes))
    assert any(message in p for p in problems), problems


def test_valid_variants_pass():
    assert config_problems(_with(DSV3, q_lora_rank=None, first_k_dense_replace=0, norm_topk_prob=False,
                                 num_nextn_predict_layers=0, n_group=1, topk_group=1)) == []
    assert config_problems(_with(K2, model_type="deepseek_v3", architectures=KeyError)) == []
