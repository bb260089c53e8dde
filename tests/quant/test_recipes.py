"""Recipes: loading through ModelOpt's loader, overrides, errors, and end to end on the tiny stand-in.

The end-to-end tests quantize copies of the stand-in with each shipped recipe in this process and check the
result against module predicates written here (names, classes, which layers own f_a_proj), not the globs.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

import modelopt_ext
from modelopt_ext.quant import recipes as R

SHIPPED = ["kimi_k3/calibration_free", "kimi_k3/fp8_all", "kimi_k3/nvfp4_experts-fp8_attention", "kimi_k3/nvfp4_experts_only"]
DEEPSEEK_V3 = ["deepseek_v3/fp8_all", "deepseek_v3/nvfp4_experts-fp8_attention", "deepseek_v3/nvfp4_experts_only"]
PRODUCTION = "kimi_k3/nvfp4_experts-fp8_attention"
NVFP4 = ((2, 1), 16, (4, 3))  # E2M1 values, 16-element blocks, E4M3 scales
FP8 = (4, 3)


def _write(path, data):
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _user_recipe(quant_cfg, **top):
    data = {
        "imports": {"base_disable_all": "configs/ptq/units/base_disable_all",
                    "kimi_k3_exclusions": "units/kimi_k3_exclusions", "fp8": "configs/numerics/fp8"},
        "metadata": {"recipe_type": "ptq", "description": "test"},
        "quantize": {"algorithm": "max", "quant_cfg": [{"$import": "base_disable_all"}, *copy.deepcopy(quant_cfg),
                                                       {"$import": "kimi_k3_exclusions"}]},
    }
    data.update(top)
    return data


O_PROJ_FP8 = {"quantizer_name": "*self_attn.o_proj.weight_quantizer", "cfg": {"$import": "fp8"}}

# ---------------------------------------------------------------------------------------------- loading


def test_shipped_recipes_and_name_resolution(tmp_path, monkeypatch):
    assert R.available_recipes() == sorted(SHIPPED + DEEPSEEK_V3)
    full = R.RECIPES_DIR / "kimi_k3" / "fp8_all.yaml"
    assert R.resolve_recipe("kimi_k3/fp8_all") == full
    with pytest.raises(R.RecipeNotFoundError, match="recipe name 'fp8_all' is ambiguous: deepseek_v3/fp8_all, "
                                                    "kimi_k3/fp8_all; give the full name"):
        R.resolve_recipe("fp8_all")
    assert R.resolve_recipe("calibration_free") == R.RECIPES_DIR / "kimi_k3" / "calibration_free.yaml"
    assert R.resolve_recipe("kimi_k3/fp8_all.yaml") == full
    assert R.resolve_recipe(full) == full
    # in a checkout the recipes are the repository's top-level recipes/ (test_the_wheel_ships_the_recipes)
    assert R.RECIPES_DIR == Path(modelopt_ext.__file__).resolve().parents[1] / "recipes"
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "mine.yaml", _user_recipe([]))
    assert R.resolve_recipe("mine.yaml") == tmp_path / "mine.yaml"
    assert R.resolve_recipe("mine") == tmp_path / "mine.yaml"  # not shipped: falls back to the file system


@pytest.mark.parametrize("name", R.available_recipes())
def test_every_shipped_recipe_loads_through_modelopt(name, monkeypatch, capsys):
    import modelopt.recipe

    calls = []
    real = modelopt.recipe.load_recipe
    monkeypatch.setattr(modelopt.recipe, "load_recipe", lambda *a, **k: calls.append(a) or real(*a, **k))
    recipe = R.load(name)
    assert len(calls) == 1
    assert capsys.readouterr().out == ""  # ModelOpt's print went to the logger
    assert recipe.path == R.RECIPES_DIR / f"{name}.yaml"
    assert recipe["metadata"]["recipe_type"] == "ptq"
    assert recipe["quantize"]["algorithm"]["method"] == "max"
    entries = recipe["quantize"]["quant_cfg"]
    assert entries[0] == {"quantizer_name": "*", "parent_class": None, "cfg": None, "enable": False}
    # the family's exclusions unit comes last, so it wins over every enabling entry
    family = name.partition("/")[0]
    unit_file = R.RECIPES_DIR / "units" / f"{family}_exclusions.yaml"
    unit = yaml.safe_load(unit_file.read_text())
    assert [e["quantizer_name"] for e in entries[-len(unit):]] == [e["quantizer_name"] for e in unit]
    assert all(not e["enable"] for e in entries[-len(unit):])
    assert len(recipe.sources) == len(entries)
    assert recipe.sources[0].modelopt_default and "base_disable_all" in recipe.sources[0].location
    assert str(recipe.sources[-1]).startswith(str(unit_file))


def test_recipe_contents():
    def enabling(name):
        return {e["quantizer_name"]: e["cfg"] for e in R.load(name)["quantize"]["quant_cfg"] if e["enable"]}

    prod = enabling(PRODUCTION)
    for which in ("weight", "input"):
        cfg = prod[f"*block_sparse_moe.experts.*{which}_quantizer"]
        assert (cfg["num_bits"], cfg["block_sizes"][-1], cfg["block_sizes"]["scale_bits"]) == NVFP4
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "f_a_proj", "b_proj", "q_a_proj", "q_b_proj",
                   "kv_a_proj_with_mqa", "kv_b_proj"]
    for proj in projections:
        cfg = prod.pop(f"*self_attn.{proj}.weight_quantizer")
        assert cfg["num_bits"] == FP8 and cfg["block_sizes"] == {-1: 128, -2: 128}
    assert sorted(prod) == ["*block_sparse_moe.experts.*input_quantizer", "*block_sparse_moe.experts.*weight_quantizer"]
    fp8 = enabling("kimi_k3/fp8_all")
    assert sorted(fp8) == ["*input_quantizer", "*weight_quantizer"]
    assert all(c["num_bits"] == FP8 and c["axis"] is None and c["block_sizes"] is None for c in fp8.values())
    assert sorted(enabling("kimi_k3/nvfp4_experts_only")) == [
        "*block_sparse_moe.experts.*input_quantizer", "*block_sparse_moe.experts.*weight_quantizer"]


def test_exclusion_unit_holds_the_family_static_globs():
    """The unit and the family spec must not drift: the unit holds exactly the globs of quantizer_exclusions."""
    from modelopt_ext.models.kimi_k3.spec import quantizer_exclusions
    from modelopt_ext.models.kimi_k3.standin.configs import tiny_text_config

    unit = yaml.safe_load((R.RECIPES_DIR / "units" / "kimi_k3_exclusions.yaml").read_text())
    globs = [e["quantizer_name"] for e in unit]
    spec = quantizer_exclusions(tiny_text_config())
    static = [p for p in spec if "layers." not in p]
    assert set(static) <= set(globs)
    assert set(globs) == set(static) == set(spec)
    # the KDA input group (q/k/v/g/f_a/b: one GEMM in vLLM) is left to the recipes, which treat it alike
    assert not [g for g in globs for leaf in ("q", "k", "v", "g", "f_a", "b") if fnmatch.fnmatchcase(
        f"language_model.model.layers.1.self_attn.{leaf}_proj.weight_quantizer", g)]
    assert all(e == {"quantizer_name": e["quantizer_name"], "enable": False} for e in unit)


def test_overrides_apply_with_types():
    recipe = R.load("kimi_k3/nvfp4_experts_only", overrides=[
        "quantize.quant_cfg.1.cfg.block_sizes.-1=32",
        "quantize.quant_cfg.2.cfg.constant_amax=2688",  # null before: any type; the schema wants a float
        "quantize.quant_cfg.2.enable=false",
        "quantize.algorithm.layerwise.enable=false",
        "metadata.description=tuned",
    ])
    weight, inputs = recipe["quantize"]["quant_cfg"][1:3]
    assert weight["cfg"]["block_sizes"][-1] == 32
    assert inputs["enable"] is False and inputs["cfg"]["constant_amax"] == 2688.0
    assert recipe["metadata"]["description"] == "tuned"
    assert recipe.overrides == (
        "quantize.quant_cfg.1.cfg.block_sizes.-1=32", "quantize.quant_cfg.2.cfg.constant_amax=2688",
        "quantize.quant_cfg.2.enable=false", "quantize.algorithm.layerwise.enable=false",
        "metadata.description=tuned")
    fp8 = R.load("kimi_k3/fp8_all", ["quantize.quant_cfg.1.cfg.num_bits=8", "quantize.quant_cfg.1.cfg.axis=0"])
    assert fp8["quantize"]["quant_cfg"][1]["cfg"]["num_bits"] == 8 and fp8["quantize"]["quant_cfg"][1]["cfg"]["axis"] == 0
    again = R.load("kimi_k3/fp8_all", ["quantize.quant_cfg.1.cfg.num_bits=e4m3"])
    assert again["quantize"]["quant_cfg"][1]["cfg"]["num_bits"] == (4, 3)


@pytest.mark.parametrize("override, expected", [
    ("quantize.algorithm.mehtod=max", r"--set quantize.algorithm.mehtod: unknown key 'mehtod' under quantize.algorithm"),
    ("quantize.quant_cfg.99.enable=true", r"quantize.quant_cfg is a list of \d+ entries; '99' is not an index"),
    ("quantize.quant_cfg.1.enable=3", r"--set quantize.quant_cfg.1.enable: expected bool .*got int 3"),
    ("metadata.description=5", r"--set metadata.description: expected string .*got int 5"),
    ("quantize.algorithm.layerwise=yes", r"--set quantize.algorithm.layerwise: expected mapping .*got bool"),
    ("quantize.quant_cfg.1.cfg.num_bits=foo", r"--set quantize.quant_cfg.1.cfg.num_bits: expected int, e.g. 8, or ExMy"),
    ("quantize.algorithm.method.x=1", r"--set quantize.algorithm.method.x: quantize.algorithm.method is a string"),
    ("novalue", r"override 'novalue' is not KEY=VALUE"),
    ("quantize.quant_cfg.1.cfg.num_bits=e5m2", r"after --set .*num_bits=e5m2: quantize.quant_cfg.cfg: .*blockwise"),
])
def test_bad_overrides_name_file_key_and_type(override, expected):
    with pytest.raises(ValueError, match=expected) as info:
        R.load("kimi_k3/fp8_all", [override])
    assert str(R.RECIPES_DIR / "kimi_k3" / "fp8_all.yaml") in str(info.value)


def test_missing_recipe_lists_what_was_looked_for_and_the_names():
    with pytest.raises(R.RecipeNotFoundError) as info:
        R.load("fp9_everything")
    message = str(info.value)
    assert "'fp9_everything' not found" in message
    assert str(R.RECIPES_DIR / "fp9_everything.yaml") in message
    for name in SHIPPED + DEEPSEEK_V3:
        assert name in message
    with pytest.raises(R.RecipeNotFoundError, match="Available recipes: deepseek_v3/fp8_all, .*kimi_k3/fp8_all"):
        R.resolve_recipe("units/kimi_k3_exclusions")  # a unit is not a recipe


def test_user_yaml_path(tmp_path, monkeypatch):
    """A recipe anywhere on disk: relative to the working directory, importing this package's unit by its
    RECIPES_DIR-relative name, a sibling unit by its own folder, and ModelOpt built-ins."""
    folder = tmp_path / "mine"
    folder.mkdir()
    _write(folder / "extra_off.yaml", [{"quantizer_name": "*self_attn.q_proj*", "enable": False}])
    (folder / "extra_off.yaml").write_text("# modelopt-schema: modelopt.torch.quantization.config."
                                           "QuantizerCfgListConfig\n" + (folder / "extra_off.yaml").read_text())
    data = _user_recipe([O_PROJ_FP8, {"$import": "extra_off"}])
    data["imports"]["extra_off"] = "extra_off"
    _write(folder / "o_proj.yaml", data)
    monkeypatch.chdir(tmp_path)
    recipe = R.load("mine/o_proj.yaml", ["quantize.quant_cfg.1.cfg.num_bits=e4m3"])
    names = [e["quantizer_name"] for e in recipe["quantize"]["quant_cfg"]]
    assert names[:3] == ["*", "*self_attn.o_proj.weight_quantizer", "*self_attn.q_proj*"]
    assert "*self_attn.f_b_proj*" in names  # from the unit this package ships
    assert recipe.path == folder / "o_proj.yaml"
    assert str(recipe.sources[2]).startswith(f"{folder / 'extra_off.yaml'} entry [0]")


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d.update(calibration={"samples": 4}),
     r"unknown top-level key\(s\) 'calibration' \(a PTQ recipe has imports, metadata, quantize\)"),
    (lambda d: d["quantize"]["quant_cfg"][1].update(enable="yes"),
     r"quantize.quant_cfg\[1\] \(quantizer_name '\*self_attn.o_proj.weight_quantizer'\): enable must be true or false, got str 'yes'"),
    (lambda d: d["quantize"]["quant_cfg"][1].update(enabel=True),
     r"quantize.quant_cfg\[1\] .*unknown key\(s\) 'enabel'"),
    (lambda d: d["quantize"]["quant_cfg"][1]["cfg"].update(num_bitz=8),
     r"invalid entry quantize.quant_cfg\[1\] \('\*self_attn.o_proj.weight_quantizer'\): cfg.num_bitz: Extra inputs"),
    (lambda d: d["quantize"]["quant_cfg"][1]["cfg"].update(axis="rows"),
     r"invalid entry quantize.quant_cfg\[1\] .*cfg.axis: .*got 'rows'"),
    (lambda d: d["quantize"].update(algorithm=5), r"invalid recipe: quantize.algorithm: .*valid string.*\(got 5\)"),
    (lambda d: d["quantize"].update(quant_cfg={"*": {"enable": False}}), r"quantize.quant_cfg must be a list"),
    (lambda d: d["quantize"]["quant_cfg"].append({"$import": "missing"}),
     r"quantize.quant_cfg\[3\]: \$import of 'missing', which imports does not declare"),
    (lambda d: d["metadata"].update(recipe_type="auto_quantize"), r"metadata.recipe_type must be 'ptq'"),
])
def test_user_yaml_errors_name_file_and_entry(tmp_path, mutate, expected):
    data = _user_recipe([O_PROJ_FP8])
    mutate(data)
    path = _write(tmp_path / "user.yaml", data)
    with pytest.raises(ValueError, match=expected) as info:
        R.load(path)
    assert str(info.value).startswith(f"{path}: ")


def _modelopt_calibration_names():
    """The calibration algorithm names ModelOpt registers (read here from its mode registry's names)."""
    from modelopt.torch.quantization.mode import CalibrateModeRegistry

    return {name.removesuffix("_calibrate") for name in CalibrateModeRegistry._name2descriptor if name != "_no_calibrate"}


@pytest.mark.parametrize("algorithm, entry", [({"method": "maxx"}, "quantize.algorithm.method"),
                                              ("maxx", "quantize.algorithm")])
def test_unknown_calibration_algorithm_is_refused_at_load(tmp_path, algorithm, entry):
    data = _user_recipe([O_PROJ_FP8])
    data["quantize"]["algorithm"] = algorithm
    path = _write(tmp_path / "user.yaml", data)
    with pytest.raises(ValueError) as info:
        R.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {entry}: unknown calibration algorithm 'maxx'; valid: local_hessian, max, "
                              "mse (ModelOpt ")
    for name in _modelopt_calibration_names():  # the list comes from ModelOpt
        assert name in message, name
    assert "null (no calibration)" in message


def test_unknown_algorithm_from_an_override_names_the_override():
    with pytest.raises(ValueError) as info:
        R.load("kimi_k3/fp8_all", ["quantize.algorithm.method=maxx"])
    assert str(info.value).startswith(f"{R.RECIPES_DIR / 'kimi_k3' / 'fp8_all.yaml'}: after --set "
                                      "quantize.algorithm.method=maxx: quantize.algorithm.method: unknown calibration "
                                      "algorithm 'maxx'; valid: local_hessian, max, mse")
    # an override fixes a file's algorithm; a valid one loads
    assert R.load("kimi_k3/fp8_all", ["quantize.algorithm.method=mse"])["quantize"]["algorithm"]["method"] == "mse"


@pytest.mark.parametrize("algorithm, expected", [
    ({"method": "awq_lite"}, "quantize.algorithm.method: calibration algorithm 'awq_lite' cannot run in "
     "modelopt_ext's calibration, which turns ModelOpt's distributed_sync off and syncs amax across ranks itself: "
     "AWQLiteCalibConfig has no distributed_sync; use one of: local_hessian, max, mse"),
    ("smoothquant", "quantize.algorithm: calibration algorithm 'smoothquant' cannot run in modelopt_ext's "
     "calibration, which turns ModelOpt's distributed_sync off and syncs amax across ranks itself: "
     "SmoothQuantCalibConfig has no distributed_sync; use one of: local_hessian, max, mse"),
    (None, "quantize.algorithm: calibration algorithm null (no calibration) cannot run in modelopt_ext's "
     "calibration, which turns ModelOpt's distributed_sync off and syncs amax across ranks itself: "
     "QuantizeAlgorithmConfig has no distributed_sync; use one of: local_hessian, max, mse"),
    (["max", "mse"], "quantize.algorithm is a list of 2 algorithms; modelopt_ext calibrates with one algorithm, "
     "use one of: local_hessian, max, mse"),
    ({"method": "max", "bogus": 1}, "quantize.algorithm.bogus: Extra inputs are not permitted (got 1)"),
    ({"layerwise": {"enable": False}}, "quantize.algorithm has no method; use one of: local_hessian, max, mse"),
])
def test_algorithms_calibrate_cannot_run_are_refused_at_load(tmp_path, algorithm, expected):
    """calibrate switches ModelOpt's distributed_sync off (sync.calibration_algorithm): only the algorithms
    whose config has that field run; today each of these failed inside mtq.quantize, after the model load."""
    data = _user_recipe([O_PROJ_FP8])
    data["quantize"]["algorithm"] = algorithm
    path = _write(tmp_path / "user.yaml", data)
    with pytest.raises(ValueError) as info:
        R.load(path)
    assert str(info.value) == f"{path}: {expected}"


def test_ptq_refuses_an_unknown_algorithm_in_validate(tiny_ckpt, tmp_path, loads, capsys):
    """Before anything is loaded (today it failed in ModelOpt with an AssertionError after the full load)."""
    from modelopt_ext.cli import main

    data = yaml.safe_load((R.RECIPES_DIR / "kimi_k3" / "fp8_all.yaml").read_text())
    data["quantize"]["algorithm"]["method"] = "maxx"
    path = _write(tmp_path / "maxx.yaml", data)
    capsys.readouterr()
    rc = main(["ptq", "--model", str(tiny_ckpt), "--export-dir", str(tmp_path / "out"), "--no-progress",
               "--recipe", str(path)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("modelopt-ext ptq: error: ")]
    assert rc == 1 and loads == [] and not (tmp_path / "out").exists()
    assert err[-1].startswith(f"modelopt-ext ptq: error: validate: {path}: quantize.algorithm.method: unknown "
                              "calibration algorithm 'maxx'; valid: local_hessian, max, mse (ModelOpt "), err


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("metadata: !!python/object/apply:os.system ['echo unsafe']\n")
    with pytest.raises(ValueError, match=f"{path}: not valid YAML"):
        R.load(path)


def test_qformat_mapping():
    from modelopt.torch.opt.config_loader import BUILTIN_CONFIG_ROOT

    assert R.recipe_for_qformat("fp8") == R.resolve_recipe("kimi_k3/fp8_all")
    assert R.recipe_for_qformat("nvfp4_experts_only", family="kimi_k3") == R.resolve_recipe("kimi_k3/nvfp4_experts_only")
    for family, table in R.qformat_recipes().items():
        for qformat, recipe in table.items():  # real hf_ptq.py --qformat names, real recipes
            assert BUILTIN_CONFIG_ROOT.joinpath(f"configs/ptq/presets/model/{qformat}.yaml").is_file()
            assert recipe in R.available_recipes()
    with pytest.raises(ValueError, match=r"--qformat 'nvfp4' has no modelopt_ext recipe \(mapped: .*kimi_k3: fp8 -> "):
        R.recipe_for_qformat("nvfp4")


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def checkpoint(tiny_ckpt, tmp_path_factory):
    from modelopt_ext.testing.checkpoints import copy_checkpoint

    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("quant"), "quant_recipes")


def _calibration_inputs(checkpoint, config):
    from transformers import AutoTokenizer

    from modelopt_ext.models.kimi_k3.standin.inputs import synthetic_image, text_image_inputs

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    text = "Calibration reads every projection once: text, then an image with a caption."
    return [text_image_inputs(tokenizer, config, text, synthetic_image(56, 56)),
            {"input_ids": torch.tensor([tokenizer.encode(text)] * 2)}]


@pytest.fixture(scope="module")
def quantized(checkpoint):
    """name -> (model, quant config, calibration inputs) quantized with that recipe; each model is loaded
    fresh, once. NVFP4 models are never run after calibration (ModelOpt's NVFP4 forward needs CUDA)."""
    import modelopt.torch.quantization as mtq

    import modelopt_ext

    cache = {}

    def get(name):
        if name not in cache:
            model = modelopt_ext.from_pretrained(checkpoint, trust_remote_code=True, dtype=torch.float32)
            inputs = _calibration_inputs(checkpoint, model.config)

            def forward_loop(m):
                with torch.no_grad():
                    for batch in inputs:
                        m(**batch, use_cache=False)

            config = R.quant_config(R.load(name), model.config)
            cache[name] = (mtq.quantize(model, config, forward_loop), config, inputs)
        return cache[name]

    return get


def _enabled(model):
    """Enabled quantizers by name, listed with ModelOpt's own classes."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    return {n: m for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled}


def _must_stay_unquantized(model) -> list[str]:
    """Module names (written here, from the model's structure) whose quantizers must all be disabled."""
    text = model.language_model.model
    kda = {i for i, layer in enumerate(text.layers) if hasattr(layer.self_attn, "f_a_proj")}
    assert kda and len(kda) < len(text.layers)  # both kinds present
    names = []
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        layer = re.search(r"language_model\.model\.layers\.(\d+)\.self_attn\.", name)
        if (name.endswith("block_sparse_moe.gate") or leaf.endswith("_conv1d")
                or leaf in ("routed_expert_down_proj", "routed_expert_up_proj")
                or (layer and int(layer.group(1)) in kda and leaf == "f_b_proj")
                or re.search(r"(_res_norm|_res_proj|output_attn_res_norm|output_attn_res_proj)$", name)
                or "Norm" in type(module).__name__
                or name in ("vision_tower", "mm_projector", "language_model.lm_head")):
            names.append(name)
    return names


def _assert_exclusions(model):
    enabled = _enabled(model)
    keep = _must_stay_unquantized(model)
    assert len(keep) > 50
    offenders = [q for q in enabled for m in keep if q.startswith(f"{m}.")]
    assert not offenders, offenders[:10]
    params = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("A_log") for n in params) and any(n.endswith("dt_bias") for n in params)
    assert not [q for q in enabled if "A_log" in q or "dt_bias" in q]


def _mla_and_kda(model):
    layers = model.language_model.model.layers
    mla = [i for i, layer in enumerate(layers) if hasattr(layer.self_attn, "kv_b_proj")]
    kda = [i for i, layer in enumerate(layers) if hasattr(layer.self_attn, "f_a_proj")]
    assert mla and kda and sorted(mla + kda) == list(range(len(layers)))
    return mla, kda


def _assert_attention(model, enabled, fp8_check):
    """o_proj and g_proj in every layer, KDA's whole input group q/k/v/g/f_a/b (one GEMM in vLLM) and MLA's
    q_a/kv_a_proj_with_mqa are quantized alike; KDA's f_b_proj is not."""
    mla, kda = _mla_and_kda(model)
    for i in range(len(model.language_model.model.layers)):
        prefix = f"language_model.model.layers.{i}.self_attn"
        group = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj") if i in kda else (
            "q_a_proj", "kv_a_proj_with_mqa", "g_proj")
        for leaf in ("o_proj",) + group:
            fp8_check(enabled[f"{prefix}.{leaf}.weight_quantizer"])
        if i in kda:
            assert f"{prefix}.f_b_proj.weight_quantizer" not in enabled


def _assert_nvfp4_experts(model, enabled):
    layers = model.language_model.model.layers
    moe = [i for i, layer in enumerate(layers) if hasattr(layer, "block_sparse_moe")]
    assert moe
    for i in moe:
        experts = layers[i].block_sparse_moe.experts
        prefix = f"language_model.model.layers.{i}.block_sparse_moe.experts"
        for proj in ("gate_up_proj", "down_proj"):
            per_expert = [enabled.get(f"{prefix}.{proj}_weight_quantizers.{e}") for e in range(experts.num_experts)]
            assert all(q is not None for q in per_expert), f"{prefix}.{proj}: an expert is not quantized"
            assert len({id(q) for q in per_expert}) == experts.num_experts  # one quantizer per expert
            for q in per_expert + [enabled[f"{prefix}.{proj}_input_quantizer"]]:
                assert (q.num_bits, q.block_sizes[-1], q.block_sizes["scale_bits"]) == NVFP4
                assert q.amax is not None and torch.isfinite(q.amax).all() and (q.amax > 0).all()


def test_fp8_all_end_to_end(quantized):
    model, config, calib_inputs = quantized("kimi_k3/fp8_all")
    _assert_exclusions(model)
    enabled = _enabled(model)

    def fp8(q):
        assert q.num_bits == FP8 and q.amax is not None

    _assert_attention(model, enabled, fp8)
    for name in ("mlp.down_proj", "block_sparse_moe.shared_experts.up_proj"):
        assert any(n.endswith(f"{name}.weight_quantizer") for n in enabled), name
    assert not [n for n in enabled if "routed_expert_" in n]  # no engine quantizes the latent projections
    assert sum(".experts.gate_up_proj_weight_quantizers." in n for n in enabled) > 0
    R.check_patterns_match(config, model)
    with torch.no_grad():  # FP8 fake quant runs on a CPU
        assert torch.isfinite(model(**calib_inputs[1], use_cache=False).logits).all()


def test_production_recipe_end_to_end(quantized):
    model, config, _ = quantized(PRODUCTION)
    _assert_exclusions(model)
    enabled = _enabled(model)

    def fp8_block(q):
        assert q.num_bits == FP8 and q.block_sizes == {-1: 128, -2: 128}

    _assert_attention(model, enabled, fp8_block)
    _assert_nvfp4_experts(model, enabled)
    # weight-only attention; shared experts, dense MLP and latent projections stay bf16
    rest = [n for n in enabled if ".block_sparse_moe.experts." not in n and not n.endswith("weight_quantizer")]
    assert not rest, rest
    assert not [n for n in enabled if re.search(r"(shared_experts|\.mlp\.|routed_expert_(down|up)_proj)", n)]
    # the unit holds every family exclusion already: quant_config appends none
    assert len(config["quant_cfg"]) == len(R.load(PRODUCTION)["quantize"]["quant_cfg"])
    R.check_patterns_match(config, model)


def test_nvfp4_experts_only_end_to_end(quantized):
    model, config, _ = quantized("kimi_k3/nvfp4_experts_only")
    _assert_exclusions(model)
    enabled = _enabled(model)
    assert enabled and all(".block_sparse_moe.experts." in n for n in enabled)
    _assert_nvfp4_experts(model, enabled)
    R.check_patterns_match(config, model)


def test_check_patterns_match_names_file_and_entry(quantized, tmp_path):
    model, _, _ = quantized("kimi_k3/nvfp4_experts_only")
    typo = {"quantizer_name": "*self_attn.o_prj.weight_quantizer", "enable": False}
    path = _write(tmp_path / "bogus.yaml", _user_recipe([O_PROJ_FP8, typo]))
    with pytest.raises(ValueError) as info:
        R.check_patterns_match(R.quant_config(R.load(path), model.config), model)
    assert f"{path} quantize.quant_cfg[2]: quantizer_name '*self_attn.o_prj.weight_quantizer' matches no quantizer" \
        in str(info.value)
    # a misspelt entry in an imported unit names the unit, its entry and the importing recipe
    unit = tmp_path / "off.yaml"
    unit.write_text("# modelopt-schema: modelopt.torch.quantization.config.QuantizerCfgListConfig\n"
                    "- {quantizer_name: '*A_log*', enable: false}\n- {quantizer_name: '*dt_bais*', enable: false}\n")
    data = _user_recipe([O_PROJ_FP8, {"$import": "off"}])
    data["imports"]["off"] = "off"
    path = _write(tmp_path / "with_unit.yaml", data)
    with pytest.raises(ValueError) as info:
        R.check_patterns_match(R.quant_config(R.load(path), model.config), model)
    message = str(info.value)
    assert f"{unit} entry [1] (imported by {path} quantize.quant_cfg[2]): quantizer_name '*dt_bais*'" in message
    assert "A_log" not in message  # a parameter without a quantizer: allowed for a disabling entry
    # an enabling entry must hit a quantizer
    with pytest.raises(ValueError, match=r"\[1\]: quantizer_name '\*A_log\*' matches no quantizer of "):
        R.check_patterns_match([{"quantizer_name": "*", "enable": False},
                                {"quantizer_name": "*A_log*", "cfg": {"num_bits": 8}}], model)


def test_quant_config_needs_a_known_family():
    with pytest.raises(ValueError, match="model_type 'llama' has no modelopt_ext family"):
        R.quant_config(R.load("kimi_k3/fp8_all"), {"model_type": "llama"})
    plain = R.quant_config("kimi_k3/fp8_all", {"model_type": "llama"}, family_exclusions=False)
    assert set(plain) == {"quant_cfg", "algorithm"}



def test_family_exclusions_skip_globs_already_in_effect(checkpoint):
    """Family globs that an earlier final disabling glob already states, or that a final `*X*` glob covers, are
    not appended (they would change nothing and cost conversion time); an entry that may enable something
    after such a glob keeps them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=True)
    family = list(dict.fromkeys(R._family(config).quantizer_exclusions(config)))
    assert R.family_exclusion_entries(R.load(PRODUCTION)["quantize"]["quant_cfg"], config) == []
    # the same globs before an entry that enables quantizers are not final: every family glob is appended
    late = [{"quantizer_name": "*", "enable": False}, {"quantizer_name": "*self_attn.f_b_proj*", "enable": False},
            {"quantizer_name": "*norm*", "enable": False}, O_PROJ_FP8]
    assert [e["quantizer_name"] for e in R.family_exclusion_entries(late, config)] == family
    # final ones are skipped, exactly or covered (`*_res_proj*` inside `*res_proj*`); a glob with other
    # wildcards covers nothing
    final = [O_PROJ_FP8, {"quantizer_name": "*res_proj*", "enable": False},
             {"quantizer_name": "*self_attn.f_?_proj*", "enable": False}]
    added = [e["quantizer_name"] for e in R.family_exclusion_entries(final, config)]
    assert "*_res_proj*" not in added and "*self_attn.f_b_proj*" in added and "*norm*" in added
    assert len(added) == len(family) - 1


@pytest.mark.parametrize("name", SHIPPED)
def test_skipped_family_globs_leave_every_quantizer_as_it_was(checkpoint, name):
    """The quantizers after ModelOpt's conversion with the family's globs as appended (already-effective ones
    skipped) equal those with every family glob appended, attribute for attribute."""
    from modelopt.torch.quantization.conversion import replace_quant_module, set_quantizer_by_cfg
    from modelopt.torch.quantization.nn import TensorQuantizer

    import modelopt_ext

    states = []
    for prune in (True, False):
        model = modelopt_ext.from_pretrained(checkpoint, trust_remote_code=True, dtype=torch.float32)
        cfg = R.quant_config(R.load(name), model.config, family_exclusions=False)["quant_cfg"]
        if prune:
            cfg = cfg + R.family_exclusion_entries(cfg, model.config)
        else:  # every family glob appended, whether already in effect or not
            family = R._family(model.config).quantizer_exclusions(model.config)
            cfg = cfg + [{"quantizer_name": p, "enable": False} for p in family]
        replace_quant_module(model)
        set_quantizer_by_cfg(model, cfg)
        states.append(({n: (m.is_enabled, repr(m)) for n, m in model.named_modules() if isinstance(m, TensorQuantizer)},
                       len(cfg)))
    (pruned, n_pruned), (full, n_full) = states
    assert n_pruned < n_full
    assert len(pruned) > 100 and pruned == full


def test_histogram_calibrator_is_refused_at_load(tmp_path):
    """ModelOpt 0.47's calibration algorithms fail on a histogram calibrator (compute_amax without a method)
    after the model is loaded; percentile / histogram-MSE / entropy activation amax are refused at load."""
    entry = {"quantizer_name": "*self_attn.o_proj.input_quantizer", "cfg": {"$import": "fp8", "calibrator": "histogram"}}
    path = _write(tmp_path / "user.yaml", _user_recipe([O_PROJ_FP8, entry]))
    with pytest.raises(ValueError, match=rf"^{path} quantize.quant_cfg\[2\]: quantizer_name "
                       r"'\*self_attn.o_proj.input_quantizer': cfg.calibrator is 'histogram'; modelopt_ext calibrates "
                       r"with ModelOpt's max calibrator only: .* cannot be summed under expert parallelism"):
        R.load(path)


def test_histogram_calibrator_set_by_override_is_refused_at_load():
    """`--set` applies after the file's checks: a calibrator it sets is refused there too, before loading."""
    with pytest.raises(ValueError, match=r"after --set quantize.quant_cfg.2.cfg.calibrator=histogram .*"
                       r"cfg.calibrator is 'histogram'; modelopt_ext calibrates with ModelOpt's max calibrator only"):
        R.load("kimi_k3/nvfp4_experts_only", overrides=["quantize.quant_cfg.2.cfg.calibrator=histogram"])


def test_the_wheel_ships_the_recipes(tmp_path):
    """recipes/ sits at the repository's top level; setup.py ships it as modelopt_ext/recipes, where an
    installed copy finds its recipes by name. Built here from this checkout (no network, no isolation)."""
    checkout = Path(modelopt_ext.__file__).resolve().parents[1]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(tmp_path / "wheel"), str(checkout)],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("modelopt_ext-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(site)
    shipped = sorted(p.relative_to(checkout / "recipes").as_posix() for p in (checkout / "recipes").rglob("*.yaml"))
    assert sorted(n[len("modelopt_ext/recipes/"):] for n in names if n.startswith("modelopt_ext/recipes/")) == shipped
    assert not [n for n in names if n.startswith("recipes/")]
    probe = ("import json, modelopt_ext; from modelopt_ext.quant import recipes as R; "
             "print(json.dumps([modelopt_ext.__file__, str(R.RECIPES_DIR), R.available_recipes(), "
             "str(R.resolve_recipe('kimi_k3/fp8_all'))]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-3000:]
    package, recipes_dir, available, fp8_all = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(package).parent == site / "modelopt_ext" and Path(recipes_dir) == site / "modelopt_ext" / "recipes"
    assert available == R.available_recipes() and Path(fp8_all) == site / "modelopt_ext/recipes/kimi_k3/fp8_all.yaml"
