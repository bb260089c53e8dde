"""Remote-code locks: the sha256 of every Python file a checkpoint ships, checked before any of it runs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)


class RemoteCodeMismatch(ValueError):
    """The checkpoint's remote code differs from the lock."""


@dataclasses.dataclass(frozen=True)
class RemoteCodeLock:
    revision: str
    files: Mapping[str, str]  # file name -> sha256 hex
    source: str  # where the lock came from, for messages


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a file, read in 1 MiB chunks (shards are gigabytes)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def remote_code_files(checkpoint: Path) -> dict[str, str]:
    """sha256 of every top-level `*.py` file of a checkpoint folder (what trust_remote_code may import)."""
    return {p.name: sha256_file(p) for p in sorted(Path(checkpoint).glob("*.py"))}


def load_lock(path: Path) -> RemoteCodeLock:
    expected = 'expected {"revision": str, "files": {name: sha256 hex}}'
    try:
        data = json.loads(Path(path).read_text())
        revision, files = data["revision"], data["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"remote-code lock {path} is unreadable or malformed ({e}); {expected}") from e
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in files.items()
    ):
        raise ValueError(f"remote-code lock {path}: 'files' is malformed; {expected}")
    return RemoteCodeLock(revision=str(revision), files=dict(files), source=str(path))


def check_remote_code(checkpoint: Path, lock: RemoteCodeLock) -> None:
    """Raise RemoteCodeMismatch naming every changed, unknown or missing file (with both hashes)."""
    found = remote_code_files(checkpoint)
    problems = []
    for name, digest in found.items():
        if name not in lock.files:
            problems.append(f"unknown file {name} (sha256 {digest}) is not in the lock")
        elif digest != lock.files[name]:
            problems.append(f"{name} has sha256 {digest}, the lock expects {lock.files[name]}")
    for name in sorted(set(lock.files) - set(found)):
        problems.append(f"{name} (sha256 {lock.files[name]}) is missing from the checkpoint")
    if problems:
        raise RemoteCodeMismatch(
            f"remote code in {checkpoint} does not match the lock {lock.source} (revision {lock.revision}): "
            + "; ".join(problems)
            + ". Review the code, then record it with `modelopt-ext lock-remote-code DIR --out LOCK` and pass "
            "the lock (remote_code_lock=LOCK / --remote-code-lock LOCK)."
        )


def write_lock(checkpoint: Path, out: Path, revision: str) -> RemoteCodeLock:
    """Record the remote code of `checkpoint` as reviewed. Logs a warning: this vouches for the code."""
    files = remote_code_files(checkpoint)
    if not files:
        raise ValueError(f"{checkpoint} has no *.py files to lock")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"revision": revision, "files": files}, indent=2, sort_keys=True) + "\n")
    logger.warning(
        "recorded a remote-code lock of %d files from %s in %s (revision %s): code matching it will be "
        "trusted and executed, so only lock code you have reviewed", len(files), checkpoint, out, revision,
    )
    return RemoteCodeLock(revision=revision, files=files, source=str(out))
