"""modelopt_ext.export.target: what may receive an export (the source is untouchable, --overwrite replaces only
an empty dir or a finished export, symlinks resolved, names the staging dir can hold) and the shared-filesystem
probe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelopt_ext.export.target import (
    ExportDirError,
    check_export_dir,
    check_export_target,
    check_probe,
    remove_probe,
    resolve_export_dir,
    write_probe,
)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    model = tmp_path / "models" / "ckpt"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    return model


@pytest.mark.parametrize("export", ["ckpt", ".", "..", "ckpt/../ckpt", "ckpt/sub", "ckpt/a/b"])
def test_the_checkpoint_its_parents_and_its_inside_are_refused(ckpt, export, monkeypatch):
    monkeypatch.chdir(ckpt.parent)
    path = resolve_export_dir(export)
    with pytest.raises(ExportDirError, match=rf"--export-dir {path} and --model {ckpt}: the export dir "):
        check_export_target(path, ckpt, {})
    assert (ckpt / "config.json").read_text() == "{}"


def test_an_empty_string_is_refused(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExportDirError, match=r"export dir '' is empty \(an unset shell variable\?\)"):
        check_export_dir("", overwrite=True)


def test_a_symlink_to_the_checkpoint_is_refused(ckpt, tmp_path):
    link = tmp_path / "looks_new"
    link.symlink_to(ckpt)
    with pytest.raises(ExportDirError, match="is not empty; pass --overwrite"):
        check_export_dir(link, overwrite=False)
    (ckpt / "MANIFEST.sha256").write_text("")  # even a checkpoint that looks like an export
    path = check_export_dir(link, overwrite=True)
    assert path == ckpt.resolve()
    with pytest.raises(ExportDirError, match="the export dir is the checkpoint"):
        check_export_target(path, ckpt, {})


def test_files_the_run_reads_may_not_lie_inside_the_export_dir(ckpt, tmp_path):
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "data" / "calib.jsonl").write_text("{}")
    with pytest.raises(ExportDirError, match=rf"--dataset {out / 'data' / 'calib.jsonl'} lies inside the export dir"):
        check_export_target(out, ckpt, {"--dataset": out / "data" / "calib.jsonl", "--recipe": None})
    with pytest.raises(ExportDirError, match=r"--summary-json .*summary.json lies inside the export dir"):
        check_export_target(out, ckpt, {"--summary-json": out / "summary.json"})
    with pytest.raises(ExportDirError, match=r"--summary-json .* lies inside the checkpoint"):
        check_export_target(tmp_path / "elsewhere", ckpt, {"--summary-json": ckpt / "summary.json"})
    check_export_target(tmp_path / "elsewhere", ckpt, {"--dataset": out / "data" / "calib.jsonl"})


def test_overwrite_replaces_only_an_export_or_an_empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    assert check_export_dir(tmp_path / "empty", overwrite=False) == tmp_path / "empty"
    data = tmp_path / "data"
    data.mkdir()
    (data / "thesis.tex").write_text("years of work")
    with pytest.raises(ExportDirError, match=rf"export dir {data} is not empty and holds no finished modelopt-ext"):
        check_export_dir(data, overwrite=True)


def test_a_name_too_long_for_the_staging_dir_is_refused(tmp_path):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    ok = "o" * (limit - len(".x.replaced-00000000") + 1)
    assert check_export_dir(tmp_path / ok, overwrite=False)
    with pytest.raises(ExportDirError, match=rf"more than the {limit} bytes a file name may have"):
        check_export_dir(tmp_path / (ok + "o"), overwrite=False)


def test_probe_seen_by_a_rank_sharing_the_filesystem_and_not_by_another(tmp_path):
    shared = tmp_path / "shared" / "out"
    (tmp_path / "shared").mkdir()
    name, token = write_probe(shared)
    check_probe(shared, name, token, rank=1, host="node1")
    other = tmp_path / "node1" / "out"  # the same relative path resolved on another node
    (tmp_path / "node1").mkdir()
    with pytest.raises(ExportDirError, match=r"rank 1 \(host node1\) does not see the file rank 0 wrote .*missing"):
        check_probe(other, name, token, rank=1, host="node1")
    remove_probe(shared, name)
    assert list((tmp_path / "shared").iterdir()) == []
