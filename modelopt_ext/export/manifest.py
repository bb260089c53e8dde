"""Check (5) of `verify_export`: the ``MANIFEST.sha256`` of an export (``sha256  path`` per file, sorted)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

from modelopt_ext.lock import sha256_file

MANIFEST_NAME = "MANIFEST.sha256"
_MANIFEST_LINE = re.compile(r"^([0-9a-f]{64})  (.+)$")


def file_digests(export_dir: Path, known: Mapping[str, str] | None = None) -> dict[str, str]:
    """sha256 of every file under ``export_dir`` but the manifest, by POSIX path relative to it; a file named
    in ``known`` (relative path -> sha256, e.g. worked out by the rank that wrote it) is not read again."""
    known = known or {}
    digests = {}
    for p in sorted(export_dir.rglob("*")):
        name = p.relative_to(export_dir).as_posix()
        if p.is_file() and name != MANIFEST_NAME:
            digests[name] = known[name] if name in known else sha256_file(p)
    return digests


def _check_manifest(path: Path, digests: Mapping[str, str], problems: list[str]) -> bool:
    """Append a problem for every file that does not match the manifest at `path`, or one for a missing
    manifest (modelopt-ext's exporter always writes it); False when there is no manifest to check."""
    if not path.is_file():
        what = "is not a file" if path.exists() else "is missing"
        problems.append(
            f"{path} {what}: modelopt-ext's exporter always writes {MANIFEST_NAME}, so this export is incomplete "
            "or was not written by modelopt-ext; for an export of ModelOpt's own export_hf_checkpoint, "
            "`modelopt-ext verify --write-manifest` checks it and writes one"
        )
        return False
    listed: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        m = _MANIFEST_LINE.match(line)
        if m is None:
            problems.append(f"{MANIFEST_NAME} line {number} is not 'sha256  filename': {line[:80]!r}")
        else:
            listed[m.group(2)] = m.group(1)
    for name, digest in sorted(listed.items()):
        if name not in digests:
            problems.append(f"{name} is listed in {MANIFEST_NAME} but missing")
        elif digests[name] != digest:
            problems.append(f"{name} changed since {MANIFEST_NAME} was written (sha256 {digests[name]}, was {digest})")
    problems.extend(f"{name} is not listed in {MANIFEST_NAME}" for name in sorted(set(digests) - set(listed)))
    return True


def _write_manifest(export_dir: Path, digests: Mapping[str, str]) -> None:
    tmp = export_dir / f".{MANIFEST_NAME}.tmp"
    tmp.write_text("".join(f"{digests[name]}  {name}\n" for name in sorted(digests)))
    tmp.replace(export_dir / MANIFEST_NAME)
