"""Tiny stand-in checkpoints for tests: generated once per directory and reused."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path


def _generator(family: str):
    """The family's stand-in generator (`FamilySpec.make_tiny`)."""
    from modelopt_ext.families import families

    spec = families()[family]
    if spec.make_tiny is None:
        raise ValueError(f"family {family!r} has no stand-in generator")
    return spec.make_tiny


def tiny_checkpoint(family: str, root: Path, seed: int = 0, sizes: Mapping[str, int] | None = None,
                    fit_steps: int = 0) -> Path:
    """Path of `family`'s stand-in generated under `root` for (seed, sizes, fit_steps); generated on first use.
    `sizes` overrides fields of the family's default sizes; with `fit_steps` the weights are fitted to the
    embedded corpus first (`make-tiny --fit`)."""
    sizes = dict(sizes or {})
    digest = hashlib.sha256(json.dumps(sizes, sort_keys=True).encode()).hexdigest()[:10]
    out = Path(root) / f"{family}-seed{seed}-{digest}{f'-fit{fit_steps}' if fit_steps else ''}"
    if not (out / "config.json").exists():
        _generator(family)(out, seed=seed, sizes=sizes, force=True, fit_steps=fit_steps)
    return out


def copy_checkpoint(src: Path, root: Path, name: str) -> Path:
    """Copy a checkpoint to `root/name`. transformers names a checkpoint's remote-code module after the
    folder's base name and the code's hash, so a copy under a new name gets its own, unpatched module."""
    import shutil

    dst = Path(root) / name
    if dst.exists():
        raise FileExistsError(f"{dst} exists; use a fresh name so the copy gets its own remote-code module")
    shutil.copytree(src, dst)
    return dst


def remote_module(checkpoint: Path, file_stem: str):
    """The loaded remote-code module `file_stem` of `checkpoint`, or None if it was never imported."""
    import sys

    base = Path(checkpoint).name  # callers use plain identifiers, which transformers keeps as they are
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers_modules.") and f".{base}." in name and name.endswith("." + file_stem):
            return module
    return None
