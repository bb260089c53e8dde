"""Tests of modelopt_ext/export/quant_layout.py: block grids, algorithm names and reading the quantization config."""

from __future__ import annotations

import json
from types import MappingProxyType

import pytest

from modelopt_ext.export.quant_layout import _QuantSpec, _read_quant_spec, canonical_algo, fp8_pb_grid


@pytest.mark.parametrize("shape, grid", [((128, 128), (1, 1)), ((129, 256), (2, 2)), ((1, 1000), (1, 8))])
def test_fp8_pb_grid_counts_started_blocks(shape, grid):
    assert fp8_pb_grid(shape) == grid


def test_canonical_algo():
    assert canonical_algo("fp8_pb_wo") == "FP8_PB_WO"
    assert canonical_algo(None) is None


def test_format_for_mixed_precision_takes_the_nearest_listed_ancestor():
    spec = _QuantSpec("MIXED_PRECISION", 16, ("*.gate",), MappingProxyType({"m.experts": ("NVFP4", 32)}), None)
    assert spec.format_for("m.experts.3.w1") == ("NVFP4", 32)
    assert spec.format_for("m.experts") == ("NVFP4", 32)
    assert spec.format_for("m.attn.q_proj") is None
    assert spec.format_for("m.experts.gate") is None  # excluded
    plain = _QuantSpec("FP8", 16, (), MappingProxyType({}), None)
    assert plain.format_for("anything") == ("FP8", 16)


def _write(tmp_path, hf, config):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf))
    (tmp_path / "config.json").write_text(json.dumps(config))


def test_read_quant_spec_agreeing_configs(tmp_path):
    _write(tmp_path, {"quantization": {"quant_algo": "nvfp4", "group_size": 16, "exclude_modules": ["lm_head"],
                                       "kv_cache_quant_algo": "FP8"}},
           {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"],
                                    "config_groups": {"g": {"weights": {"group_size": 16}}}}})
    problems = []
    spec = _read_quant_spec(tmp_path, problems)
    assert problems == []
    assert (spec.algo, spec.group_size, spec.exclude, dict(spec.layers), spec.kv_cache) == (
        "NVFP4", 16, ("lm_head",), {}, "FP8")


def test_read_quant_spec_names_each_disagreement(tmp_path):
    _write(tmp_path, {"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"], "group_size": 0}},
           {"quantization_config": {"quant_method": "fp8", "quant_algo": "NVFP4", "ignore": ["gate"]}})
    problems = []
    spec = _read_quant_spec(tmp_path, problems)
    assert spec.algo == "FP8" and spec.group_size == 16
    assert problems == [
        "hf_quant_config.json group_size is 0, expected a positive integer",
        "config.json quantization_config.quant_algo 'NVFP4' != hf_quant_config.json quant_algo 'FP8'",
        "config.json quantization_config.ignore and hf_quant_config.json exclude_modules differ: only in ignore "
        "['gate'], only in exclude_modules ['lm_head']",
        "config.json quantization_config.quant_method is 'fp8', expected 'modelopt' or 'modelopt_mixed'",
    ]


def test_read_quant_spec_without_any_quantization(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    problems = []
    spec = _read_quant_spec(tmp_path, problems)
    assert problems == [] and spec.algo is None and spec.format_for("m.w") is None
