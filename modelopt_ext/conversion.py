"""Weight conversions a family registers with transformers for one load only.

transformers keeps checkpoint conversion mappings (per model class or model type: how checkpoint tensors
become model parameters, e.g. per-expert weights stacked into a fused expert parameter) in a process-wide
registry. A family that needs its own (Kimi-K3's MXFP4 experts) or a model type transformers does not map
(Kimi-K2's `kimi_k2`, loaded as `deepseek_v3`) registers it in its `PreparedLoad.conversion_scope` with
`scoped_conversion_mapping`, which puts the registry back as it was afterwards.
"""

from __future__ import annotations

import contextlib

from transformers import conversion_mapping as _cm


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
