"""Checkpoint conversion table of Kimi-K3: per-expert w1/w3/w2 tensors <-> fused expert tensors.

Declarative: transformers applies these on load and reverses them on `save_pretrained`, so saved
checkpoints carry the original per-expert keys (w1 rows first, then w3, in `gate_up_*`).
Registered under the multimodal class name only; the native `kimi_linear` model type (Kimi-Linear-48B)
keeps its own, unrelated mapping.
"""

from __future__ import annotations

import contextlib

from transformers import conversion_mapping as _cm
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


@contextlib.contextmanager
def scoped_conversion_mapping(class_name: str, transforms: list):
    """Register `transforms` for `class_name` only while loading.

    transformers keeps conversion mappings in a process-wide registry; leaving ours there would also apply
    it to an unpatched model of the same class name loaded later. The loaded model keeps its own copy
    (`model._weight_conversions`), which `save_pretrained` reverses, so nothing is lost by removing it.
    """
    cm = _cm  # module object: its registry globals are read and restored below
    if cm._checkpoint_conversion_mapping_cache is None:
        cm.get_checkpoint_conversion_mapping(class_name)  # builds the registry
    registry = cm._checkpoint_conversion_mapping_cache
    had_entry, previous = class_name in registry, registry.get(class_name)
    was_user = class_name in cm.USER_REGISTERED_MAPPINGS
    cm.register_checkpoint_conversion_mapping(class_name, transforms, overwrite=True)
    try:
        yield
    finally:
        if had_entry:
            registry[class_name] = previous
        else:
            registry.pop(class_name, None)
        if not was_user:
            cm.USER_REGISTERED_MAPPINGS.discard(class_name)
