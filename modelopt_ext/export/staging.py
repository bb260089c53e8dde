"""Where an export is written: a hidden staging directory next to the target, published by one rename only
when every file (the manifest last) is complete, so an interrupted run never leaves a directory that looks
like a finished export.

- `staging_dir` creates `.NAME.partial-<8 hex digits>` beside the export dir, with an owner record (host, pid)
  that `stale_dirs` reads to tell a dead run's leftovers from a running one's; the record is removed
  (`drop_owner`) before the manifest is written.
- `publish` puts the staging dir in place. Onto a missing or empty export dir that is one rename(2). Onto a
  previous export (`--overwrite`) it is one renameat2(RENAME_EXCHANGE) where the filesystem supports it: the
  export path names the complete old export until that instant and the complete new one after it, never a
  mix and never nothing. A reader that opened files of the old export keeps reading the old bytes (removed
  only once closed); a reader that holds the old directory open (an fd, its working directory) sees it
  emptied as the old export is deleted. Where the exchange is not supported (non-Linux, some network
  filesystems) the old export is renamed aside first, leaving a moment in which the path does not exist.
  Once the new export is in place the run has succeeded: failing to delete the old one is a warning naming
  what is left.
- `interrupts_raise` turns SIGTERM and SIGINT into `Interrupted` while staging exists, so the staging dir is
  removed (`discard`) on every rank instead of being left behind; `ptq` covers its whole run the same way,
  so a signal that reaches a rank after its export failed still ends in its error line.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from modelopt_ext.export.target import (
    _TOKEN_CHARS,
    REPLACED_SUFFIX,
    STAGING_SUFFIX,
    ExportDirError,
    check_export_dir,
)

logger = logging.getLogger(__name__)

# Files of the source checkpoint that an export replaces or must not carry over.
NOT_COPIED = ("config.json", "hf_quant_config.json", "MANIFEST.sha256")
OWNER_NAME = ".modelopt_ext_owner.json"  # inside a staging dir while it is written
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
DISCARD_BOUND_S = 10.0  # how long `discard` keeps removing a staging dir that another rank still writes into

__all__ = ["ExportDirError", "Interrupted", "check_export_dir", "discard", "publish", "staging_dir", "stale_dirs"]


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived while an export was staged, or anywhere in a run that `interrupts_raise`
    covers (a BaseException: no `except Exception` keeps it). `during` is the step it reached, where the
    caller records one (`ptq` names its phase)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
        self.during: str | None = None


class _RaiseOnce:
    """The handler `interrupts_raise` installs: the first SIGTERM or SIGINT raises `Interrupted` in the main
    thread, later ones are logged and ignored (the first one's unwinding, to `discard` or to the command's
    error line, must run to its end)."""

    def __init__(self):
        self.raised: list[int] = []

    def __call__(self, signum, frame):
        if self.raised:
            logger.warning("%s while unwinding after %s: ignored", signal.Signals(signum).name,
                           signal.Signals(self.raised[0]).name)
            return
        self.raised.append(signum)
        raise Interrupted(signum)


@contextlib.contextmanager
def interrupts_raise():
    """While active (main thread only), the first SIGTERM or SIGINT raises `Interrupted` in the main thread;
    later ones are logged and ignored: the first one's unwinding (to `discard`) must run to its end, and a
    launcher may forward a signal twice or follow SIGTERM with SIGINT. Nested inside another (`ptq` covers
    its whole run, the export its staging), the outer handler stays: one signal raises once per run, and
    one arriving after the inner block (a rank unwinding from a failed export) still raises."""
    if threading.current_thread() is not threading.main_thread() or isinstance(
            signal.getsignal(signal.SIGTERM), _RaiseOnce):
        yield
        return
    handler = _RaiseOnce()
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def staging_dir(export_dir: Path, created: list[Path] | None = None) -> Path:
    """A new hidden directory beside `export_dir`, holding only its owner record. `created`: its path is appended
    before the directory is made, so that a signal arriving from then on (before the caller holds the returned
    path) still lets the caller `discard` it."""
    export_dir.parent.mkdir(parents=True, exist_ok=True)
    path = export_dir.parent / f".{export_dir.name}{STAGING_SUFFIX}{secrets.token_hex(_TOKEN_CHARS // 2)}"
    if created is not None:
        created.append(path)
    path.mkdir()
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    (path / OWNER_NAME).write_text(json.dumps(owner) + "\n")
    return path


def drop_owner(staging: Path) -> None:
    (staging / OWNER_NAME).unlink(missing_ok=True)


def _owner_alive(path: Path) -> tuple[bool, str]:
    """(whether the run that created `path` may still be running, who it was)."""
    try:
        owner = json.loads((path / OWNER_NAME).read_text())
        host, pid = str(owner["host"]), int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False, "no owner record"
    who = f"pid {pid} on {host}"
    if host != socket.gethostname():
        return True, who + ", another host: cannot tell whether it still runs"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, who + ", no longer running"
    except PermissionError:
        pass
    return True, who + ", still running"


def _size(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def stale_dirs(export_dir: Path, *, overwrite: bool, remove: bool) -> list[str]:
    """Staging and replaced dirs of `export_dir` left by earlier runs, logged; with `remove` (given only with
    `overwrite`), those whose run is not running any more are deleted. Returns one line per dir found."""
    lines = []
    for suffix in (STAGING_SUFFIX, REPLACED_SUFFIX):
        for path in sorted(export_dir.parent.glob(f".{export_dir.name}{suffix}*")):
            if not path.is_dir() or path.is_symlink():
                continue
            alive, who = _owner_alive(path) if suffix == STAGING_SUFFIX else (False, "a replaced export")
            size = _size(path)
            if remove and not alive:
                shutil.rmtree(path, ignore_errors=True)
                state = "removed" if not path.exists() else "could not be removed"
            elif alive:
                state = "left: it may be in use"
            else:
                state = "removed before this export" if overwrite else "left: pass --overwrite to remove it"
            lines.append(f"{path} ({size:,} bytes, {who}): {state}")
    for line in lines:
        logger.warning("left by an earlier run of this export: %s", line)
    return lines


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


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk (so nothing looks finished before it is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_staging(staging: Path, synced: set[str]) -> None:
    """fsync every file of `staging` not named in `synced` (relative paths the writers already flushed), then
    its directories: called by rank 0 before publishing, after the manifest is written."""
    for path in sorted(staging.rglob("*")):
        if path.is_file() and path.relative_to(staging).as_posix() not in synced:
            fsync_path(path)
    for path in sorted((p for p in staging.rglob("*") if p.is_dir()), reverse=True):
        fsync_path(path)
    fsync_path(staging)


def exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (renameat2 RENAME_EXCHANGE); False where the system does not offer it."""
    if not sys.platform.startswith("linux"):
        return False
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:  # glibc before 2.28, musl
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def publish(staging: Path, export_dir: Path, overwrite: bool) -> list[str]:
    """Put the complete staging dir in place as `export_dir` (see the module doc); returns warnings (what
    of a previous export could not be removed)."""
    check_export_dir(export_dir, overwrite)
    if not export_dir.exists() or not any(export_dir.iterdir()):
        os.rename(staging, export_dir)  # rename(2) replaces an empty directory in one step
        fsync_path(export_dir.parent)  # the new name on disk
        logger.info("export complete: %s", export_dir)
        return []
    replaced = export_dir.parent / f".{export_dir.name}{REPLACED_SUFFIX}{secrets.token_hex(_TOKEN_CHARS // 2)}"
    if exchange(staging, export_dir):
        staging.rename(replaced)  # the old export, now at the staging path
    else:
        logger.info("%s: no atomic exchange here; moving the previous export aside first", export_dir)
        export_dir.rename(replaced)
        staging.rename(export_dir)
    fsync_path(export_dir.parent)
    logger.info("export complete: %s", export_dir)
    problems: list[str] = []

    def note(fn, path, info) -> None:  # `onexc` passes the exception, `onerror` (before 3.12) exc_info
        problems.append(f"{path}: {info[1] if isinstance(info, tuple) else info}")

    shutil.rmtree(replaced, **({"onexc": note} if sys.version_info >= (3, 12) else {"onerror": note}))
    if not problems:
        return []
    warning = (f"the new export is in place at {export_dir}, but the previous one could not be fully removed: "
               f"{replaced} is left ({'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''})")
    logger.warning("%s", warning)
    return [warning]


def discard(staging: Path | None, bound_s: float = DISCARD_BOUND_S) -> None:
    """Remove a staging directory, whole. A SIGTERM or SIGINT arriving meanwhile is held back and raised
    again once the directory is gone (a launcher that forwards a signal twice must not cut the removal
    short: `Interrupted` raised inside `rmtree` left the directory half removed). Another rank may still be
    writing into it (a signal reaches a rank inside a long C call, such as writing a shard, only when the
    call returns) or removing it at the same time: a directory still there is removed again, for up to
    `bound_s` seconds, then logged as left."""
    if staging is None or not staging.exists():
        return
    held: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        deadline = time.monotonic() + bound_s
        while True:
            shutil.rmtree(staging, ignore_errors=True)
            if not staging.exists():
                break
            if time.monotonic() > deadline:
                logger.warning("could not remove the staging directory %s within %.0f s (another rank may still "
                               "be writing into it); the next run of this export reports it", staging, bound_s)
                break
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if held:
        signal.raise_signal(held[0])  # now handled as it would have been: Interrupted, or the default action
