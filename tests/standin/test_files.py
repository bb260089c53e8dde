"""modelopt_ext/standin/files.py: the stand-in generators' output folder (refused, staged, published)."""

from __future__ import annotations

import os
import stat

import pytest

from modelopt_ext.standin.files import prepare_out_dir, publish, staging_dir


def test_prepare_out_dir_refuses_a_file_and_a_non_empty_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        prepare_out_dir(tmp_path / "file", force=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("x")
    with pytest.raises(FileExistsError, match="is not empty; pass --force"):
        prepare_out_dir(tmp_path / "full", force=False)
    prepare_out_dir(tmp_path / "full", force=True)
    prepare_out_dir(tmp_path / "new", force=False)
    assert (tmp_path / "full" / "a").read_text() == "x" and not (tmp_path / "new").exists()  # nothing written


def test_staging_and_publish_replace_the_folder_with_plain_permissions(tmp_path):
    out = tmp_path / "sub" / "ckpt"
    out.mkdir(parents=True)
    (out / "old").write_text("old")
    tmp = staging_dir(out)
    assert tmp.parent == out.parent and tmp.name.startswith(".ckpt.tmp-")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o777 & ~umask
    (tmp / "model.safetensors").write_text("new")
    os.chmod(tmp / "model.safetensors", 0o600)
    publish(tmp, out)
    assert not tmp.exists() and sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask
