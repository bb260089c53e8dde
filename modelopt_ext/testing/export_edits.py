"""Edits of an export's files for the verify tests: read the index, find a tensor's shard, rewrite a shard, edit
both quantization configs alike, and restore the index's total_size after an edit (so a test breaks exactly one
thing)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"


def read_index(export: Path) -> dict:
    return json.loads((export / INDEX).read_text())


def shard_of(export: Path, key: str) -> Path:
    return export / read_index(export)["weight_map"][key]


def rewrite(path: Path, mutate) -> None:
    """Load a shard, let `mutate(tensors)` change the dict, save it back."""
    tensors = load_file(str(path))
    mutate(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def fix_total_size(export: Path) -> None:
    """Set the index's metadata.total_size to the shards' tensor bytes."""
    index = read_index(export)
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        total += sum(t.numel() * t.element_size() for t in load_file(str(export / shard)).values())
    index["metadata"]["total_size"] = total
    (export / INDEX).write_text(json.dumps(index))


def edit_quant_configs(export: Path, edit) -> None:
    """Apply `edit` to hf_quant_config.json's `quantization` and config.json's `quantization_config` alike."""
    hf = json.loads((export / "hf_quant_config.json").read_text())
    edit(hf["quantization"])
    (export / "hf_quant_config.json").write_text(json.dumps(hf))
    config = json.loads((export / "config.json").read_text())
    edit(config["quantization_config"])
    (export / "config.json").write_text(json.dumps(config))
