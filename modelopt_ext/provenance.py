"""Where an export came from: `modelopt_ext_provenance.json`, written into every `ptq` export.

A consumer (or the next run) can tell from the export alone which recipe produced it (its name and the full
resolved recipe after imports and `--set` overrides), with which versions of the toolchain, from which
checkpoint (path, the family's pinned revision, the remote-code lock and its sha256), on how many
calibration tokens with what expert coverage, and at which EP degree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

PROVENANCE_NAME = "modelopt_ext_provenance.json"
DISTRIBUTIONS = ("modelopt-ext", "nvidia-modelopt", "transformers", "torch", "compressed-tensors", "accelerate",
                 "fla-core", "safetensors")


def versions() -> dict[str, str | None]:
    """Installed version of each distribution the export path uses (None when absent)."""
    out = {}
    for name in DISTRIBUTIONS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _plain(value: Any) -> Any:
    """JSON/YAML-safe copy of a loaded recipe (enums and other objects as their string values)."""
    return json.loads(json.dumps(value, default=lambda v: getattr(v, "value", str(v))))


def build(*, recipe_name: str, recipe: Mapping[str, Any], overrides, source: Path, family, lock: Path | None,
          calibration: Mapping[str, Any], distribution: Mapping[str, Any]) -> dict[str, Any]:
    from modelopt_ext.lock import sha256_file

    data = _plain(dict(recipe))
    return {
        "producer": {"name": "modelopt_ext", "version": versions()["modelopt-ext"]},
        "recipe": {"name": recipe_name, "path": str(getattr(recipe, "path", "") or ""), "overrides": list(overrides),
                   "resolved_yaml": yaml.safe_dump(data, sort_keys=False)},
        "versions": versions(),
        "source": {"path": str(Path(source).absolute()), "family": family.name, "revision": family.revision,
                   "remote_code_lock": None if lock is None else str(lock),
                   "remote_code_lock_sha256": None if lock is None else sha256_file(lock)},
        "calibration": dict(calibration),
        "distribution": dict(distribution),
    }


def write(directory: Path, provenance: Mapping[str, Any]) -> None:
    (Path(directory) / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n")
