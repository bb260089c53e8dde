"""The adapter reads only the real config.json's keys and refuses values it does not implement."""

from __future__ import annotations

import copy
import json

import pytest

from modelopt_ext.families import family_for_config
from modelopt_ext.models.kimi_k3.config_check import TEXT_KEYS, VISION_KEYS, check_config, config_problems
from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG

REAL = json.loads(BUNDLED_CONFIG.read_text())


def _with(section: str | None, key: str, value, sub: str | None = None):
    config = copy.deepcopy(REAL)
    target = config if section is None else config[section]
    if sub is not None:
        target = target[sub]
    if value is KeyError:
        del target[key]
    else:
        target[key] = value
    return config


def test_the_public_config_has_no_problems():
    assert config_problems(REAL) == []
    assert family_for_config(REAL).name == "kimi_k3"


@pytest.mark.parametrize("key, value, supported", [
    ("hidden_act", "silu", "['situ']"),
    ("topk_method", "greedy", "['noaux_tc']"),
    ("num_expert_group", 8, "[1]"),
    ("topk_group", 4, "[1]"),
    ("moe_router_activation_func", "softmax", "['sigmoid']"),
    ("mla_use_nope", False, "[True]"),
    ("num_nextn_predict_layers", 1, "[0]"),
    ("num_expert_group", True, "[1]"),  # a bool is not the count 1
])
def test_an_unsupported_text_value_is_refused_naming_key_value_and_supported(key, value, supported):
    with pytest.raises(ValueError) as exc:
        check_config(_with("text_config", key, value), "ckpt/config.json")
    message = str(exc.value)
    assert message.startswith("ckpt/config.json is not a Kimi-K3 config modelopt_ext supports")
    assert f"text_config.{key} is {value!r}; supported: {supported}" in message


@pytest.mark.parametrize("key", TEXT_KEYS)
def test_a_missing_text_key_is_refused(key):
    assert f"text_config.{key} is missing" in config_problems(_with("text_config", key, KeyError))


@pytest.mark.parametrize("key", VISION_KEYS)
def test_a_missing_vision_key_is_refused(key):
    assert f"vision_config.{key} is missing" in config_problems(_with("vision_config", key, KeyError))


def test_the_old_stand_in_keys_are_not_accepted_in_place_of_the_real_ones():
    config = _with("text_config", "routed_expert_hidden_size", KeyError)
    config["text_config"]["latent_moe_dim"] = 3584
    assert "text_config.routed_expert_hidden_size is missing" in config_problems(config)


def test_keys_with_real_defaults_may_be_absent():
    config = copy.deepcopy(REAL)
    for key in ("topk_method", "num_expert_group", "topk_group", "num_nextn_predict_layers"):
        del config["text_config"][key]
    assert config_problems(config) == []


def test_other_value_checks():
    assert any("use_full_rank_gate is False" in p for p in
               config_problems(_with("text_config", "use_full_rank_gate", False, sub="linear_attn_config")))
    assert any("mm_projector_type is 'mlp'" in p for p in config_problems(_with("vision_config", "mm_projector_type", "mlp")))
    split = _with("text_config", "kda_layers", [1, 2, 3, 4], sub="linear_attn_config")
    assert any("must split the 1-based layers 1..93" in p and "overlap [4]" in p for p in config_problems(split))
    assert any("routed_expert_hidden_size is None" in p
               for p in config_problems(_with("text_config", "routed_expert_hidden_size", None)))
    assert config_problems({"model_type": "kimi_k3"}) == ["text_config is missing or not an object"]


def test_family_lookup_runs_the_check():
    with pytest.raises(ValueError, match=r"text_config.hidden_act is 'silu'"):
        family_for_config(_with("text_config", "hidden_act", "silu"), "x/config.json")
