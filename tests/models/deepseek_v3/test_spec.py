"""The DeepSeek-V3 family's registration (`models/deepseek_v3/spec.py`): found by both model types, no remote
code (no revision, no lock; `ptq` validate skips the lock check and refuses a lock), its EP plan against the model
transformers builds, router glob and exclusions against the loaded names, planning from the bundled configs
(`modelopt-ext plan`) and the stand-in through `modelopt-ext make-tiny`."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import torch

from modelopt_ext.cli import main
from modelopt_ext.families import experts_module_glob, families, family_for_config
from modelopt_ext.models.deepseek_v3 import sizes as S

DSV3 = json.loads(S.BUNDLED_CONFIG.read_text())
K2 = json.loads(S.KIMI_K2_CONFIG.read_text())


@pytest.fixture(scope="module")
def spec():
    return families()["deepseek_v3"]


@pytest.fixture(scope="module")
def meta_model(ds_tiny):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config.from_dict(json.loads((ds_tiny / "config.json").read_text()))
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(config)


def test_registered_for_both_model_types(spec):
    assert family_for_config(DSV3) is spec and family_for_config(K2) is spec
    assert spec.model_types == ("deepseek_v3", "kimi_k2") and spec.text_model_type is None
    assert spec.revision is None and spec.remote_code_lock is None  # transformers' own classes
    assert spec.default_recipe == "deepseek_v3/nvfp4_experts-fp8_attention" and spec.prediction is None
    assert spec.serving.engines == ("vllm", "sglang", "trtllm") and spec.ptq_refused is None
    assert spec.carried_layers(DSV3) == ("model.layers.61.",) and spec.carried_layers(K2) == ()  # Kimi-K2 ships no MTP layer
    assert spec.carried_layers({**DSV3, "num_nextn_predict_layers": 0}) == ()
    assert dict(spec.serving.recipe_engines) == {"deepseek_v3/nvfp4_experts-fp8_attention": ("vllm", "sglang"),
                                                 "deepseek_v3/fp8_all": ("vllm",)}
    assert dict(spec.bundled_configs) == {"deepseek-v3": S.BUNDLED_CONFIG, "kimi-k2": S.KIMI_K2_CONFIG}
    assert dict(spec.export_expert_names) == {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


def test_an_unsupported_config_is_refused_by_the_registry():
    with pytest.raises(ValueError, match="topk_method is 'greedy'"):
        family_for_config({**DSV3, "topk_method": "greedy"}, source="SRC")


def test_ep_plan_is_transformers_own_under_the_causal_lm_prefix(spec, meta_model):
    from transformers import DeepseekV3Config

    from modelopt_ext.ep.sharding import select_ep_plan

    assert experts_module_glob(spec) == "model.layers.*.mlp.experts"
    assert dict(spec.ep_plan) == {f"model.{k}": v for k, v in DeepseekV3Config.base_model_ep_plan.items()}
    assert select_ep_plan(spec.ep_plan, meta_model) == dict(spec.ep_plan)


def test_router_glob_and_exclusions_name_the_modules(spec, meta_model):
    names = [n for n, _ in meta_model.named_modules()]
    routers = [n for n in names if fnmatch.fnmatchcase(n, spec.router_glob)]
    assert routers == [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]
    excluded = spec.quantizer_exclusions(DSV3)

    def stays_bf16(module: str) -> bool:
        return any(fnmatch.fnmatchcase(f"{module}.weight_quantizer", g) for g in excluded)

    assert all(stays_bf16(n) for n in routers)
    assert all(stays_bf16(n) for n in ("model.embed_tokens", "lm_head", "model.norm", "model.layers.1.input_layernorm",
                                       "model.layers.1.self_attn.q_a_layernorm", "model.layers.1.self_attn.kv_a_layernorm"))
    quantizable = [n for n, m in meta_model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert "model.layers.0.mlp.gate_proj" in quantizable and "model.layers.1.mlp.shared_experts.gate_proj" in quantizable
    assert not any(stays_bf16(n) for n in quantizable)


def test_converters_are_transformers_deepseek_v3_mapping(spec):
    names = [type(c).__name__ for c in spec.converters("fp8")]
    assert names and names == [type(c).__name__ for c in spec.converters("dense")]
    with pytest.raises(ValueError, match="expert storage 'mxfp4'"):
        spec.converters("mxfp4")


@pytest.mark.parametrize("model,experts,per_rank", [("deepseek-v3", 256, 4), ("kimi-k2", 384, 6)])
def test_plan_from_the_bundled_configs(capsys, model, experts, per_rank):
    """The experts are planned as they are held after loading (bf16: the FP8 ones are dequantized), read as
    stored (FP8 + block scales)."""
    assert main(["plan", "--model", model, "--nproc", "64", "--device-memory-gib", "141", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    config = DSV3 if model == "deepseek-v3" else K2
    sizes = S.plan_sizes(config)
    assert (plan["family"], plan["num_experts"], plan["experts_per_rank"]) == ("deepseek_v3", experts, per_rank)
    assert plan["expert_storage"] == "dense" and plan["dense"] == "replicate"
    assert plan["estimate"]["expert_bytes"] == -(-sizes["expert_params"] * 2 // 64)
    assert plan["estimate"]["dense_bytes"] == sizes["loaded_dense_bytes"]
    assert plan["estimate"]["read_bytes"] == -(-sizes["expert_bytes"] // 64) + sizes["dense_bytes"]
    assert plan["expert_total_bytes"] == sizes["expert_bytes"]


def test_make_tiny_through_the_cli(tmp_path, capsys):
    out = tmp_path / "ds"
    assert main(["make-tiny", "deepseek_v3", str(out), "--num-layers", "3", "--num-experts", "8", "--top-k", "2",
                 "--hidden-size", "128", "--vocab-size", "400", "--moe-intermediate-size", "128"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and "auto_map" not in config
    assert (config["num_hidden_layers"], config["n_routed_experts"], config["num_experts_per_tok"],
            config["hidden_size"], config["vocab_size"], config["moe_intermediate_size"]) == (3, 8, 2, 128, 400, 128)
    assert family_for_config(config) is families()["deepseek_v3"]


@pytest.mark.parametrize("extra,needle", [
    (["--latent-size", "64"], "deepseek_v3 stand-in: no size latent_size"),
    (["--hidden-size", "100"], "hidden_size=100 must be a positive multiple of 128"),
])
def test_make_tiny_refuses_sizes_it_has_not(tmp_path, capsys, extra, needle):
    assert main(["make-tiny", "deepseek_v3", str(tmp_path / "x"), *extra]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


RECIPE = """\
imports:
  base_disable_all: configs/ptq/units/base_disable_all
  default_disabled_quantizers: configs/ptq/units/default_disabled_quantizers
  fp8: configs/numerics/fp8
metadata:
  recipe_type: ptq
  description: FP8 weights of every Linear (a test recipe)
quantize:
  algorithm:
    method: max
  quant_cfg:
    - $import: base_disable_all
    - quantizer_name: '*weight_quantizer'
      cfg:
        $import: fp8
    - $import: default_disabled_quantizers
"""


def test_ptq_refuses_a_family_marked_refused_before_loading(ds_tiny, tmp_path, capsys, monkeypatch, spec):
    """A family whose spec says `ptq_refused` (as this one did until its export existed) is refused in validate,
    saying why, and nothing is loaded."""
    import dataclasses

    import modelopt_ext.loading
    from modelopt_ext import families as registry

    refused = dataclasses.replace(spec, ptq_refused="the export does not write this family yet")
    monkeypatch.setattr(registry, "_FAMILIES", {**registry._FAMILIES, "deepseek_v3": refused})
    monkeypatch.setattr(modelopt_ext.loading, "load_checkpoint", lambda *a, **k: pytest.fail("loaded"))
    assert main(["ptq", "--model", str(ds_tiny), "--export-dir", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("modelopt-ext ptq: error: validate: family 'deepseek_v3' (") and \
        "cannot be quantized by ptq yet: the export does not write this family yet" in err, err


def test_ptq_validate_has_no_lock_to_check(ds_tiny, tmp_path, monkeypatch, spec):
    """validate skips the lock check of a family without remote code and refuses a lock given for it."""
    from modelopt_ext import ptq
    from modelopt_ext.export import writer
    from modelopt_ext.run_config import PtqConfig

    runnable = spec
    monkeypatch.setattr(writer, "check_export_dir", lambda d, overwrite: Path(d).absolute())
    recipe = tmp_path / "fp8_weights.yaml"
    recipe.write_text(RECIPE)
    inputs = ptq.validate(PtqConfig(model=str(ds_tiny), export_dir=str(tmp_path / "o"), recipe=str(recipe)))
    assert inputs.lock is None and inputs.family is runnable and inputs.num_experts == 16
    default = ptq.validate(PtqConfig(model=str(ds_tiny), export_dir=str(tmp_path / "o")))
    assert ptq.recipe_name(default.recipe.path) == "deepseek_v3/nvfp4_experts-fp8_attention"
    lock = tmp_path / "lock.json"
    lock.write_text("{}")
    with pytest.raises(ValueError, match=rf"--remote-code-lock {lock}: family 'deepseek_v3' loads with transformers' "
                                         "own classes and runs no remote code"):
        ptq.validate(PtqConfig(model=str(ds_tiny), export_dir=str(tmp_path / "o"), recipe=str(recipe),
                               remote_code_lock=str(lock)))
