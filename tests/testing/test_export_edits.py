"""modelopt_ext.testing.export_edits: the index, a tensor's shard, rewriting a shard, both quantization configs
alike, and the index's total_size restored after an edit (so a verify test breaks exactly one thing)."""

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from modelopt_ext.testing.export_edits import INDEX, edit_quant_configs, fix_total_size, read_index, rewrite, shard_of


def _export(root):
    """Two shards (a: fp32 [2, 3] + bf16 [4]; b: uint8 [5]), their index (total_size deliberately wrong), and
    both quantization configs."""
    save_file({"a.weight": torch.ones(2, 3), "a.scale": torch.ones(4, dtype=torch.bfloat16)},
              str(root / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({"b.weight": torch.zeros(5, dtype=torch.uint8)}, str(root / "model-00002-of-00002.safetensors"),
              metadata={"format": "pt"})
    index = {"metadata": {"total_size": 1}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                                           "a.scale": "model-00001-of-00002.safetensors",
                                                           "b.weight": "model-00002-of-00002.safetensors"}}
    (root / INDEX).write_text(json.dumps(index))
    quant = {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    (root / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    (root / "config.json").write_text(json.dumps({"model_type": "m", "quantization_config": dict(quant)}))
    return root


def test_index_and_shard_of(tmp_path):
    export = _export(tmp_path)
    assert INDEX == "model.safetensors.index.json"
    assert read_index(export)["weight_map"]["b.weight"] == "model-00002-of-00002.safetensors"
    assert shard_of(export, "a.scale") == tmp_path / "model-00001-of-00002.safetensors"


def test_rewrite_saves_the_mutated_tensors_as_pt(tmp_path):
    shard = _export(tmp_path) / "model-00001-of-00002.safetensors"

    def mutate(tensors):
        tensors["a.weight"] = tensors["a.weight"] * 3
        del tensors["a.scale"]
        tensors["c.new"] = torch.arange(2)

    rewrite(shard, mutate)
    tensors = load_file(str(shard))
    assert sorted(tensors) == ["a.weight", "c.new"]
    assert torch.equal(tensors["a.weight"], torch.full((2, 3), 3.0)) and torch.equal(tensors["c.new"], torch.arange(2))
    with safe_open(str(shard), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_fix_total_size_counts_the_shards_tensor_bytes(tmp_path):
    export = _export(tmp_path)
    fix_total_size(export)
    assert read_index(export)["metadata"]["total_size"] == 2 * 3 * 4 + 4 * 2 + 5  # fp32, bf16, uint8
    rewrite(export / "model-00002-of-00002.safetensors", lambda t: t.update({"b.weight": torch.zeros(9, dtype=torch.uint8)}))
    fix_total_size(export)
    assert read_index(export)["metadata"]["total_size"] == 24 + 8 + 9
    assert read_index(export)["weight_map"]["a.weight"] == "model-00001-of-00002.safetensors"  # the rest kept


def test_edit_quant_configs_edits_both_files_alike(tmp_path):
    export = _export(tmp_path)
    edit_quant_configs(export, lambda q: q["exclude_modules"].append("model.layers.0.mlp"))
    hf = json.loads((export / "hf_quant_config.json").read_text())
    config = json.loads((export / "config.json").read_text())
    assert hf["quantization"]["exclude_modules"] == ["lm_head", "model.layers.0.mlp"]
    assert config["quantization_config"] == hf["quantization"]
    assert hf["producer"] == {"name": "modelopt"} and config["model_type"] == "m"  # nothing else touched
