"""Tiny stand-in checkpoints for tests: generated once per directory and reused."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from modelopt_ext.models.kimi_k3.standin.generate import TinySizes, make_tiny


def tiny_kimi_k3(root: Path, seed: int = 0, sizes: TinySizes = TinySizes(), fit_steps: int = 0) -> Path:
    """Path of a stand-in generated under `root` for (seed, sizes, fit_steps); generated on first use. With
    `fit_steps` the weights are fitted to the embedded corpus first (`make-tiny --fit`)."""
    digest = hashlib.sha256(repr(dataclasses.astuple(sizes)).encode()).hexdigest()[:10]
    out = Path(root) / f"kimi_k3-seed{seed}-{digest}{f'-fit{fit_steps}' if fit_steps else ''}"
    if not (out / "config.json").exists():
        make_tiny(out, seed=seed, sizes=sizes, force=True, fit_steps=fit_steps)
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
