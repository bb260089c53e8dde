"""The stand-in generators' output folder: refused before anything is written unless empty (or `force`), then
built in a hidden temporary sibling and moved in place when complete."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def prepare_out_dir(out_dir: Path, force: bool) -> None:
    """Raises FileExistsError for a file in the way, or for a non-empty folder without `force`."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} is not empty; pass --force to replace its contents")


def staging_dir(out_dir: Path) -> Path:
    """A new hidden sibling of `out_dir` (`.NAME.tmp-XXXX`) with the permissions of a folder made by mkdir (the
    umask's), where a generator writes before the rename."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a checkpoint should read like any other folder
    return tmp


def publish(tmp: Path, out_dir: Path) -> None:
    """Give `tmp`'s files the umask's permissions (safetensors writes 0600), replace `out_dir` with it (a rename;
    an existing `out_dir` was checked by `prepare_out_dir` and is removed first)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
