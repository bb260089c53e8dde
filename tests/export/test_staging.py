"""modelopt_ext.export.staging: staging dirs with their owner, stale leftovers reported and removed, publishing by
one atomic exchange (the path always names one complete export), failures to delete the old export as
warnings, and SIGTERM/SIGINT turned into `Interrupted`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from modelopt_ext.export import staging
from modelopt_ext.export.staging import (
    OWNER_NAME,
    Interrupted,
    discard,
    drop_owner,
    exchange,
    interrupts_raise,
    publish,
    staging_dir,
    stale_dirs,
)


def _export(path: Path, tag: str, files: int = 3) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (path / f"model-{i}.safetensors").write_text(f"{tag} {i}")
    (path / "MANIFEST.sha256").write_text(tag)


def test_staging_dir_is_hidden_beside_the_export_with_its_owner(tmp_path):
    path = staging_dir(tmp_path / "out")
    assert path.parent == tmp_path and path.name.startswith(".out.partial-")
    owner = json.loads((path / OWNER_NAME).read_text())
    assert owner["pid"] == os.getpid()
    drop_owner(path)
    assert list(path.iterdir()) == []


def test_publish_onto_nothing_and_onto_an_empty_dir(tmp_path):
    for target in (tmp_path / "new", tmp_path / "empty"):
        if target.name == "empty":
            target.mkdir()
        new = staging_dir(target)
        _export(new, "new")
        drop_owner(new)
        assert publish(new, target, overwrite=False) == []
        assert (target / "MANIFEST.sha256").read_text() == "new" and not new.exists()


def test_exchange_swaps_two_directories_in_one_step(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b" / "x").write_text("b")
    if not exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not offered here")
    assert (tmp_path / "a" / "x").read_text() == "b" and (tmp_path / "b" / "x").read_text() == "a"


def test_overwrite_publish_replaces_the_old_export_whole_and_a_reader_never_sees_a_mix(tmp_path):
    """A reader polls the export path while it is replaced: every time it sees one export's files, all with one
    tag, and the path never goes missing (where the exchange is offered)."""
    out = tmp_path / "out"
    _export(out, "old", files=20)
    new = staging_dir(out)
    _export(new, "new", files=20)
    drop_owner(new)
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            try:
                fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # resolve the path once, then read inside
            except FileNotFoundError:
                seen.append("missing")
                continue
            try:
                tags = set()
                for name in os.listdir(fd):
                    with open(os.open(name, os.O_RDONLY, dir_fd=fd)) as f:
                        tags.add(f.read().split()[0])
                seen.append(tags)
            except FileNotFoundError:  # the old dir being emptied after the exchange: a reader of the old path
                seen.append("emptied")
            finally:
                os.close(fd)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert publish(new, out, overwrite=True) == []
    finally:
        stop.set()
        reader.join(timeout=10)
    assert (out / "MANIFEST.sha256").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # neither staging nor the old export is left
    assert all(s in ({"old"}, {"new"}, set(), "emptied") or s == "missing" for s in seen), seen
    if _exchange_offered(tmp_path):
        assert "missing" not in seen


def _exchange_offered(tmp_path: Path) -> bool:
    (tmp_path / "probe_a").mkdir()
    (tmp_path / "probe_b").mkdir()
    return exchange(tmp_path / "probe_a", tmp_path / "probe_b")


def test_failing_to_remove_the_old_export_is_a_warning_not_a_failure(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _export(out, "old")
    new = staging_dir(out)
    _export(new, "new")
    real = staging.shutil.rmtree

    def rmtree(path, **kwargs):  # a file of the old export that cannot be deleted
        handler = kwargs.get("onexc") or kwargs.get("onerror")
        handler(os.unlink, str(Path(path) / "model-0.safetensors"), PermissionError(13, "Permission denied"))

    monkeypatch.setattr(staging.shutil, "rmtree", rmtree)
    warnings = publish(new, out, overwrite=True)
    monkeypatch.setattr(staging.shutil, "rmtree", real)
    assert (out / "MANIFEST.sha256").read_text() == "new"
    [left] = [p for p in tmp_path.iterdir() if p.name.startswith(".out.replaced-")]
    assert warnings == [f"the new export is in place at {out}, but the previous one could not be fully removed: "
                        f"{left} is left ({left / 'model-0.safetensors'}: [Errno 13] Permission denied)"]


def test_publish_refuses_a_target_that_stopped_being_an_export(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("written by someone during the run")
    new = staging_dir(out)
    with pytest.raises(ValueError, match="holds no finished modelopt-ext export"):
        publish(new, out, overwrite=True)
    assert (out / "notes.txt").exists()


def test_stale_dirs_are_reported_and_removed_only_when_their_run_is_gone(tmp_path):
    out = tmp_path / "out"
    dead = staging_dir(out)
    (dead / "model-1.safetensors").write_bytes(b"x" * 1000)
    owner = json.loads((dead / OWNER_NAME).read_text())
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (dead / OWNER_NAME).write_text(json.dumps({**owner, "pid": int(gone.stdout)}))
    alive = staging_dir(out)  # this process: still running
    replaced = tmp_path / ".out.replaced-0badc0de"
    replaced.mkdir()
    lines = stale_dirs(out, overwrite=False, remove=False)
    assert len(lines) == 3 and all(p.exists() for p in (dead, alive, replaced))
    assert any(line.startswith(f"{dead} (") and ", no longer running): left: pass --overwrite" in line for line in lines)
    lines = stale_dirs(out, overwrite=True, remove=True)
    assert not dead.exists() and not replaced.exists() and alive.exists()
    assert any(f"{alive} (" in line and ", still running): left: it may be in use" in line for line in lines)
    discard(alive)
    assert not alive.exists()


def test_sigterm_and_sigint_raise_interrupted_while_active_then_handlers_return():
    before = signal.getsignal(signal.SIGTERM)
    for signum in (signal.SIGTERM, signal.SIGINT):
        with pytest.raises(Interrupted) as e, interrupts_raise():
            os.kill(os.getpid(), signum)
            signal.sigtimedwait([], 0.1) if hasattr(signal, "sigtimedwait") else None
        assert e.value.signum == signum and signal.Signals(signum).name in str(e.value)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_during_discard_does_not_cut_the_removal_short(tmp_path, monkeypatch):
    """A launcher that forwards SIGTERM twice: the second one arrives while the staging dir is being removed.
    The removal finishes first, then the signal raises `Interrupted` (before: raised inside rmtree, it left
    the directory half removed, and the next run found a `.out.partial-*`)."""
    path = staging_dir(tmp_path / "out")
    for i in range(20):
        (path / f"model-{i:05d}.safetensors").write_bytes(b"x" * 16)
    real_unlink = os.unlink
    sent = []

    def unlink_and_signal(name, *args, **kwargs):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(staging.shutil, "rmtree", _rmtree_with(unlink_and_signal))
    with pytest.raises(Interrupted), interrupts_raise():
        discard(path)
        signal.sigtimedwait([], 0.1) if hasattr(signal, "sigtimedwait") else None
    assert sent and not path.exists()


def _rmtree_with(unlink):
    """shutil.rmtree with each file removal done by `unlink` (the signal lands between two removals)."""
    def rmtree(path, ignore_errors=False, **kwargs):
        for child in sorted(Path(path).iterdir()):
            try:
                unlink(child)
            except OSError:
                if not ignore_errors:
                    raise
        Path(path).rmdir()
    return rmtree


def test_a_second_signal_while_unwinding_to_discard_is_ignored():
    """torchrun forwards SIGTERM; a user's Ctrl-C or a second forward may follow while the rank unwinds from
    the first `Interrupted` to `discard`: it must not raise again there and skip the removal."""
    cleaned = []
    with pytest.raises(Interrupted) as e, interrupts_raise():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.1) if hasattr(signal, "sigtimedwait") else None
        except Interrupted:
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.1) if hasattr(signal, "sigtimedwait") else None
            cleaned.append(True)
            raise
    assert cleaned and e.value.signum == signal.SIGTERM


def test_discard_outlasts_another_rank_still_writing_into_the_staging_dir(tmp_path, monkeypatch):
    """Another rank's shard write (a C call, so its own `Interrupted` waits until it returns) adds a file
    while this rank removes the directory: its rmdir fails. `discard` keeps removing until the directory is
    gone (before: three attempts back to back, then the directory was left looking like a live export)."""
    path = staging_dir(tmp_path / "out")
    real_rmtree = staging.shutil.rmtree
    calls = []

    def rmtree_racing_a_writer(p, ignore_errors=False, **kwargs):
        calls.append(p)
        if len(calls) <= 5:  # the writer created its next file just before the rmdir
            (Path(p) / f"model-{len(calls):05d}.safetensors").write_bytes(b"x")
            return
        real_rmtree(p, ignore_errors=ignore_errors, **kwargs)

    monkeypatch.setattr(staging.shutil, "rmtree", rmtree_racing_a_writer)
    discard(path)
    assert not path.exists() and len(calls) == 6


def test_discard_gives_up_after_its_bound_and_says_so(tmp_path, monkeypatch, caplog):
    path = staging_dir(tmp_path / "out")
    monkeypatch.setattr(staging.shutil, "rmtree", lambda p, ignore_errors=False, **kwargs: None)
    discard(path, bound_s=0.2)
    assert path.exists() and f"could not remove the staging directory {path} within 0 s" in caplog.text
