"""Checkpoint conversion table of Kimi-K3: per-expert w1/w3/w2 tensors <-> fused expert tensors.

Declarative: transformers applies these on load and reverses them on `save_pretrained`, so saved
checkpoints carry the original per-expert keys (w1 rows first, then w3, in `gate_up_*`).
Registered under the multimodal class name only; the native `kimi_linear` model type (Kimi-Linear-48B)
keeps its own, unrelated mapping.
"""

from __future__ import annotations

from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

EXPERTS = "block_sparse_moe.experts"
# storage -> checkpoint tensor suffix -> fused parameter suffix. transformers appends (?!\w) to patterns
# ending in a word character, so "w1.weight" never matches "w1.weight_packed".
SUFFIXES = {
    "mxfp4": {"weight_packed": "_packed", "weight_scale": "_scale"},
    "dense": {"weight": ""},
}


def expert_converters(storage: str) -> list[WeightConverter]:
    """The converters for a checkpoint whose experts are stored as `storage` ("mxfp4" or "dense")."""
    if storage not in SUFFIXES:
        raise ValueError(f"expert storage {storage!r} is not one of {sorted(SUFFIXES)}")
    converters = []
    for src, dst in SUFFIXES[storage].items():
        converters.append(
            WeightConverter(
                source_patterns=[f"{EXPERTS}.*.w1.{src}", f"{EXPERTS}.*.w3.{src}"],
                target_patterns=f"{EXPERTS}.gate_up_proj{dst}",
                operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
            )
        )
        converters.append(
            WeightConverter(
                source_patterns=f"{EXPERTS}.*.w2.{src}",
                target_patterns=f"{EXPERTS}.down_proj{dst}",
                operations=[MergeModulelist(dim=0)],
            )
        )
    return converters
