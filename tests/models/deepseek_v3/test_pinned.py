"""models/deepseek_v3/pinned.py: the family's data (floors, globs, EP plan, expert names) against transformers'
model: the globs name modules it builds, and the EP plan is transformers' own under the causal LM's prefix."""

from __future__ import annotations

import fnmatch
import json

import torch

from modelopt_ext.models.deepseek_v3 import pinned


def test_the_ep_plan_is_transformers_own_under_the_causal_lm_prefix():
    from transformers import DeepseekV3Config

    native = DeepseekV3Config().base_model_ep_plan
    assert {f"model.{k}": v for k, v in native.items()} == dict(pinned.EP_PLAN)
    assert [k for k, v in pinned.EP_PLAN.items() if v == "ep_dispatch_experts"] == [pinned.EXPERTS_GLOB]


def test_the_globs_name_modules_of_the_model(ds_tiny):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config.from_dict(json.loads((ds_tiny / "config.json").read_text()))
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    modules = [n for n, _ in model.named_modules()]
    params = [n for n, _ in model.named_parameters()]
    moe = range(config.first_k_dense_replace, config.num_hidden_layers)
    assert [n for n in modules if fnmatch.fnmatchcase(n, pinned.EXPERTS_GLOB)] == [
        f"model.layers.{i}.mlp.experts" for i in moe]
    assert [n for n in modules if fnmatch.fnmatchcase(n, pinned.ROUTER_GLOB)] == [f"model.layers.{i}.mlp.gate" for i in moe]
    for glob in pinned.EP_PLAN:
        assert any(fnmatch.fnmatchcase(n, glob) for n in modules + params), glob
    assert set(pinned.EXPORT_EXPERT_NAMES) == {"gate_proj", "up_proj", "down_proj"}
    assert set(pinned.MIN_VERSIONS) == {"transformers", "torch"}
