"""Tests for modelopt_ext.export.engines (`modelopt-ext verify --engine`) on real exports of the tiny stand-in
(CPU): the production recipe on the stand-in (whose fused FP8 block groups line up with 128-row blocks: KDA
head_dim and MLA q_lora_rank 128, as in the real model), one defect planted per test; a stand-in with a
32-row f_a_proj and a 64-row q_a_proj, which do not line up; and the fp8_all recipe (single format)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modelopt_ext.cli import main
from modelopt_ext.export import engines
from modelopt_ext.export.engines import RULES, RuleResult, check_engines, engine_verdicts, format_results
from modelopt_ext.export.manifest import MANIFEST_NAME, _write_manifest, file_digests
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.export_edits import INDEX, edit_quant_configs, fix_total_size, read_index, rewrite, shard_of
from modelopt_ext.testing.multiproc import import_file

calibrate_and_export = import_file(Path(__file__).with_name("bodies.py")).calibrate_and_export

PRODUCTION = "kimi_k3/nvfp4_experts-fp8_attention"
ENGINES = ("vllm", "sglang", "trtllm")
LAYERS = "language_model.model.layers"
EXPERTS = f"{LAYERS}.1.block_sparse_moe.experts"


def _export(source: Path, out: Path, recipe: str) -> None:
    """Calibrate in one process and export with the per-rank exporter."""
    calibrate_and_export(0, 1, str(source), str(out), recipe)


def _misaligned_standin(out: Path) -> Path:
    """The stand-in with a 32-row KDA f_a_proj (head_dim 32, 4 heads) and a 64-row MLA q_a_proj (q_lora_rank
    64): the stand-in's sizes before session 11."""
    from modelopt_ext.models.kimi_k3.standin import generate

    return generate.make_tiny(out, seed=0, text_overrides={"q_lora_rank": 64,
                                                           "linear_attn_config": {"head_dim": 32, "num_heads": 4}})


@pytest.fixture(scope="module")
def good(tiny_ckpt, tmp_path_factory) -> Path:
    """The production recipe's export of the stand-in."""
    root = tmp_path_factory.mktemp("engines_good")
    _export(copy_checkpoint(tiny_ckpt, root, "aligned_src"), root / "export", PRODUCTION)
    return root / "export"


@pytest.fixture(scope="module")
def fp8_all(good) -> Path:
    """The fp8_all recipe's export of the stand-in (a single format: no quantized_layers)."""
    root = good.parent
    _export(copy_checkpoint(root / "aligned_src", root, "aligned_src_fp8"), root / "export_fp8", "kimi_k3/fp8_all")
    return root / "export_fp8"


# ----------------------------------------------------------------------------------------------------
# helpers


def _copy(export: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(export, tmp_path / "export"))


def _results(export: Path, engines_=ENGINES) -> dict[tuple[str, str], RuleResult]:
    return {(r.engine, r.rule): r for r in check_engines(export, engines_)}


def _failing(export: Path) -> set[tuple[str, str]]:
    return {key for key, r in _results(export).items() if not r.ok}


def _problems(export: Path, engine: str, rule: str) -> str:
    return " | ".join(_results(export)[(engine, rule)].problems)


def _edit_tensors(export: Path, module: str, mutate) -> None:
    """Let `mutate(tensors)` change the shard holding `module.weight`; keep the index in step."""
    shard = shard_of(export, f"{module}.weight")
    rewrite(shard, mutate)
    index = read_index(export)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard.name}
    index["weight_map"].update({k: shard.name for k in load_file(str(shard))})
    (export / INDEX).write_text(json.dumps(index))
    fix_total_size(export)


def _drop_layers(q: dict, keep) -> None:
    q["quantized_layers"] = {k: v for k, v in q["quantized_layers"].items() if keep(k)}


# ----------------------------------------------------------------------------------------------------
# good exports


def test_good_export_passes_every_rule_of_every_engine(good):
    results = check_engines(good, ["all"])
    assert [(r.engine, r.rule) for r in results] == [(e, rule) for e in ENGINES for rule in RULES]
    assert [r for r in results if not r.ok] == []
    assert engine_verdicts(results) == dict.fromkeys(ENGINES, True)
    lines = format_results(results)
    assert len(lines) == len(results) and all(line.startswith("PASS ") for line in lines)
    by_key = {(r.engine, r.rule): r for r in results}
    vllm_notes = " ".join(by_key[("vllm", "fused-groups")].notes)  # last members: partial blocks, not failures
    assert "b_proj (2 rows)" in vllm_notes and "kv_a_proj_with_mqa (48 rows)" in vllm_notes
    assert "b_proj" not in " ".join(by_key[("sglang", "fused-groups")].notes)  # SGLang fuses q/k/v/g only
    assert "note: " in lines[RULES.index("fused-groups")]


def test_misaligned_standin_fails_only_the_fp8_block_alignment(tmp_path):
    """A 32-row KDA f_a_proj (vLLM fuses it ahead of b_proj) and a 64-row MLA q_a_proj (both engines fuse it
    ahead of kv_a_proj_with_mqa) straddle 128-row blocks: not servable as FP8 blocks."""
    _export(_misaligned_standin(tmp_path / "src"), tmp_path / "export", PRODUCTION)
    results = _results(tmp_path / "export")
    assert {k for k, r in results.items() if not r.ok} == {("vllm", "fused-groups"), ("sglang", "fused-groups")}
    vllm = " | ".join(results[("vllm", "fused-groups")].problems)
    assert "layers.1.self_attn.f_a_proj: 32 rows" in vllm and "layers.2.self_attn.q_a_proj: 64 rows" in vllm
    sglang = " | ".join(results[("sglang", "fused-groups")].problems)
    assert "q_a_proj: 64 rows" in sglang and "f_a_proj" not in sglang


def test_single_format_export(fp8_all, tmp_path):
    """fp8_all: vLLM and SGLang take it; TensorRT-LLM's Kimi-K3 runtime has no FP8 routed experts."""
    assert _failing(fp8_all) == {("trtllm", "names")}
    assert "experts carries FP8" in _problems(fp8_all, "trtllm", "names")
    export = _copy(fp8_all, tmp_path)  # an unquantized linear that is not excluded would be quantized
    edit_quant_configs(export, lambda q: q.__setitem__(
        "ignore" if "ignore" in q else "exclude_modules",
        [p for p in q.get("ignore", q.get("exclude_modules")) if p != "language_model.lm_head"]))
    assert _failing(export) == {("trtllm", "names"), ("vllm", "names"), ("sglang", "names")}
    assert "language_model.lm_head is unquantized but resolves to FP8" in _problems(export, "vllm", "names")
    assert "lm_head (language_model.lm_head) is unquantized" in _problems(export, "sglang", "names")


# ----------------------------------------------------------------------------------------------------
# one planted defect each


def test_split_kda_group(good, tmp_path):
    """f_a_proj of layer 1 back to bf16: vLLM fuses it with q/k/v/g/b (split); SGLang keeps it separate."""
    export = _copy(good, tmp_path)
    module = f"{LAYERS}.1.self_attn.f_a_proj"

    def to_bf16(t):
        scale = t.pop(f"{module}.weight_scale")
        t[f"{module}.weight"] = (t[f"{module}.weight"].float() * scale).to(torch.bfloat16)

    _edit_tensors(export, module, to_bf16)
    gone = (module, f"{LAYERS}.1.self_attn.in_proj_qkvgfab", "model.layers.1.self_attn.f_a_proj")
    edit_quant_configs(export, lambda q: _drop_layers(q, lambda k: k not in gone))
    assert _failing(export) == {("vllm", "fused-groups")}
    assert "KDA input projections of layer 1: vllm fuses them into in_proj_qkvgfab, but q_proj FP8_PB_WO" in (
        _problems(export, "vllm", "fused-groups"))
    assert "f_a_proj unquantized" in _problems(export, "vllm", "fused-groups")


def test_front_member_with_a_partial_block(good, tmp_path):
    """q_a_proj cut to 64 rows (like a 576-row kv_a_proj_with_mqa in front): its block straddles kv_a's."""
    export = _copy(good, tmp_path)
    module = f"{LAYERS}.2.self_attn.q_a_proj"
    _edit_tensors(export, module, lambda t: t.__setitem__(f"{module}.weight", t[f"{module}.weight"][:64].clone()))
    assert _failing(export) == {("vllm", "fused-groups"), ("sglang", "fused-groups")}
    assert f"{module}: 64 rows, not a multiple of 128, ahead of kv_a_proj_with_mqa in fused_qkv_a_proj_with_mqa" in (
        _problems(export, "sglang", "fused-groups"))


def test_input_width_not_a_multiple_of_the_block(good, tmp_path):
    export = _copy(good, tmp_path)
    module = f"{LAYERS}.1.self_attn.b_proj"
    _edit_tensors(export, module, lambda t: t.__setitem__(f"{module}.weight", t[f"{module}.weight"][:, :96].clone()))
    assert _failing(export) == {("vllm", "fused-groups")}  # SGLang does not fuse b_proj
    assert "b_proj: input width 96 is not a multiple of 128" in _problems(export, "vllm", "fused-groups")


def test_mixed_precision_under_quant_method_modelopt(good, tmp_path):
    export = _copy(good, tmp_path)
    config = json.loads((export / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "modelopt"
    (export / "config.json").write_text(json.dumps(config))
    assert _failing(export) == {("sglang", "method")}
    assert "SGLang needs 'modelopt_mixed'" in _problems(export, "sglang", "method")


def test_mixed_precision_without_nvfp4_layers_goes_to_w4afp8_in_sglang(good, tmp_path):
    export = _copy(good, tmp_path)
    edit_quant_configs(export, lambda q: q["quantized_layers"].update(
        {k: {"quant_algo": "FP8_PB_WO", "group_size": 128} for k, v in q["quantized_layers"].items()
         if v["quant_algo"] == "NVFP4"}))
    failing = _failing(export)
    assert ("sglang", "method") in failing and ("vllm", "method") not in failing
    assert "routes it to w4afp8" in _problems(export, "sglang", "method")


def test_lower_case_layer_algorithms_pass_every_engine(good, tmp_path):
    """ModelOpt 0.47 writes fp8_pb_wo: vLLM and SGLang upper-case per-layer names, TensorRT-LLM maps it."""
    export = _copy(good, tmp_path)
    edit_quant_configs(export, lambda q: [v.update(quant_algo=v["quant_algo"].lower()) for v in q["quantized_layers"].values()
                                     if v["quant_algo"] == "FP8_PB_WO"])
    assert _failing(export) == set()


def test_lower_case_top_level_algorithm_passes_vllm_only(good, tmp_path):
    export = _copy(good, tmp_path)
    edit_quant_configs(export, lambda q: q.update(quant_algo="mixed_precision"))
    assert _failing(export) == {("sglang", "method"), ("trtllm", "method")}
    assert "no QuantAlgo" in _problems(export, "trtllm", "method")


def test_substring_exclusion_hits_a_quantized_module_in_vllm(good, tmp_path):
    export = _copy(good, tmp_path)
    pattern = f"{LAYERS}.1.self_attn.q"
    edit_quant_configs(export, lambda q: q["ignore" if "ignore" in q else "exclude_modules"].append(pattern))
    assert _failing(export) == {("vllm", "exclusions")}
    assert f"pattern {pattern!r} excludes quantized {LAYERS}.1.self_attn.q_proj (vllm substring)" in (
        _problems(export, "vllm", "exclusions"))


def test_missing_sglang_alias_keys(good, tmp_path):
    """Without the `model.layers.N...` keys SGLang finds none of its module names; vLLM is unaffected."""
    export = _copy(good, tmp_path)
    edit_quant_configs(export, lambda q: _drop_layers(q, lambda k: not k.startswith("model.")))
    assert _failing(export) == {("sglang", "names")}
    problems = _problems(export, "sglang", "names")
    assert "model.layers.1.mlp.experts (language_model.model.layers.1.block_sparse_moe.experts) carries NVFP4 " \
           "but resolves to unquantized (no key)" in problems


def test_quantized_latent_projection(good, tmp_path):
    """The engines build routed_expert_up_proj unquantized: FP8 tensors there would be read as bf16."""
    export = _copy(good, tmp_path)
    module = f"{LAYERS}.1.block_sparse_moe.routed_expert_up_proj"

    def to_fp8(t):
        w = t[f"{module}.weight"].float()
        scale = w.abs().amax() / 448
        t[f"{module}.weight"] = (w / scale).to(torch.float8_e4m3fn)
        t[f"{module}.weight_scale"], t[f"{module}.input_scale"] = scale.reshape(()), torch.tensor(1.0)

    _edit_tensors(export, module, to_fp8)
    edit_quant_configs(export, lambda q: q.__setitem__(
        "ignore" if "ignore" in q else "exclude_modules",
        [p for p in q.get("ignore", q.get("exclude_modules")) if "routed_expert_up_proj" not in p]))
    assert _failing(export) == {(e, "never-quantized") for e in ENGINES}
    assert f"{module} carries weight_scale, input_scale, weight F8_E4M3" in _problems(export, "vllm", "never-quantized")


def test_expert_missing_input_scale(good, tmp_path):
    export = _copy(good, tmp_path)
    key = f"{EXPERTS}.3.w1.input_scale"
    _edit_tensors(export, f"{EXPERTS}.3.w1", lambda t: t.pop(key))
    assert _failing(export) == {(e, "experts") for e in ENGINES}
    assert f"{EXPERTS}.3.w1 has no input_scale" in _problems(export, "vllm", "experts")


def test_w1_w3_with_different_input_scales(good, tmp_path):
    export = _copy(good, tmp_path)
    key = f"{EXPERTS}.3.w3.input_scale"
    _edit_tensors(export, f"{EXPERTS}.3.w3", lambda t: t.__setitem__(key, t[key] * 2))
    assert _failing(export) == {("trtllm", "experts")}  # TensorRT-LLM asserts they are equal
    assert f"{EXPERTS}.3: w1.input_scale" in _problems(export, "trtllm", "experts")


def test_w1_w3_with_different_second_scales(good, tmp_path):
    export = _copy(good, tmp_path)
    key = f"{EXPERTS}.3.w3.weight_scale_2"
    _edit_tensors(export, f"{EXPERTS}.3.w3", lambda t: t.__setitem__(key, t[key] * 2))
    assert _failing(export) == {(e, "experts") for e in ENGINES}  # one w13 alpha per expert


@pytest.mark.parametrize("module", [f"{EXPERTS}.3.w1", f"{LAYERS}.2.self_attn.q_b_proj"], ids=["nvfp4", "fp8_block"])
def test_zero_block_scale_over_non_zero_codes(good, tmp_path, module):
    export = _copy(good, tmp_path)

    def zero_first_block(t):
        scale = t[f"{module}.weight_scale"]
        flat = scale.float().reshape(-1)
        flat[0] = 0
        t[f"{module}.weight_scale"] = flat.reshape(scale.shape).to(scale.dtype)

    _edit_tensors(export, module, zero_first_block)
    assert _failing(export) == {(e, "scales") for e in ENGINES}
    assert f"{module}.weight_scale: 1 zero block scale(s) over non-zero codes" in _problems(export, "sglang", "scales")


def test_zero_block_scale_over_a_zero_block_is_fine(good, tmp_path):
    export = _copy(good, tmp_path)
    module = f"{LAYERS}.2.self_attn.q_b_proj"  # [192, 128]: two row blocks

    def zero_first_block(t):
        t[f"{module}.weight"] = t[f"{module}.weight"].clone()
        t[f"{module}.weight"][:128] = 0
        scale = t[f"{module}.weight_scale"].clone()
        scale.reshape(-1)[0] = 0
        t[f"{module}.weight_scale"] = scale

    _edit_tensors(export, module, zero_first_block)
    assert _failing(export) == set()


def test_nan_scale(good, tmp_path):
    export = _copy(good, tmp_path)
    module = f"{LAYERS}.1.self_attn.q_proj"

    def nan_first(t):
        t[f"{module}.weight_scale"] = t[f"{module}.weight_scale"].clone()
        t[f"{module}.weight_scale"].reshape(-1)[0] = float("nan")

    _edit_tensors(export, module, nan_first)
    assert _failing(export) == {(e, "scales") for e in ENGINES}
    assert f"{module}.weight_scale: 1 non-finite or negative value(s)" in _problems(export, "trtllm", "scales")


# ----------------------------------------------------------------------------------------------------
# API and CLI


def test_family_without_serving_facts(good, monkeypatch):
    import dataclasses

    real = engines.family_for_config
    monkeypatch.setattr(engines, "family_for_config", lambda c, source: dataclasses.replace(real(c, source),
                                                                                              serving=None))
    results = check_engines(good, ["vllm", "trtllm"])
    assert [(r.engine, r.rule, r.ok) for r in results] == [("vllm", "family", False), ("trtllm", "family", False)]
    assert "unknown for family 'kimi_k3'" in results[0].problems[0]


def test_engine_selection(good):
    assert {r.engine for r in check_engines(good, ["sglang", "sglang"])} == {"sglang"}
    with pytest.raises(ValueError, match="unknown serving engine 'tgi'"):
        check_engines(good, ["tgi"])


def test_format_results_caps_the_problems():
    results = [RuleResult("vllm", "names", "src.py: f", tuple(f"p{i}" for i in range(8))),
               RuleResult("sglang", "fused-groups", "src.py: g", (), ("a note",))]
    assert format_results(results) == ["FAIL vllm names (src.py: f): p0; p1; p2; p3; p4; 3 more",
                                       "PASS sglang fused-groups (src.py: g): note: a note"]
    assert engine_verdicts(results) == {"vllm": False, "sglang": True}


def test_cli_engine_exit_codes(good, tmp_path, capsys):
    assert main(["verify", str(good), "--engine", "all"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nPASS ") == len(ENGINES) * len(RULES) and "FAIL" not in out
    export = _copy(good, tmp_path)
    config = json.loads((export / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "modelopt"  # verify accepts it; SGLang does not
    (export / "config.json").write_text(json.dumps(config))
    (export / MANIFEST_NAME).unlink()
    _write_manifest(export, file_digests(export))
    assert main(["verify", str(export)]) == 0  # without --engine: unchanged
    capsys.readouterr()
    assert main(["verify", str(export), "--engine", "vllm,trtllm"]) == 0
    assert main(["verify", str(export), "--engine", "vllm", "--engine", "sglang"]) == 2
    captured = capsys.readouterr()
    assert "FAIL sglang method" in captured.out and "breaks the rules of sglang" in captured.err
    with pytest.raises(SystemExit):
        main(["verify", str(export), "--engine", "tgi"])
