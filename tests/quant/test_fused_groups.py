"""modelopt_ext.quant.fused_groups: a recipe that quantizes an engine-fused group (KDA q/k/v/g/f_a/b, MLA
q_a + kv_a_proj_with_mqa, gate/up) in two ways is refused in validate, naming the group and both sides; the
quantizer states it works out from the recipe equal those ModelOpt's own conversion sets."""

from __future__ import annotations

import pytest
import torch

from modelopt_ext.quant import recipes as R
from modelopt_ext.quant.fused_groups import QUANTIZERS, describe, quantizer_states, split_groups
from modelopt_ext.testing.checkpoints import copy_checkpoint

SHIPPED = ["kimi_k3/nvfp4_experts-fp8_attention", "kimi_k3/fp8_all", "kimi_k3/nvfp4_experts_only", "kimi_k3/calibration_free"]
PRODUCTION = SHIPPED[0]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_split_no_group(name, config, serving):
    assert split_groups(R.quant_config(R.load(name), config)["quant_cfg"], config, serving) == []


def test_a_kda_projection_left_out_is_a_split(config, serving, recipe_with):
    path = recipe_with([{"quantizer_name": "*self_attn.b_proj*", "enable": False}], "nvfp4_experts-fp8_attention")
    lines = split_groups(R.quant_config(R.load(path), config)["quant_cfg"], config, serving)
    kda = [i + 1 for i in range(config["text_config"]["num_hidden_layers"])
           if i + 1 in config["text_config"]["linear_attn_config"]["kda_layers"]]
    assert lines == [
        f"KDA input projections (vllm in_proj_qkvgfab, sglang fused_qkvg_proj) in layers {[i - 1 for i in kda]}: "
        "q_proj/k_proj/v_proj/g_proj/f_a_proj: weights FP8 E4M3, 128x128 blocks, inputs unquantized; "
        "b_proj: weights unquantized, inputs unquantized"]


def test_mla_and_gate_up_splits_are_named(config, serving, recipe_with):
    path = recipe_with([
        {"quantizer_name": "*kv_a_proj_with_mqa.weight_quantizer", "enable": False},
        {"quantizer_name": "*shared_experts.gate_proj.weight_quantizer", "cfg": {"num_bits": [4, 3]}},
    ], "nvfp4_experts-fp8_attention")
    lines = split_groups(R.quant_config(R.load(path), config)["quant_cfg"], config, serving)
    assert len(lines) == 2
    mla = next(line for line in lines if line.startswith("MLA"))
    assert mla.startswith("MLA latent down projections (vllm fused_qkv_a_proj, sglang fused_qkv_a_proj_with_mqa) in "
                          "layers [2, 5]: q_a_proj: weights FP8 E4M3, 128x128 blocks")
    assert mla.endswith("kv_a_proj_with_mqa: weights unquantized, inputs unquantized")
    shared = next(line for line in lines if line.startswith("shared experts"))
    assert "gate_proj: weights FP8 E4M3, inputs unquantized; up_proj: weights unquantized" in shared


def test_ptq_refuses_a_split_group_in_validate(tiny_ckpt, tmp_path, loads, capsys, recipe_with):
    """Before anything is loaded, naming the recipe, the group and the modules on each side; nothing written."""
    from modelopt_ext.cli import main

    path = recipe_with([{"quantizer_name": "*self_attn.f_a_proj*", "enable": False}], "nvfp4_experts-fp8_attention")
    model = copy_checkpoint(tiny_ckpt, tmp_path, "src")
    before = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    capsys.readouterr()
    rc = main(["ptq", "--model", str(model), "--export-dir", str(tmp_path / "out"), "--no-progress",
               "--recipe", str(path)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("modelopt-ext ptq: error: ")]
    assert rc == 1 and loads == [] and not (tmp_path / "out").exists()
    assert err[-1].startswith(f"modelopt-ext ptq: error: validate: recipe {path} quantizes modules that the serving "
                              "engines fuse into one GEMM in different ways"), err
    assert "KDA input projections (vllm in_proj_qkvgfab, sglang fused_qkvg_proj)" in err[-1]
    assert "f_a_proj: weights unquantized, inputs unquantized" in err[-1]
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == before


@pytest.fixture(scope="module")
def own_copy(tiny_ckpt, tmp_path_factory):
    """A copy with its own remote-code module: ModelOpt's conversion changes the classes it quantizes, which
    must not reach other tests' models of the shared checkpoint."""
    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("fused_groups"), "fused_groups")


@pytest.mark.parametrize("name", SHIPPED + ["split"])
def test_states_equal_modelopt_conversion(name, own_copy, config, recipe_with):
    """For every quantizer of the converted tiny model (every linear, not only the fused groups' members):
    enabled as worked out, with the worked-out bits and blocks."""
    from modelopt.torch.quantization.conversion import replace_quant_module, set_quantizer_by_cfg
    from modelopt.torch.quantization.nn import TensorQuantizer

    import modelopt_ext

    split = [{"quantizer_name": "*self_attn.g_proj*", "enable": False},
             {"quantizer_name": "*mlp.up_proj.input_quantizer", "cfg": {"num_bits": 8}}]
    recipe = recipe_with(split, "nvfp4_experts-fp8_attention") if name == "split" else name
    cfg = R.quant_config(R.load(recipe), config)["quant_cfg"]
    model = modelopt_ext.from_pretrained(own_copy, trust_remote_code=True, dtype=torch.float32)
    replace_quant_module(model)
    set_quantizer_by_cfg(model, cfg)
    actual = {n: m for n, m in model.named_modules() if isinstance(m, TensorQuantizer)
              and n.rpartition(".")[2] in QUANTIZERS and ".experts." not in n and isinstance(
                  model.get_submodule(n.rpartition(".")[0]), torch.nn.Linear)}
    assert len(actual) > 100
    worked_out = quantizer_states(cfg, actual)
    for n, q in actual.items():
        enabled, attrs = worked_out[n]
        assert enabled == q.is_enabled, n
        if enabled:
            bits = tuple(attrs["num_bits"]) if isinstance(attrs["num_bits"], list) else attrs["num_bits"]
            assert bits == q.num_bits, n
            blocks = {int(k) if str(k).lstrip("-").isdigit() else k: v for k, v in (attrs["block_sizes"] or {}).items()}
            assert {k: v for k, v in blocks.items() if isinstance(k, int)} == {
                k: v for k, v in (q.block_sizes or {}).items() if isinstance(k, int)}, n


def test_describe():
    assert describe((False, None)) == "unquantized"
    assert describe((True, {"num_bits": [4, 3], "block_sizes": {"-1": 128, "-2": 128}})) == "FP8 E4M3, 128x128 blocks"
    assert describe((True, {"num_bits": [2, 1], "block_sizes": {"-1": 16, "type": "dynamic"}})) == "E2M1, 16-blocks"
    assert describe((True, {"num_bits": 8, "axis": 0})) == "INT8, per channel (axis 0)"
