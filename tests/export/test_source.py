"""Tests for modelopt_ext.export.source: what the exporter reads of a source checkpoint (dtypes, FP8-block
Linears, the layers it carries over), on the DeepSeek-V3 stand-in (FP8 128x128 blocks) and the Kimi-K3 one (none)."""

from __future__ import annotations

import json

import pytest
import torch

from modelopt_ext.export.source import SourceTensors, checkpoint_dtype
from modelopt_ext.formats.fp8_block import dequantize_blocks


@pytest.fixture(scope="module")
def ds_source(tmp_path_factory):
    from modelopt_ext.models.deepseek_v3.standin.generate import make_tiny

    path = make_tiny(tmp_path_factory.mktemp("ds_source") / "tiny", seed=0)
    return SourceTensors.read(path, json.loads((path / "config.json").read_text()))


def test_fp8_block_modules_are_found_from_the_headers(ds_source):
    modules = ds_source.modules
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in modules  # [192, 256]: a partial block
    assert "model.layers.1.mlp.experts.7.gate_proj" in modules and "model.layers.4.eh_proj" not in modules  # bf16
    assert not any("norm" in m or m.endswith("mlp.gate") for m in modules)
    assert ds_source.dtype == torch.bfloat16
    dtypes = ds_source.export_dtypes()
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == torch.bfloat16  # F8 stored, dequantized to bf16
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32


def test_exact_fp8_block_is_the_sources_codes_and_scales(ds_source):
    module = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    codes = ds_source.tensor(f"{module}.weight")
    held = torch.zeros(2, 1, 2, 1)  # ModelOpt's FP8_PB_WO scale shape
    weight, scale = ds_source.exact_fp8_block(module, torch.zeros_like(codes), held)
    assert torch.equal(weight.view(torch.uint8), codes.view(torch.uint8)) and scale.shape == held.shape
    assert torch.equal(scale.flatten(), ds_source.tensor(f"{module}.weight_scale_inv").flatten())
    # other shapes or a module the source does not store as FP8 blocks: ModelOpt's output stays
    assert ds_source.exact_fp8_block(module, torch.zeros(4, 4, dtype=codes.dtype), held) is None
    assert ds_source.exact_fp8_block(module, torch.zeros_like(codes), torch.zeros(3, 1, 2, 1)) is None
    assert ds_source.exact_fp8_block("model.layers.4.eh_proj", torch.zeros_like(codes), held) is None


def test_carried_layers_are_dequantized_without_scales(ds_source):
    carried = ds_source.carried(("model.layers.4.",))
    assert carried and all(k.startswith("model.layers.4.") for k in carried)
    assert not any(k.endswith("weight_scale_inv") for k in carried)
    key = "model.layers.4.self_attn.q_b_proj.weight"
    want = dequantize_blocks(ds_source.tensor(key), ds_source.tensor(key + "_scale_inv"), torch.bfloat16)
    assert carried[key].dtype == torch.bfloat16 and torch.equal(carried[key], want)
    assert torch.equal(carried["model.layers.4.eh_proj.weight"], ds_source.tensor("model.layers.4.eh_proj.weight"))


def test_a_checkpoint_without_fp8_blocks_has_no_modules(tiny_ckpt):
    source = SourceTensors.read(tiny_ckpt, json.loads((tiny_ckpt / "config.json").read_text()))
    assert source.modules == frozenset() and source.float_dtypes
    assert source.carried(()) == {}


def test_checkpoint_dtype():
    assert checkpoint_dtype({"torch_dtype": "float32"}) == torch.float32
    assert checkpoint_dtype({"dtype": "torch.float16"}) == torch.float16
    assert checkpoint_dtype({}) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int8': expected one of"):
        checkpoint_dtype({"torch_dtype": "int8"})
