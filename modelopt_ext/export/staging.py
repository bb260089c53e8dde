"""Where an export is written: a hidden staging directory next to the target, renamed into place only
when every file (the manifest last) is complete, so an interrupted run never leaves a directory that looks
like a finished export."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

# Files of the source checkpoint that an export replaces or must not carry over.
NOT_COPIED = ("config.json", "hf_quant_config.json", "MANIFEST.sha256")


class ExportDirError(ValueError):
    """The export directory cannot be used (non-empty without overwrite, a file, not writable)."""


def check_export_dir(export_dir: str | os.PathLike, overwrite: bool) -> Path:
    """The absolute export path, after checking it can be written; raises ExportDirError naming it."""
    path = Path(export_dir).absolute()
    if path.exists() and not path.is_dir():
        raise ExportDirError(f"export dir {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ExportDirError(f"export dir {path} is not empty; pass --overwrite to replace it")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportDirError(f"export dir {path}: cannot create files in {parent}")
    return path


def staging_dir(export_dir: Path) -> Path:
    """A new, empty, hidden directory beside `export_dir`."""
    export_dir.parent.mkdir(parents=True, exist_ok=True)
    path = export_dir.parent / f".{export_dir.name}.partial-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def copy_source_files(source_dir: Path, staging: Path) -> list[str]:
    """Copy the checkpoint's remote code, tokenizer and generation config (every top-level file but weights,
    the index and the files the export rewrites)."""
    copied = []
    for f in sorted(source_dir.iterdir()):
        if not f.is_file() or f.name in NOT_COPIED or f.name.endswith((".safetensors", ".safetensors.index.json")):
            continue
        shutil.copyfile(f, staging / f.name)
        copied.append(f.name)
    return copied


def publish(staging: Path, export_dir: Path, overwrite: bool) -> None:
    """Rename the complete staging directory to `export_dir` (replacing it only with `overwrite`)."""
    check_export_dir(export_dir, overwrite)
    old = None
    if export_dir.exists():
        if any(export_dir.iterdir()):
            old = export_dir.parent / f".{export_dir.name}.replaced-{secrets.token_hex(4)}"
            export_dir.rename(old)
        else:
            export_dir.rmdir()
    staging.rename(export_dir)
    if old is not None:
        shutil.rmtree(old)
    logger.info("export complete: %s", export_dir)


def discard(staging: Path | None) -> None:
    if staging is not None and staging.exists():
        shutil.rmtree(staging, ignore_errors=True)
