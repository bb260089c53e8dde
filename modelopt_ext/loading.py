"""`modelopt_ext.from_pretrained`: find the checkpoint's family, let it validate, patch and load."""

from __future__ import annotations

from pathlib import Path

from modelopt_ext.families import family_for_config, read_config


def from_pretrained(path: str | Path, **kwargs):
    """Load a checkpoint of a supported family with its adapter applied.

    Args:
        path: local checkpoint folder (no hub downloads).
        **kwargs: transformers `from_pretrained` keyword arguments (e.g. `dtype`, `trust_remote_code`,
            `experts_implementation`) plus family options (e.g. `remote_code_lock`).
    Returns:
        The model class `AutoModelForCausalLM` gives for the checkpoint, patched by the family adapter.
    """
    config = read_config(path)
    family = family_for_config(config, source=str(Path(path) / "config.json"))
    return family.load(path, **kwargs)
