"""Tests of modelopt_ext/export/engine_names.py: algorithm spellings, engine name candidates and resolution."""

from __future__ import annotations

import pytest

from modelopt_ext.export.engine_names import (
    mismatch,
    resolve,
    same_algo,
    sglang_candidates,
    sources,
    trtllm_algo,
    vllm_candidates,
)


@pytest.mark.parametrize("name, want", [
    ("fp8_pb_wo", "FP8_PB_WO"), ("FP8_BLOCK_SCALES", "FP8_PB_WO"), ("nvfp4", "NVFP4"), (None, None), (3, 3),
])
def test_same_algo(name, want):
    assert same_algo(name) == want


@pytest.mark.parametrize("name, want", [
    ("fp8_pb_wo", "FP8_BLOCK_SCALES"), ("FP8_PB_WO", "FP8_BLOCK_SCALES"), ("nvfp4", "nvfp4"), (None, None),
])
def test_trtllm_algo(name, want):
    assert trtllm_algo(name) == want


def test_prefix_candidates():
    assert vllm_candidates("language_model.model.layers.0.mlp") == [
        "language_model.model.layers.0.mlp", "model.language_model.layers.0.mlp"]
    assert vllm_candidates("language_model.lm_head") == ["language_model.lm_head", "lm_head"]
    assert vllm_candidates("model.layers.0.mlp") == ["model.layers.0.mlp"]
    assert sglang_candidates("model.layers.0.mlp") == ["model.layers.0.mlp", "model.language_model.layers.0.mlp"]
    assert sglang_candidates("model.language_model.layers.0.mlp") == [
        "model.language_model.layers.0.mlp", "language_model.model.layers.0.mlp"]


def test_sources_join_the_loader_and_the_family_files():
    assert sources("vllm", "names", {}) == "vllm/model_executor/layers/quantization/modelopt.py: " \
        "ModelOptMixedPrecisionConfig._resolve_quant_algo"
    assert sources("vllm", "names", {("vllm", "names"): "m.py: X"}).endswith("_resolve_quant_algo; m.py: X")
    assert sources("trtllm", "never-quantized", {("trtllm", "never-quantized"): "m.py"}) == "m.py"
    assert sources("trtllm", "never-quantized", {}) == "the family's model code (no source recorded)"


def test_resolve_exact_key_then_shards_then_a_key_under_it():
    prefix = "model.layers.0.attn.qkv_proj"
    shards = [f"model.layers.0.attn.{p}_proj" for p in "qkv"]
    assert resolve({prefix: "FP8", shards[0]: "NVFP4"}, prefix, shards, vllm_candidates) == ("FP8", f"key {prefix}")
    assert resolve({s: "NVFP4" for s in shards[:2]}, prefix, shards, vllm_candidates) == ("NVFP4", "its shards' keys")
    assert resolve({shards[0]: "NVFP4", shards[1]: "FP8"}, prefix, shards, vllm_candidates) == (
        None, "shards disagree (q_proj NVFP4, k_proj FP8)")
    assert resolve({f"{prefix}.inner": "FP8"}, prefix, shards, vllm_candidates) == ("FP8", f"key {prefix}.inner under it")
    assert resolve({"model.layers.1.mlp": "FP8"}, prefix, shards, vllm_candidates) == (None, "no key")


def test_mismatch():
    assert mismatch("m", "m", "NVFP4", "NVFP4", "key m") == []
    assert mismatch("m", "m", "absent", None, "no key") == []
    assert mismatch("m", "m", "unquantized", "FP8", "key m") == [
        "m is unquantized but resolves to FP8 (key m): the engine would quantize it"]
    assert mismatch("a.m", "b.m", "NVFP4", None, "no key") == ["b.m (a.m) carries NVFP4 but resolves to unquantized (no key)"]
    assert mismatch("m", "m", "NVFP4", None, "shards disagree (q FP8, k NVFP4)") == [
        "m: shards disagree (q FP8, k NVFP4); the engine refuses a mixed fused layer"]
