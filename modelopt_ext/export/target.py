"""Whether a path may receive an export: checked in validate, before anything is loaded, and again at publish.

The rules protect what the user has: the export dir is never the checkpoint, above it or inside it, never
holds a file the run reads, and `--overwrite` replaces only an empty directory or a finished export of this
tool (one with its manifest). Symbolic links and `..` are resolved first, so the checks see the real
directories, and the export is written where the link points.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from modelopt_ext.export.manifest import MANIFEST_NAME

logger = logging.getLogger(__name__)

STAGING_SUFFIX = ".partial-"  # `.NAME.partial-<8 hex digits>`: a run's export while it is written
REPLACED_SUFFIX = ".replaced-"  # `.NAME.replaced-<8 hex digits>`: a previous export being removed after publishing
_TOKEN_CHARS = 8  # the hex characters after either suffix


class ExportDirError(ValueError):
    """The export directory cannot be used (see the module doc); the message names it and why."""


def resolve_export_dir(export_dir: str | os.PathLike) -> Path:
    """The real, absolute path of `export_dir` (symlinks and `..` resolved); refuses an empty string."""
    raw = os.fspath(export_dir)
    if not raw.strip():
        raise ExportDirError(f"export dir {raw!r} is empty (an unset shell variable?); give a directory path "
                             "(an empty path would mean the current directory)")
    given = Path(raw).absolute()
    path = given.resolve()
    if path != given and (given.is_symlink() or any(p.is_symlink() for p in given.parents)):
        logger.info("export dir %s resolves to %s (a symbolic link): the export is written there", given, path)
    return path


def _existing_ancestor(path: Path) -> Path:
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    return parent


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):  # no such limit reported: the common one
        return 255


def check_export_dir(export_dir: str | os.PathLike, overwrite: bool) -> Path:
    """The export dir's real path, after checking it can be written and (with `overwrite`) replaced; raises
    ExportDirError naming it. Does not create or change anything."""
    path = resolve_export_dir(export_dir)
    if path.exists() and not path.is_dir():
        raise ExportDirError(f"export dir {path} exists and is not a directory")
    if path == Path(path.anchor):
        raise ExportDirError(f"export dir {path} is the filesystem root; give a directory of its own")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise ExportDirError(f"export dir {path} is not empty; pass --overwrite to replace it")
        if not (path / MANIFEST_NAME).is_file():
            raise ExportDirError(
                f"export dir {path} is not empty and holds no finished modelopt-ext export (no {MANIFEST_NAME}); "
                "--overwrite replaces only such an export or an empty directory: choose another export dir")
    parent = _existing_ancestor(path)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportDirError(f"export dir {path}: cannot create files in {parent}")
    longest = f".{path.name}{REPLACED_SUFFIX}{'0' * _TOKEN_CHARS}"
    limit = _name_max(parent)
    if len(os.fsencode(longest)) > limit:
        raise ExportDirError(
            f"export dir name {path.name!r} is {len(os.fsencode(path.name))} bytes; the staging directory beside it "
            f"({longest[:24]}...) needs {len(os.fsencode(longest))}, more than the {limit} bytes a file name may have "
            f"in {parent}: choose a shorter name")
    return path


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def check_export_target(export_dir: Path, source_dir: str | os.PathLike,
                        files: Mapping[str, str | os.PathLike | None]) -> None:
    """Refuse an export dir (already resolved) that is, contains or lies inside the checkpoint dir, or that
    contains one of `files` (what the run reads or writes besides the export: {"--recipe": path, ...}).
    A file the run writes (`--summary-json`) may not lie inside the checkpoint either."""
    source = Path(source_dir).resolve()
    given = f"--export-dir {export_dir} and --model {source}"
    if export_dir == source:
        raise ExportDirError(f"{given}: the export dir is the checkpoint; the source is never written")
    if _inside(source, export_dir):
        raise ExportDirError(f"{given}: the export dir contains the checkpoint, which replacing it would delete")
    if _inside(export_dir, source):
        raise ExportDirError(f"{given}: the export dir lies inside the checkpoint; the source is never written")
    for option, file in files.items():
        if file is None:
            continue
        real = Path(file).resolve()
        if _inside(real, export_dir):
            raise ExportDirError(f"{option} {real} lies inside the export dir {export_dir}, which the export "
                                 "replaces: keep it outside")
        if option == "--summary-json" and _inside(real, source):
            raise ExportDirError(f"--summary-json {real} lies inside the checkpoint {source}; the source is never "
                                 "written")


PROBE_SUFFIX = ".probe-"


def _probe_dir(export_dir: Path) -> Path:
    return export_dir.parent if export_dir.parent.is_dir() else _existing_ancestor(export_dir)


def write_probe(export_dir: Path) -> tuple[str, str]:
    """Rank 0: a small file beside where the staging dir will be; returns (its name, its content)."""
    name, token = f".{export_dir.name}{PROBE_SUFFIX}{secrets.token_hex(4)}", secrets.token_hex(16)
    (_probe_dir(export_dir) / name).write_text(token)
    return name, token


def check_probe(export_dir: Path, name: str, token: str, rank: int, host: str) -> None:
    """Every rank: rank 0's probe must be there, beside this rank's own resolution of the export dir."""
    path = _probe_dir(export_dir) / name
    try:
        seen = path.read_text()
    except OSError as e:
        seen = f"unreadable ({e.strerror})"
    if seen != token:
        raise ExportDirError(
            f"export dir {export_dir}: rank {rank} (host {host}) does not see the file rank 0 wrote beside it "
            f"({path}: {'missing' if not path.exists() else seen}); every rank must write to one export dir on a "
            "filesystem all nodes share, at the same path (a node-local or relative path that differs per node "
            "cannot hold one export)")


def remove_probe(export_dir: Path, name: str) -> None:
    (_probe_dir(export_dir) / name).unlink(missing_ok=True)
