"""Remote-code locks (modelopt_ext.lock): record, read, and check a checkpoint's Python files."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from modelopt_ext.lock import RemoteCodeMismatch, check_remote_code, load_lock, remote_code_files, write_lock


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "modeling_a.py").write_bytes(b"A = 1\n")
    (d / "configuration_b.py").write_bytes(b"B = 2\n")
    (d / "config.json").write_text("{}")  # not code
    (d / "notes.py.txt").write_text("x")  # not a .py file
    (d / "sub").mkdir()
    (d / "sub" / "nested.py").write_text("N = 3\n")  # only top-level files are remote code
    return d


def test_remote_code_files_hashes_top_level_py(ckpt):
    assert remote_code_files(ckpt) == {"configuration_b.py": _sha(b"B = 2\n"), "modeling_a.py": _sha(b"A = 1\n")}


def test_write_then_load_then_check_passes(ckpt, tmp_path, caplog):
    out = tmp_path / "locks" / "deep" / "lock.json"
    with caplog.at_level(logging.WARNING, logger="modelopt_ext.lock"):
        lock = write_lock(ckpt, out, "rev-1")
    assert lock.files == {"configuration_b.py": _sha(b"B = 2\n"), "modeling_a.py": _sha(b"A = 1\n")}
    assert lock.revision == "rev-1" and lock.source == str(out)
    data = json.loads(out.read_text())
    assert data == {"revision": "rev-1", "files": dict(lock.files)}

    loaded = load_lock(out)
    assert loaded.revision == "rev-1" and dict(loaded.files) == dict(lock.files) and loaded.source == str(out)
    check_remote_code(ckpt, loaded)  # equal: no exception

    warnings = [r for r in caplog.records if r.name == "modelopt_ext.lock" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "trusted" in msg and "reviewed" in msg and str(ckpt) in msg and str(out) in msg


def test_modified_file_names_file_and_both_hashes(ckpt, tmp_path):
    lock = write_lock(ckpt, tmp_path / "lock.json", "rev-2")
    (ckpt / "modeling_a.py").write_bytes(b"A = 1\nimport os\n")
    with pytest.raises(RemoteCodeMismatch) as exc:
        check_remote_code(ckpt, load_lock(tmp_path / "lock.json"))
    msg = str(exc.value)
    assert "modeling_a.py" in msg and "configuration_b.py" not in msg
    assert _sha(b"A = 1\nimport os\n") in msg and lock.files["modeling_a.py"] in msg
    assert str(tmp_path / "lock.json") in msg and "rev-2" in msg and str(ckpt) in msg
    assert isinstance(exc.value, ValueError)


def test_unknown_and_missing_files_named(ckpt, tmp_path):
    write_lock(ckpt, tmp_path / "lock.json", "rev")
    lock = load_lock(tmp_path / "lock.json")
    (ckpt / "extra_code.py").write_bytes(b"print('hi')\n")
    (ckpt / "configuration_b.py").unlink()
    with pytest.raises(RemoteCodeMismatch) as exc:
        check_remote_code(ckpt, lock)
    msg = str(exc.value)
    assert "unknown file extra_code.py" in msg and _sha(b"print('hi')\n") in msg
    assert "configuration_b.py" in msg and "missing" in msg and lock.files["configuration_b.py"] in msg
    assert "modeling_a.py" not in msg


def test_only_extra_file(ckpt, tmp_path):
    lock = write_lock(ckpt, tmp_path / "lock.json", "rev")
    (ckpt / "zzz.py").write_text("")
    with pytest.raises(RemoteCodeMismatch, match=r"zzz\.py"):
        check_remote_code(ckpt, lock)


@pytest.mark.parametrize(
    "content",
    ["{not json", "[]", "null", '{"files": {}}', '{"revision": "r"}', '{"revision": "r", "files": 3}'],
    ids=["syntax", "list", "null", "no-revision", "no-files", "files-int"],
)
def test_malformed_lock_names_the_path(tmp_path, content):
    path = tmp_path / "bad.lock.json"
    path.write_text(content)
    with pytest.raises(ValueError) as exc:
        load_lock(path)
    assert str(path) in str(exc.value)
    assert not isinstance(exc.value, RemoteCodeMismatch)


@pytest.mark.parametrize("files", ['["abc"]', '"abc"'], ids=["list", "str"])
def test_malformed_files_value_names_the_path(tmp_path, files):
    path = tmp_path / "bad.lock.json"
    path.write_text('{"revision": "r", "files": %s}' % files)
    with pytest.raises(ValueError) as exc:
        load_lock(path)
    assert str(path) in str(exc.value)


def test_missing_lock_file_names_the_path(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ValueError, match="nope.json"):
        load_lock(path)


def test_write_lock_refuses_folder_without_py(tmp_path):
    d = tmp_path / "weights_only"
    d.mkdir()
    (d / "config.json").write_text("{}")
    out = tmp_path / "lock.json"
    with pytest.raises(ValueError, match="weights_only"):
        write_lock(d, out, "rev")
    assert not out.exists()
