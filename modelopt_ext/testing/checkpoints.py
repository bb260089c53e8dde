"""Tiny stand-in checkpoints for tests: generated once per directory and reused."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from modelopt_ext.models.kimi_k3.standin.generate import TinySizes, make_tiny


def tiny_kimi_k3(root: Path, seed: int = 0, sizes: TinySizes = TinySizes()) -> Path:
    """Path of a stand-in generated under `root` for (seed, sizes); generated on first use."""
    digest = hashlib.sha256(repr(dataclasses.astuple(sizes)).encode()).hexdigest()[:10]
    out = Path(root) / f"kimi_k3-seed{seed}-{digest}"
    if not (out / "config.json").exists():
        make_tiny(out, seed=seed, sizes=sizes, force=True)
    return out
